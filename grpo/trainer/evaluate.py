"""Held-out evaluation on prompts never seen in training, scored by every reward: greedy (one completion per prompt,
the default), or n samples per prompt at a temperature with mean@n, pass@k and maj@k (`grpo.evaluation.metrics`);
on the data's held-out split (today's metric names) and on every named set of evaluation.sets (``<name>/...``).

``run`` is a built `Run`, or what `grpo.eval` builds for a saved model: anything with ``runtime``, ``tokenizer``,
``rewards``, ``completion_format``, ``turn_loop``, ``eval_backend``, ``splits`` and ``settings.evaluation``.
"""
from __future__ import annotations

import hashlib
import sys
from typing import TYPE_CHECKING

from grpo import data
from grpo.errors import DataError, SetupError
from grpo.evaluation.metrics import prompt_metrics
from grpo.experience import score_groups, score_stats
from grpo.rewards.answers import needs_answer, vote_key
from grpo.rollout.base import Sampling
from grpo.rollout.episodes.turns import episode_metrics
from grpo.rollout.episodes.wiring import episode_columns, seen_rows

if TYPE_CHECKING:
    from grpo.trainer.run import Run


def evaluate(run: Run, label: str) -> dict:
    """{metric: value}: the held-out split's under their own names (``reward_mean``, ``completion_len_mean``, each
    reward function's mean, and with n > 1 ``mean@n``, ``pass@k``, ``maj@k``), each named set's as ``<name>/<metric>``.
    Empty when there is nothing to evaluate."""
    out = evaluate_rows(run, run.splits.eval, label, "held-out") if run.splits.eval else {}
    for name, rows in run.splits.sets.items():
        out.update({f"{name}/{k}": v for k, v in evaluate_rows(run, rows, label, name).items()})
    return out


def evaluate_rows(run: Run, rows: list[dict], label: str, name: str) -> dict:
    """One set's metrics (module docstring): every rank decodes its share, the sums are all-reduced."""
    s, rt, backend = run.settings.evaluation, run.runtime, run.eval_backend
    if len(rows) < rt.world_size:
        raise SetupError(f"evaluation set {name} has {len(rows)} prompts, fewer than the number of processes "
                         f"({rt.world_size}); every rank evaluates a share: give it more prompts")
    shard = rows[rt.rank::rt.world_size]
    # every rank generates as many prompts (ZeRO-3 ranks decode in lockstep); the padding is not scored
    padded = shard + shard[-1:] * (-(-len(rows) // rt.world_size) - len(shard))
    sampling = s.sampling or Sampling(s.max_new_tokens, greedy=True)
    seed = None if s.sampling is None else set_seed(s.seed, rt.rank, name)  # the same for every model compared
    backend.desc = f"eval {label}" if name == "held-out" else f"eval {name} {label}"
    if rt.is_main:
        what = "held-out evaluation" if name == "held-out" else f"evaluation set {name}"
        how = "greedy" if s.sampling is None else f"{s.n} samples each"
        print(f"[grpo] {what} ({label}): {len(rows)} prompts, {how}, up to {sampling.max_new_tokens} new tokens",
              file=sys.stderr, flush=True)
    extra = episode_stats = None
    if run.sampler.turn_loop is None:
        out = backend.generate([r["prompt_ids"] for r in padded], s.n, sampling, seed=seed)
        comps, trunc = out.ids[:len(shard)], out.truncated[:len(shard)]
    else:  # the same turn loop as training; the padding's episodes are dropped before counting
        seed_for = (lambda turn: None) if seed is None else (lambda turn: seed + turn)
        loop = run.sampler.turn_loop(backend.generate, seed_for)
        eps = loop.run(padded, [r["prompt_ids"] for r in padded], s.n, sampling)
        eps.groups, eps.prompt_ids = eps.groups[:len(shard)], eps.prompt_ids[:len(shard)]
        comps, trunc, extra, shard = eps.completion_ids, eps.truncated, episode_columns(eps), seen_rows(shard, eps)
        episode_stats = episode_metrics(rt.all_reduce(eps.sums()), prefix="")
    _, scores, sums = score_groups(run.sampler, shard, comps, trunc, extra)  # eval never stops a run
    stats = score_stats(rt.all_reduce(sums))
    out = {"reward_mean": stats["reward_mean"], "completion_len_mean": stats["completion_len_mean"],
           **(episode_stats or {})}
    for rf in run.sampler.rewards:
        out[rf.name] = stats[f"reward/{rf.name}"]
    if s.n > 1:
        out.update(_sampled_metrics(run, comps, scores))
    if rt.is_main:
        print(f"[grpo] {_line(run, out, label, name, len(rows))}", file=sys.stderr, flush=True)
    return out


def set_seed(seed: int, rank: int, name: str) -> int:
    """The sampling seed of one set on one rank: evaluation.seed, the rank and the set's name (not the step, the
    model or the run: the same prompts get the same seeds wherever they are evaluated)."""
    h = hashlib.sha256(repr((seed, rank, name)).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def correct_reward(run: Run):
    """The reward whose score decides pass@k and maj@k: evaluation.correct_reward, else ``accuracy``, else the first."""
    want = run.settings.evaluation.correct_reward or "accuracy"
    return next((rf for rf in run.sampler.rewards if rf.name == want), run.sampler.rewards[0])


def _sampled_metrics(run: Run, comps: list[list[list[int]]], scores: list[dict]) -> dict:
    """mean@n, pass@k and (where the correct reward defines an answer) maj@k, averaged over every prompt of every
    rank."""
    s, rf = run.settings.evaluation, correct_reward(run)
    key = vote_key(rf.spec, rf.kwargs)
    sums: dict[str, float] = {"prompts": float(len(comps))}
    i = 0
    for group in comps:
        got = [scores[i + j][rf.name] for j in range(len(group))]
        answers = [key(run.tokenizer.decode(c, skip_special_tokens=True)) for c in group] if key else None
        for k, v in prompt_metrics(got, answers, s.ks, s.threshold).items():
            sums[k] = sums.get(k, 0.0) + v
        i += len(group)
    total = run.runtime.all_reduce(sums)  # every rank has prompts (`evaluate_rows`), so the same keys
    return {k: v / total["prompts"] for k, v in total.items() if k != "prompts"}


def _line(run: Run, out: dict, label: str, name: str, n_rows: int) -> str:
    s = run.settings.evaluation
    head = "accuracy" if "accuracy" in out else "reward_mean"
    value = "n/a (no sample scored)" if out[head] is None else f"{out[head]:.3f}"
    how = "greedy" if s.sampling is None else f"n={s.n} at temperature {s.sampling.temperature:g}"
    line = f"{name} {head} ({label}, {n_rows} prompts, {how}): {value}"
    at = [f"{k} {v:.3f}" for k, v in out.items() if "@" in k]
    return line + (f"; {', '.join(at)}" if at else "")


def check_sets(specs: list[dict], dcfg, rewards) -> None:
    """Before any model loads: every named set reads (its rows, its prompt column), and has an answer column when a
    reward reads the answer. ``dcfg``: the run's data section; ``rewards``: the resolved reward functions."""
    readers = [rf.name for rf in rewards if needs_answer(rf.fn)]
    for spec in specs:
        rows, scfg = data.set_rows(spec, dcfg), data.set_source(spec, dcfg)
        if readers and scfg.answer_column not in rows[0]:
            raise DataError(f"evaluation.sets {spec['name']}: no answer column {scfg.answer_column!r} "
                            f"(answer_column), which reward {readers[0]!r} reads; its columns are: "
                            f"{', '.join(map(str, rows[0]))}")
