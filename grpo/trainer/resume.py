"""Which checkpoint a run resumes: the layout of ``<output_dir>/checkpoints/``, what verifies (`damage`: the
``COMPLETE`` marker and the manifest, `grpo.trainer.manifest`), and what trainer.resume names (`choose`).

``trainer.resume=auto`` takes the newest checkpoint that verifies; a damaged newer one is passed over with one
line saying why and moved aside to ``damaged-step_<N>`` (`set_aside`), never deleted. A path to a damaged
checkpoint stops the run in one line naming the bad file; a folder of checkpoints (``<run>/checkpoints``, or the
run directory) is taken as its newest that verifies.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from grpo.errors import SetupError
from grpo.trainer import manifest, state_files

MARKER = "COMPLETE"
STATE = "trainer_state"            # trainer_state.json + trainer_state.safetensors
LEGACY_STATE = "trainer_state.pt"  # checkpoints written before: a pickle, read by `state_files.load_legacy`
DAMAGED = "damaged-"               # a damaged checkpoint that resume=auto passed over: moved aside, kept
_STEP = re.compile(r"^step_(\d+)$")


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return [p for p in reversed(step_dirs(checkpoints_dir(output_dir))) if (p / MARKER).exists()]


def latest(output_dir: str | Path) -> Path | None:
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def step_of(ckpt: Path) -> int:
    return int(_STEP.match(ckpt.name).group(1))


def later_than(output_dir: str | Path, step: int) -> list[Path]:
    """Complete checkpoints newer than ``step``, oldest first."""
    return [p for p in complete_checkpoints(output_dir) if step_of(p) > step]


def damage(ckpt: Path, checksums: bool = True) -> str | None:
    """What is wrong with checkpoint directory ``ckpt``, naming the file (None: it verifies). A checkpoint written
    before manifests (a ``trainer_state.pt`` and no manifest) is taken as it is. ``checksums=False``: sizes and
    presence only (no file read)."""
    if not (ckpt / MARKER).is_file():
        return f"{MARKER} is missing: not a complete checkpoint"
    if not (ckpt / manifest.NAME).exists() and (ckpt / LEGACY_STATE).is_file() \
            and not state_files.paths(ckpt, STATE)[0].exists():
        return None
    return manifest.problem(ckpt, checksums)


def step_dirs(root: Path) -> list[Path]:
    """Every ``step_<N>`` directory under ``root``, complete or not, newest first."""
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()] \
        if root.is_dir() else []
    return [p for _, p in sorted(found, reverse=True)]


def newest_intact(root: Path, checksums: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``root`` that verifies, and the newer ones passed over with why."""
    skipped = []
    for ckpt in step_dirs(root):
        why = damage(ckpt, checksums)
        if why is None:
            return ckpt, skipped
        skipped.append((ckpt, why))
    return None, skipped


def choose(resume: str | None, output_dir: str | Path, checksums: bool = True):
    """``(checkpoint or None, [(newer checkpoint passed over, why)])`` for trainer.resume: ``None``/'' -> fresh;
    ``auto`` -> the newest intact checkpoint of output_dir, or fresh; a folder of checkpoints (``<run>/checkpoints``,
    or the run directory) -> the newest intact one in it; else that checkpoint, verified. FileNotFoundError for a
    path that is not there, SetupError naming the bad file for a damaged one."""
    if not resume:
        return None, []
    if resume == "auto":
        found, skipped = newest_intact(checkpoints_dir(output_dir), checksums)
        if found is None and skipped:
            raise SetupError(f"trainer.resume=auto: no checkpoint in {checkpoints_dir(output_dir)} verifies (the "
                             f"newest, {skipped[0][0].name}: {skipped[0][1]}); they are left as they are: start a "
                             "new trainer.output_dir")
        return found, skipped
    p = Path(resume)
    if resume in ("disable", "resume_path") and not p.exists():  # verl's trainer.resume_mode values
        raise FileNotFoundError(f"trainer.resume={resume} is verl's; ours: null (a fresh run), auto or a path")
    if not p.is_dir():
        raise FileNotFoundError(f"trainer.resume={resume!r}: no such checkpoint directory")
    folder = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not (p / MARKER).exists() and step_dirs(folder):
        found, skipped = newest_intact(folder, checksums)
        if found is None:
            raise SetupError(f"trainer.resume={resume!r}: no checkpoint in this folder verifies (the newest, "
                             f"{skipped[0][0].name}: {skipped[0][1]})")
        return found, skipped
    if not (p / MARKER).is_file():
        raise FileNotFoundError(f"trainer.resume={resume!r} is not a complete checkpoint (no {MARKER} marker)")
    why = damage(p, checksums)
    if why is not None:
        raise SetupError(f"trainer.resume={resume!r} is damaged: {why}; resume from another checkpoint "
                         "(trainer.resume=auto takes the newest that verifies)")
    return p, []


def resolve_resume(resume: str | None, output_dir: str | Path, checksums: bool = False) -> Path | None:
    """The checkpoint `choose` takes (by default checked without reading its files: before the model loads)."""
    return choose(resume, output_dir, checksums)[0]


def set_aside(skipped: list[tuple[Path, str]], resumed: Path, say: bool) -> None:
    """The damaged checkpoints a resume passed over are moved to ``damaged-step_<N>`` next to them (kept, never
    deleted, and no longer in the way of the steps trained again); one line each says so."""
    for ckpt, why in skipped:
        to = move_aside(ckpt)
        if say:
            print(f"[grpo] checkpoint {ckpt.name} is damaged ({why}): resuming from {resumed.name}; it is kept as "
                  f"{to}", file=sys.stderr, flush=True)


def move_aside(path: Path) -> Path:
    """``path`` renamed to ``damaged-<name>`` beside it (``damaged-<n>-<name>`` when that is taken): kept, out of
    the way. Returns where it went."""
    to, n = path.with_name(DAMAGED + path.name), 1
    while to.exists():
        n += 1
        to = path.with_name(f"{DAMAGED}{n}-{path.name}")
    path.rename(to)
    return to
