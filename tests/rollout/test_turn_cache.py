"""The K/V kept between turns (grpo/rollout/turn_cache.py, the hf decode loop): a later turn that continues kept rows
prefills only their new tokens, and gives the tokens and log-probs of re-prefilling every context whole."""
from __future__ import annotations

import pytest
import torch

import grpo.rollout.hf as rollout
from grpo.models import char_tokenizer, tiny_model
from grpo.rollout.backends import HFBackend
from grpo.rollout.base import Sampling
from grpo.rollout.turn_cache import Kept, TurnCache
from tests.oracle import hf_logprobs


def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _next_suffixes(tok, suffixes, comps, turn):
    """Each row's next context: what it had, its sampled turn (the first tokens of some, as a format's stop does),
    then tool text of ragged length."""
    out = []
    for g, (ss, cs) in enumerate(zip(suffixes, comps)):
        out.append([s + c[:len(c) - (j % 2)] + _enc(tok, f"[tool]{'r' * (g + j + turn)}[a]")
                    for j, (s, c) in enumerate(zip(ss, cs))])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_kept_turns_match_reprefilling_every_context(family, monkeypatch):
    """Three turns: the first with G=3 decoding against one shared copy of each prompt, the later ones over each
    row's context, with the kept K/V and without (each prompt prefilled once, forked, each row its suffix), from
    the same random draws. The tokens are equal on both paths, and the kept path prefilled only the new tokens."""
    tok = char_tokenizer()
    model = tiny_model(family, len(tok), seed=0)
    prompts = [_enc(tok, "What is 12 + 7?"), _enc(tok, "Hi"), _enc(tok, "3+4=")]
    prefilled = []
    real_prefill = rollout.prefill

    def spy(model, input_ids, attention, synced=False, cache=None):
        prefilled.append(int(attention[:, -input_ids.shape[1]:-1].sum()))
        return real_prefill(model, input_ids, attention, synced, cache)

    monkeypatch.setattr(rollout, "prefill", spy)
    seen, real_sample = [], rollout.sample_tokens

    def spy_sample(logits, **k):  # the log-prob of each sampled token: tiny random models' tokens barely move
        token = real_sample(logits, **k)
        seen.append(torch.log_softmax(logits.float(), -1).gather(-1, token[:, None])[:, 0])
        return token

    monkeypatch.setattr(rollout, "sample_tokens", spy_sample)
    turns = TurnCache()
    kw = dict(batch_size=2, progress=False)
    s = Sampling(5, temperature=1.0)
    torch.manual_seed(1)
    comps, _ = rollout.generate(model, tok, prompts, s, group_size=3, turns=turns, **kw)
    assert len(turns.rows) == 9 and len({tuple(c) for c in comps[0]}) > 1
    suffixes = [[[] for _ in g] for g in comps]
    for turn in (2, 3):
        suffixes = _next_suffixes(tok, suffixes, comps, turn)
        contexts = rollout.flatten(prompts, suffixes)
        prefilled.clear()
        seen.clear()
        torch.manual_seed(turn)
        kept = rollout.generate(model, tok, prompts, s, group_size=1, suffixes=suffixes, turns=turns, **kw)
        new_tokens, kept_logps = sum(prefilled), list(seen)
        seen.clear()
        torch.manual_seed(turn)  # the same draws, in the same order: the same tokens when the logits are the same
        plain = rollout.generate(model, tok, prompts, s, group_size=1, suffixes=suffixes, **kw)
        assert kept == plain and len({tuple(c) for g in kept[0] for c in g}) > 3
        torch.testing.assert_close(torch.cat(kept_logps), torch.cat(seen), atol=1e-5, rtol=1e-5)
        # only the tokens after what the previous turn held (its samples but the last, tool text) were prefilled
        assert 0 < new_tokens < sum(len(c) - len(p) for c, p in zip(contexts, [p for p, ss in zip(prompts, suffixes)
                                                                             for _ in ss]))
        comps = kept[0]


def test_kept_turns_sample_from_the_whole_contexts_distribution(monkeypatch):
    """Sampling a later turn from kept K/V: the sampler's log-prob of every token equals a plain forward over the
    whole context (what the trainer's old log-probs compute): the episode stays on-policy."""
    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=0)
    prompts = [_enc(tok, "What is 12 + 7?"), _enc(tok, "x")]
    turns = TurnCache()
    kw = dict(batch_size=2, progress=False)
    s = Sampling(6, temperature=0.7)
    torch.manual_seed(2)
    comps, _ = rollout.generate(model, tok, prompts, s, group_size=2, turns=turns, **kw)
    suffixes = _next_suffixes(tok, [[[] for _ in g] for g in comps], comps, 2)
    seen, real_sample = [], rollout.sample_tokens

    def spy(logits, **k):
        token = real_sample(logits, **k)
        seen.append(torch.log_softmax(logits.float() / k["temperature"], -1).gather(-1, token[:, None])[:, 0])
        return token

    monkeypatch.setattr(rollout, "sample_tokens", spy)
    out, _ = rollout.generate(model, tok, prompts, s, group_size=1, suffixes=suffixes, turns=turns, **kw)
    sampled = [row for group in out for row in group]
    want = hf_logprobs(model, rollout.flatten(prompts, suffixes), sampled, 0.7)
    got = torch.stack(seen, 1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g[:len(w)], w, atol=1e-5, rtol=1e-5)


def test_take_finds_the_longest_shared_prefix_and_rows_live_one_call():
    turns = TurnCache()
    kv = [torch.zeros(1, 4, 2)]
    turns.begin(first_turn=True)
    turns.keep([[1, 2, 3, 4], [1, 2, 9, 9]], [torch.zeros(2, 1, 4, 2)], [torch.zeros(2, 1, 4, 2)],
               torch.ones(2, 4, dtype=torch.bool))
    assert turns.take([1, 2, 3, 7]) == (None, 0)  # kept rows are the next call's
    turns.end()
    row, n = turns.take([1, 2, 9, 5, 6])
    assert n == 3 and row.tokens.tolist() == [1, 2, 9, 9]
    assert turns.take([1, 2, 3, 4])[1] == 3  # the last token is decoding's first input: never taken
    assert turns.take([7, 1])[0] is None
    turns.begin(first_turn=True)  # a new rollout's first turn: nothing from the last one
    assert turns.take([1, 2, 3, 7]) == (None, 0)
    turns.rows = [Kept(torch.tensor([1, 2]), kv, kv)]
    backend = HFBackend(None, None, keep_turns=True)
    backend.turns = turns
    backend.sleep()  # after a rollout the update gets the memory
    assert turns.rows == [] and HFBackend(None, None).turns is None


def test_a_backend_that_keeps_turns_keeps_each_calls_rows():
    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=0)
    backend = HFBackend(model, tok, batch_size=2, keep_turns=True)
    out = backend.generate([_enc(tok, "ab")], 2, Sampling(max_new_tokens=3))
    assert len(backend.turns.rows) == 2 and len(out.ids[0]) == 2
