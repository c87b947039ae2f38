"""Hybrid families (recurrent layers mixed with attention) share the prompt exactly: each completion continues from
its prompt's state (grpo/engine/state_layers.py). Log-probs and gradients of the shared layout against each
prompt + completion run alone through the model's own forward, on tiny random configs (tests/hybrid_families.py):
ragged prompts shorter and longer than the convolution kernel and the scan chunk (Gated DeltaNet's 64 included),
G in {1, 2, 5}, 1-token completions, linear and full attention layers mixed."""

import warnings

import pytest
import torch
import transformers

from grpo.engine import token_logprobs
from grpo.engine.features import attention_modules, model_features
from grpo.engine.state_layers import state_layers
from tests.engine.test_logprobs import assert_grads_close, grads, max_err, reference_with_grads
from tests.hybrid_families import CHUNK, FAMILIES, KERNEL, VOCAB, tiny_model

torch.set_num_threads(1)
PROMPT_LENS = [1, 9, 70, 3]  # below and above the kernel (4) and the chunks (4; Gated DeltaNet: 64)
COMPLETION_LENS = [[3], [6, 1], [2, 7, 1, 5, 3], [1, 2]]  # G = 1, 2, 5, 2
SERVED = tuple(f for f in FAMILIES if f != "jamba")


def _data(prompt_lens=PROMPT_LENS, completion_lens=COMPLETION_LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    return [tok(p) for p in prompt_lens], [[tok(s) for s in ss] for ss in completion_lens]


def _shared(model, prompts, comps, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shared layout must really be taken, no fallback
        return token_logprobs(model, prompts, comps, **kw)


@pytest.mark.parametrize("family", SERVED)
def test_hybrid_family_shares_the_prompt_state_exactly(family):
    model = tiny_model(family)
    served, missing = model_features(model)
    assert missing is None and served[0].startswith("recurrent layers") and state_layers(model)
    assert bool(attention_modules(model)) == (family != "mamba2")  # mixed with softmax attention but in Mamba2
    prompts, comps = _data()
    assert min(PROMPT_LENS) < KERNEL <= CHUNK < 64 < max(PROMPT_LENS)
    ref, w, ref_grads = reference_with_grads(model, prompts, comps)
    out = _shared(model, prompts, comps)
    assert max_err(out, ref) <= 2e-5
    assert_grads_close(grads(model, out, w), ref_grads, rel=1e-3)
    assert "forward" not in vars(state_layers(model)[0])  # the layer's own forward is back


@pytest.mark.parametrize("family,reentrant", [("qwen3_5_text", False), ("bamba", True)])
def test_one_token_completions_and_gradient_checkpointing(family, reentrant):
    """Every completion one token long (the layers' one-token path is the in-place decoding step: the engine keeps
    clear of it), and the recompute of gradient checkpointing hands the states over again."""
    model = tiny_model(family)
    prompts, comps = _data([5, 2], [[1, 1, 1], [1]])
    ref, w, ref_grads = reference_with_grads(model, prompts, comps)
    assert max_err(_shared(model, prompts, comps), ref) <= 2e-5
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    prompts, comps = _data([6, 2], [[4, 1, 3], [2]])
    ref, w, ref_grads = reference_with_grads(model, prompts, comps)
    out = _shared(model, prompts, comps)
    assert max_err(out, ref) <= 2e-5
    assert_grads_close(grads(model, out, w), ref_grads, rel=1e-3)


def test_lora_on_the_recurrent_projections():
    """peft LoRA on a Gated DeltaNet layer's projections (and the attention's): adapter gradients equal the
    per-sequence forward's, and the adapter disabled gives the base model's log-probs."""
    peft = pytest.importorskip("peft")
    base = tiny_model("qwen3_5_text")
    prompts, comps = _data()
    with torch.no_grad():
        plain = token_logprobs(base, prompts, comps)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                             target_modules=["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                                             "q_proj", "v_proj"])
    model = peft.get_peft_model(base, config)
    ref, w, ref_grads = reference_with_grads(model, prompts, comps)
    assert any("in_proj_qkv.lora_A" in n for n in ref_grads)
    out = _shared(model, prompts, comps)
    assert max_err(out, ref) <= 2e-5
    assert_grads_close(grads(model, out, w), ref_grads, rel=1e-3)
    with torch.no_grad(), model.disable_adapter():
        assert max_err(_shared(model, prompts, comps), plain) <= 1e-6
    assert max_err(out, plain) > 1e-3  # the adapter counts


def _tiny(family, **kw):
    config = transformers.AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family,why", [
    ("jamba", "layers of type linear_attention (JambaMambaMixer: its multi-token scan does not start from a given"),
    ("minimax", "layers of type linear_attention (MiniMaxLightningAttention: a recurrent state outside"),
])
def test_recurrent_layers_that_cannot_be_handed_over_are_refused_naming_them(family, why):
    model = tiny_model(family) if family == "jamba" else _tiny(family, layer_types=["linear_attention",
                                                                                     "full_attention"])
    assert model_features(model)[1].startswith(why)
    with pytest.warns(UserWarning, match="standard layout: layers of type linear_attention"):
        prompts, comps = _data([3], [[2, 2]])
        token_logprobs(model, prompts, comps)


def test_a_linear_attention_named_attention_is_not_softmax_attention():
    """MiniMax's lightning attention is a class named ``*Attention`` with a ``layer_idx``: not an attention layer
    the AttentionInterface serves (so never reported as one bypassing it), and Nemotron-H's MoE and MLP layers,
    which mix no tokens, are not missing attention."""
    model = _tiny("minimax", layer_types=["linear_attention", "full_attention"])
    names = {type(m).__name__ for m in attention_modules(model)}
    assert names == {"MiniMaxAttention"}
    nemotron = tiny_model("nemotron_h")
    assert {type(m).__name__ for m in attention_modules(nemotron)} == {"NemotronHAttention"}
    assert model_features(nemotron)[1] is None


def test_bench_hybrid_quick_runs(capsys):
    """scripts/bench_families.py --families qwen3_5_text,bamba (docs/prefix-engine.md), scaled down: a row per
    family with both layouts' timings and the speed-ups, and a memory worker's peak."""
    import importlib.util

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location("bench_families", ROOT / "scripts" / "bench_families.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--repeats", "1", "--families", "qwen3_5_text,bamba"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    rows = [r for r in rows if r[0].strip() != "model" and not r[0].startswith("---")]
    assert [r[0].strip() for r in rows] == ["qwen3_5_text", "bamba"]
    for r in rows:
        assert float(r[4]) > 0 and float(r[5]) > 0 and r[6].strip().endswith("x")
    # --memory: each layout's step in a fresh process (--memory-worker); here one, in this process
    assert bench.main(["--memory-worker", '["qwen3_5_text", 16, 4, 3, true, true]']) == 0
    assert float(capsys.readouterr().out.strip()) >= 0
