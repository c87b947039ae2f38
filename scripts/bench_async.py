#!/usr/bin/env python
"""Asynchronous GRPO side by side (issue 33; docs/benchmarks.md#current-figures): the same steps through today's
loop (inline: one process samples then trains) and through the generator process at rollout.max_staleness K = 0,
1, 2 (generation and update in two processes, one thread each), the variants alternated round by round.

    PYTHONPATH=. python scripts/bench_async.py                        # the quickstart shape (SmolLM2-135M, 8x8x16)
    PYTHONPATH=. python scripts/bench_async.py --slow-reward 0.5      # + a reward that sleeps 0.5 s per group
    PYTHONPATH=. python scripts/bench_async.py --slow-reward auto     # ... as long as the update (measured first)
    PYTHONPATH=. python scripts/bench_async.py --curve docs/async-curve.png   # quickstart learning curves K=0 vs 1
    PYTHONPATH=. python scripts/bench_async.py --quick                # the smoke recipe's tiny model, seconds

Per variant: the median wall time of a step (batch + update, after --warmup steps), the trainer's idle fraction
(time waiting for a batch / step time) and the generator's (time waiting for weights or a request / step time),
and the weight publication (trainer: copy into shared memory) and load (generator: copy into its model) per step.
The real `grpo.trainer.pipeline` and `grpo.update.policy_update` run; evaluation, logging and checkpoints do not.
--curve instead trains the quickstart recipe with `grpo-train` at K = 0 and K = 1 and plots reward_mean against
the cumulative step time (wall clock, without the held-out evaluations) in one figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def slow_reward(prompts, completions, sleep_s: float = 1.0, group_size: int = 8, **columns):
    """Weight 0, score 0: sleeps ``sleep_s`` per group (a slow verifier or tool), on the side that scores."""
    time.sleep(sleep_s * len(completions) / group_size)
    return [0.0] * len(completions)


def config(recipe: str, out: str, K: int, overrides: list[str], slow: float, steps: int):  # noqa: PLR0913
    from omegaconf import OmegaConf

    from grpo.config.compose import compose
    from grpo.config.schema import load

    raw = compose([f"recipe={recipe}", f"trainer.output_dir={out}", f"rollout.max_staleness={K}",
                   f"trainer.max_steps={steps}", "logging.wandb.mode=disabled", *overrides])
    raw = OmegaConf.masked_copy(raw, [k for k in raw if k != "hydra"])
    if slow:
        G = raw.algorithm.group_size
        OmegaConf.update(raw, "reward.functions.slow", {"fn": "bench_async:slow_reward", "weight": 0.0,
                                                         "sleep_s": slow, "group_size": G}, merge=True)
    return load(OmegaConf.to_container(raw, resolve=True))


def variant(name: str, args, steps: int) -> dict:
    """One variant, ``steps`` steps: its per-step timings."""
    import torch

    from grpo.trainer import pipeline
    from grpo.trainer.build import build_run
    from grpo.trainer.run import LoopState
    from grpo.update import policy_update

    K = 0 if name == "inline" else int(name.split("=")[1])
    with tempfile.TemporaryDirectory() as out:
        cfg = config(args.recipe, out, K, args.override, args.slow_reward, steps)
        torch.set_num_threads(1)
        run = build_run(cfg)
        src = pipeline.batches(run, cfg, LoopState(), process=name != "inline")
        rows = []
        try:
            for step in range(1, steps + 1):
                t0 = time.time()
                batch = src.batch(step)
                t1 = time.time()
                policy_update(run.runtime, batch, run.settings.update)
                s = batch.stats
                rows.append({"step_s": time.time() - t0, "update_s": time.time() - t1, "groups": len(batch.rows),
                             "trainer_wait_s": s.get("time/trainer_wait_s", 0.0),
                             "generator_wait_s": s.get("time/generator_wait_s"),
                             "sample_s": s.get("time/generator_busy_s", t1 - t0),
                             "publish_s": s.get("time/weights_publish_s"), "load_s": s.get("time/weights_load_s")})
        finally:
            src.close()
            run.close()
    return {"variant": name, "rows": rows}


def summarize(name: str, rows: list[dict]) -> dict:
    total = sum(r["step_s"] for r in rows)
    mean = lambda k: None if rows[0][k] is None else sum(r[k] for r in rows) / len(rows)  # noqa: E731
    return {"variant": name, "steps": len(rows), "step_s_median": statistics.median(r["step_s"] for r in rows),
            "update_s_mean": mean("update_s"), "sample_s_mean": mean("sample_s"),
            "trainer_idle_frac": sum(r["trainer_wait_s"] for r in rows) / total,
            "generator_idle_frac": None if name == "inline" else sum(r["generator_wait_s"] for r in rows) / total,
            "publish_s_mean": mean("publish_s"), "load_s_mean": mean("load_s")}


def calibrate(args) -> float:
    """``--slow-reward auto``: the sleep per group that makes the generator's side (sampling + the reward) take
    as long as the update, from one inline run of the configured shape."""
    args.slow_reward = 0.0
    rows = variant("inline", args, args.warmup + args.steps)["rows"][args.warmup:]
    gap = statistics.mean(r["update_s"] for r in rows) - statistics.mean(r["sample_s"] for r in rows)
    sleep = max(gap, 0.0) / statistics.mean(r["groups"] for r in rows)
    print(f"calibrated: the reward sleeps {sleep:.3f} s per group", file=sys.stderr)
    return sleep


def side_by_side(args) -> list[dict]:
    names = ["inline", "K=0", "K=1", "K=2"] if not args.variants else args.variants.split(",")
    if args.slow_reward == "auto":
        args.slow_reward = calibrate(args)
    args.slow_reward = float(args.slow_reward)
    measured = {n: [] for n in names}
    for r in range(args.rounds):  # alternated: the machine's load drifts over all variants alike
        for n in names:
            got = variant(n, args, args.warmup + args.steps)
            measured[n] += got["rows"][args.warmup:]
            print(f"round {r + 1} {n}: " + json.dumps(summarize(n, got["rows"][args.warmup:])), file=sys.stderr)
    return [summarize(n, measured[n]) for n in names]


def curve(args) -> None:
    """The quickstart recipe trained at K = 0 and K = 1 by grpo-train, one thread per process, one run after the
    other (``--together``: both at once, so that both see the same load on a busy machine); reward_mean by
    cumulative step time."""
    runs, procs, root = {}, {}, Path(tempfile.mkdtemp())
    for K in (0, 1):
        cmd = [sys.executable, "-m", "grpo.train", f"recipe={args.recipe}", f"rollout.max_staleness={K}",
               f"trainer.output_dir={root / f'k{K}'}", "logging.plot=false", "logging.sample_every=0",
               "logging.wandb.mode=disabled", *args.override]
        print(f"K={K}: load before {os.getloadavg()[0]:.2f}", file=sys.stderr)
        procs[K] = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                    stdout=subprocess.DEVNULL, stderr=open(root / f"k{K}.log", "w"))
        if not args.together:
            procs[K].wait()
            print(f"K={K}: load after {os.getloadavg()[0]:.2f}", file=sys.stderr)
    for K, p in procs.items():
        assert p.wait() == 0, (root / f"k{K}.log").read_text()[-2000:]
        lines = [json.loads(line) for line in (root / f"k{K}" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in lines if "loss" in r]
        clock = [sum(r["step_time_s"] for r in rows[:i + 1]) for i in range(len(rows))]
        runs[K] = {"time_s": clock, "reward_mean": [r["reward_mean"] for r in rows]}
        print(json.dumps({"K": K, "total_s": clock[-1], "rewards": runs[K]["reward_mean"],
                          "staleness_max": max(r.get("async/staleness_max", 0) for r in rows),
                          "eval_after": lines[-1]}))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for K, r in runs.items():
        ax.plot(r["time_s"], r["reward_mean"], marker="o", label=f"rollout.max_staleness={K}")
    ax.set_xlabel("wall-clock time of the training steps (s)")
    ax.set_ylabel("reward_mean")
    ax.set_title(f"{args.recipe}: synchronous vs one step of overlap")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.curve, dpi=110)


def main(argv=None) -> list[dict] | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="quickstart")
    p.add_argument("--override", action="append", default=[], help="a config override (repeatable)")
    p.add_argument("--slow-reward", default="0", help="add a reward sleeping this many s per group; auto: as long "
                   "as the update minus the sampling (measured inline first)")
    p.add_argument("--variants", default="", help="comma-separated subset of inline,K=0,K=1,K=2")
    p.add_argument("--steps", type=int, default=4, help="measured steps per variant and round")
    p.add_argument("--warmup", type=int, default=2, help="steps per variant not measured (the pipeline fills)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="the smoke recipe, 1 round of 2 + 1 steps")
    p.add_argument("--curve", default="", help="train K=0 and K=1 and write their learning curves to this PNG")
    p.add_argument("--together", action="store_true", help="--curve: run K=0 and K=1 at the same time")
    p.add_argument("--json", default="", help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.recipe, args.rounds, args.steps, args.warmup = "smoke", 1, 2, 1
    if args.curve:
        curve(args)
        return None
    print(f"load before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    results = side_by_side(args)
    print(f"load after: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    for r in results:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
