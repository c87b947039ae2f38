"""What an adapter sync sends (`grpo.rollout.lora_sync`), without vLLM: the decision, the refusals, the tensors, the
PEFT folder (loaded back by PEFT itself as the independent reference) and the resident versions. The engine side is
tests/rollout/test_vllm_lora.py (make test-vllm)."""
import contextlib
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

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
