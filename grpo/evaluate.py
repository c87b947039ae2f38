"""Held-out evaluation: greedy completions on prompts never seen in training, scored by every reward."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from grpo.config import Config
from grpo.logger import interactive
from grpo.rollout import generate
from grpo.sampling import Completions, Sampling
from grpo.tools.episodes import episode_metrics
from grpo.tools.runs import episode_columns, seen_rows, turn_loop

if TYPE_CHECKING:
    from grpo.run import Run


def evaluate(run: Run, cfg: Config, label: str) -> dict:
    """Mean reward and each function's mean on the held-out split (greedy). Empty when there is none.
    The function named ``accuracy`` (if any) is the headline number."""
    rows = run.splits.eval
    if not rows:
        return {}
    rt = run.runtime
    shard = rows[rt.rank::rt.world_size]
    # every rank generates as many prompts (ZeRO-3 ranks decode in lockstep); the padding is not scored
    padded = shard + shard[-1:] * (-(-len(rows) // rt.world_size) - len(shard))
    max_new = cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens

    def greedy(prompt_ids, group_size=1, sampling=None, seed=None, suffixes=None) -> Completions:
        return Completions(*generate(rt.model, run.tokenizer, prompt_ids, group_size=1, max_new_tokens=max_new,
                                     batch_size=max(cfg.rollout.batch_size * cfg.algorithm.group_size, 1),
                                     greedy=True, desc=f"eval {label}", progress=rt.is_main and interactive(),
                                     suffixes=suffixes))
    from grpo.experience import score_groups

    extra = episode_stats = None
    if run.toolset is None:
        out = greedy([r["prompt_ids"] for r in padded])
        comps, trunc = out.ids[:len(shard)], out.truncated[:len(shard)]
    else:  # the same turn loop as training, greedy; the padding's episodes are dropped before counting
        eps = turn_loop(run, cfg, greedy).run(padded, [r["prompt_ids"] for r in padded], 1,
                                              Sampling(max_new, greedy=True))
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
