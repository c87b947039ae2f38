import pytest
import torch

from grpo.models import char_tokenizer, tiny_model
from grpo.rollout.base import Sampling, cut_at_eos
from grpo.rollout.hf import generate


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_shared_prompt_prefill_samples_identical_tokens(family):
    tok = char_tokenizer()
    model = tiny_model(family, len(tok), seed=0)
    prompts = [tok("What is 12 + 7?")["input_ids"], tok("Hi")["input_ids"], tok("3+4=")["input_ids"]]
    out = []
    for share in (True, False):
        torch.manual_seed(1)
        out.append(generate(model, tok, prompts, Sampling(10), group_size=4, batch_size=2, progress=False,
                            share_prompt=share))
    assert out[0] == out[1]
    comps, trunc = out[0]
    assert [len(g) for g in comps] == [4, 4, 4]
    assert len({tuple(c) for c in comps[0]}) > 1  # samples differ inside a group


def test_greedy_is_deterministic_and_one_per_prompt():
    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=0)
    prompts = [tok("abc")["input_ids"], tok("hello there")["input_ids"]]
    a = generate(model, tok, prompts, Sampling(6, greedy=True), group_size=4, progress=False)
    b = generate(model, tok, prompts, Sampling(6, greedy=True), group_size=4, progress=False)
    assert a == b and [len(g) for g in a[0]] == [1, 1]


def test_cut_at_eos_keeps_eos_and_flags_truncation():
    assert cut_at_eos([5, 6, 2, 0, 0], [2], 5) == ([5, 6, 2], False)
    assert cut_at_eos([5, 6, 7], [2], 3) == ([5, 6, 7], True)


def test_checkpoint_generation_config_does_not_change_sampling():
    """A generation_config.json with a repetition penalty must not make the rollout off-policy."""
    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=0)
    prompts = [tok("What is 12 + 7?")["input_ids"]]
    outs = []
    for penalty in (None, 50.0):
        if penalty:
            model.generation_config.repetition_penalty = penalty
            model.generation_config.no_repeat_ngram_size = 2
        torch.manual_seed(3)
        outs.append(generate(model, tok, prompts, Sampling(12), group_size=4, progress=False))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_decode_matches_hf_generate(family):
    """The decode loop (prefill, positions under left padding, cache, EOS stop) against HF's own generate."""
    tok = char_tokenizer()
    model = tiny_model(family, len(tok), seed=0)
    prompts = [tok("What is 12 + 7?")["input_ids"], tok("Hi")["input_ids"], tok("x")["input_ids"]]
    comps, trunc = generate(model, tok, prompts, Sampling(12, greedy=True), group_size=3, progress=False)
    eos = tok.eos_token_id
    for p, (c,), cut in zip(prompts, comps, trunc):
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             do_sample=False, max_new_tokens=12, eos_token_id=eos,
                             pad_token_id=eos)[0, len(p):].tolist()
        want = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert c == want and cut == [eos not in ref]


def test_eos_stops_rows_and_min_new_tokens_forbids_it():
    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=0)
    eos = tok.eos_token_id
    with torch.no_grad():  # make EOS by far the most likely token everywhere
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(len(tok)))
        model.lm_head.bias[eos] = 30.0
    prompts = [tok("abc")["input_ids"], tok("hello")["input_ids"]]
    comps, trunc = generate(model, tok, prompts, Sampling(6), group_size=3, progress=False)
    assert all(c == [eos] for g in comps for c in g) and not any(f for fl in trunc for f in fl)
    comps, trunc = generate(model, tok, prompts, Sampling(6), group_size=3, progress=False, min_new_tokens=4)
    assert all(len(c) == 5 and c[-1] == eos and eos not in c[:4] for g in comps for c in g)


def _hf_warped_probs(logits, temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    z = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        z = TopKLogitsWarper(top_k)(None, z)
    if top_p < 1:
        z = TopPLogitsWarper(top_p)(None, z)
    return torch.softmax(z, -1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8),
                                                     (0.9, 6, 0.7)])
def test_sampler_matches_the_warped_distribution(temperature, top_k, top_p):
    """Inverse-CDF sampling reproduces HF's temperature / top-k / top-p distribution (independent reference)."""
    from grpo.rollout.hf import sample_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=g) * 2
    want = _hf_warped_probs(logits, temperature, top_k, top_p)
    n = 40000
    draws = sample_tokens(logits.repeat_interleave(n, 0), temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=g).view(3, n)
    freq = torch.stack([torch.bincount(r, minlength=12) for r in draws]).float() / n
    assert torch.all(freq[want == 0] == 0)  # never a token outside the support
    assert (freq - want).abs().max() < 4.5 * (want * (1 - want) / n).sqrt().max() + 1e-9


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_cascade_decode_holds_the_prompt_once_and_matches_the_fork(family, monkeypatch):
    """Shared-prompt decoding keeps one copy of each prompt's K/V (the per-row cache holds only the row's own
    tokens) and samples the same tokens as G forked copies of the prefilled cache; ragged prompts with a
    1-token prompt (a fully padded prefill row) included."""
    import grpo.rollout.hf as rollout

    tok = char_tokenizer()
    model = tiny_model(family, len(tok), seed=0)
    prompts = [tok("What is 12 + 7?")["input_ids"], tok("x")["input_ids"], tok("Hello")["input_ids"]]
    seen = []
    real_decode = rollout.decode

    def spy(model, last, attention, cache, pick, **kw):
        out = real_decode(model, last, attention, cache, pick, **kw)
        seen.append((kw["shared"], cache.get_seq_length(), attention.shape[1]))
        return out

    monkeypatch.setattr(rollout, "decode", spy)
    torch.manual_seed(5)
    cascade = generate(model, tok, prompts, Sampling(8), group_size=4, batch_size=3, progress=False)
    shared, own_len, width = seen[-1]
    assert shared is not None and shared.calls >= model.config.num_hidden_layers
    assert shared.keys[0].shape[0] == 3 and shared.keys[0].shape[2] == width - 1  # B prompts, once each
    assert own_len <= 8  # last prompt token + generated tokens, never the prompt
    monkeypatch.setattr(rollout, "_cascade_ok", lambda model, n: False)
    torch.manual_seed(5)
    fork = generate(model, tok, prompts, Sampling(8), group_size=4, batch_size=3, progress=False)
    assert seen[-1][0] is None and seen[-1][1] >= width - 1
    assert cascade == fork


def test_rows_stop_at_their_own_eos_and_the_loop_runs_for_the_rest():
    """decode() with a scripted picker: row r says EOS at step r; finished rows get padding, the loop runs until
    the last row stops."""
    from grpo.rollout.hf import decode, prefill

    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=0)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ids = torch.tensor([tok("abcd")["input_ids"]] * 3)
    attention = torch.ones_like(ids)
    steps = []

    def pick(logits):
        t = len(steps)
        steps.append(t)
        return torch.tensor([eos if r == t else 7 for r in range(3)])

    out = decode(model, ids[:, -1], attention, prefill(model, ids, attention), pick, max_new_tokens=10, eos=[eos],
                 pad_id=pad)
    assert len(steps) == 3 and out.shape == (3, 3)
    assert out.tolist() == [[eos, pad, pad], [7, eos, pad], [7, 7, eos]]


def test_non_finite_logits_fail_clearly():
    from grpo.rollout.hf import sample_tokens

    with pytest.raises(RuntimeError, match="not finite"):
        sample_tokens(torch.tensor([[0.0, float("nan"), 1.0]]))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_suffixes_prefill_each_prompt_once_and_match_whole_contexts(family, monkeypatch):
    """Later turns of multi-turn episodes: each prompt prefilled once, forked to its rows, each row prefilling only
    its own suffix. Greedy tokens equal those of prefilling every prompt + suffix whole (share_prompt=False); the
    sampler's log-prob of every sampled token equals a plain forward over the whole context. Ragged prompts (one of
    1 token), ragged suffixes and groups of 3, 1 and 2 rows over two chunks."""
    import grpo.rollout.hf as rollout
    from tests.oracle import hf_logprobs

    tok = char_tokenizer()
    model = tiny_model(family, len(tok), seed=0)
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [enc("What is 12 + 7?"), enc("x"), enc("Hello")]
    suffixes = [[enc("ab"), enc("a longer turn"), enc("c")], [enc("19 then")], [enc("obs: 4"), enc("zz")]]
    contexts = rollout.flatten(prompts, suffixes)
    prefilled = []
    real_prefill = rollout.prefill

    def spy_prefill(model, input_ids, attention, synced=False, cache=None):
        prefilled.append(int(attention[:, -input_ids.shape[1]:-1].sum()))
        return real_prefill(model, input_ids, attention, synced, cache)

    monkeypatch.setattr(rollout, "prefill", spy_prefill)
    kw = dict(group_size=1, batch_size=2, progress=False)
    greedy = [generate(model, tok, prompts, Sampling(6, greedy=True), suffixes=suffixes, share_prompt=share, **kw)
              for share in (True, False)]
    assert greedy[0] == greedy[1] and [len(g) for g in greedy[0][0]] == [3, 1, 2]
    whole = sum(len(c) - 1 for c in contexts)
    assert sum(prefilled[:4]) == whole - sum((len(p) - 1) * (len(s) - 1) for p, s in zip(prompts, suffixes))
    assert sum(prefilled[4:]) == whole
    seen = []
    real_sample = rollout.sample_tokens

    def spy_sample(logits, **k):
        token = real_sample(logits, **k)
        seen.append(torch.log_softmax(logits.float() / k["temperature"], -1).gather(-1, token[:, None])[:, 0])
        return token

    monkeypatch.setattr(rollout, "sample_tokens", spy_sample)
    torch.manual_seed(3)
    comps, _ = generate(model, tok, prompts, Sampling(6, temperature=0.7), suffixes=suffixes, **kw)
    sampled = [row for group in comps for row in group]
    got = [row for n in (4, 2) for row in torch.stack([s for s in seen if len(s) == n], 1)]  # two chunks: 4, 2 rows
    want = hf_logprobs(model, contexts, sampled, 0.7)
    assert len(set(map(tuple, sampled))) > 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g[:len(w)], w, atol=1e-5, rtol=1e-5)
