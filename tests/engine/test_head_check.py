"""The log-prob head equals the model's own logits (grpo/engine/logprob_head.py's TRANSFORMS), or the start-up check
(grpo/engine/head_check.py) refuses the model in one line: Falcon-H1's lm_head_multiplier, a planted head transform
nobody listed, every attention family, through peft, and before training in a real build."""
import time
import warnings

import pytest
import torch
import transformers

from grpo.engine import logprob_head
from grpo.engine.head_check import _check_tokens, check_head, head_gap, head_tolerance
from grpo.engine.logprobs import token_logprobs
from grpo.errors import SetupError
from grpo.models import apply_lora
from tests.prefix_families import FAMILIES, VOCAB, tiny_model

PROMPT, COMPS = [5, 9, 14, 3, 22, 7], [[11, 40, 2], [63, 8, 8, 19, 30]]


def falcon_h1(multiplier=0.039):
    """A tiny random Falcon-H1 (Mamba2 + attention, logits = lm_head(h) * lm_head_multiplier)."""
    cfg = transformers.AutoConfig.for_model(
        "falcon_h1", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
        mamba_n_groups=1, mamba_chunk_size=8, lm_head_multiplier=multiplier, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def own_logprobs(model):
    """Each completion's token log-probs from the model's own forward on prompt + completion, one row at a time."""
    out = []
    for c in COMPS:
        ids = torch.tensor([PROMPT + c])
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1:-1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0])
    return out


def _grads(model, logps):
    model.zero_grad()
    sum((k + 1) * lp.sum() for k, lp in enumerate(logps)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_falcon_h1_logprobs_and_gradients_equal_its_own_forward():
    model = falcon_h1()
    want = own_logprobs(model)
    g_want = _grads(model, want)
    got = token_logprobs(model, [PROMPT], [COMPS], shared_prefix=False)[0]
    g_got = _grads(model, got)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert g_got.keys() == g_want.keys() and "lm_head.weight" in g_got
    for name in g_want:
        torch.testing.assert_close(g_got[name], g_want[name], rtol=1e-4, atol=1e-6, msg=name)
    assert check_head(model) < 1e-5


def test_falcon_h1_without_its_transform_is_refused(monkeypatch):
    """The engine as it was before Falcon-H1 was listed: log-probs 0.1-0.4 off, refused naming the class."""
    monkeypatch.delitem(logprob_head.TRANSFORMS, "falcon_h1")
    with pytest.raises(SetupError, match=r"FalconH1ForCausalLM differ from the model's own forward by 0\.\d"):
        check_head(falcon_h1())


class ScaledLogitsLlama(transformers.LlamaForCausalLM):
    """A model with a head transform no table lists: its logits are doubled after lm_head."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


def _scaled(lora=False):
    model = tiny_model("llama")
    scaled = ScaledLogitsLlama(model.config).eval()
    scaled.load_state_dict(model.state_dict())
    return apply_lora(scaled, _Lora()) if lora else scaled


class _Lora:
    r, alpha, dropout, target_modules = 4, 8, 0.0, ["q_proj", "v_proj", "lm_head"]


@pytest.mark.parametrize("lora", [False, True])
def test_an_unknown_head_transform_is_refused_in_one_line(lora):
    with pytest.raises(SetupError) as e:
        check_head(_scaled(lora))
    msg = str(e.value)
    assert "\n" not in msg and "ScaledLogitsLlama differ from the model's own forward by" in msg
    assert "TRANSFORMS" in msg


def test_the_decision_is_the_one_every_rank_agrees_on():
    """``agree`` (the runtime's maximum over ranks) decides: a rank whose own gap is 0 stops when another's is not."""
    assert check_head(tiny_model("llama"), agree=lambda gap: gap) < 1e-5
    with pytest.raises(SetupError, match="by 0.5 "):
        check_head(tiny_model("llama"), agree=lambda gap: max(gap, 0.5))


def test_the_check_puts_the_model_back_in_training_mode_with_its_dropout():
    model = tiny_model("llama").train()
    model.model.layers[0].eval()
    check_head(model)
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_attention_family_passes_cheaply(dtype):
    """Every family the engine serves passes (granite's scaling, cohere2's, gemma2's soft-cap included), in float32
    and bfloat16, and the check costs a small fraction of a second of CPU each on these tiny models."""
    cpu = []
    for family in FAMILIES:
        model = tiny_model(family, dtype=dtype)
        t = time.process_time()
        gap = check_head(model)
        cpu.append(time.process_time() - t)
        assert gap < (1e-5 if dtype == torch.float32 else 1e-3), family
    assert sorted(cpu)[len(cpu) // 2] < 0.5, cpu


def test_peft_wrapped_families_pass():
    for family in ("llama", "gemma2", "granite"):
        model = apply_lora(tiny_model(family), _Lora())
        assert head_gap(model) < 1e-5, family


def test_build_run_refuses_the_model_before_training(cfg_factory, monkeypatch, tmp_path):
    """In a real build (the smoke recipe), the planted model stops the run at start-up: no step, no metrics."""
    import grpo.trainer.build as build

    monkeypatch.setattr(build, "load_model", lambda mcfg, vocab, seed=0: _scaled())
    monkeypatch.setattr(build, "load_reference", lambda *a, **k: None)
    with pytest.raises(SetupError, match="ScaledLogitsLlama differ"):
        build.build_run(cfg_factory())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# non-trivial values of each transform's config key, and what a family needs to build at a tiny size
_SET = {"logits_scaling": 3.0, "logit_scale": 0.3, "final_logit_softcapping": 0.5, "logits_soft_cap": 0.5,
        "output_logit_soft_cap": 0.5, "logits_mup_width_multiplier": 4.0, "unpadded_vocab_size": 90}
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)


@pytest.mark.parametrize("model_type", ["granite", "hyperclovax", "cohere", "gemma3_text",
                                        "vaultgemma", "beam", "recurrent_gemma", "xlstm", "inkling_text",
                                        "inkling2_text"])
def test_each_listed_transform_is_its_familys_own(model_type):
    """The table entry of ``model_type`` against that family's real modeling code (a multiplier that divides in
    one family and multiplies in another, three soft-cap keys, a padded vocabulary the model drops): with the
    transform's key set to a value that changes the logits, the engine equals the model's own forward."""
    default = transformers.AutoConfig.for_model(model_type)
    settable = lambda k: hasattr(default, k) and not isinstance(getattr(type(default), k, None), property)  # noqa: E731
    kw = {k: v for k, v in {**_SMALL, **_SET}.items() if settable(k)}
    assert any(k in kw for k in _SET)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **kw))
    assert head_gap(model.eval()) < 1e-5


# the cheap tests (those mutation testing runs): one tiny llama built at import, so that every mutant's tests,
# forked from a process that imported this module, reuse it instead of building their own
LLAMA = tiny_model("llama")


def test_the_tolerance_of_each_dtype_and_the_boundary_and_nan_of_the_decision():
    assert (head_tolerance(torch.bfloat16), head_tolerance(torch.float16), head_tolerance(torch.float32)) == \
        (0.25, 0.05, 1e-3)
    assert check_head(LLAMA, agree=lambda gap: 1e-3) == 1e-3  # a gap of exactly the tolerance passes
    with pytest.raises(SetupError, match=r"LlamaForCausalLM differ from the model's own forward by 0\.0011 \(largest "
                                         r"over 12 tokens; rounding in float32 explains 0\.001\)"):
        check_head(LLAMA, agree=lambda gap: 1.1e-3)
    with pytest.raises(SetupError, match="by nan"):
        check_head(LLAMA, agree=lambda gap: float("nan"))
    seen = []
    assert check_head(LLAMA, agree=lambda gap: seen.append(gap) or gap) == seen[0] < 1e-5


def test_the_check_tokens_are_fixed_and_known_to_the_model_and_its_head():
    prompt, comps = _check_tokens(97)
    ids = [(7 + 37 * k) % 97 for k in range(12)]
    assert prompt == ids[:4] and comps == [ids[4:8], ids[8:12]]
    assert _check_tokens(10) == ([7, 4, 1, 8], [[5, 2, 9, 6], [3, 0, 7, 4]])
    # a config that claims more tokens than the head has: only tokens below the smallest size are scored
    big = dict(vars(LLAMA.config))
    try:
        LLAMA.config.vocab_size = 10_000
        assert head_gap(LLAMA) < 1e-5
    finally:
        LLAMA.config.vocab_size = big["vocab_size"]


def test_the_gap_is_the_largest_of_the_log_prob_and_entropy_differences(monkeypatch):
    import grpo.engine.head_check as hc

    real = hc.token_logprobs

    def shifted(*a, lp=0.0, ent=0.0, **kw):
        lps, ents = real(*a, **kw)
        return [[x + lp for x in lps[0]]], [[x + ent for x in ents[0]]]

    monkeypatch.setattr(hc, "token_logprobs", lambda *a, **kw: shifted(*a, lp=0.01, **kw))
    assert abs(head_gap(LLAMA) - 0.01) < 1e-5
    monkeypatch.setattr(hc, "token_logprobs", lambda *a, **kw: shifted(*a, ent=-0.02, **kw))
    assert abs(head_gap(LLAMA) - 0.02) < 1e-5


def test_the_two_forwards_run_in_eval_mode_and_the_modes_are_put_back():
    modes = []
    hook = LLAMA.model.register_forward_pre_hook(lambda m, a: modes.append(m.training))
    try:
        LLAMA.train()
        LLAMA.model.layers[0].eval()
        assert check_head(LLAMA) < 1e-5
        assert LLAMA.training and not LLAMA.model.layers[0].training and LLAMA.model.layers[1].training
    finally:
        hook.remove()
        LLAMA.eval()
    assert modes == [False, False]


def test_the_engine_side_is_the_standard_layout_and_its_tokens_are_below_every_vocabulary(monkeypatch):
    import grpo.engine.head_check as hc

    calls, sizes = [], []
    real_lp, real_tokens = hc.token_logprobs, hc._check_tokens
    monkeypatch.setattr(hc, "token_logprobs", lambda *a, **kw: calls.append(kw) or real_lp(*a, **kw))
    monkeypatch.setattr(hc, "_check_tokens", lambda vocab: sizes.append(vocab) or real_tokens(vocab))
    monkeypatch.setitem(logprob_head.TRANSFORMS, "llama", lambda text: logprob_head.HeadTransform(vocab=50))
    head_gap(LLAMA)  # (the gap itself: the engine drops the logits past 50, the model's own forward does not)
    assert calls == [dict(shared_prefix=False, return_entropy=True)] and sizes == [50]


def test_the_tolerance_is_the_models_dtypes():
    import copy

    half = copy.deepcopy(LLAMA).to(torch.bfloat16)
    assert check_head(half, agree=lambda gap: 0.2) == 0.2
    with pytest.raises(SetupError, match="rounding in bfloat16 explains 0.25"):
        check_head(half, agree=lambda gap: 0.3)


def test_a_model_answering_with_a_tuple():
    hook = LLAMA.register_forward_hook(lambda m, a, out: out.to_tuple())  # as with return_dict=False
    try:
        assert head_gap(LLAMA) < 1e-5
    finally:
        hook.remove()
