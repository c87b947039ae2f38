"""Multi-turn episodes in the loss: tool/environment tokens are in the forward's input but carry no loss, KL or
entropy and are not counted by any normaliser (tests/oracle.py drops them independently); the log-probs of the
model's tokens after a tool result equal a plain forward over the whole episode."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo.config.schema import AlgorithmConfig, EngineConfig
from tests.helpers import nest_like
from tests.oracle import assert_grads_close, close, flat, old_and_reference_logprobs, oracle_grads
from tests.test_update import CaptureRuntime

EOS, VOCAB, MAX_LEN, TEMP = 2, 100, 8, 0.7
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"]
SPLIT = EngineConfig(shared_prefix=True, max_tokens_per_micro_batch=24, attention_kernel="grouped")


def _tokens(gen, n):
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


def _episode(gen, turns: list[int], tools: list[int]):
    """Model turns of the given lengths (each ending in EOS) with tool outputs between them; (ids, mask)."""
    ids, mask = [], []
    for k, n in enumerate(turns):
        ids += _tokens(gen, n) + [EOS]
        mask += [1] * (n + 1)
        if k < len(tools):
            ids += _tokens(gen, tools[k])
            mask += [0] * tools[k]
    return ids, mask


@pytest.fixture(scope="module")
def setup():
    from grpo.batch import Batch
    from grpo.models import tiny_model

    policy = tiny_model("llama", VOCAB, seed=0)
    reference = tiny_model("llama", VOCAB, seed=1)
    gen = torch.Generator().manual_seed(3)
    prompts = [_tokens(gen, 6), _tokens(gen, 3)]
    shapes = [[([2, 3], [5]), ([4], []), ([1, 0, 2], [3, 6])], [([3, 2], [7]), ([0], [])]]
    episodes = [[_episode(gen, t, o) for t, o in g] for g in shapes]
    comps = [[e[0] for e in g] for g in episodes]
    masks = [[e[1] for e in g] for g in episodes]
    adv = torch.tensor([1.1, -0.6, 0.8, -1.2, 0.5])
    batch = Batch([{}, {}], prompts, comps, [[False] * len(g) for g in comps], torch.zeros(5), adv,
                  completion_masks=masks)
    old, ref = old_and_reference_logprobs(policy, reference, batch, TEMP, gen)
    return policy, batch, old, ref


def _run(policy, batch, acfg, ecfg=SPLIT):
    from grpo.update import UpdateSettings, policy_update

    rt = CaptureRuntime(policy)
    policy.zero_grad(set_to_none=True)
    stats = policy_update(rt, batch, UpdateSettings(acfg, ecfg, temperature=TEMP, max_len=MAX_LEN,
                                                    mask_truncated=False, max_grad_norm=1.0))
    return stats, rt.grads


def _algo(**kw):
    return AlgorithmConfig(**{**dict(beta=0.1, epsilon=0.2, epsilon_high=0.28, delta=2.0), **kw})


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", AGGS)
def test_masked_policy_update_matches_the_oracle(setup, agg, level):
    policy, batch, old, ref = setup
    b = dataclasses.replace(batch, old_logps=nest_like(batch, old), ref_logps=nest_like(batch, ref))
    acfg = _algo(loss_agg=agg, importance_sampling=level)
    stats, grads = _run(policy, b, acfg)
    loss, want, kl = oracle_grads(policy, b, acfg, temperature=TEMP, max_len=MAX_LEN, mask_truncated=False,
                                  old=old, ref=ref)
    assert close(stats["loss"], loss), (stats["loss"], loss)
    assert close(stats["kl"], kl), (stats["kl"], kl)
    assert_grads_close(grads, want)


def test_tool_tokens_contribute_nothing(setup):
    """Old and reference log-probs at tool positions set to absurd values change nothing: loss, KL, entropy,
    clip statistics and every gradient stay bitwise the same. Without the mask they would."""
    policy, batch, old, ref = setup
    masks = [torch.tensor(m, dtype=torch.bool) for m in flat(batch.completion_masks)]
    wild_old = [torch.where(m, o, torch.full_like(o, -30.0)) for o, m in zip(old, masks)]
    wild_ref = [torch.where(m, r, torch.full_like(r, 5.0)) for r, m in zip(ref, masks)]
    acfg = _algo(loss_agg="token_mean")
    def with_logps(b, old_lp, ref_lp):
        return dataclasses.replace(b, old_logps=nest_like(batch, old_lp), ref_logps=nest_like(batch, ref_lp))

    a = _run(policy, with_logps(batch, old, ref), acfg)
    b = _run(policy, with_logps(batch, wild_old, wild_ref), acfg)
    for k in ("loss", "kl", "entropy", "clip_ratio", "ratio_mean"):
        assert a[0][k] == b[0][k], k
    assert all(torch.equal(a[1][n], b[1][n]) for n in a[1])
    unmasked = dataclasses.replace(batch, completion_masks=None)
    c = _run(policy, with_logps(unmasked, wild_old, wild_ref), acfg)
    assert c[0]["loss"] != a[0]["loss"] and c[0]["kl"] != a[0]["kl"]


def test_counts_exclude_tool_tokens(setup):
    from grpo.runtime.base import Runtime
    from grpo.update import batch_counts, loss_mask

    _, batch, _, _ = setup
    counts = batch_counts(batch, loss_mask(batch, False), MAX_LEN, Runtime())
    assert counts.num_tokens == sum(sum(m) for m in flat(batch.completion_masks))
    assert counts.num_tokens < sum(len(c) for c in flat(batch.completion_ids))
    assert counts.num_seqs == 5


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_logprobs_after_a_tool_result_equal_a_plain_forward(setup, shared_prefix):
    """The engine's log-probs of every model token (those after a tool result included) equal an independent
    forward over prompt + whole episode."""
    from grpo import token_logprobs

    policy, batch, _, _ = setup
    with torch.no_grad():
        got = token_logprobs(policy, batch.prompt_ids, batch.completion_ids, shared_prefix=shared_prefix,
                             temperature=TEMP, attention_kernel="grouped")
        for p, comps, masks, lps in zip(batch.prompt_ids, batch.completion_ids, batch.completion_masks, got):
            for c, m, lp in zip(comps, masks, lps):
                logits = policy(input_ids=torch.tensor([p + c])).logits[0].float()
                want = torch.log_softmax(logits / TEMP, -1)[len(p) - 1:-1].gather(-1, torch.tensor(c)[:, None])[:, 0]
                sel = torch.tensor(m, dtype=torch.bool)
                after_tool = [k for k in range(1, len(m)) if m[k] and not m[k - 1]]
                assert torch.allclose(lp[sel], want[sel], atol=1e-5)
                if after_tool:
                    assert torch.allclose(lp[after_tool], want[after_tool], atol=1e-5)
