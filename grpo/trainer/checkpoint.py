"""Checkpoints: atomic ``<output_dir>/checkpoints/step_<N>/`` directories, and a run saved into and
restored from them (`save_checkpoint`, `restore`, `save_final`).

A checkpoint is written into ``.tmp-step_<N>``, flushed, marked complete, then renamed; only a
directory holding the ``COMPLETE`` marker is ever resumed from, so a crash at any instant (kill -9
during a save included) leaves the previous checkpoint usable. Older checkpoints are removed only
after the new one is complete, keeping the last ``keep_last``. The model's files are the runtime's
(`Runtime.save_model_state`); ``trainer_state.{json,safetensors}`` hold the loop's state, the schedule, the sampler
and the RNG; ``rank_<r>.{json,safetensors}`` each rank's own RNG, rollouts and batches in flight when there are many
processes (`grpo.trainer.state_files`: no pickle). The owner writes ``MANIFEST.json`` last (every file's size and
CRC-32, `grpo.trainer.manifest`); a resume verifies it (`damage`) and never loads a checkpoint that fails.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from grpo.config.schema import Config
from grpo.errors import SetupError
from grpo.trainer import manifest, state_files
from grpo.trainer.resume import (  # noqa: F401  (the directory's layout and trainer.resume, used through here)
    DAMAGED,
    LEGACY_STATE,
    MARKER,
    STATE,
    checkpoints_dir,
    choose,
    complete_checkpoints,
    damage,
    later_than,
    latest,
    move_aside,
    resolve_resume,
    set_aside,
    step_of,
)
from grpo.trainer.run import LoopState

if TYPE_CHECKING:
    from grpo.trainer.logger import MetricsLogger
    from grpo.trainer.run import Run


def save_state(path: Path, state: dict, name: str = STATE) -> None:
    state_files.save(path, name, state)


def load_state(ckpt: Path, name: str = STATE, say: bool = True) -> dict:
    return state_files.load_state(ckpt, name, say)


def abandon_after(run: Run, cfg: Config, log: MetricsLogger, step: int) -> None:
    """A resume from ``step`` that goes on training: what the directory holds of steps after it (checkpoints,
    ``metrics.jsonl`` / ``samples.jsonl`` lines, and ``final/`` when it came from one of those steps) belongs
    to the continuation it replaces and is removed, so that the directory never holds two histories. Called
    only once training is about to start: a resume with nothing to do deletes nothing."""
    out = Path(cfg.trainer.output_dir)
    later = later_than(out, step)
    lines = log.truncate_after(step)
    final = out / "final"
    gone = [p.name for p in later] + [f"{lines} metrics lines"] * bool(lines)
    if run.owns_output_dir:
        for p in later:
            shutil.rmtree(p, ignore_errors=True)
        if later and final.is_dir() and run.runtime.is_main:  # final/ of the abandoned continuation
            shutil.rmtree(final, ignore_errors=True)
            gone.append("final/")
    run.runtime.barrier()
    if later and run.runtime.is_main:
        print(f"[grpo] resuming from step {step} abandons the later steps of this directory: removed "
              f"{', '.join(gone)}", file=sys.stderr, flush=True)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(output_dir: str | Path, step: int, write_fn, keep_last: int = 2, owner: bool = True) -> Path:
    """Atomically create ``checkpoints/step_<step>``; ``write_fn(tmp_dir)`` writes the contents (every rank calls
    this). The ``owner`` of the directory (rank 0; each node's first rank on a filesystem rank 0 does not share)
    creates the temporary directory, marks it complete and renames it."""
    root = checkpoints_dir(output_dir)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}"
    if owner:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    write_fn(tmp)
    if not owner:
        return final
    (tmp / MARKER).write_text(f"{step}\n")
    manifest.write(tmp)  # last: every file of every rank in this directory is there (the caller's barrier)
    _fsync_tree(tmp)
    if final.exists():  # a stale copy of the same step (e.g. from a forced re-run)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    for old in complete_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for junk in root.glob(".tmp-step_*"):  # leftovers of saves that crashed earlier
        if junk != tmp:
            shutil.rmtree(junk, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------- a run's checkpoints
# Keys that define the run: resuming with any of them changed is refused unless trainer.force_resume.
RUN_DEFINING = ["model.name_or_path", "model.lora", "data.source", "data.task_kwargs", "data.seed",
                "data.num_train", "data.num_eval", "data.split", "data.load_kwargs", "data.prompt_column",
                "data.answer_column", "data.system_prompt", "data.prompt_template", "data.chat_template",
                "data.max_prompt_tokens", "algorithm.group_size", "rollout.prompts_per_step", "trainer.seed",
                "reward.functions", "rollout.max_staleness",
                "evaluation.sets"]  # a training prompt that is in a named set is dropped from training


def fingerprint(cfg: Config) -> dict:
    flat = asdict(cfg)
    out = {}
    for key in RUN_DEFINING:
        obj = flat
        for part in key.split("."):
            obj = obj[part]
        out[key] = json.loads(json.dumps(obj, sort_keys=True, default=str))
    return out


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def save_checkpoint(run: Run, state: LoopState, cfg: Config) -> Path:
    """``checkpoints/step_<state.step>``: every rank calls it (its files, then the owner marks it complete)."""
    rt = run.runtime

    def write(tmp: Path) -> None:
        if rt.world_size > 1:  # each rank's own sampling stream and rollouts (rank 0's are also below)
            rt.barrier()       # rank 0 has created tmp
            save_state(tmp, {"rng": rng_state(), "buffer": state.buffer, "in_flight": state.in_flight},
                       f"rank_{rt.rank}")
        optimizer_state = rt.save_model_state(tmp)
        if run.owns_output_dir:  # every node's copy holds the state (the same on every rank)
            save_state(tmp, {
                "step": state.step, "optimizer": optimizer_state,
                "scheduler": run.scheduler.state_dict(), "sampler": run.sampler.prompts.state_dict(),
                "rng": rng_state(), "buffer": state.buffer, "skipped_steps": state.skipped_steps,
                "bad_steps": state.bad_steps, "failed_reward_steps": state.failed_reward_steps,
                "fingerprint": fingerprint(cfg), "config_hash": _hash(fingerprint(cfg)),
                "schedule": schedule(cfg), "in_flight": state.in_flight,
            })
        rt.barrier()  # every rank has written its files before rank 0 marks the checkpoint complete

    path = save(cfg.trainer.output_dir, state.step, write, cfg.trainer.keep_last, owner=run.owns_output_dir)
    rt.barrier()
    return path


def restore(run: Run, cfg: Config) -> LoopState:
    """Load the checkpoint named by trainer.resume into the run's objects; returns the loop's state to continue
    from (a fresh `LoopState`, step 0, when there is nothing to resume). Nothing in the directory is changed here
    but the damaged checkpoints the resume passed over, moved aside (`set_aside`): a resume that then trains
    abandons what came after its checkpoint (`abandon_after`), one that has nothing to do leaves the rest as it was."""
    rt = run.runtime
    ckpt, skipped, existing = _decide(run, cfg)
    if ckpt is None:
        if existing:
            raise SetupError(f"trainer.output_dir={cfg.trainer.output_dir} already holds checkpoints of another run "
                             f"(newest {existing[-1].name}); continue it with trainer.resume=auto, or use a new "
                             "trainer.output_dir")
        return LoopState()
    if run.owns_output_dir:
        set_aside([(p, why) for p, why in skipped if step_of(p) > step_of(ckpt)], ckpt, say=True)
    saved = load_state(ckpt, say=rt.is_main)
    _check_fingerprint(saved, cfg, ckpt)
    rt.load_model_state(ckpt, saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    run.sampler.prompts.load_state_dict(saved["sampler"])
    set_rng_state(saved["rng"])
    state = LoopState(step=saved["step"], buffer=saved["buffer"], bad_steps=saved["bad_steps"],
                      skipped_steps=saved["skipped_steps"], failed_reward_steps=saved["failed_reward_steps"],
                      in_flight=saved.get("in_flight"))
    own = f"rank_{rt.rank}"
    if rt.world_size > 1 and (state_files.paths(ckpt, own)[0].exists() or (ckpt / f"{own}.pt").exists()):
        mine = load_state(ckpt, own, say=False)
        set_rng_state(mine["rng"])
        state.buffer = mine["buffer"]
        state.in_flight = mine.get("in_flight")  # asynchronous GRPO: this rank's share (never rank 0's)
    changed = apply_schedule(run, cfg, saved)
    if rt.is_main:
        print(f"[grpo] resumed from {ckpt} (step {state.step})", file=sys.stderr, flush=True)
        if changed and state.step < cfg.trainer.max_steps:  # at max_steps nothing trains: nothing takes effect
            print(f"[grpo] changed since the checkpoint, in effect from step {state.step + 1}: {', '.join(changed)}",
                  file=sys.stderr, flush=True)
    return state


# Keys that may change on resume and that the optimizer or the LR schedule hold (a checkpoint restores the
# saved values): after loading, the configured ones are put back in place.
SCHEDULE = ["trainer.lr", "trainer.warmup_steps", "trainer.lr_schedule", "trainer.max_steps",
            "trainer.weight_decay", "trainer.adam_betas"]


def schedule(cfg: Config) -> dict:
    t = cfg.trainer
    return {"trainer.lr": t.lr, "trainer.warmup_steps": t.warmup_steps, "trainer.lr_schedule": t.lr_schedule,
            "trainer.max_steps": t.max_steps, "trainer.weight_decay": t.weight_decay,
            "trainer.adam_betas": list(t.adam_betas)}


def apply_schedule(run: Run, cfg: Config, saved: dict) -> list[str]:
    """Make the configured learning rate, schedule, weight decay and betas the ones the resumed steps use (the
    optimizer's and scheduler's saved state carry the checkpoint's). Returns ``key old -> new`` for each that
    changed (a checkpoint that did not record its schedule: the learning rate, read from the scheduler)."""
    before = saved.get("schedule") or {"trainer.lr": saved["scheduler"]["base_lrs"][0]}
    sch, t = run.scheduler, cfg.trainer
    sch.base_lrs = [t.lr for _ in sch.base_lrs]
    for group, fn in zip(run.optimizer.param_groups, sch.lr_lambdas):  # the lr of the next step, as LambdaLR does
        group.update(initial_lr=t.lr, lr=t.lr * fn(sch.last_epoch), weight_decay=t.weight_decay)
        if "betas" in group:
            group["betas"] = tuple(t.adam_betas)
    sch._last_lr = [g["lr"] for g in run.optimizer.param_groups]
    now = schedule(cfg)
    return [f"{k} {before[k]} -> {now[k]}" for k in SCHEDULE if k in before and before[k] != now[k]]


def _check_fingerprint(saved: dict, cfg: Config, ckpt: Path) -> None:
    """Refuse a checkpoint whose run-defining keys differ (unless trainer.force_resume). A key the checkpoint's
    version did not record is not compared (older checkpoints stay resumable)."""
    now = fingerprint(cfg)
    changed = [k for k in RUN_DEFINING if k in saved["fingerprint"] and saved["fingerprint"][k] != now.get(k)]
    if changed and not cfg.trainer.force_resume:
        k = changed[0]
        raise SetupError(f"cannot resume from {ckpt}: {k} changed ({saved['fingerprint'].get(k)!r} -> {now[k]!r}); "
                         "set trainer.force_resume=true to resume anyway, or use a new trainer.output_dir")


def _decide(run: Run, cfg: Config) -> tuple[Path | None, list[tuple[Path, str]], list[Path]]:
    """The checkpoint to resume, the damaged ones passed over, and the complete ones of this rank's directory
    (those that verify, on a rank that checked them). The ranks that own a directory read its files to verify
    them; the others check what needs no read (presence, sizes). With many processes every rank's view is
    gathered: a damaged explicit path stops them all with the same line, and they all resume one step."""
    rt, verify = run.runtime, run.owns_output_dir
    error, ckpt, skipped = None, None, []
    try:
        ckpt, skipped = choose(cfg.trainer.resume, cfg.trainer.output_dir, checksums=verify)
    except (FileNotFoundError, SetupError) as e:
        if rt.world_size == 1:
            raise SetupError(str(e)) from None
        error = str(e)
    existing = complete_checkpoints(cfg.trainer.output_dir)
    if rt.world_size > 1:
        if cfg.trainer.resume == "auto":  # every candidate checked: the step agreed on must verify on every node
            bad = {p: why for p in existing if (why := damage(p, checksums=verify)) is not None}
            skipped = sorted(set(skipped) | set(bad.items()), key=lambda s: -step_of(s[0]))
            existing = [p for p in existing if p not in bad]
        ckpt, existing = _agree_on_checkpoint(rt, cfg, ckpt, existing, error)
    return ckpt, skipped, existing


def _agree_on_checkpoint(runtime, cfg: Config, ckpt: Path | None, existing: list[Path], error: str | None = None):
    """Every rank resumes the same step. With one output_dir per node each node reads its own copy, and a node
    that died while finalising a checkpoint may hold one fewer: take the newest step complete on every rank.
    Every rank decides from the same gathered view, so they all raise the same error or none does (``error``:
    this rank's reason to stop, e.g. the damaged checkpoint trainer.resume names)."""
    views = runtime.gather((ckpt.name if ckpt else None, [p.name for p in existing], error))
    errors = [v[2] for v in views if v[2]]
    if errors:
        raise SetupError(errors[0])
    if len({v[0] for v in views}) == 1 and all(set(v[1]) == set(views[0][1]) for v in views):
        return ckpt, existing
    if not any(v[0] for v in views):  # a fresh start: refused if any rank's directory holds checkpoints
        return None, existing or [Path(cfg.trainer.output_dir) / "checkpoints" / next(n for v in views for n in v[1])]
    common = set.intersection(*(set(v[1]) for v in views))
    if not common:
        raise SetupError("the ranks have no checkpoint in common to resume from (each node reads its own "
                         "trainer.output_dir; see docs/distributed.md); resume with trainer.resume=<a step every node "
                         "holds> or start a new trainer.output_dir")
    step = max(common, key=lambda name: int(name.split("_")[1]))
    return (ckpt.parent if ckpt else checkpoints_dir(cfg.trainer.output_dir)) / step, existing


def save_final(run: Run, cfg: Config) -> Path:
    """``<output_dir>/final``: a directory `AutoModelForCausalLM.from_pretrained` loads (or the
    LoRA adapter with model.lora.merge_on_save=false), with its manifest (`grpo.trainer.manifest`); a
    vision-language model's holds its image processor too (``preprocessor_config.json``), so that the directory
    is a ``model.name_or_path`` again."""
    out = Path(cfg.trainer.output_dir) / "final"
    tmp = out.with_name(".tmp-final")
    run.runtime.save_final(tmp, run.tokenizer, merge_lora=cfg.model.lora.enabled and cfg.model.lora.merge_on_save)
    if run.runtime.is_main:
        if run.image_processor is not None:
            run.image_processor.save_pretrained(tmp)
        manifest.write(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    run.runtime.barrier()
    return out


def final_damage(output_dir: str | Path) -> str | None:
    """What is wrong with ``<output_dir>/final`` (None: it verifies, or it predates manifests and holds a model)."""
    final = Path(output_dir) / "final"
    if not final.is_dir():
        return "there is no final/"
    if not (final / manifest.NAME).exists() and any(final.glob("*.safetensors")):
        return None
    return manifest.problem(final)


def set_final_aside(output_dir: str | Path) -> Path:
    """A damaged ``final/`` moved to ``damaged-final`` (kept) before it is saved again."""
    return move_aside(Path(output_dir) / "final")
