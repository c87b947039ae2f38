"""Equivalence of the shared-prefix forward with an independent per-sequence reference."""

import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from grpo.engine import plan_micro_batches, token_logprobs
from grpo.engine.layout import build_layout

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 128
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}
# G in {1, 2, 5}; ragged prompts (1-token prompt included) and completions (1-token completions included)
PROMPT_LENS = [1, 9, 4]
COMPLETION_LENS = [[3], [5, 1], [2, 7, 1, 4, 3]]


def make_model(family="llama", impl="sdpa", dtype=torch.float32, seed=0, **overrides):
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **overrides}, attn_implementation=impl)
    model = model_cls(config).to(dtype)
    if family == "qwen2":  # biases are zero at init; make them count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
    return model.eval()


def make_data(prompt_lens=PROMPT_LENS, completion_lens=COMPLETION_LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    return [tok(p) for p in prompt_lens], [[tok(s) for s in ss] for ss in completion_lens]


def reference(model, prompts, comps, temperature=1.0):
    """Each prompt+completion alone, batch of one, no padding, the model's own forward."""
    logps, ents = [], []
    for p, cs in zip(prompts, comps):
        row_lp, row_ent = [], []
        for r in cs:
            logits = model(torch.tensor([p + r])).logits[0].float() / temperature
            lp = torch.log_softmax(logits[len(p) - 1 : len(p) + len(r) - 1], dim=-1)
            row_lp.append(lp.gather(-1, torch.tensor(r)[:, None])[:, 0])
            row_ent.append(-(lp.exp() * lp).sum(-1))
        logps.append(row_lp)
        ents.append(row_ent)
    return logps, ents


def max_err(a, b):
    return max((x.float() - y.float()).abs().max().item() for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def weights_like(logps, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(len(x), generator=g) for x in row] for row in logps]


def weighted_loss(logps, weights):
    return sum((x * w).sum() for row, wrow in zip(logps, weights) for x, w in zip(row, wrow))


def grads(model, logps, weights):
    model.zero_grad(set_to_none=True)
    weighted_loss(logps, weights).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_with_grads(model, prompts, comps):
    """(per-sequence reference log-probs, the loss weights, the reference gradients): what every equivalence
    test compares the engine's log-probs and gradients with."""
    ref, _ = reference(model, prompts, comps)
    w = weights_like(ref)
    return ref, w, grads(model, ref, w)


def assert_grads_close(got, want, rel=1e-4):
    assert got.keys() == want.keys()
    for name in want:
        scale = want[name].abs().max().item()
        err = (got[name] - want[name]).abs().max().item()
        assert err <= rel * scale + 1e-12, f"{name}: max err {err:.3e} vs grad scale {scale:.3e}"


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_matches_per_sequence_reference(family, impl, shared):
    model = make_model(family, impl)
    prompts, comps = make_data()
    ref, w, ref_grads = reference_with_grads(model, prompts, comps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shared path must really be taken, no fallback
        out = token_logprobs(model, prompts, comps, shared_prefix=shared)
    assert [[len(x) for x in row] for row in out] == COMPLETION_LENS
    assert all(x.dtype == torch.float32 and x.dim() == 1 for row in out for x in row)
    assert max_err(out, ref) <= 1e-5
    assert_grads_close(grads(model, out, w), ref_grads)
    assert model.config._attn_implementation == impl


def test_bf16_close():
    model = make_model("llama", "sdpa", dtype=torch.bfloat16)
    prompts, comps = make_data()
    ref, _ = reference(model, prompts, comps)
    out = token_logprobs(model, prompts, comps)
    assert max_err(out, ref) <= 2e-2


def test_temperature_and_entropy_with_gradients():
    model = make_model("qwen3", "sdpa")
    prompts, comps = make_data()
    ref_lp, ref_ent = reference(model, prompts, comps, temperature=0.7)
    w1, w2 = weights_like(ref_lp, seed=3), weights_like(ref_lp, seed=4)

    def both_grads(lp, ent):
        model.zero_grad(set_to_none=True)
        (weighted_loss(lp, w1) + weighted_loss(ent, w2)).backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    ref_grads = both_grads(ref_lp, ref_ent)
    for shared in (True, False):
        lp, ent = token_logprobs(model, prompts, comps, shared_prefix=shared, temperature=0.7, return_entropy=True)
        assert max_err(lp, ref_lp) <= 1e-5
        assert max_err(ent, ref_ent) <= 1e-5
        assert_grads_close(both_grads(lp, ent), ref_grads)


def test_no_grad():
    model = make_model("llama", "sdpa")
    prompts, comps = make_data()
    ref, _ = reference(model, prompts, comps)
    with torch.no_grad():
        out = token_logprobs(model, prompts, comps)
    assert not any(x.requires_grad for row in out for x in row)
    assert max_err(out, ref) <= 1e-5


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    model = make_model("qwen2", "sdpa").train()
    prompts, comps = make_data()
    ref, w, ref_grads = reference_with_grads(model, prompts, comps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation notice of gradient_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        model.enable_input_require_grads()
    layers = model.model.layers
    funcs = [layer._gradient_checkpointing_func for layer in layers]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = token_logprobs(model, prompts, comps)
    # everything restored before backward; the recompute in backward still uses the shared layout
    assert model.config._attn_implementation == "sdpa"
    assert [layer._gradient_checkpointing_func for layer in layers] == funcs
    assert max_err(out, ref) <= 1e-5
    assert_grads_close(grads(model, out, w), ref_grads)
    assert model.config._attn_implementation == "sdpa"


def test_config_restored_on_exception():
    model = make_model("llama", "eager")
    with pytest.raises(IndexError):
        token_logprobs(model, [[1, 2]], [[[3, 10**6]]])
    assert model.config._attn_implementation == "eager"
    # and the model still works normally afterwards
    model(torch.tensor([[1, 2, 3]]))


def test_layout_positions_and_prediction_indices():
    layout = build_layout([[5, 6, 7]], [[[8, 9], [10]]], "cpu")
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3]]  # restart at len(P) for every completion
    assert layout.pred_idx.tolist() == [2, 3, 2]  # last prompt token predicts every first completion token
    assert layout.targets.tolist() == [8, 9, 10]


def test_plan_budget_whole_groups_and_split():
    P, S = [10, 4, 12, 2], [[5, 5], [1, 1, 1], [10, 10, 10, 3], [7]]
    plan = plan_micro_batches(P, S, 25)
    seen = []
    for mb in plan:
        tokens = sum(P[g] + sum(S[g][sl]) for g, sl in mb)
        assert tokens <= 25
        seen += [(g, i) for g, sl in mb for i in range(*sl.indices(len(S[g])))]
    assert sorted(seen) == [(g, i) for g in range(4) for i in range(len(S[g]))]
    # groups that fit stay whole; the oversize group 2 (45 tokens) is split by completions, prompt in each part
    for g in (0, 1, 3):
        assert [sl for mb in plan for gg, sl in mb if gg == g] == [slice(0, len(S[g]))]
    assert len([sl for mb in plan for gg, sl in mb if gg == 2]) >= 3
    assert plan_micro_batches(P, S, None) == [[(g, slice(0, len(S[g]))) for g in range(4)]]
    # the standard layout counts the prompt once per completion
    for mb in plan_micro_batches(P, S, 40, shared_prefix=False):
        assert sum(P[g] + s for g, sl in mb for s in S[g][sl]) <= 40


def test_plan_rejects_single_sequence_over_budget():
    with pytest.raises(ValueError, match="exceeds max_tokens_per_micro_batch=12"):
        plan_micro_batches([10], [[1, 3]], 12)
    model = make_model()
    with pytest.raises(ValueError, match="alone exceeds"):
        token_logprobs(model, [[1] * 10], [[[2], [3, 4, 5]]], max_tokens_per_micro_batch=12)


@pytest.mark.parametrize("shared", [True, False])
def test_micro_batched_equals_unbatched(shared):
    model = make_model("mistral", "sdpa")
    prompts, comps = make_data()
    w = weights_like(comps)
    full = token_logprobs(model, prompts, comps, shared_prefix=shared)
    full_grads = grads(model, full, w)
    small = token_logprobs(model, prompts, comps, shared_prefix=shared, max_tokens_per_micro_batch=14)
    assert max_err(small, full) <= 1e-5
    assert_grads_close(grads(model, small, w), full_grads)


def _check_fallback(model, match):
    prompts, comps = make_data()
    ref, w, ref_grads = reference_with_grads(model, prompts, comps)
    with pytest.warns(UserWarning, match=match):
        out = token_logprobs(model, prompts, comps, shared_prefix=True)
    assert max_err(out, ref) <= 1e-5
    assert_grads_close(grads(model, out, w), ref_grads)


def test_sliding_window_shared_exactly_and_inactive_when_long():
    """A window shorter than the sequences is honoured inside the shared layout (every family with windows:
    tests/engine/test_families.py); one longer than every sequence is inactive and takes the fused kernels."""
    for model in (make_model("mistral", "sdpa", sliding_window=4),
                  make_model("qwen2", "eager", use_sliding_window=True, sliding_window=3, max_window_layers=0),
                  make_model("mistral", "sdpa", sliding_window=64)):
        prompts, comps = make_data()
        ref, w, ref_grads = reference_with_grads(model, prompts, comps)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = token_logprobs(model, prompts, comps)
        assert max_err(out, ref) <= 1e-5
        assert_grads_close(grads(model, out, w), ref_grads)


def test_an_unimplemented_feature_falls_back_naming_it():
    """A feature the shared layout does not implement (here: Llama 4's chunked attention, declared on a config the
    Llama code ignores, so the standard layout's answer is still the reference) is refused by name."""
    model = make_model("llama", "sdpa")
    model.config.attention_chunk_size = 4
    _check_fallback(model, r"chunked attention \(attention_chunk_size\) is not implemented by the shared layout")


def test_a_layer_that_bypasses_our_attention_fails_in_one_line():
    """The every-layer check (grpo/engine/patch.py) raises, in training forwards and in decoding alike, and says how
    to turn the sharing off."""
    from grpo.engine.patch import DECODE_ATTN_NAME, check_every_layer

    model = make_model()
    attn = model.model.layers[1].self_attn
    attn.forward = lambda hidden_states, **kw: (torch.zeros_like(hidden_states), None)  # never calls attention
    prompts, comps = make_data()
    with pytest.raises(RuntimeError, match="only 1 of 2 attention layers") as e:
        token_logprobs(model, prompts, comps)
    assert "\n" not in str(e.value) and "shared_prefix=False" in str(e.value)
    with pytest.raises(RuntimeError, match="rollout.share_prompt=false") as e:
        check_every_layer(1, model, DECODE_ATTN_NAME)
    assert "\n" not in str(e.value)
    check_every_layer(2, model, DECODE_ATTN_NAME)  # every layer: nothing to say


def test_peft_lora_model():
    peft = pytest.importorskip("peft")
    base = make_model("llama", "sdpa")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    prompts, comps = make_data()
    ref, w, ref_grads = reference_with_grads(model, prompts, comps)
    out = token_logprobs(model, prompts, comps)
    assert max_err(out, ref) <= 1e-5
    assert_grads_close(grads(model, out, w), ref_grads)
    with model.disable_adapter(), torch.no_grad():  # the LoRA reference model: adapter off
        off = token_logprobs(model, prompts, comps)
        assert max_err(off, reference(base, prompts, comps)[0]) <= 1e-5


def test_smollm2_if_available():
    path = Path.home() / ".cache" / "grpo" / "SmolLM2-135M-Instruct"
    if not (path / "config.json").exists():
        pytest.skip("embedded SmolLM2 not prepared (make model)")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, comps = make_data([6, 3], [[4, 1, 2], [3]])
    with torch.no_grad():
        ref, _ = reference(model, prompts, comps)
        for shared in (True, False):
            assert max_err(token_logprobs(model, prompts, comps, shared_prefix=shared), ref) <= 1e-4


def test_empty_completion_and_tensor_inputs():
    model = make_model()
    out = token_logprobs(model, [torch.tensor([1, 2])], [[torch.tensor([3, 4]), torch.tensor([], dtype=torch.long)]])
    assert out[0][1].shape == (0,) and out[0][0].shape == (2,)


def test_bench_quick_runs():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_prefix.py"), "--quick"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("| tiny-llama-quick |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["64", "8", "4"]  # P, S, G
    std, shared, speedup = float(cells[4]), float(cells[5]), float(cells[6].rstrip("x"))
    assert shared > 0.0005  # the times are printed to 3 decimals, the speedup (of the unrounded ones) to 2
    assert (std - 5e-4) / (shared + 5e-4) - 0.005 <= speedup <= (std + 5e-4) / (shared - 5e-4) + 0.005
    P, S, G = 64, 8, 4  # the analytic ceilings of docs/prefix-engine.md, written out here
    linear, attention = G * (P + S) / (P + G * S), G * (P + S) ** 2 / (P ** 2 + G * S * (2 * P + S))
    assert cells[10] == f"{linear:.2f}x / {attention:.2f}x"  # 3.00x / 2.45x
    low, high = (float(x) for x in cells[7].rstrip("x").split("-"))  # the range of the per-repeat speedups
    assert low <= high and abs(low - speedup) <= 0.01  # one repeat: its speedup is the range
    # the combined ceiling also counts the lm_head, the same work in both layouts: between 1 and the larger ratio
    assert 1.0 < float(cells[8].rstrip("x")) <= max(linear, attention)


# --------------------------------------------------------------------------------------------- narrow unit tests
# One tiny one-layer llama built at import (a module's top runs once in the process every mutant of `make mutate` is
# forked from), tiny groups: the entry's checks, choices and both forwards, each against the per-sequence reference.
torch.manual_seed(0)
ONE = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, attn_implementation="sdpa")).eval()
with torch.no_grad():  # sharp attention: at the init's scale it is near uniform, and wrong positions change little
    for _w in ONE.parameters():
        if _w.dim() > 1:
            _w.normal_(0, 0.5)
# a later completion of two tokens: its second is predicted at its own position (restarting at len(P))
SMALL_P, SMALL_C = [[1, 2, 3], [4]], [[[5, 6], [7, 11]], [[8, 9, 10], []]]


def test_both_layouts_of_one_small_model_equal_the_reference():
    from grpo.engine import logprobs

    nonempty = [[r for r in cs if r] for cs in SMALL_C]
    ref, w, ref_grads = reference_with_grads(ONE, SMALL_P, nonempty)
    ref_lp, ref_ent = reference(ONE, SMALL_P, nonempty, temperature=0.5)
    for shared in (True, False):
        out = logprobs.token_logprobs(ONE, SMALL_P, SMALL_C, shared_prefix=shared)
        assert [[len(x) for x in row] for row in out] == [[2, 2], [3, 0]]
        assert out[1][1].dtype == torch.float32
        assert max_err([out[0], out[1][:1]], ref) <= 1e-5
        assert_grads_close(grads(ONE, [out[0], out[1][:1]], w), ref_grads)
        lp, ent = logprobs.token_logprobs(ONE, SMALL_P, SMALL_C, shared_prefix=shared, temperature=0.5,
                                          return_entropy=True)
        for got, want in ((lp, ref_lp), (ent, ref_ent)):
            assert max_err([got[0], got[1][:1]], want) <= 1e-5 and got[1][1].shape == (0,)


def test_groups_without_a_completion_token_and_micro_batches():
    from grpo.engine import logprobs

    for shared in (True, False):
        out, ent = logprobs.token_logprobs(ONE, [[1, 2]], [[[], []]], shared_prefix=shared, return_entropy=True)
        assert [x.shape for x in out[0]] == [(0,), (0,)] == [x.shape for x in ent[0]]
        full = logprobs.token_logprobs(ONE, SMALL_P, SMALL_C, shared_prefix=shared)
        split = logprobs.token_logprobs(ONE, SMALL_P, SMALL_C, shared_prefix=shared, max_tokens_per_micro_batch=6)
        assert max_err([split[0], split[1][:1]], [full[0], full[1][:1]]) <= 1e-6 and split[1][1].shape == (0,)


def test_the_inputs_are_checked_before_the_model_runs():
    from grpo.engine.logprobs import _as_groups, _as_list

    with pytest.raises(ValueError, match="^2 prompts but 1 completion groups$"):
        _as_groups([[1], [2]], [[[3]]], 1.0)
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match=f"^temperature must be > 0, got {bad}$"):
            _as_groups([[1]], [[[3]]], bad)
    with pytest.raises(ValueError, match="^group 1 has an empty prompt"):
        _as_groups([[1], []], [[[3]], [[4]]], 1.0)
    prompts, comps = _as_groups([torch.tensor([1, 2]), (3,)], [[torch.tensor([4])], [[5.0, 6]]], 0.01)
    assert prompts == [[1, 2], [3]] and comps == [[[4]], [[5, 6]]]
    assert all(type(t) is int for t in _as_list(torch.tensor([7, 8])) + _as_list([9.0]))


def test_the_vision_families_and_the_refused_ones_go_to_the_image_path(monkeypatch):
    from grpo.engine import logprobs

    calls = []
    monkeypatch.setattr(logprobs, "vision_token_logprobs", lambda *a, **kw: calls.append((a, kw)) or "images")
    for model_type in ("qwen2_vl", "gemma3", "lfm2_vl"):
        model = types_model(model_type)
        got = logprobs.token_logprobs(model, "p", "c", shared_prefix=False, temperature=0.3,
                                      max_tokens_per_micro_batch=7, return_entropy=True)
        assert got == "images"
        assert calls.pop() == ((model, "p", "c"), dict(shared_prefix=False, temperature=0.3,
                                                      max_tokens_per_micro_batch=7, return_entropy=True))
    with pytest.raises(ValueError, match="temperature"):  # a text model type: the text path
        logprobs.token_logprobs(types_model("llama"), [[1]], [[[2]]], temperature=0)
    assert calls == []


def types_model(model_type):
    return torch.nn.Module() if model_type is None else _Typed(model_type)


class _Typed(torch.nn.Module):
    def __init__(self, model_type):
        super().__init__()
        self.config = transformers.PretrainedConfig()
        self.config.model_type = model_type


def test_the_model_parts_of_a_plain_a_wrapped_and_a_headless_model(monkeypatch):
    from grpo.engine.logprobs import _model_parts

    assert _model_parts(ONE) == (ONE, ONE.model, ONE.lm_head)

    class DistributedDataParallel(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    ddp = DistributedDataParallel(ONE)
    with pytest.warns(UserWarning, match="DDP does not all-reduce these gradients"):
        assert _model_parts(ddp) == (ONE, ONE.model, ONE.lm_head)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            assert _model_parts(ddp)[0] is ONE  # no gradients: nothing to all-reduce
        assert _model_parts(ONE)[0] is ONE

    class Own(torch.nn.Module):  # a decoder found through .model where get_decoder answers the model itself
        def __init__(self, decoder="model", head=True):
            super().__init__()
            self.head = torch.nn.Linear(2, 2) if head else None
            if decoder == "model":
                self.model = torch.nn.Linear(2, 2)

        def get_output_embeddings(self):
            return self.head

        def get_decoder(self):
            return self

    own = Own()
    assert _model_parts(own) == (own, own.model, own.head)
    with pytest.raises(ValueError, match="^Own has no output embeddings: token_logprobs needs a causal LM$"):
        _model_parts(Own(head=False))
    with pytest.raises(ValueError, match="^cannot find the decoder stack of Own$"):
        _model_parts(Own(decoder=None))
    plain = torch.nn.Module()
    with pytest.raises(ValueError, match="^Module has no output embeddings"):
        _model_parts(plain)

    class NoGetter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def get_output_embeddings(self):
            return self.head

    m = NoGetter()
    assert _model_parts(m) == (m, m.model, m.head)


def test_the_shared_layout_is_asked_for_the_longest_sequence_and_a_refusal_warns(monkeypatch):
    from grpo.engine import logprobs
    from grpo.errors import GRPOWarning

    asked = []
    monkeypatch.setattr(logprobs, "shared_prefix_unsupported", lambda lm, n: asked.append((lm, n)))
    assert logprobs._shared_prefix_serves(ONE, [[1, 2, 3], [4]], [[[5]], [[6, 7, 8, 9]]]) is True
    assert logprobs._shared_prefix_serves(ONE, [[1, 2, 3]], [[]]) is True  # a group without completions
    assert logprobs._shared_prefix_serves(ONE, [], []) is True  # no group: nothing long
    assert asked == [(ONE, 5), (ONE, 3), (ONE, 0)]
    monkeypatch.setattr(logprobs, "shared_prefix_unsupported", lambda lm, n: "why not")
    with pytest.warns(GRPOWarning, match="^shared-prefix forward disabled, using the standard layout: why not$"):
        assert logprobs._shared_prefix_serves(ONE, [[1]], [[[2]]]) is False


def test_the_kernel_choice_and_its_refusals(monkeypatch):
    from grpo.engine import logprobs

    assert logprobs.ATTENTION_KERNELS == ("auto", "grouped", "flex")
    with pytest.raises(ValueError, match="^attention_kernel must be one of auto, grouped, flex, got 'fast'$"):
        logprobs._resolve_kernel("fast", ONE)
    assert logprobs._resolve_kernel("auto", ONE) == "grouped" == logprobs._resolve_kernel("grouped", ONE)
    monkeypatch.setattr(logprobs, "flex_available", lambda: True)
    with pytest.raises(ValueError, match="cannot run backward on CPU"):
        logprobs._resolve_kernel("flex", ONE)
    with torch.no_grad():
        assert logprobs._resolve_kernel("flex", ONE) == "flex"
        ONE.train()
        try:
            assert logprobs._resolve_kernel("flex", ONE) == "flex"  # training, no attention dropout
            ONE.config.attention_dropout = 0.1
            with pytest.raises(ValueError, match="has no attention dropout"):
                logprobs._resolve_kernel("flex", ONE)
            ONE.config.attention_dropout = None
            assert logprobs._resolve_kernel("flex", ONE) == "flex"
            ONE.config.attention_dropout = 0.1
            ONE.eval()
            assert logprobs._resolve_kernel("flex", ONE) == "flex"  # eval: dropout off
        finally:
            ONE.config.attention_dropout = 0.0
            ONE.eval()
        monkeypatch.setattr(logprobs, "flex_available", lambda: False)
        with pytest.raises(ValueError, match="needs torch.nn.attention.flex_attention"):
            logprobs._resolve_kernel("flex", ONE)
        assert logprobs._resolve_kernel("auto", ONE) == "grouped"


def test_flex_builds_the_block_mask_and_every_layer_is_checked(monkeypatch):
    from grpo.engine import logprobs

    built, checked = [], []
    monkeypatch.setattr(logprobs, "build_block_mask", lambda layout: built.append(layout.n_tokens))
    real = logprobs.check_every_layer
    monkeypatch.setattr(logprobs, "check_every_layer", lambda calls, lm: checked.append((calls, lm)) or real(calls, lm))
    lm, decoder, head = logprobs._model_parts(ONE)
    want, _ = logprobs._forward_shared_prefix(lm, decoder, head, SMALL_P, SMALL_C, 1.0, False, "grouped")
    assert built == [] and checked == [(1, ONE)]
    with torch.no_grad():
        got, ent = logprobs._forward_shared_prefix(lm, decoder, head, SMALL_P, SMALL_C, 1.0, True, "flex")
    assert built == [11] and checked[-1] == (1, ONE) and ent.shape == got.shape == (7,)
    torch.testing.assert_close(got, want.detach())
    assert logprobs._forward_shared_prefix(lm, decoder, head, [[1]], [[[]]], 1.0, False, "flex")[0].shape == (0,)
    assert built == [11]  # nothing to compute: no layout built


def test_the_device_is_the_input_embeddings_or_else_the_first_parameter():
    from grpo.engine.logprobs import _device, _empty

    class NoEmbeddings(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1, device="meta"))

        def get_input_embeddings(self):
            return None

    assert _device(NoEmbeddings()).type == "meta"
    emb = torch.nn.Embedding(2, 2, device="meta")
    ONE_meta = types.SimpleNamespace(get_input_embeddings=lambda: emb)
    assert _device(ONE_meta).type == "meta" and _device(ONE).type == "cpu"
    e = _empty(torch.device("meta"))
    assert e.shape == (0,) and e.device.type == "meta" and e.dtype == torch.float32


def test_the_entry_picks_the_layout_the_kernel_and_the_micro_batches_it_is_asked_for(monkeypatch):
    from grpo.engine import logprobs

    calls = []
    for name in ("_forward_shared_prefix", "_forward_standard"):
        real = getattr(logprobs, name)
        monkeypatch.setattr(logprobs, name, lambda *a, _n=name, _r=real: calls.append((_n, a[3:])) or _r(*a))
    logprobs.token_logprobs(ONE, SMALL_P, SMALL_C)  # the default: shared
    assert calls == [("_forward_shared_prefix", (SMALL_P, SMALL_C, 1.0, False, "grouped"))]
    calls.clear()
    logprobs.token_logprobs(ONE, SMALL_P, SMALL_C, shared_prefix=False, temperature=0.5, return_entropy=True)
    assert calls == [("_forward_standard", (SMALL_P, SMALL_C, 0.5, True))]
    calls.clear()
    monkeypatch.setattr(logprobs, "flex_available", lambda: True)
    monkeypatch.setattr(logprobs, "build_block_mask", lambda layout: None)  # (the grouped kernel runs instead)
    with torch.no_grad():
        logprobs.token_logprobs(ONE, SMALL_P, SMALL_C, attention_kernel="flex")
    assert calls == [("_forward_shared_prefix", (SMALL_P, SMALL_C, 1.0, False, "flex"))]
    for shared in (True, False):  # the plan of each layout, at the budget asked
        calls.clear()
        logprobs.token_logprobs(ONE, SMALL_P, SMALL_C, shared_prefix=shared, max_tokens_per_micro_batch=7)
        plan = plan_micro_batches([3, 1], [[2, 2], [3, 0]], 7, shared_prefix=shared)
        assert [c[1][:2] for c in calls] == [([SMALL_P[g] for g, _ in mb], [SMALL_C[g][sl] for g, sl in mb])
                                              for mb in plan]
    assert len(plan_micro_batches([3, 1], [[2, 2], [3, 0]], 7, shared_prefix=False)) == 3  # not the shared plan's 2


def test_a_config_without_a_model_type_is_a_text_model():
    from grpo.engine import logprobs

    class Untyped(torch.nn.Module):
        config = types.SimpleNamespace()

    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs.token_logprobs(Untyped(), [[1]], [[[2]]], temperature=0)


def test_both_layouts_read_the_models_config_for_its_head():
    """The head's transform of the model's config (HyperCLOVA X's logit scale, grpo/engine/logprob_head.py) applies in
    both layouts: the reference is the model's logits scaled by hand (Llama's own forward ignores the key)."""
    from grpo.engine import logprobs

    nonempty = [[r for r in cs if r] for cs in SMALL_C]
    want = []
    with torch.no_grad():
        for p, cs in zip(SMALL_P, nonempty):
            row = []
            for r in cs:
                logits = ONE(torch.tensor([p + r])).logits[0]
                lp = torch.log_softmax(logits * 2.5, -1)[len(p) - 1:-1]
                row.append(lp.gather(-1, torch.tensor(r)[:, None])[:, 0])
            want.append(row)
        ONE.config.model_type, ONE.config.logits_scaling = "hyperclovax", 2.5
        try:
            for shared in (True, False):
                got = logprobs.token_logprobs(ONE, SMALL_P, SMALL_C, shared_prefix=shared)
                assert max_err([got[0], got[1][:1]], want) <= 1e-5
        finally:
            del ONE.config.model_type, ONE.config.logits_scaling


def test_the_decoder_is_the_models_own_answer_before_its_model_attribute():
    from grpo.engine.logprobs import _model_parts

    class TwoStacks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.stack, self.head = (torch.nn.Linear(2, 2) for _ in range(3))

        def get_output_embeddings(self):
            return self.head

        def get_decoder(self):
            return self.stack

    m = TwoStacks()
    assert _model_parts(m) == (m, m.stack, m.head)
    m.get_decoder = lambda: None  # no answer: the model attribute
    assert _model_parts(m)[1] is m.model


def test_a_config_without_attention_dropout_trains_with_flex(monkeypatch):
    from grpo.engine import logprobs

    monkeypatch.setattr(logprobs, "flex_available", lambda: True)
    monkeypatch.setattr(ONE, "config", types.SimpleNamespace(model_type="llama"))
    ONE.train()
    try:
        with torch.no_grad():
            assert logprobs._resolve_kernel("flex", ONE) == "flex"
    finally:
        ONE.eval()


def test_a_layer_that_does_not_pass_the_layout_on_reads_it_from_the_switch(monkeypatch):
    """StableLM's decoder layers drop keyword arguments: the attention then reads the layout the switch holds."""
    from grpo.engine import logprobs
    from grpo.engine.prefix_attention import LAYOUT_KWARG

    attn = ONE.model.layers[0].self_attn
    real = type(attn).forward
    monkeypatch.setattr(attn, "forward", lambda *a, **kw: real(attn, *a, **{k: v for k, v in kw.items()
                                                                            if k != LAYOUT_KWARG}))
    nonempty = [[r for r in cs if r] for cs in SMALL_C]
    with torch.no_grad():
        want, _ = reference(ONE, SMALL_P, nonempty)
        got = logprobs.token_logprobs(ONE, SMALL_P, SMALL_C)
    assert max_err([got[0], got[1][:1]], want) <= 1e-5
