"""Atomic checkpoints: ``<output_dir>/checkpoints/step_<N>/``.

A checkpoint is written into ``.tmp-step_<N>``, flushed, marked complete, then renamed; only a
directory holding the ``COMPLETE`` marker is ever resumed from, so a crash at any instant (kill -9
during a save included) leaves the previous checkpoint usable. Older checkpoints are removed only
after the new one is complete, keeping the last ``keep_last``.
"""
from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

MARKER = "COMPLETE"
STATE = "trainer_state.pt"
_STEP = re.compile(r"^step_(\d+)$")


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and (p / MARKER).exists()]
    return [p for _, p in sorted(found)]


def latest(output_dir: str | Path) -> Path | None:
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def drop_after(output_dir: str | Path, step: int) -> None:
    """Remove complete checkpoints newer than ``step`` (resuming from ``step`` abandons them)."""
    for p in complete_checkpoints(output_dir):
        if int(_STEP.match(p.name).group(1)) > step:
            shutil.rmtree(p, ignore_errors=True)


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


def save_state(path: Path, state: dict) -> None:
    torch.save(state, path / STATE)


def load_state(ckpt: Path) -> dict:
    return torch.load(ckpt / STATE, map_location="cpu", weights_only=False)


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """``None``/'' -> fresh; ``auto`` -> newest complete checkpoint or fresh; else that path (validated)."""
    if not resume:
        return None
    if resume == "auto":
        return latest(output_dir)
    p = Path(resume)
    if not p.is_dir():
        raise FileNotFoundError(f"trainer.resume={resume!r}: no such checkpoint directory")
    if not (p / MARKER).exists() or not (p / STATE).exists():
        raise FileNotFoundError(f"trainer.resume={resume!r} is not a complete checkpoint (no {MARKER} marker)")
    return p
