"""The training loop: `fit(cfg)` reads top to bottom: sample, score, normalise, old/ref log-probs, optimise,
log, evaluate, save. Each stage lives in its own module; the command line (grpo/train.py) calls `fit` once
the config is composed and checked, so a mistake on the command line never waits for torch to import.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict

from grpo import experience
from grpo.config.schema import Config
from grpo.errors import SetupError
from grpo.rewards.score import first_failure
from grpo.rollout import registry
from grpo.trainer import checkpoint, logger, pipeline
from grpo.trainer.alarms import Watch
from grpo.trainer.build import build_run
from grpo.trainer.checkpoint import abandon_after, restore, save_checkpoint, save_final
from grpo.trainer.evaluate import evaluate
from grpo.trainer.progress import StepClock
from grpo.trainer.run import LoopState, Run
from grpo.trainer.signals import StopSignals
from grpo.update import policy_update


def fit(cfg: Config) -> dict:
    """Run GRPO as configured; returns the final summary (eval accuracy before/after, steps)."""
    logger.quiet_when_not_interactive()
    with logger.run_log(cfg.trainer.output_dir, enabled=int(os.environ.get("RANK") or 0) == 0):  # train.log
        run = build_run(cfg)  # runtime, tokenizer, policy, reference, data, rewards, optimizer, sampler
        try:  # a collective that timed out or lost a rank (it failed or hangs): one line, not a traceback
            with StopSignals(run.runtime.is_main, lambda: _saved(cfg)) as signals, \
                    run.runtime.peer_failures_as_errors():
                return _train(run, cfg, signals)
        finally:
            run.close()


def _saved(cfg: Config) -> str:
    """What a stop at once leaves (the second Ctrl-C)."""
    last = checkpoint.latest(cfg.trainer.output_dir)
    if last is None:
        return "no checkpoint has been written, nothing to resume"
    return f"the last complete checkpoint, {last}, is intact: resume with trainer.resume=auto"


def _train(run: Run, cfg: Config, signals: StopSignals) -> dict:
    state = restore(run, cfg)  # LoopState: step, counters, rollout buffer, batches in flight (step 0 when fresh)
    start = state.step
    if registry.capabilities(run.settings.sampler.backend).remote and not cfg.rollout.max_staleness:
        run.sampler.backend.ready()  # connect: a server of another model or a shorter length refused before anything
    log = logger.MetricsLogger(cfg.trainer.output_dir, asdict(cfg), cfg.logging.wandb, enabled=run.runtime.is_main,
                               resumed=start > 0)
    if start >= cfg.trainer.max_steps and start > 0:
        return _already_done(run, cfg, log, start)
    if start > 0:  # training goes on from this checkpoint: what this directory holds of later steps goes
        abandon_after(run, cfg, log, start)
    _say(run, _summary_line(run, cfg))
    signals.step = start + 1
    summary = {"eval_before": _eval_before(run, log, start)}
    batches = pipeline.batches(run, cfg, state)  # the batch for step t: collected now, or sampled ahead (K > 0)
    watch = Watch(cfg, log, run.runtime.is_main)  # the alarms (alarms.*) over every step's metrics
    clock = StepClock(start, cfg.trainer.max_steps)  # the console's step k/N [elapsed<remaining]
    try:
        for step in range(start + 1, cfg.trainer.max_steps + 1):
            if (stopped := _step(run, cfg, state, batches, log, signals, step, watch, clock)) is not None:
                return stopped
        return _finish(run, state, cfg, log, summary, batches)
    finally:
        batches.close()


def _step(run: Run, cfg: Config, state: LoopState, batches, log, signals: StopSignals, step: int,
          watch: Watch, clock: StepClock) -> dict | None:
    """One training step; returns the run's summary when it stops here (a signal)."""
    t0, signals.step, mu = time.time(), step, cfg.algorithm.num_iterations
    lr = run.scheduler.get_last_lr()[0]  # this step's (the update steps the scheduler on to the next one's)
    # 1. experience: rollout -> rewards -> advantages -> old/ref log-probs (every mu steps; else the buffer's)
    if state.buffer is None or (step - 1) % mu == 0:
        state.buffer = batches.batch(step)
        _count_reward_failures(state, run)  # counted here, the stop is after this step is logged
    batch, t1 = state.buffer, time.time()
    # 2. one optimizer step on it
    stats = policy_update(run.runtime, batch, run.settings.update)
    if not stats.get("empty_batch"):  # an empty batch (nothing to learn from) is skipped, but is not "bad"
        state.bad_steps = state.bad_steps + 1 if stats["skipped"] else 0
    state.skipped_steps += int(stats["skipped"])
    # 3. metrics, held-out evaluation, samples
    metrics = {"step": step, **batch.stats, **stats, "skipped_steps": state.skipped_steps,
               "lr": lr, "step_time_s": time.time() - t0,
               "time/experience_s": t1 - t0, "time/update_s": time.time() - t1}
    metrics.setdefault("kl", None)  # logged even where the batch has none (beta = 0: there is no reference)
    metrics.update(watch.step(step, metrics))  # an alarm that fires or clears: one line; alarm/<name> logged
    if cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0 and step < cfg.trainer.max_steps:
        metrics.update({f"eval/{k}": v for k, v in evaluate(run, f"step {step}").items()})
    log.log(metrics, console=step % cfg.logging.log_every == 0, progress=clock.line(step))
    if cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
        log.samples(step, experience.sample_rows(run.sampler, batch, cfg.logging.num_samples))
        log.completions(step, experience.completion_rows(run.sampler, batch))  # wandb's completions table
    # 4. the loop's state; checkpoint (with the batches in flight) and stop when asked, or when steps keep going bad
    state.step, state.buffer = step, batch if step % mu else None
    state.stop_requested = run.runtime.any_rank(signals.requested)  # every rank stops after the same step
    _stop_on_failed_rewards(state, run, cfg, batch.stats)
    if state.bad_steps >= cfg.trainer.max_bad_steps:
        _save(run, state, cfg, batches)  # weights are those of the last good step: bad steps change nothing
        raise SetupError(f"{state.bad_steps} steps in a row had a non-finite loss or gradient; stopped. "
                         "Lower trainer.lr or check the rewards; the last good state is checkpointed")
    if watch.stop is not None:
        _save(run, state, cfg, batches)
        raise SetupError(f"{watch.stop}; the state after this step is checkpointed (resume with trainer.resume=auto)")
    if (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or state.stop_requested:
        _save(run, state, cfg, batches)
        signals.saved_step = step  # a second signal from here on: this step is finished and saved
    if state.stop_requested:
        _say(run, f"stopped by signal at step {step}; checkpoint written, resume with trainer.resume=auto")
        log.finish()
        return {"steps": step, "interrupted": True}
    return None


def _save(run: Run, state: LoopState, cfg: Config, batches) -> None:
    state.in_flight = batches.in_flight()  # K > 0: the batches of the next K steps, finished and stored
    save_checkpoint(run, state, cfg)


def _eval_before(run: Run, log: logger.MetricsLogger, start: int) -> dict:
    """Step 0's held-out evaluation; a resumed run's "before" is the one it logged when it started."""
    if start > 0:
        return log.logged_eval(0)
    before = evaluate(run, "before")
    log.truncate_after(-1)  # a fresh run in a used directory starts a fresh metrics.jsonl
    log.log({"step": 0, **{f"eval/{k}": v for k, v in before.items()}}, console=False)
    return before


def _count_reward_failures(state: LoopState, run: Run) -> None:
    """Per function, the training rollouts in a row in which it scored no sample (it raised, timed out, returned
    None or a non-finite value on every one), counted over every rank on the first rollout round. The held-out
    evaluation does not count."""
    for rf in run.sampler.rewards:
        failed = state.buffer.stats[f"reward/{rf.name}"] is None
        state.failed_reward_steps[rf.name] = state.failed_reward_steps.get(rf.name, 0) + 1 if failed else 0


def _stop_on_failed_rewards(state: LoopState, run: Run, cfg: Config, stats: dict) -> None:
    """Stop (after the step is logged) when a function scored no sample in reward.max_failed_steps rollouts in a
    row; the message says what it did the first time it failed."""
    for rf in run.sampler.rewards:
        n = state.failed_reward_steps.get(rf.name, 0)
        if n < cfg.reward.max_failed_steps:
            continue
        errors = stats[f"reward/{rf.name}_errors"]
        why = first_failure(rf.name) if errors else "returned None for every sample" + (
            " (a verl-style function that raises scores None: its first error is logged once)"
            if hasattr(rf.fn, "verl_fn") else "")
        raise SetupError(f"reward function {rf.name!r} scored no sample in {n} training rollouts in a row (the last "
                         f"at step {state.step}; reward.max_failed_steps={cfg.reward.max_failed_steps}): it "
                         f"{why or 'failed'}; fix it or remove it with ~reward.functions.{rf.name}")


def _summary_line(run: Run, cfg: Config) -> str:
    """The run at a glance, the first line of its log."""
    t, r = cfg.trainer, cfg.rollout
    return (f"{cfg.model.name_or_path}: {len(run.splits.train)} train / {len(run.splits.eval)} held-out prompts, "
            f"{r.prompts_per_step} prompts x G={cfg.algorithm.group_size} per step, "
            f"{t.max_steps} step{'s' * (t.max_steps != 1)}, "
            f"lr {t.lr:g} ({t.lr_schedule}, warmup {t.warmup_steps}), beta {cfg.algorithm.beta:g}, "
            f"rewards {', '.join(rf.name for rf in run.sampler.rewards)}; output {t.output_dir}"
            + (f"; asynchronous, max_staleness {r.max_staleness}" if r.max_staleness else ""))


def _already_done(run: Run, cfg: Config, log: logger.MetricsLogger, start: int) -> dict:
    """Resumed at or past trainer.max_steps: nothing to train; the final model is saved if it is missing. Nothing
    is deleted: a checkpoint older than the directory's newest leaves the later steps (and final/) as they are."""
    later = checkpoint.later_than(cfg.trainer.output_dir, start)
    if later:
        _say(run, f"checkpoint step {start} is at trainer.max_steps={cfg.trainer.max_steps}: nothing to do. This "
                  f"directory's run went on to step {checkpoint.step_of(later[-1])}; it is kept as it was. Raise "
                  f"trainer.max_steps to train on from step {start} (that removes the later steps), or resume "
                  "with trainer.resume=auto")
        log.finish()
        return {"steps": start, "resumed": True}
    why = checkpoint.final_damage(cfg.trainer.output_dir)  # final/ verified against its manifest
    if why is None:
        _say(run, f"run already reached trainer.max_steps={cfg.trainer.max_steps} (checkpoint step {start}); "
                  "nothing to do")
        log.finish()
        return {"steps": start, "resumed": True}
    if os.path.isdir(os.path.join(cfg.trainer.output_dir, "final")):
        kept = checkpoint.set_final_aside(cfg.trainer.output_dir) if run.runtime.is_main else None
        _say(run, f"final/ is damaged ({why}): saving it again from checkpoint step {start}; the damaged one is "
                  f"kept as {kept}")
    else:
        _say(run, f"run reached trainer.max_steps={cfg.trainer.max_steps} but stopped before its final model was "
                  "saved; saving it from the last checkpoint")
    save_final(run, cfg)
    log.finish()
    return {"steps": start, "resumed": True, "final_saved": True}


def _finish(run: Run, state: LoopState, cfg: Config, log: logger.MetricsLogger, summary: dict, batches) -> dict:
    """After the last step: held-out evaluation, the last checkpoint, final/, the console report."""
    state.step = max(cfg.trainer.max_steps, state.step)
    summary["eval_after"] = evaluate(run, "after")
    log.log({"step": state.step, **{f"eval/{k}": v for k, v in summary["eval_after"].items()}}, console=False)
    _save(run, state, cfg, batches)
    save_final(run, cfg)
    _report(run, cfg, summary, log)
    log.finish()
    return {"steps": state.step, **summary}


def _report(run: Run, cfg: Config, summary: dict, log: logger.MetricsLogger) -> None:
    if not run.runtime.is_main:
        return
    rows = [m for m in logger.read_metrics(log.path) if "reward_mean" in m]
    print("\n" + logger.ascii_curve([m["reward_mean"] for m in rows], label="reward_mean"), file=sys.stderr)
    if cfg.logging.plot and rows:
        logger.plot_curves(rows, os.path.join(cfg.trainer.output_dir, "reward_curve.png"))
    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        fb, fa = ("n/a" if v is None else f"{v:.3f}" for v in (b, a))
        print(f"held-out {key:<20} before {fb:>7}  after {fa:>7}", file=sys.stderr)
    print(f"final model: {os.path.join(cfg.trainer.output_dir, 'final')}", file=sys.stderr)


def _say(run: Run, msg: str) -> None:
    if run.runtime.is_main:
        print(f"[grpo] {msg}", file=sys.stderr, flush=True)
