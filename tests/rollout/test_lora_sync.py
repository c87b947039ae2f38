"""What an adapter sync sends (`grpo.rollout.lora_sync`), without vLLM: the decision, the refusals, the tensors, the
PEFT folder (loaded back by PEFT itself as the independent reference) and the resident versions. The engine side is
tests/rollout/test_vllm_lora.py (make test-vllm)."""
import contextlib
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig  # imported at collection: mutmut's forkserver holds it for every mutant
from peft import get_peft_model
from safetensors.torch import load_file

from grpo.config.schema import LoraConfig, VLLMConfig
from grpo.errors import SetupError
from grpo.models import apply_lora, char_tokenizer, tiny_model
from grpo.rollout import lora_sync as ls
from grpo.rollout import weights as ls_weights
from grpo.rollout.weights import hf_weights

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def _policy(targets=("q_proj", "v_proj"), r=4, alpha=8, seed=0, **peft):
    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=seed, **TINY)
    policy = apply_lora(model, LoraConfig(enabled=True, r=r, alpha=alpha, target_modules=list(targets)))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)
    return policy


def test_adapters_are_chosen_where_vllm_serves_them_and_merged_weights_otherwise():
    said = []
    assert ls.choose("auto", _policy(), say=said.append) is True
    assert ls.choose("merged", _policy()) is False
    assert ls.choose("auto", tiny_model("llama", 100, **TINY)) is False  # no LoRA: the plain weights
    trained_head = _policy()
    trained_head.get_base_model().lm_head.weight.requires_grad_(True)
    assert ls.choose("auto", trained_head, say=said.append) is False
    assert len(said) == 1 and "lm_head.weight" in said[0] and "merged weights" in said[0]
    with pytest.raises(SetupError, match=r"lora_sync=adapters: trained weights outside the adapters.*use rollout"):
        ls.choose("adapters", trained_head)


@pytest.mark.parametrize("targets, why", [(("q_proj", "lm_head"), "LoRA on lm_head"),
                                          (("q_proj", "embed_tokens"), "LoRA on embed_tokens")])
def test_adapters_on_modules_vllm_does_not_serve_go_merged(targets, why):
    assert why in ls.refusal(_policy(targets))


def test_the_config_check_refuses_adapters_that_cannot_be_served_before_any_model_loads():
    lora = LoraConfig(enabled=True, target_modules=["q_proj", "lm_head"])
    ls.check_config(VLLMConfig(lora_sync="auto"), lora)  # auto: merged weights, said at the first sync
    with pytest.raises(SetupError, match=r"^rollout\.vllm\.lora_sync=adapters: model\.lora\.target_modules has "
                                         r"lm_head, which vLLM does not serve as LoRA .*; use rollout"):
        ls.check_config(VLLMConfig(lora_sync="adapters"), lora)
    with pytest.raises(SetupError, match="above the largest rank vLLM serves"):
        ls.check_config(VLLMConfig(lora_sync="adapters"), LoraConfig(enabled=True, r=1024))
    assert [ls.served_rank(r) for r in (1, 4, 8, 9, 512)] == [1, 8, 8, 16, 512]
    with pytest.raises(SetupError, match="ranks up to 512"):
        ls.served_rank(513)


@pytest.mark.parametrize("name", ["vllm", "server"])
def test_each_backend_that_syncs_adapters_refuses_them_in_its_config_check(name, monkeypatch):
    """The registry's check (run before any model loads) of both backends that sync LoRA adapters."""
    from grpo.config.schema import ModelConfig, RolloutConfig, ServerConfig
    from grpo.rollout import registry

    rollout = RolloutConfig(backend=name, vllm=VLLMConfig(lora_sync="adapters"),
                            server=ServerConfig(urls=["http://h:1"]))
    model = ModelConfig(name_or_path="tiny:llama", lora=LoraConfig(enabled=True, target_modules=["embed_tokens"]))
    monkeypatch.setattr(registry, "resolve", lambda n, device: n)  # as if vLLM were installed (the check needs none)
    with pytest.raises(SetupError, match="embed_tokens, which vLLM does not serve as LoRA"):
        registry.check(rollout, model, "cuda")
    registry.check(rollout, ModelConfig(name_or_path="tiny:llama"), "cuda")  # no LoRA: nothing to refuse
    registry.check(replace(rollout, backend="hf"), model, "cuda")  # samples the trained model itself


def test_the_adapter_folder_is_what_peft_loads_into_the_same_model(tmp_path):
    """The folder written for vLLM, loaded by PEFT into a fresh base model, scores as the trainer's model does."""
    from peft import PeftModel

    policy = _policy(r=4, alpha=12)
    adapter = ls.adapter_state(policy, _whole)
    ls.write_peft_dir(adapter, tmp_path / "v0")
    fresh = PeftModel.from_pretrained(tiny_model("llama", len(char_tokenizer()), seed=0, **TINY), str(tmp_path / "v0"))
    x = torch.tensor([[5, 9, 2, 40, 7, 11]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=x).logits, policy(input_ids=x).logits, rtol=0, atol=1e-6)
        with policy.disable_adapter():  # the adapter matters: the check is not vacuous
            assert not torch.allclose(policy(input_ids=x).logits, fresh(input_ids=x).logits, atol=1e-3)
    n = sum(p.numel() * p.element_size() for k, p in policy.named_parameters() if ".lora_" in k)
    assert adapter.nbytes == n and len(adapter.tensors) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)


def test_under_zero3_only_a_and_b_are_gathered_never_the_base_weight():
    policy = _policy()
    gathered = []

    @contextlib.contextmanager
    def full_weights(params):
        gathered.append(params)
        yield False

    ls.adapter_state(policy, full_weights)
    lora = {id(p) for n, p in policy.named_parameters() if ".lora_" in n}
    assert gathered and all(len(ps) == 2 and {id(p) for p in ps} <= lora for ps in gathered)


def test_the_base_weights_go_unmerged_when_the_adapters_go_on_their_own():
    policy = _policy()
    base = dict(hf_weights(policy, merge=False))
    merged = dict(hf_weights(policy))
    plain = policy.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert torch.equal(base["model.layers.0.self_attn.q_proj.weight"], plain)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], plain)
    assert base.keys() == merged.keys()


def test_the_newest_versions_stay_resident_and_older_ones_are_unloaded_with_their_folders():
    loaded, unloaded = {}, []
    slots = ls.AdapterSlots(lambda path, i: loaded.__setitem__(i, path), unloaded.append, keep=2)
    adapter = ls.adapter_state(_policy(), _whole)
    for v in (0, 1, 2, 2, 5):
        slots.add(v, adapter)
    assert sorted(slots.resident) == [2, 5] and unloaded == [1, 3, 2]  # vLLM ids are version + 1
    assert not loaded[1].exists() and loaded[6].is_dir() and (loaded[6] / "adapter_config.json").exists()
    slots.close()
    assert not slots.root.exists()


@contextlib.contextmanager
def _whole(params):
    yield False


# ------------------------------------------------------------------ grpo/rollout/weights.py: hf_weights and counted
def test_merged_weights_are_w_plus_scaled_b_a_under_the_plain_names_and_the_trainers_w_is_untouched():
    policy = _policy(targets=("q_proj",), r=4, alpha=8)
    layer = policy.get_base_model().model.layers[1].self_attn.q_proj
    w0 = layer.base_layer.weight.detach().clone()
    got = dict(hf_weights(policy))
    plain = {n: t for n, t in policy.get_base_model().state_dict().items()}
    assert set(got) == {n.replace(".base_layer.", ".") for n in plain if ".lora_" not in n}
    want = w0 + (8 / 4) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert torch.allclose(got["model.layers.1.self_attn.q_proj.weight"], want, atol=1e-6)
    assert torch.equal(layer.base_layer.weight, w0)
    assert not got["model.layers.1.self_attn.q_proj.weight"].requires_grad
    emb = got["model.embed_tokens.weight"]  # a plain weight: the parameter's own tensor, detached
    assert emb.data_ptr() == policy.get_base_model().model.embed_tokens.weight.data_ptr() and not emb.requires_grad


def test_each_weight_is_made_whole_for_its_reading_and_a_temporary_one_is_copied():
    policy = _policy(targets=("q_proj",))
    asked = []

    @contextlib.contextmanager
    def full_weights(params):
        asked.append(params)
        yield True  # gathered for the block: what outlives it is a copy

    got = list(hf_weights(policy, full_weights))
    base = policy.get_base_model()
    q = base.model.layers[0].self_attn.q_proj
    names = [n for n, _ in got]
    i = names.index("model.layers.0.self_attn.q_proj.weight")
    assert {id(p) for p in asked[i]} == {id(p) for p in q.parameters()} and len(asked[i]) == 3  # W, A, B
    j = names.index("model.norm.weight")
    assert len(asked[j]) == 1 and asked[j][0] is base.model.norm.weight
    assert got[j][1].data_ptr() != base.model.norm.weight.data_ptr()  # copied
    assert torch.equal(got[j][1], base.model.norm.weight)
    unmerged = dict(hf_weights(policy, full_weights, merge=False))
    assert torch.equal(unmerged["model.layers.0.self_attn.q_proj.weight"], q.base_layer.weight)


def test_a_plain_model_and_buffers_go_as_they_are():
    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=0, **TINY)
    model.register_buffer("extra_buffer", torch.arange(3.0))
    asked = []

    @contextlib.contextmanager
    def full_weights(params):
        asked.append(params)
        yield False

    got = list(hf_weights(model, full_weights))
    assert [n for n, _ in got] == list(model.state_dict())
    i = [n for n, _ in got].index("extra_buffer")
    assert asked[i] == [] and torch.equal(got[i][1], torch.arange(3.0))  # a buffer: no parameter to gather
    w = dict(got)["model.norm.weight"]
    assert w.data_ptr() == model.model.norm.weight.data_ptr()  # not temporary: not copied
    with ls_weights.as_they_are([1]) as temporary:
        assert temporary is False


def test_an_inactive_adapter_leaves_the_base_weight_as_a_copy():
    policy = _policy(targets=("q_proj",))
    layer = policy.get_base_model().model.layers[0].self_attn.q_proj
    merged = ls_weights._merged(layer)
    assert not torch.equal(merged, layer.base_layer.weight)
    # an active adapter that is not one of its own: nothing added
    out = ls_weights._merged(SimpleNamespace(active_adapters=["other"], lora_A={"default": None},
                                             base_layer=layer.base_layer))
    assert torch.equal(out, layer.base_layer.weight) and out.data_ptr() != layer.base_layer.weight.data_ptr()
    out = ls_weights._merged(SimpleNamespace(base_layer=layer.base_layer))  # no adapters at all
    assert torch.equal(out, layer.base_layer.weight)
    out = ls_weights._merged(SimpleNamespace(active_adapters=["default"], base_layer=layer.base_layer))  # no lora_A
    assert torch.equal(out, layer.base_layer.weight)


def test_the_merged_weight_keeps_the_base_weights_dtype():
    base = SimpleNamespace(weight=torch.ones(2, 2, dtype=torch.bfloat16))
    layer = SimpleNamespace(active_adapters=["default"], lora_A={"default": None}, base_layer=base,
                            get_delta_weight=lambda a: torch.full((2, 2), 0.5))  # a float32 delta
    out = ls_weights._merged(layer)
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.full((2, 2), 1.5, dtype=torch.bfloat16))


def test_counted_tallies_what_passed_and_closes_its_source():
    def source():
        try:
            yield "a", torch.zeros(2, 3)
            yield "b", torch.zeros(4, dtype=torch.float16)
            yield "c", torch.zeros(1)
        finally:
            closed.append(True)

    closed, tally = [], {"tensors": 5, "other": 1}
    src = source()  # held here: closed by counted, not by its garbage collection
    stream = ls_weights.counted(src, tally)
    assert [next(stream)[0], next(stream)[0]] == ["a", "b"]
    assert tally == {"tensors": 2, "bytes": 24 + 8, "other": 1} and closed == []
    stream.close()
    assert closed == [True]
    closed.clear()
    assert [n for n, _ in ls_weights.counted(source(), tally)] == ["a", "b", "c"]
    assert tally["tensors"] == 3 and tally["bytes"] == 24 + 8 + 4 and closed == [True]
    assert [n for n, _ in ls_weights.counted([("x", torch.zeros(1))], tally)] == ["x"]  # a list: nothing to close
    assert tally["tensors"] == 1 and tally["bytes"] == 4


# ----------------------------------------------------------- unit tests over a tiny PEFT model built in memory
# (a few Linear layers named as a decoder's, a fraction of a millisecond to build: the mutants' tests; the tests
# above build a tiny llama each, about a second, and check the folder against PEFT's own loading)
class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({p: torch.nn.Linear(4, 4, bias=False) for p in ("q_proj", "v_proj")}) for _ in range(2))
        self.lm_head = torch.nn.Linear(4, 10, bias=False)


def _peft(targets=("q_proj", "v_proj"), name="default", **cfg):
    return get_peft_model(_Tiny(), PeftLoraConfig(r=2, lora_alpha=4, target_modules=list(targets), **cfg),
                          adapter_name=name)


class DistributedDataParallel(torch.nn.Module):  # named as torch's: unwrap_model goes through it by its name
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_lora_layers_are_the_base_models_names_of_its_lora_layers_through_a_parallel_wrapper():
    policy = _peft()
    want = {f"layers.{i}.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")}
    assert set(ls.lora_layers(policy)) == want
    got = ls.lora_layers(DistributedDataParallel(policy))  # the peft model inside is not unwrapped: its base is read
    assert set(got) == want and got["layers.1.v_proj"] is policy.get_base_model().layers[1]["v_proj"]
    assert ls.lora_layers(_Tiny()) == {}  # not a peft model
    base = policy.get_base_model()
    base.only_a = SimpleNamespace()  # not modules: named_modules skips them; modules with one of the two parts:
    base.layers[0]["half_a"] = torch.nn.Module()
    base.layers[0]["half_a"].lora_A = torch.nn.ModuleDict()
    base.layers[0]["half_b"] = torch.nn.Module()
    base.layers[0]["half_b"].base_layer = torch.nn.Linear(1, 1)
    assert set(ls.lora_layers(policy)) == want


def test_the_active_adapter_is_its_name_and_its_config_or_the_first_of_a_list():
    policy = _peft(name="first")
    name, cfg = ls.active_adapter(DistributedDataParallel(policy))
    assert name == "first" and cfg is policy.peft_config["first"]
    listed = SimpleNamespace(active_adapter=["b", "a"], peft_config={"a": 1, "b": 2})
    assert ls.active_adapter(listed) == ("b", 2)


@pytest.mark.parametrize("kwargs, targets, why", [
    (dict(use_dora=True), ("q_proj",), "DoRA adapters (use_dora) are not LoRA to vLLM"),
    (dict(rank_pattern={"q_proj": 4}), ("q_proj",), "per-layer ranks or alphas (rank_pattern / alpha_pattern)"),
    (dict(alpha_pattern={"q_proj": 4}), ("q_proj",), "per-layer ranks or alphas (rank_pattern / alpha_pattern)"),
    ({}, ("lm_head", "q_proj", "embed_tokens"), "LoRA on embed_tokens, lm_head, which vLLM does not serve as LoRA"),
    ({}, ("q_proj", "v_proj"), None),
])
def test_the_refusal_names_what_vllm_cannot_serve_as_lora(kwargs, targets, why):
    assert ls.refusal(_peft(targets, **kwargs)) == why


def test_a_config_without_dora_or_per_layer_fields_is_plain_lora():
    policy = _peft()
    policy.peft_config["default"] = SimpleNamespace(r=2, lora_alpha=4, is_prompt_learning=False)  # without those fields
    assert ls.refusal(policy) is None


def test_a_trained_weight_outside_the_adapters_is_refused_by_its_name_the_first_one():
    policy = _peft()
    assert ls.refusal(_Tiny()) == "the model has no LoRA layers"
    base = policy.get_base_model()
    base.lm_head.weight.requires_grad_(True)
    base.embed_tokens.weight.requires_grad_(True)
    assert ls.refusal(policy) == ("trained weights outside the adapters (base_model.model.embed_tokens.weight: "
                                  "modules_to_save, a trained embedding or bias)")
    base.embed_tokens.weight.requires_grad_(False)
    assert "(base_model.model.lm_head.weight: " in ls.refusal(DistributedDataParallel(policy))
    base.lm_head.weight.requires_grad_(False)
    for n, p in policy.named_parameters():  # frozen adapters are not trained weights outside them either
        p.requires_grad_(False)
    assert ls.refusal(policy) is None


def test_choose_says_once_why_it_merges_and_adapters_refuses_in_one_line(capsys):
    said = []
    assert ls.choose("auto", _peft(), say=said.append) is True
    assert ls.choose("merged", _peft(), say=said.append) is False
    assert ls.choose("adapters", _peft(), say=said.append) is True
    assert ls.choose("adapters", _Tiny(), say=said.append) is False  # no LoRA: merged, nothing refused or said
    assert ls.choose("auto", _Tiny(), say=said.append) is False
    assert said == []
    dora = _peft(use_dora=True)
    assert ls.choose("auto", dora, say=said.append) is False
    assert said == ["LoRA: the merged weights go to vLLM at every sync, not the adapters: DoRA adapters (use_dora) "
                    "are not LoRA to vLLM"]
    with pytest.raises(SetupError, match=r"^rollout\.vllm\.lora_sync=adapters: DoRA adapters \(use_dora\) are not "
                                         r"LoRA to vLLM; use rollout\.vllm\.lora_sync=auto or merged$"):
        ls.choose("adapters", dora)
    capsys.readouterr()
    assert ls.choose("auto", dora) is False  # said on stderr by default
    assert capsys.readouterr() == ("", "[grpo] " + said[0] + "\n")


def test_say_once_prints_the_line_to_stderr_and_flushes_it(monkeypatch):
    class Err:
        def __init__(self):
            self.parts, self.flushed = [], 0

        def write(self, s):
            self.parts.append(s)

        def flush(self):
            self.flushed += 1

    err = Err()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("sys.stdout", Err())
    ls.say_once("merged")
    assert "".join(err.parts) == "[grpo] merged\n" and err.flushed == 1


def test_the_config_check_passes_a_servable_or_disabled_adapter_and_refuses_at_the_largest_rank_plus_one():
    assert ls.config_refusal(LoraConfig(enabled=True, r=512, target_modules=list(ls.LORA_MODULES))) is None
    assert ls.config_refusal(LoraConfig(enabled=True, r=513)) == ("model.lora.r=513 is above the largest rank vLLM "
                                                                  "serves (512)")
    assert ls.config_refusal(LoraConfig(enabled=True, target_modules=["lm_head", "q_proj", "norm"])) == (
        "model.lora.target_modules has lm_head, norm, which vLLM does not serve as LoRA (it serves q_proj, k_proj, "
        "v_proj, o_proj, gate_proj, up_proj, down_proj)")
    bad = LoraConfig(enabled=False, target_modules=["lm_head"])
    ls.check_config(VLLMConfig(lora_sync="adapters"), bad)  # no LoRA: nothing to refuse
    ls.check_config(VLLMConfig(lora_sync="adapters"), LoraConfig(enabled=True))
    with pytest.raises(SetupError, match=r"lm_head, .*; use rollout\.vllm\.lora_sync=auto \(merged weights then\)$"):
        ls.check_config(VLLMConfig(lora_sync="adapters"), replace(bad, enabled=True))


def test_the_adapter_bytes_add_up_every_tensors_size():
    adapter = ls.Adapter({"a": torch.zeros(2, 3), "b": torch.zeros(5, dtype=torch.float16)}, {})
    assert adapter.nbytes == 2 * 3 * 4 + 5 * 2
    assert ls.Adapter({}, {}).nbytes == 0


def test_the_adapter_state_is_a_copy_of_the_active_adapters_a_and_b_under_peft_names_gathered_in_pairs():
    policy = _peft(("q_proj",))
    policy.add_adapter("other", PeftLoraConfig(r=3, lora_alpha=5, target_modules=["v_proj"], use_rslora=True))
    policy.set_adapter("other")  # on v_proj only: each q_proj layer (the first one too) has no "other"
    base = policy.get_base_model()
    odd = torch.nn.Parameter(torch.randn(4, 3).t())  # a weight that is not contiguous
    base.layers[0]["v_proj"].lora_A["other"].weight = odd
    gathered = []

    @contextlib.contextmanager
    def full_weights(params):
        gathered.append(params)
        yield False

    adapter = ls.adapter_state(policy, full_weights)
    v = [base.layers[i]["v_proj"] for i in (0, 1)]
    assert [[id(p) for p in ps] for ps in gathered] == [[id(m.lora_A["other"].weight), id(m.lora_B["other"].weight)]
                                                        for m in v]
    want = {f"base_model.model.layers.{i}.v_proj.{part}.weight": getattr(v[i], part)["other"].weight
            for i in (0, 1) for part in ("lora_A", "lora_B")}
    assert list(adapter.tensors) == list(want)
    for key, w in want.items():
        got = adapter.tensors[key]
        assert torch.equal(got, w) and got.data_ptr() != w.data_ptr() and got.is_contiguous()
        assert not got.requires_grad and got.device.type == "cpu"
    assert adapter.config == {"peft_type": "LORA", "r": 3, "lora_alpha": 5.0, "target_modules": ["q_proj", "v_proj"],
                              "use_rslora": True, "bias": "none", "modules_to_save": None}
    assert type(adapter.config["r"]) is int and type(adapter.config["lora_alpha"]) is float
    policy.set_adapter("default")
    plain = ls.adapter_state(policy, full_weights).config
    assert plain["use_rslora"] is False and plain["r"] == 2 and plain["lora_alpha"] == 4.0
    cfg = SimpleNamespace(r=2.0, lora_alpha=4)  # a config without use_rslora: not rank-stabilized
    listed = SimpleNamespace(active_adapter="default", peft_config={"default": cfg}, get_base_model=lambda: base)
    got = ls.adapter_state(listed, full_weights).config
    assert got["use_rslora"] is False and type(got["r"]) is int and type(got["lora_alpha"]) is float


def test_the_peft_folder_holds_the_tensors_and_the_config_and_can_be_written_again(tmp_path):
    adapter = ls.Adapter({"base_model.model.x.lora_A.weight": torch.arange(6.0).reshape(2, 3)}, {"r": 2, "x": None})
    path = tmp_path / "a" / "b"
    ls.write_peft_dir(adapter, path)
    ls.write_peft_dir(adapter, path)  # a folder that is there already
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((path / "adapter_config.json").read_text()) == {"r": 2, "x": None}
    got = load_file(str(path / "adapter_model.safetensors"))
    assert list(got) == list(adapter.tensors) and torch.equal(got["base_model.model.x.lora_A.weight"],
                                                              adapter.tensors["base_model.model.x.lora_A.weight"])


def _slots(tmp_path, keep=1, root="given"):
    calls = []
    slots = ls.AdapterSlots(lambda path, i: calls.append(("load", path.name, i)),
                            lambda i: calls.append(("unload", i)), keep=keep,
                            root=str(tmp_path) if root == "given" else root)
    return slots, calls


def test_the_slots_keep_the_newest_version_by_default_and_at_least_one(tmp_path):
    adapter = ls.Adapter({"w": torch.zeros(1)}, {"r": 1})
    for keep in (1, 0, -3):
        slots, calls = _slots(tmp_path, keep=keep)
        assert slots.keep == 1 and slots.latest is None and slots.resident == {}
        slots.add(3, adapter)
        slots.add(4, adapter)
        assert calls == [("load", "v3", 4), ("load", "v4", 5), ("unload", 4)] and list(slots.resident) == [4]
        assert not (slots.root / "v3").exists() and (slots.root / "v4" / "adapter_model.safetensors").is_file()
    slots, _ = _slots(tmp_path, keep="2")
    assert slots.keep == 2
    slots = ls.AdapterSlots(lambda p, i: None, lambda i: None)
    assert slots.keep == 1


def test_the_slots_folder_is_under_the_root_given_else_in_ram_where_there_is_dev_shm(tmp_path):
    import tempfile

    slots, _ = _slots(tmp_path)
    assert slots.root.parent == tmp_path and slots.root.name.startswith("grpo-lora-") and slots.root.is_dir()
    slots, _ = _slots(tmp_path, root=None)
    shm = Path("/dev/shm")
    assert slots.root.parent == (shm if shm.is_dir() else Path(tempfile.gettempdir()))
    assert slots.root.name.startswith("grpo-lora-")
    slots.close()


def test_without_dev_shm_the_slots_folder_is_in_the_temporary_directory(tmp_path, monkeypatch):
    import tempfile

    is_dir = Path.is_dir
    monkeypatch.setattr(Path, "is_dir", lambda self: str(self) != "/dev/shm" and is_dir(self))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    slots, _ = _slots(tmp_path, root=None)
    assert slots.root.parent == tmp_path and slots.root.name.startswith("grpo-lora-")
    slots.close()


def test_a_version_added_again_is_unloaded_first_and_a_folder_already_gone_is_no_error(tmp_path):
    adapter = ls.Adapter({"w": torch.zeros(1)}, {"r": 1})
    slots, calls = _slots(tmp_path, keep=2)
    slots.add(0, adapter)
    slots.add(0, ls.Adapter({"w": torch.ones(1)}, {"r": 1}))
    assert calls == [("load", "v0", 1), ("unload", 1), ("load", "v0", 1)] and slots.latest == 0
    shutil.rmtree(slots.resident[0])  # removed by someone else
    slots.add(1, adapter)
    slots.add(2, adapter)
    assert calls[-1] == ("unload", 1) and sorted(slots.resident) == [1, 2] and slots.latest == 2
    slots.close()
    slots.close()  # twice: nothing left to remove
    assert slots.resident == {} and not slots.root.exists()


def test_a_request_names_the_newest_or_the_given_resident_version_by_its_id_and_folder(tmp_path, monkeypatch):
    made = []
    monkeypatch.setitem(sys.modules, "vllm.lora.request",
                        SimpleNamespace(LoRARequest=lambda *a: made.append(a) or a))
    slots, _ = _slots(tmp_path, keep=2)
    assert slots.request() is None and made == []
    adapter = ls.Adapter({"w": torch.zeros(1)}, {"r": 1})
    slots.add(4, adapter)
    slots.add(7, adapter)
    assert slots.request() == ("v7", 8, str(slots.root / "v7"))
    assert slots.request(4) == ("v4", 5, str(slots.root / "v4"))
    with pytest.raises(KeyError, match=r"adapter version 5 is not resident \(resident: \[4, 7\]\)"):
        slots.request(5)
    slots.close()
