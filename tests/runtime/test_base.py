"""grpo/runtime/base.py: the one-process behaviour every runtime starts from; the world-size check."""
from types import SimpleNamespace

import peft as _peft  # noqa: F401 - holding() imports them on its first call: here, once, not in every mutant
import pytest
import torch
import transformers  # noqa: F401

from grpo.errors import PeerLostError, SetupError
from grpo.models import tiny_model
from grpo.runtime import base
from grpo.runtime.base import Runtime, check_world_size, holding
from grpo.runtime.local import LocalRuntime


def test_collectives_of_one_process_are_the_identity():
    rt = LocalRuntime("cpu")
    assert isinstance(rt, Runtime) and rt.world_size == 1 and rt.is_main
    assert rt.all_reduce({"a": 1.5}) == {"a": 1.5} and rt.all_max({"n": 3.0}) == {"n": 3.0}
    assert rt.gather(7) == [7] and rt.any_rank(True) and not rt.any_rank(False)
    with rt.generation_context() as extra:
        assert extra == {}


def test_prompts_per_step_must_divide_among_the_processes():
    check_world_size(8, 4)
    with pytest.raises(SetupError, match="rollout.prompts_per_step=6 must be divisible.*4"):
        check_world_size(6, 4)


class _Placed:
    """A model stand-in that records where it was placed."""

    def __init__(self):
        self.to_calls = []

    def to(self, device):
        self.to_calls.append(device)
        return ("placed", self)


def test_setup_places_the_model_and_keeps_the_optimizer_and_schedule():
    rt = Runtime()
    rt.device = torch.device("meta")
    m = _Placed()
    assert rt.setup(m, "opt", "sched") == ("placed", m)
    assert (rt.model, rt.optimizer, rt.scheduler) == (("placed", m), "opt", "sched") and m.to_calls == [rt.device]
    ref = _Placed()
    assert rt.prepare_reference(ref) == ("placed", ref) and ref.to_calls == [torch.device("meta")]
    assert rt.unwrap() == ("placed", m) and rt.unwrap("other") == "other"
    assert rt.node_local_checkpoints(True) is None and rt.expect_backwards(3) is None and rt.barrier() is None


def test_the_defaults_of_one_process():
    rt = Runtime()
    assert (rt.rank, rt.local_rank, rt.world_size, rt.device, rt.process_group) == (0, 0, 1, torch.device("cpu"),
                                                                                     False)
    assert rt.is_main and rt.thread_view() is rt and rt.peer_failure(RuntimeError("x")) is None
    rt.rank = 1
    assert not rt.is_main
    values = {"a": 1.0}
    assert rt.all_reduce(values) is not values and rt.all_max(values) is not values
    assert rt.any_rank(2) is True and rt.any_rank(0) is False
    x = torch.ones(2, requires_grad=True)
    rt.backward((x * 3).sum())
    assert torch.equal(x.grad, torch.full((2,), 3.0))
    for call in (lambda: rt.step(1.0), lambda: rt.save_model_state("d"), lambda: rt.load_model_state("d", None)):
        with pytest.raises(NotImplementedError):
            call()
    with rt.full_weights([x]) as temporary:
        assert temporary is False
    assert rt._final_state_dict() is None and rt._final_state_dict(trainable_only=True) is None


def test_peer_failures_become_their_one_line_error_and_others_pass_unchanged():
    class Rt(Runtime):
        def peer_failure(self, error):
            return PeerLostError("rank 1 is gone") if "lost" in str(error) else None

    original = ValueError("connection lost")
    with pytest.raises(PeerLostError, match="^rank 1 is gone$") as e:
        with Rt().peer_failures_as_errors():
            raise original
    assert e.value.__cause__ is original
    with pytest.raises(ValueError, match="^other$"):
        with Rt().peer_failures_as_errors():
            raise ValueError("other")
    with pytest.raises(ValueError, match="connection lost"):
        with Runtime().peer_failures_as_errors():  # one process: nothing is a peer's failure
            raise original
    with Rt().peer_failures_as_errors():
        pass


def test_full_parameters_are_float_cpu_copies_by_name():
    rt = Runtime()
    rt.model = torch.nn.Linear(2, 1).to(torch.float16)
    full = rt.full_parameters()
    assert list(full) == ["weight", "bias"] and all(t.dtype == torch.float32 for t in full.values())
    assert torch.equal(full["weight"], rt.model.weight.float())
    full["weight"] += 1  # a copy
    assert not torch.equal(full["weight"], rt.model.weight.float()) and not full["bias"].requires_grad


class _HFModel:
    """A saved model stand-in: records save_pretrained's folder and keywords, merge_and_unload with peft."""

    def __init__(self, log, peft=False, name="model"):
        self.log, self.name = log, name
        if peft:
            self.peft_config = {}
            self.merge_and_unload = lambda: _HFModel(log, name="merged")

    def save_pretrained(self, tmp, **kw):
        self.log.append((self.name, str(tmp), kw))


class _Saving(Runtime):
    def __init__(self, log, state=None, peft=False):
        self.log, self.state, self.model = log, state, _HFModel(log, peft)

    def _final_state_dict(self, trainable_only=False):
        self.log.append(("state", trainable_only))
        return self.state

    def barrier(self):
        self.log.append("barrier")


def test_save_final_writes_the_model_and_tokenizer_on_rank_0_in_a_fresh_folder(tmp_path):
    log, tmp = [], tmp_path / "final.tmp"
    tmp.mkdir()
    (tmp / "stale").write_text("x")
    tok = SimpleNamespace(save_pretrained=lambda d: log.append(("tok", str(d))))
    _Saving(log).save_final(tmp, tok, merge_lora=False)
    assert not tmp.exists()  # removed; the stand-in model writes nothing
    assert log == [("state", False), ("model", str(tmp), {}), ("tok", str(tmp)), "barrier"]
    log.clear()
    _Saving(log, state={"w": 1}).save_final(tmp, tok, merge_lora=False)  # partitioned: the gathered weights
    assert log == [("state", False), ("model", str(tmp), {"state_dict": {"w": 1}}), ("tok", str(tmp)), "barrier"]
    log.clear()
    rt = _Saving(log, state={"w": 1})
    rt.rank = 1
    rt.save_final(tmp, tok, merge_lora=False)
    assert log == [("state", False), "barrier"]  # every rank gathers, only rank 0 writes


def test_save_final_of_lora_merges_or_saves_the_adapter_alone(tmp_path, monkeypatch):
    log = []
    tok = SimpleNamespace(save_pretrained=lambda d: log.append(("tok", str(d))))
    _Saving(log, peft=True).save_final(tmp_path, tok, merge_lora=True)
    assert log[:2] == [("state", False), ("merged", str(tmp_path), {})]
    log.clear()
    _Saving(log, state={"lora": 1}, peft=True).save_final(tmp_path, tok, merge_lora=False)  # the adapter alone
    assert log[:2] == [("state", True), ("model", str(tmp_path), {"state_dict": {"lora": 1}})]
    log.clear()
    held = []
    monkeypatch.setattr(base, "holding", lambda model, state: held.append((model, state)) or _HFModel(
        log, peft=True, name="held"))
    rt = _Saving(log, state={"all": 1}, peft=True)
    rt.save_final(tmp_path, tok, merge_lora=True)  # partitioned: merged in a CPU copy holding them whole
    assert held == [(rt.model, {"all": 1})] and log[:2] == [("state", False), ("merged", str(tmp_path), {})]


def test_is_peft_needs_a_peft_config_and_merge_and_unload():
    assert base._is_peft(SimpleNamespace(peft_config={}, merge_and_unload=None))
    assert not base._is_peft(SimpleNamespace(peft_config={}))
    assert not base._is_peft(SimpleNamespace(merge_and_unload=None))


def test_holding_builds_a_copy_whose_parameters_are_the_given_tensors():
    model = tiny_model("llama", 40, seed=0)
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    copy = holding(model, state)
    assert copy is not model and not copy.training
    assert all(p.device.type == "cpu" for p in copy.parameters())
    got = dict(copy.named_parameters())
    name = "model.layers.0.self_attn.q_proj.weight"
    assert got[name].data_ptr() == state[name].data_ptr()  # assigned, not copied
    assert copy.generation_config is model.generation_config
    tied = copy.get_output_embeddings().weight is copy.get_input_embeddings().weight
    assert tied or not model.config.tie_word_embeddings
    with pytest.raises(RuntimeError, match=r"do not match the model \(missing \['model.norm.weight'\], "
                                           r"unexpected \[\]\)"):
        holding(model, {k: v for k, v in state.items() if k != "model.norm.weight"})
    with pytest.raises(RuntimeError, match=r"unexpected \['extra'\]"):
        holding(model, {**state, "extra": torch.zeros(1)})


def test_holding_a_lora_model_keeps_its_adapter_for_the_merge():
    lora = _peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
    model = _peft.get_peft_model(tiny_model("llama", 40, seed=0), lora, adapter_name="mine")  # not "default"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    name = next(k for k in state if "lora_B" in k)
    state[name] += 0.5
    copy = holding(model, state)
    assert base._is_peft(copy) and copy.active_adapter == model.active_adapter == "mine"
    assert copy.peft_config[copy.active_adapter].r == 2
    assert torch.equal(dict(copy.named_parameters())[name], state[name])
    merged = copy.merge_and_unload()
    assert not base._is_peft(merged)
