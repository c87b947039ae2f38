"""The K/V kept between turns (grpo/rollout/turn_cache.py, the hf decode loop): a later turn that continues kept rows
prefills only their new tokens, and gives the tokens and log-probs of re-prefilling every context whole."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# the tiny models' classes imported at collection, so that mutmut's fork server holds them (else every mutant's first
# tiny_model imports them again: 2.4 s)
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2ForCausalLM  # noqa: F401
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import grpo.rollout.hf as rollout
from grpo.models import char_tokenizer, tiny_model
from grpo.rollout.backends import HFBackend
from grpo.rollout.base import Sampling
from grpo.rollout.turn_cache import Kept, TurnCache, batched, layer_tensors, plain_layers
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


def _kv(rows, width, layer, heads=2, dim=3, values=False):
    """Distinct numbers per row, head, column, layer, and for keys and values."""
    n = rows * heads * width * dim
    return torch.arange(n, dtype=torch.float32).reshape(rows, heads, width, dim) + 1000 * layer + 500 * values


def test_keep_compacts_each_row_to_its_valid_columns_and_a_call_keeps_every_batch():
    turns = TurnCache()
    keys, values = [_kv(2, 4, 0), _kv(2, 4, 1)], [_kv(2, 4, 0, values=True), _kv(2, 4, 1, values=True)]
    valid = torch.tensor([[0, 1, 1, 1], [1, 0, 1, 1]], dtype=torch.bool)
    turns.begin(first_turn=True)
    turns.keep([[5, 6, 7], [8, 9, 10]], keys, values, valid)
    turns.keep([[4]], [k[:1] for k in keys], [v[:1] for v in values], torch.tensor([[0, 0, 0, 1]], dtype=torch.bool))
    assert turns.rows == [] and len(turns._new) == 3
    turns.end()
    assert turns._new == [] and [k.tokens.tolist() for k in turns.rows] == [[5, 6, 7], [8, 9, 10], [4]]
    for layer in (0, 1):
        assert torch.equal(turns.rows[0].keys[layer], keys[layer][0][:, 1:])
        assert torch.equal(turns.rows[1].keys[layer], keys[layer][1][:, [0, 2, 3]])
        assert torch.equal(turns.rows[1].values[layer], values[layer][1][:, [0, 2, 3]])
        assert torch.equal(turns.rows[2].values[layer], values[layer][0][:, 3:])
    with pytest.raises(AssertionError, match="^each valid K/V column holds one token$"):
        turns.keep([[1, 2]], keys, values, valid)


def test_calls_hand_their_rows_to_the_next_and_clear_frees_them():
    turns = TurnCache()
    assert (turns.rows, turns._new, turns._index) == ([], [], None)
    kv = [torch.zeros(1, 1, 2, 1)]
    turns.keep([[1, 2]], kv, kv, torch.ones(1, 2, dtype=torch.bool))
    turns.end()
    first = turns.rows
    assert turns.take([1, 2, 3]) == (first[0], 2) and turns._index is not None
    turns.begin(first_turn=False)  # a later turn: the previous call's rows stay to be taken from
    assert turns.rows is first and turns._new == [] and turns._index is None
    turns.keep([[7, 8]], kv, kv, torch.ones(1, 2, dtype=torch.bool))
    turns.end()  # the index of the old rows is not the new rows'
    assert turns.take([1, 2, 3]) == (None, 0) and turns.take([7, 8, 9])[1] == 2
    turns.begin(first_turn=False)
    turns.keep([[3, 3]], kv, kv, torch.ones(1, 2, dtype=torch.bool))
    turns.clear()
    assert (turns.rows, turns._new, turns._index) == ([], [], None)
    turns.end()
    assert turns.rows == []


def test_take_matches_whole_prefixes_and_never_past_a_rows_end():
    turns = TurnCache()
    turns.rows = [Kept(torch.tensor(t), [], []) for t in ([5], [5, 6, 7], [1, 3, 9, 9, 9, 9], [0])]
    assert turns.take([5]) == (None, 0) and turns.take([]) == (None, 0)
    for pad in (0, 1):  # a short row is padded with -1, which is no token
        row, n = turns.take([5, pad, pad, 9])
        assert n == 1 and row is turns.rows[0]
    row, n = turns.take([5, 6, 7, 8])
    assert n == 3 and row is turns.rows[1]
    assert turns.take([5, 6]) == (turns.rows[0], 1)  # the first of equally long matches
    row, n = turns.take([1, 2, 9, 9, 9, 9, 9])  # a prefix ends at the first difference
    assert n == 1 and row is turns.rows[2]
    assert turns.take([0, 0, 0])[0] is turns.rows[3] and turns.take([0, 0, 0])[1] == 1
    assert turns.take([9, 9, 9, 9, 9, 9, 9, 9]) == (None, 0)
    assert TurnCache().take([1, 2, 3]) == (None, 0)


def test_batched_left_pads_the_kept_prefixes_into_one_cache():
    config = LlamaConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                         vocab_size=10)
    a = Kept(torch.tensor([1, 2, 3]), [_kv(1, 3, 0)[0], _kv(1, 3, 1)[0]],
             [_kv(1, 3, 0, values=True)[0], _kv(1, 3, 1, values=True)[0]])
    b = Kept(torch.tensor([4, 5, 6, 7]), [_kv(1, 4, 0)[0] + 50, _kv(1, 4, 1)[0] + 50],
             [_kv(1, 4, 0, values=True)[0] + 50, _kv(1, 4, 1, values=True)[0] + 50])
    cache, mask = batched(SimpleNamespace(config=config), [(a, 2), (b, 4)], "cpu")
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]] and mask.dtype == torch.long
    assert plain_layers(cache) and len(cache.layers) == 2
    keys, values = layer_tensors(cache)
    for layer in (0, 1):
        want_k = torch.zeros(2, 2, 4, 3)
        want_k[0, :, 2:], want_k[1] = a.keys[layer][:, :2], b.keys[layer]
        want_v = torch.zeros(2, 2, 4, 3)
        want_v[0, :, 2:], want_v[1] = a.values[layer][:, :2], b.values[layer]
        assert torch.equal(keys[layer], want_k) and torch.equal(values[layer], want_v)
        assert keys[layer] is cache.layers[layer].keys and values[layer] is cache.layers[layer].values
    cache, mask = batched(SimpleNamespace(config=config), [(b, 3)], "cpu")  # one row
    assert mask.tolist() == [[1, 1, 1]] and torch.equal(layer_tensors(cache)[0][1], b.keys[1][None, :, :3])


def test_plain_layers_are_full_dynamic_layers_only():
    mistral = MistralConfig(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                            vocab_size=10, sliding_window=4)
    assert not plain_layers(DynamicCache(config=mistral))
    assert plain_layers(SimpleNamespace(layers=[DynamicLayer(), DynamicLayer()]))
    assert not plain_layers(SimpleNamespace(layers=[DynamicLayer(), DynamicSlidingWindowLayer(4)]))
    assert not plain_layers(SimpleNamespace()) and plain_layers(SimpleNamespace(layers=[]))
