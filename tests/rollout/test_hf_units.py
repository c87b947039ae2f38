"""grpo/rollout/hf.py's pieces over a scripted stand-in model: the prefill and decode calls (tokens, positions,
masks, cache), stopping, synced decoding, the shared and forked prompt K/V, the K/V kept between turns, and the
sampler against an independent inverse-CDF draw. tests/rollout/test_hf.py runs the same loop on real tiny models
against HF's own generate."""

import contextlib
import math
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache, GenerationConfig, LlamaConfig, MistralConfig

import grpo.rollout.hf as hf
from grpo.engine.decode_attention import DECODE_ATTN_NAME, DECODE_KWARG, SharedPrefixKV
from grpo.errors import GRPOWarning
from grpo.rollout.base import Sampling
from grpo.rollout.turn_cache import TurnCache

V, EOS, ALT = 32, 31, 1  # vocabulary, the stand-in's EOS, every row's second choice


def default_rule(tokens, positions):
    """The stand-in's next token after ``tokens`` at ``positions``: never EOS, never ALT."""
    return (tokens * 7 + positions * 3) % (V - 3) + 2


class Scripted(torch.nn.Module):
    """A causal LM stand-in: next token = ``rule(token, position)`` (logit 100; ALT gets 50, the rest 0). Each forward
    is recorded, and writes one K/V column per input token into the cache (key = the token id, value = its
    position), as an attention layer does."""

    def __init__(self, rule=default_rule, eos=EOS, layers=1, config=LlamaConfig):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = config(num_hidden_layers=layers, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                             vocab_size=V)
        self.generation_config = GenerationConfig(eos_token_id=eos)
        self.rule, self.calls = rule, []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, logits_to_keep=0,
                cache=None, **kwargs):
        B, T = input_ids.shape
        pos = torch.arange(T).expand(B, T) if position_ids is None else position_ids
        self.calls.append(SimpleNamespace(ids=input_ids.tolist(), pos=pos.tolist(), use_cache=use_cache,
                                          mask=None if attention_mask is None else attention_mask,
                                          keep=logits_to_keep, cache=cache, kwargs=kwargs, training=self.training,
                                          grad=torch.is_grad_enabled()))
        if cache is not None:
            for layer in range(self.config.num_hidden_layers):
                cache.update(input_ids[:, None, :, None].float(), pos[:, None, :, None].float(), layer)
        nxt = self.rule(input_ids, pos)
        logits = torch.zeros(B, T, V)
        logits[..., ALT] = 50.0  # far apart: sampling at temperature 1 draws the rule's token (e^-50 else)
        logits.scatter_(-1, nxt[..., None], 100.0)
        return SimpleNamespace(logits=logits)


class OldStyle(Scripted):
    """A transformers release before ``cache``: the K/V cache argument is ``past_key_values``."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, logits_to_keep=0,
                past_key_values=None, **kwargs):
        return super().forward(input_ids, attention_mask, position_ids, use_cache, logits_to_keep,
                               cache=past_key_values, **kwargs)


class PromptLearning(Scripted):
    """A prompt-learning PEFT wrapper (prefix / prompt tuning): its own forward must run (its virtual tokens), so
    unwrapping it is refused (grpo/engine/unwrap.py)."""

    peft_config = {"default": SimpleNamespace(is_prompt_learning=True)}
    active_peft_config = peft_config["default"]

    def get_base_model(self):
        return self


class Bar:
    """A stand-in for tqdm, recording what it is made with and told."""

    made: list = []

    def __init__(self, **kw):
        self.kw, self.updates, self.closed = kw, [], False
        Bar.made.append(self)

    def update(self, n):
        self.updates.append(n)

    def close(self):
        self.closed = True


@pytest.fixture
def bars(monkeypatch):
    monkeypatch.setattr(hf, "tqdm", Bar)
    monkeypatch.setattr(Bar, "made", [])
    return Bar.made


def tokenizer(pad=0, eos=None):
    return SimpleNamespace(pad_token_id=pad, eos_token_id=eos)


def run(model, prompts, sampling=None, **kw):
    kw.setdefault("progress", False)
    return hf.generate(model, tokenizer(kw.pop("pad", 0)), prompts, sampling or Sampling(3, greedy=True), **kw)


def mask_of(call):
    return call.mask.tolist()


def decode_rows(model, last, width=2, **kw):
    """``hf.decode`` of rows whose ``width`` prompt tokens hold no padding (last: each row's last one), from an empty
    cache, greedy, EOS the stand-in's unless ``eos`` says otherwise."""
    kw = {"eos": [EOS], "pad_id": 0, **kw}
    return hf.decode(model, torch.tensor(last), torch.ones(len(last), width, dtype=torch.long),
                     DynamicCache(config=model.config), hf.greedy_pick, **kw)


# --------------------------------------------------------------------------------------------- prefill
def test_prefill_runs_every_token_but_the_last_at_its_left_padded_position():
    model = Scripted()
    ids, mask = hf._left_padded([[5, 6, 7], [8]], 0, "cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    cache = hf.prefill(model, ids, mask)
    (call,) = model.calls
    assert call.ids == [[5, 6], [0, 0]] and mask_of(call) == [[1, 1], [0, 0]]
    assert call.pos == [[0, 1], [0, 0]]  # padding clamped to 0
    assert call.use_cache is True and call.keep == 1 and call.cache is cache
    assert isinstance(cache, DynamicCache) and cache.layers[0].keys[:, 0, :, 0].tolist() == [[5, 6], [0, 0]]


def test_prefill_after_held_tokens_continues_their_positions():
    """A suffix after a cache: ``attention`` covers the held columns, then the new tokens."""
    model = Scripted()
    held = DynamicCache(config=model.config)
    attention = torch.tensor([[0, 1, 1, 1, 1, 1]])
    out = hf.prefill(model, torch.tensor([[4, 5, 6]]), attention, cache=held)
    (call,) = model.calls
    assert out is held and call.cache is held
    assert call.ids == [[4, 5]] and call.pos == [[2, 3]] and mask_of(call) == [[0, 1, 1, 1, 1]]


def test_a_one_token_prompt_prefills_nothing_unless_every_rank_must_run_the_same_forwards():
    model = Scripted()
    ids, mask = torch.tensor([[9]]), torch.tensor([[1]])
    cache = hf.prefill(model, ids, mask)
    assert model.calls == [] and cache.get_seq_length() == 0
    cache = hf.prefill(model, ids, mask, synced=True)
    (call,) = model.calls
    assert call.ids == [[9]] and mask_of(call) == [[1]] and call.use_cache is False and call.keep == 1
    assert call.cache is None and cache.get_seq_length() == 0  # discarded: nothing reaches the cache


# --------------------------------------------------------------------------------------------- decode
def test_decode_feeds_each_sample_at_the_next_position_with_a_growing_mask():
    model = Scripted()
    attention = torch.tensor([[1, 1, 1], [0, 0, 1]])
    cache = DynamicCache(config=model.config)
    out = hf.decode(model, torch.tensor([7, 8]), attention, cache, hf.greedy_pick, max_new_tokens=3, eos=[EOS],
                    pad_id=0)
    first, second, third = model.calls
    assert first.ids == [[7], [8]] and first.pos == [[2], [0]] and mask_of(first) == attention.tolist()
    want1 = default_rule(torch.tensor([7, 8]), torch.tensor([2, 0]))
    assert second.ids == [[int(t)] for t in want1] and second.pos == [[3], [1]]
    assert mask_of(second) == [[1, 1, 1, 1], [0, 0, 1, 1]] and mask_of(third) == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert third.pos == [[4], [2]]
    assert all(c.cache is cache and c.use_cache is True and c.keep == 1 for c in model.calls)
    want2 = default_rule(want1, torch.tensor([3, 1]))
    assert out.tolist() == [[int(a), int(b), int(c)] for a, b, c in
                            zip(want1, want2, default_rule(want2, torch.tensor([4, 2])))]


def test_rows_pad_after_their_eos_and_the_loop_stops_when_every_row_has():
    """Row 0 says EOS at its first step, row 1 at its second; the loop stops there, not at max_new_tokens."""
    model = Scripted(rule=lambda t, p: torch.where(p >= torch.tensor([[2], [3]])[: len(t)], EOS, 5))
    out = decode_rows(model, [3, 4], width=3, max_new_tokens=6, pad_id=29)
    assert out.tolist() == [[EOS, 29], [5, EOS]] and len(model.calls) == 2


def test_the_loop_runs_max_new_tokens_when_no_row_stops():
    model = Scripted()
    out = decode_rows(model, [3], max_new_tokens=4)
    assert out.shape == (1, 4) and len(model.calls) == 4 and EOS not in out.tolist()[0]


def test_every_eos_id_stops_a_row():
    model = Scripted(rule=lambda t, p: torch.full_like(t, 30))
    out = decode_rows(model, [3], max_new_tokens=4, eos=[EOS, 30])
    assert out.tolist() == [[30]]


def test_min_new_tokens_forbids_eos_for_that_many_steps_only():
    model = Scripted(rule=lambda t, p: torch.full_like(t, EOS))
    out = decode_rows(model, [3], max_new_tokens=5, min_new_tokens=2)
    assert out.tolist() == [[ALT, ALT, EOS]]
    model = Scripted(rule=lambda t, p: torch.full_like(t, EOS))
    out = decode_rows(model, [3], max_new_tokens=5, eos=[EOS, 30], min_new_tokens=1)
    assert out.tolist() == [[ALT, EOS]]


def test_a_synced_decode_steps_on_until_no_rank_is_still_decoding():
    """synced is the runtime's any_rank: asked whether any rank has rows left (this one: none after step 0)."""
    asked = []

    def any_rank(mine_left):
        asked.append(mine_left)
        return len(asked) < 3  # another rank decodes for two more steps

    model = Scripted(rule=lambda t, p: torch.full_like(t, EOS))
    out = decode_rows(model, [3], max_new_tokens=6, synced=any_rank)
    assert asked == [False, False, False] and len(model.calls) == 3
    assert out.tolist() == [[EOS, 0, 0]]


def test_all_done_asks_the_other_ranks_whether_this_one_has_rows_left():
    asked = []

    def any_rank(x):
        asked.append(x)
        return x

    assert hf._all_done(torch.tensor([True, True]), None) is True
    assert hf._all_done(torch.tensor([True, False]), None) is False
    assert hf._all_done(torch.tensor([True, False]), any_rank) is False and asked == [True]
    assert hf._all_done(torch.tensor([True, True]), any_rank) is True and asked == [True, False]
    assert hf._all_done(torch.tensor([True, True]), lambda x: True) is False  # another rank still decodes


def test_decode_against_a_shared_prompt_switches_attention_and_checks_every_layer_once(monkeypatch):
    entered, checked = [], []
    sentinel = torch.ones(1, 1, 1, 0, dtype=torch.bool)

    @contextlib.contextmanager
    def switched(model, name, state=None):
        entered.append((model, name, state))
        yield
        entered.append("exit")

    monkeypatch.setattr(hf, "switched_attention", switched)
    monkeypatch.setattr(hf, "check_every_layer", lambda calls, model, name: checked.append((calls, model, name)))
    monkeypatch.setattr(hf, "placeholder_mask", lambda device: sentinel)
    model = Scripted()
    shared = SharedPrefixKV(keys=[], values=[], valid=torch.ones(1, 2, dtype=torch.bool), group=2, calls=7)
    out = decode_rows(model, [3, 3], width=3, max_new_tokens=3, shared=shared)
    assert entered == [(model, DECODE_ATTN_NAME, shared), "exit"] and checked == [(7, model, DECODE_ATTN_NAME)]
    assert len(model.calls) == 3 and out.shape == (2, 3)
    assert all(c.mask is sentinel and c.kwargs[DECODE_KWARG] is shared for c in model.calls)
    assert [c.pos for c in model.calls] == [[[2], [2]], [[3], [3]], [[4], [4]]]
    checked.clear()
    decode_rows(model, [3, 3], width=3, max_new_tokens=1, shared=shared)
    assert checked == [(7, model, DECODE_ATTN_NAME)]  # after the first step's forward, whatever the length


# --------------------------------------------------------------------------------------------- generate
def test_generate_left_pads_with_the_pad_id_or_else_the_first_eos():
    for pad, want in ((4, 4), (None, EOS)):
        model = Scripted()
        hf.generate(model, tokenizer(pad=pad), [[5, 6, 7], [8, 9]], Sampling(2, greedy=True), progress=False)
        assert model.calls[0].ids == [[5, 6], [want, 8]]


def test_finished_rows_are_padded_and_cut_at_their_eos():
    model = Scripted(rule=lambda t, p: torch.where(t == 7, EOS, 5))
    comps, cut = hf.generate(model, tokenizer(pad=3), [[6, 7], [6, 6]], Sampling(3, greedy=True), progress=False)
    assert comps == [[[EOS]], [[5, 5, 5]]] and cut == [[False], [True]]


def test_greedy_samples_one_completion_per_prompt_and_warns_of_nothing(monkeypatch):
    monkeypatch.setattr(hf, "_warned_truncated", False)
    model = Scripted()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comps, _ = run(model, [[5, 6], [7, 8, 9]], Sampling(2, greedy=True, top_p=0.5), group_size=4)
    assert [len(g) for g in comps] == [1, 1] and [len(r) for r in model.calls[-1].ids] == [1, 1]
    assert len(model.calls[0].ids) == 2  # one prefill row per prompt


@pytest.mark.parametrize("share", [True, False])
def test_groups_of_samples_in_batches_of_prompts(share, monkeypatch):
    monkeypatch.setattr(hf, "_cascade_ok", lambda model, n: False)  # the fork: one cache row per sample
    model = Scripted()
    prompts = [[5, 6, 4], [7, 8, 9], [10, 11, 12]]
    comps, cut = run(model, prompts, Sampling(2), group_size=3, batch_size=2, share_prompt=share)
    assert [len(g) for g in comps] == [3, 3, 3] and [len(g) for g in cut] == [3, 3, 3]
    prefills = [c for c in model.calls if len(c.ids[0]) > 1]
    assert [len(c.ids) for c in prefills] == ([2, 1] if share else [6, 3])  # once per prompt, or per sample
    assert [len(c.ids) for c in model.calls if len(c.ids[0]) == 1] == [6, 6, 3, 3]
    assert model.calls[1].ids == [[4]] * 3 + [[9]] * 3  # each prompt's last token, G times


def test_generate_restores_the_training_mode_and_decodes_in_eval_without_grad():
    model = Scripted()
    model.train()
    run(model, [[5, 6]])
    assert model.training and not any(c.training or c.grad for c in model.calls) and torch.is_grad_enabled()
    model.calls.clear()
    run(model, [[5, 6], [7]], Sampling(2), suffixes=[[[8]], [[9]]], share_prompt=False)  # the whole contexts
    assert model.calls and not any(c.grad for c in model.calls)
    model.eval()
    run(model, [[5, 6]])
    assert not model.training


def test_the_runtimes_generation_context_is_entered_and_its_sync_used(monkeypatch):
    """ZeRO-3's context yields synced_gpus: a 1-token prompt still runs a (discarded) prefill forward, decoding
    asks the other ranks, and no K/V is kept between turns (every rank must run the same forwards)."""
    asked, events = [], []

    @contextlib.contextmanager
    def context():
        events.append("enter")
        yield {"synced_gpus": lambda mine_left: asked.append(mine_left) or False}
        events.append("exit")

    turns = TurnCache()
    model = Scripted(rule=lambda t, p: torch.full_like(t, EOS))
    comps, _ = run(model, [[5]], context=context, turns=turns)
    assert events == ["enter", "exit"] and asked == [False] and comps == [[[EOS]]]
    assert [c.use_cache for c in model.calls] == [False, True] and turns.rows == []
    model = Scripted(rule=lambda t, p: torch.full_like(t, EOS))
    run(model, [[5]], context=lambda: contextlib.nullcontext({}), turns=turns)  # a runtime with no options
    assert len(model.calls) == 1


def test_a_truncated_distribution_warns_once_per_process(monkeypatch):
    monkeypatch.setattr(hf, "_warned_truncated", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.warn_truncated_sampling(1.0, 0)  # on-policy: nothing to say
    assert hf._warned_truncated is False
    with pytest.warns(GRPOWarning, match=r"top_p=0.9 / rollout.top_k=0.*not exactly on-policy"):
        hf.warn_truncated_sampling(0.9, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.warn_truncated_sampling(0.5, 3)
    monkeypatch.setattr(hf, "_warned_truncated", False)
    with pytest.warns(GRPOWarning, match="top_k=1"):
        hf.warn_truncated_sampling(1.0, 1)
    monkeypatch.setattr(hf, "_warned_truncated", False)
    with pytest.warns(GRPOWarning) as seen:
        run(Scripted(), [[5, 6]], Sampling(2, top_k=4))
    assert len(seen) == 1
    # stacklevel: the caller of generate is told (this file; under make mutate, mutmut's trampoline, which adds a
    # frame), not hf.py itself nor a no_grad decorator's wrapper
    assert os.path.basename(seen[0].filename) not in ("hf.py", "_contextlib.py")


def test_flatten_and_regroup():
    assert hf.flatten([[1], [2, 3]], [[[4], [5, 6]], [[7]]]) == [[1, 4], [1, 5, 6], [2, 3, 7]]
    assert hf.regroup(["a", "b", "c"], [[[4], [5, 6]], [[7]]]) == [["a", "b"], ["c"]]


@pytest.mark.parametrize("why", ["recurrent", "no share"])
def test_suffixes_prefill_each_whole_context_where_the_prompt_cannot_be_shared(why, monkeypatch):
    monkeypatch.setattr(hf, "has_recurrent_layers", lambda m: why == "recurrent")
    model = Scripted(rule=lambda t, p: torch.where(t == 9, EOS, 5))
    comps, cut = run(model, [[5, 6], [7]], Sampling(2), suffixes=[[[8], [8, 9]], [[9]]], group_size=5,
                     share_prompt=why == "recurrent")
    assert model.calls[0].ids == [[0, 5, 6], [5, 6, 8], [0, 0, 7]]  # prompt + suffix, each its own row, less last
    assert comps == [[[5, 5], [EOS]], [[EOS]]] and cut == [[True, False], [False]]


def test_suffixes_fork_each_prompt_and_prefill_only_the_rows_own_tokens():
    model = Scripted(rule=lambda t, p: torch.where(t == 9, EOS, 5))
    comps, cut = run(model, [[5, 6, 7], [4]], Sampling(2), suffixes=[[[8], [8, 9, 9]], [[9]]])
    prompts, rows = model.calls[:2]
    assert prompts.ids == [[5, 6], [0, 0]]  # one row per prompt
    assert rows.ids == [[0, 0, 7], [7, 8, 9], [0, 0, 4]]  # each row: its last prompt token, its suffix, less last
    assert mask_of(rows) == [[1, 1, 0, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]
    assert rows.pos == [[1, 1, 2], [2, 3, 4], [0, 0, 0]]  # the padding's own: 1
    keys = rows.cache.layers[0].keys[:, 0, :, 0].tolist()
    assert keys[0][:2] == [5, 6] and keys[1][:2] == [5, 6] and keys[2][:2] == [0, 0]  # forked per row
    assert comps == [[[5, 5], [EOS]], [[EOS]]] and cut == [[True, False], [False]]


# --------------------------------------------------------------------------------------------- turns kept
def test_a_later_turn_prefills_only_what_follows_the_kept_tokens():
    """Turn 1 keeps each row's K/V (here: keys that are the token ids); turn 2's contexts continue them, so its
    prefill feeds only their new tokens, after the kept columns."""
    model = Scripted(rule=lambda t, p: torch.where(p >= 2, EOS, 5))
    turns = TurnCache()
    first, _ = run(model, [[2, 3], [4, 6, 8]], Sampling(4), turns=turns, group_size=1)
    assert first == [[[5, EOS]], [[EOS]]]
    assert [k.tokens.tolist() for k in turns.rows] == [[2, 3, 5], [4, 6, 8, EOS]]  # every sample fed
    assert all(k.keys[0][0, :, 0].tolist() == k.tokens.tolist() for k in turns.rows)
    model.calls.clear()
    run(model, [[2, 3], [4, 6, 8]], Sampling(4), turns=turns, suffixes=[[[5, EOS, 7, 7]], [[EOS, 11]]])
    prefill_call = model.calls[0]
    assert prefill_call.ids == [[EOS, 7], [0, 0]]  # the new tokens but the last, after the kept ones
    assert prefill_call.pos == [[3, 4], [3, 3]]
    assert mask_of(prefill_call) == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert prefill_call.cache.layers[0].keys[:, 0, :4, 0].tolist() == [[0, 2, 3, 5], [4, 6, 8, EOS]]
    assert [k.tokens.tolist() for k in turns.rows] == [[2, 3, 5, EOS, 7, 7], [4, 6, 8, EOS, 11]]
    assert all(k.keys[0][0, :, 0].tolist() == k.tokens.tolist() for k in turns.rows)


def test_kept_rows_after_a_shared_prompt_hold_the_prompt_then_their_own_tokens(monkeypatch):
    monkeypatch.setattr(hf, "_cascade_ok", lambda model, n: True)

    monkeypatch.setattr(hf, "switched_attention", lambda model, name, state=None: contextlib.nullcontext())
    monkeypatch.setattr(hf, "check_every_layer", lambda calls, model, name: None)
    model = Scripted(rule=lambda t, p: torch.where(p >= 3, EOS, 5))
    turns = TurnCache()
    run(model, [[2, 3, 4], [6, 7]], Sampling(3), group_size=2, turns=turns)
    assert [k.tokens.tolist() for k in turns.rows] == [[2, 3, 4, 5, EOS]] * 2 + [[6, 7, 5, 5]] * 2
    assert all(k.keys[0][0, :, 0].tolist() == k.tokens.tolist() for k in turns.rows)
    assert turns.rows[2].values[0][0, :, 0].tolist() == [0, 1, 2, 3]  # positions: the padding left out


def test_keep_leaves_out_caches_whose_layers_do_not_hold_every_position():
    kept = []
    turns = SimpleNamespace(keep=lambda *a: kept.append(a))
    hf._keep(turns, SimpleNamespace(layers=[SimpleNamespace()]), None, torch.ones(1, 2), [[1, 2]],
             torch.tensor([[3, 4]]), [1])
    assert kept == []


def test_keep_hands_over_context_then_fed_samples_with_their_columns():
    kept = []
    turns = SimpleNamespace(keep=lambda *a: kept.append(a))
    cache = DynamicCache(config=Scripted().config)
    cache.update(torch.zeros(2, 1, 4, 1), torch.zeros(2, 1, 4, 1), 0)
    attention = torch.tensor([[0, 1], [1, 1]])
    hf._keep(turns, cache, None, attention, [[7], [8, 9]], torch.tensor([[3, 4, 5], [6, 0, 0]]), [2])
    ((tokens, keys, values, valid),) = kept
    assert tokens == [[7, 3, 4], [8, 9, 6, 0]] and keys[0] is cache.layers[0].keys
    assert valid.tolist() == [[False, True, True, True], [True, True, True, True]]
    shared = SharedPrefixKV(keys=[torch.arange(3.)[None, None, :, None]], values=[torch.zeros(1, 1, 3, 1)],
                            valid=torch.tensor([[False, True, True]]), group=2)
    kept.clear()
    hf._keep(turns, cache, shared, attention, [[7], [8, 9]], torch.tensor([[3, 4, 5], [6, 0, 0]]), [2])
    ((tokens, keys, values, valid),) = kept
    assert keys[0].shape == (2, 1, 7, 1) and keys[0][:, 0, :3, 0].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert valid.tolist() == [[False, True, True, True, True, True]] * 2  # the prompt's, then fed + 1 own


# --------------------------------------------------------------------------------------------- caches
def test_forked_copies_each_prompts_kv_to_its_rows():
    cache = DynamicCache(config=Scripted(layers=2).config)
    for layer in range(2):
        cache.update(torch.tensor([[[[1.], [2.]]], [[[3.], [4.]]]]) * (layer + 1), torch.zeros(2, 1, 2, 1), layer)
    out = hf._forked(cache, torch.tensor([1, 1, 0]))
    assert out is cache
    assert [la.keys[:, 0, :, 0].tolist() for la in cache.layers] == [[[3, 4], [3, 4], [1, 2]],
                                                                     [[6, 8], [6, 8], [2, 4]]]


def test_forked_skips_layers_without_kv_and_serves_a_cache_without_layers():
    class Recurrent:
        def batch_select_indices(self, rows):
            raise AssertionError("a recurrent layer holds no K/V")

    cache = DynamicCache(config=Scripted().config)
    cache.update(torch.ones(1, 1, 2, 1), torch.ones(1, 1, 2, 1), 0)
    cache.layers.append(Recurrent())
    assert hf._forked(cache, torch.tensor([0, 0])).layers[0].keys.shape[0] == 2
    picked = []
    old = SimpleNamespace(batch_select_indices=lambda rows: picked.append(rows.tolist()))
    assert hf._forked(old, torch.tensor([0, 0, 1])) is old and picked == [[0, 0, 1]]


def test_shared_prompt_zeroes_the_padding_of_every_layer_in_place():
    cache = DynamicCache(config=Scripted(layers=2).config)
    cache.update(torch.full((2, 1, 3, 1), 5.), torch.full((2, 1, 3, 1), 6.), 0)
    cache.update(torch.full((2, 1, 2, 1), 7.), torch.full((2, 1, 2, 1), 8.), 1)  # a window keeps the last 2 slots
    valid = torch.tensor([[0, 0, 1], [0, 1, 1]])
    kv = hf._shared_prompt(cache, valid, 4)
    assert kv.group == 4 and kv.valid.dtype == torch.bool and kv.valid.tolist() == valid.bool().tolist()
    assert kv.keys[0] is cache.layers[0].keys and kv.values[1] is cache.layers[1].values
    assert kv.keys[0][:, 0, :, 0].tolist() == [[0, 0, 5], [0, 5, 5]]
    assert kv.values[0][:, 0, :, 0].tolist() == [[0, 0, 6], [0, 6, 6]]
    assert kv.keys[1][:, 0, :, 0].tolist() == [[0, 7], [7, 7]] and kv.values[1][:, 0, :, 0].tolist() == [[0, 8],
                                                                                                          [8, 8]]


def test_shared_prompt_of_a_cache_without_layers_and_of_a_layer_without_kv():
    old = SimpleNamespace(key_cache=[torch.ones(1, 1, 2, 1)], value_cache=[torch.ones(1, 1, 2, 1) * 2])
    kv = hf._shared_prompt(old, torch.tensor([[0, 1]]), 2)
    assert kv.keys[0][0, 0, :, 0].tolist() == [0, 1] and kv.values[0][0, 0, :, 0].tolist() == [0, 2]
    layered = SimpleNamespace(layers=[SimpleNamespace(), SimpleNamespace(keys=torch.ones(1, 1, 2, 1),
                                                                         values=torch.ones(1, 1, 2, 1))])
    kv = hf._shared_prompt(layered, torch.tensor([[0, 1]]), 3)
    assert kv.keys[0] is None and kv.values[0] is None and kv.keys[1][0, 0, :, 0].tolist() == [0, 1]


@pytest.mark.parametrize("answer", [None, "a reason", NotImplementedError])
def test_share_or_fork_follows_what_the_model_can_serve(answer, monkeypatch):
    asked = []

    def unsupported(model, max_len):
        asked.append(max_len)
        if answer is NotImplementedError:
            raise NotImplementedError("prompt learning")
        return answer

    monkeypatch.setattr(hf, "shared_decode_unsupported", unsupported)
    model = Scripted()
    cache = DynamicCache(config=model.config)
    cache.update(torch.tensor([[[[1.], [2.]]], [[[3.], [4.]]]]), torch.zeros(2, 1, 2, 1), 0)
    shared, out = hf._share_or_fork(model, cache, torch.tensor([[1, 1, 1], [0, 1, 1]]), 2, 11)
    assert asked == [11]
    if answer is None:
        assert shared.group == 2 and shared.valid.tolist() == [[True, True], [False, True]]
        assert shared.keys[0][:, 0, :, 0].tolist() == [[1, 2], [0, 4]]
        assert type(out) is DynamicCache and out is not cache and out.get_seq_length() == 0
    else:
        assert shared is None and out is cache
        assert cache.layers[0].keys[:, 0, :, 0].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4]]


def test_generate_asks_for_the_longest_row_and_skips_sharing_one_token_prompts(monkeypatch):
    asked = []
    monkeypatch.setattr(hf, "_cascade_ok", lambda model, n: asked.append(n) or False)
    run(Scripted(), [[5, 6, 7]], Sampling(4), group_size=2)
    assert asked == [3 + 4]
    run(Scripted(), [[5]], Sampling(4), group_size=2)
    assert asked == [7]  # nothing prefilled, nothing to share


def test_cache_argument_name_follows_the_models_forward():
    assert hf._cache_kwarg(Scripted()) == "cache"
    assert hf._cache_kwarg(OldStyle()) == "past_key_values"
    wrapped = SimpleNamespace(get_base_model=lambda: OldStyle(), forward=lambda cache=None: None)
    assert hf._cache_kwarg(wrapped) == "past_key_values"
    model = OldStyle()
    run(model, [[5, 6]])
    assert model.calls[0].cache is not None and model.calls[1].cache is model.calls[0].cache


def test_collect_cuts_each_row_and_groups_them():
    comps, cut = [], []
    hf._collect([[3, EOS, 0], [4, 4, 4], [EOS, 0, 0]], [2, 1], [EOS], 3, comps, cut)
    assert comps == [[[3, EOS], [4, 4, 4]], [[EOS]]] and cut == [[False, True], [False]]


# --------------------------------------------------------------------------------------------- sampling
def reference_draw(logits, u, temperature, top_k, top_p):
    """Inverse CDF in plain Python: the first token whose cumulative mass exceeds u * total, over softmax(z / T)
    restricted to the top-k, then to the smallest most-likely set reaching top_p."""
    out = []
    for row, ur in zip(logits.tolist(), u):
        z = [x / temperature for x in row]
        if 0 < top_k < len(z):
            kth = sorted(z, reverse=True)[top_k - 1]
            z = [x if x >= kth else -math.inf for x in z]
        m = max(z)
        e = [math.exp(x - m) for x in z]
        p = [x / sum(e) for x in e]
        if top_p < 1.0:
            keep, mass = set(), 0.0
            for i in sorted(range(len(p)), key=lambda i: -p[i]):
                if mass < top_p:
                    keep.add(i)
                mass += p[i]
            p = [x if i in keep else 0.0 for i, x in enumerate(p)]
        target, acc = ur * sum(p), 0.0
        out.append(next((i for i, x in enumerate(p) if (acc := acc + x) > target), len(p) - 1))
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 3, 1.0), (1.0, 0, 0.6),
                                                     (0.8, 4, 0.5), (1.0, 8, 1.0), (1.0, 9, 1.0), (1.0, 1, 1.0)])
def test_sample_tokens_is_the_inverse_cdf_of_the_warped_softmax(temperature, top_k, top_p):
    logits = torch.randn(400, 8, generator=torch.Generator().manual_seed(1)) * 2
    got = hf.sample_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                           generator=torch.Generator().manual_seed(7))
    u = torch.rand(400, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(7))[:, 0].tolist()
    want = reference_draw(logits, u, temperature, top_k, top_p)
    assert got.dtype == torch.long and got.shape == (400,)
    assert sum(a != b for a, b in zip(got.tolist(), want)) <= 2  # a draw within float error of a boundary


def test_sample_tokens_never_returns_a_token_past_the_mass(monkeypatch):
    """A uniform draw of exactly 1 (float rounding of u * total) still lands on the last token with mass."""
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=torch.float64))
    logits = torch.tensor([[0.0, 1.0, -math.inf, -math.inf], [2.0, -math.inf, 0.0, 1.0]])
    assert hf.sample_tokens(logits).tolist() == [1, 3]
    # a token of 2e-9 mass after one that holds all of float32's: still drawn where the draw lands on it (top_p=1
    # restricts nothing)
    assert hf.sample_tokens(torch.tensor([[0.0, -20.0]])).tolist() == [1]
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.zeros(shape, dtype=torch.float64))
    assert hf.sample_tokens(torch.tensor([[-math.inf, 1.0, 0.0]])).tolist() == [1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sample_tokens_refuses_logits_that_are_not_finite(bad):
    with pytest.raises(RuntimeError, match="lower trainer.lr or resume an earlier checkpoint"):
        hf.sample_tokens(torch.tensor([[0.0, 1.0], [bad, 0.0]]))
    with pytest.raises(RuntimeError, match="not finite"):
        hf.sample_tokens(torch.tensor([[-math.inf, -math.inf]]))


def test_greedy_pick_is_the_argmax_of_each_row():
    assert hf.greedy_pick(torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])).tolist() == [1, 0]


# --------------------------------------------------------------------------------------------- more of generate
def test_generate_defaults_to_one_sample_per_prompt_in_batches_of_eight_with_a_rollout_bar(bars):
    model = Scripted()
    comps, _ = hf.generate(model, tokenizer(), [[5, 6, 7]] * 9, Sampling(2))
    assert [len(g) for g in comps] == [1] * 9
    assert [len(c.ids) for c in model.calls if len(c.ids[0]) == 2] == [8, 1]
    (bar,) = bars
    assert bar.kw == {"total": 9, "desc": "rollout", "unit": "seq", "leave": False, "disable": False}
    assert bar.updates == [8, 1] and bar.closed


def test_the_bar_counts_every_sample_or_every_suffix(bars):
    run(Scripted(), [[5, 6], [7, 8]], Sampling(2), group_size=3, batch_size=1, desc="eval", progress=False)
    run(Scripted(), [[5, 6], [7, 8]], Sampling(2, greedy=True), group_size=3)
    run(Scripted(), [[5, 6], [7, 8]], Sampling(2), suffixes=[[[1], [2], [3]], [[4]]], group_size=7)
    assert [b.kw["total"] for b in bars] == [6, 2, 4] and [b.updates for b in bars] == [[3, 3], [2], [4]]
    assert bars[0].kw["desc"] == "eval" and bars[0].kw["disable"] is True


@pytest.mark.parametrize("progress", [True, False])
def test_the_whole_context_fallback_keeps_every_setting_of_the_call(progress, bars, monkeypatch):
    monkeypatch.setattr(hf, "has_recurrent_layers", lambda m: True)
    events = []

    @contextlib.contextmanager
    def context():
        events.append("enter")
        yield {}

    model = Scripted(rule=lambda t, p: torch.full_like(t, EOS))
    comps, _ = hf.generate(model, tokenizer(), [[5, 6], [7, 3]], Sampling(3), suffixes=[[[8], [9]], [[4]]],
                           batch_size=1, desc="turn 2", progress=progress, min_new_tokens=1, context=context)
    assert events == ["enter"] and comps == [[[ALT, EOS], [ALT, EOS]], [[ALT, EOS]]]
    assert [len(c.ids) for c in model.calls if len(c.ids[0]) > 1] == [1, 1, 1]  # batches of one context
    assert [b.kw["desc"] for b in bars] == ["turn 2"] and bars[0].kw["disable"] is (not progress)


def test_sampling_settings_reach_the_sampler(monkeypatch):
    seen = []

    def sampler(logits, **kw):
        seen.append(kw)
        return logits.argmax(-1)

    monkeypatch.setattr(hf, "sample_tokens", sampler)
    monkeypatch.setattr(hf, "_warned_truncated", True)  # said once already
    run(Scripted(), [[5, 6]], Sampling(1, temperature=0.7, top_p=0.8, top_k=3))
    assert seen == [{"temperature": 0.7, "top_p": 0.8, "top_k": 3}]


def test_a_prompt_learning_peft_policy_samples_through_its_own_forward():
    model = PromptLearning(rule=lambda t, p: torch.full_like(t, EOS))
    comps, _ = run(model, [[5, 6]], Sampling(2))
    assert comps == [[[EOS]]] and model.calls
    comps, _ = run(model, [[5, 6]], Sampling(2), suffixes=[[[7], [8]]])
    assert comps == [[[EOS], [EOS]]]


def test_a_synced_empty_suffix_still_runs_its_discarded_forward():
    """ZeRO-3: a row whose context adds nothing prefills one token, which every rank must still run."""

    @contextlib.contextmanager
    def context():
        yield {"synced_gpus": lambda mine_left: False}

    for ctx, want in ((context, [True, False, True]), (None, [True, True])):
        model = Scripted(rule=lambda t, p: torch.full_like(t, EOS))
        run(model, [[5, 6]], Sampling(2), suffixes=[[[]]], context=ctx)
        assert [c.use_cache for c in model.calls] == want


def test_a_group_of_one_decodes_from_its_own_prefill(monkeypatch):
    asked = []
    monkeypatch.setattr(hf, "_cascade_ok", lambda model, n: asked.append(n) or False)
    run(Scripted(), [[5, 6, 7]], Sampling(4), group_size=1)
    assert asked == []


def test_a_later_turn_keeps_min_new_tokens(bars):
    model = Scripted(rule=lambda t, p: torch.where(p >= 2, EOS, 5))
    turns = TurnCache()
    run(model, [[2, 3]], Sampling(4), turns=turns)
    comps, _ = run(model, [[2, 3]], Sampling(4), turns=turns, suffixes=[[[5, EOS, 7]]], min_new_tokens=1)
    assert comps == [[[ALT, EOS]]] and bars[-1].updates == [1]


def test_the_cache_follows_the_models_config():
    """A sliding-window model's prefill and its rows' own cache keep their window (the layers transformers makes
    from the config)."""
    model = Scripted(config=lambda **kw: MistralConfig(sliding_window=2, **kw))
    ids, mask = hf._left_padded([[5, 6, 7, 8]], 0, "cpu")
    cache = hf.prefill(model, ids, mask)
    assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"
    forked = hf._forked(cache, torch.tensor([0, 0]))
    assert forked.layers[0].keys.shape[0] == 2


def recurrent_layer(n_prompts):
    """A prefilled cache layer with recurrent state (a Mamba / GatedDeltaNet layer's): state i is prompt i's."""
    return SimpleNamespace(conv_states={0: torch.arange(float(n_prompts))[:, None]},
                           recurrent_states={0: torch.arange(float(n_prompts))[:, None] * 10},
                           is_conv_states_initialized={0: True}, is_recurrent_states_initialized={0: True},
                           has_previous_state={0: True}, conv_kernel_size={0: 4}, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("cascade", [True, False])
def test_each_row_gets_its_prompts_recurrent_state(cascade, monkeypatch):
    monkeypatch.setattr(hf, "shared_decode_unsupported", lambda model, n: None if cascade else "no")
    model = Scripted()
    cache = DynamicCache(config=model.config)
    cache.layers[0] = recurrent_layer(2)
    shared, out = hf._share_or_fork(model, cache, torch.ones(2, 3, dtype=torch.long), 2, 9)
    assert (shared is not None) == cascade and (out is cache) != cascade
    assert out.layers[0].conv_states[0][:, 0].tolist() == [0, 0, 1, 1]
    assert out.layers[0].recurrent_states[0][:, 0].tolist() == [0, 0, 10, 10]


def test_sample_tokens_defaults_to_the_plain_softmax():
    logits = torch.randn(300, 6, generator=torch.Generator().manual_seed(2))
    got = hf.sample_tokens(logits, generator=torch.Generator().manual_seed(3))
    u = torch.rand(300, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))[:, 0].tolist()
    assert sum(a != b for a, b in zip(got.tolist(), reference_draw(logits, u, 1.0, 0, 1.0))) <= 1


def test_top_p_drops_a_token_whose_more_likely_ones_reach_it_exactly():
    """Four equally likely tokens, top_p = 0.5: the two most likely (by the sort) reach 0.5; the third's more likely
    tokens already hold 0.5, so it is dropped."""
    draws = hf.sample_tokens(torch.zeros(4000, 4), top_p=0.5, generator=torch.Generator().manual_seed(0))
    assert len(set(draws.tolist())) == 2
