"""Held-out evaluation: greedy completions on prompts never seen in training, scored by every reward."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from grpo.experience import score_groups
from grpo.rollout.base import Sampling
from grpo.rollout.episodes.runs import episode_columns, seen_rows
from grpo.rollout.episodes.turns import episode_metrics

if TYPE_CHECKING:
    from grpo.trainer.run import Run


def evaluate(run: Run, label: str) -> dict:
    """Mean reward and each function's mean on the held-out split (greedy: ``run.eval_backend``, sized by
    ``run.settings.evaluation``). Empty when there is none. The function named ``accuracy`` (if any) is the
    headline number."""
    rows = run.splits.eval
    if not rows:
        return {}
    rt, backend = run.runtime, run.eval_backend
    shard = rows[rt.rank::rt.world_size]
    # every rank generates as many prompts (ZeRO-3 ranks decode in lockstep); the padding is not scored
    padded = shard + shard[-1:] * (-(-len(rows) // rt.world_size) - len(shard))
    greedy = Sampling(run.settings.evaluation.max_new_tokens, greedy=True)
    backend.desc = f"eval {label}"  # its progress bar (a terminal): done/total [elapsed<remaining]
    if rt.is_main:
        print(f"[grpo] held-out evaluation ({label}): {len(rows)} prompts, greedy, up to {greedy.max_new_tokens} "
              "new tokens", file=sys.stderr, flush=True)
    extra = episode_stats = None
    if run.turn_loop is None:
        out = backend.generate([r["prompt_ids"] for r in padded], 1, greedy)
        comps, trunc = out.ids[:len(shard)], out.truncated[:len(shard)]
    else:  # the same turn loop as training, greedy; the padding's episodes are dropped before counting
        eps = run.turn_loop(backend.generate).run(padded, [r["prompt_ids"] for r in padded], 1, greedy)
        eps.groups, eps.prompt_ids = eps.groups[:len(shard)], eps.prompt_ids[:len(shard)]
        comps, trunc, extra, shard = eps.completion_ids, eps.truncated, episode_columns(eps), seen_rows(shard, eps)
        episode_stats = episode_metrics(rt.all_reduce(eps.sums()), prefix="")
    _, stats = score_groups(run, shard, comps, trunc, extra)  # eval never stops a run (the loop counts failures)
    out = {"reward_mean": stats["reward_mean"], "completion_len_mean": stats["completion_len_mean"],
           **(episode_stats or {})}
    for rf in run.rewards:
        out[rf.name] = stats[f"reward/{rf.name}"]
    if rt.is_main:
        head = "accuracy" if "accuracy" in out else "reward_mean"
        value = "n/a (no sample scored)" if out[head] is None else f"{out[head]:.3f}"
        print(f"[grpo] held-out {head} ({label}, {len(rows)} prompts, greedy): {value}", file=sys.stderr, flush=True)
    return out
