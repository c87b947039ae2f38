"""grpo/trainer/checkpoint.py past its main path (tests/trainer/test_checkpoint.py holds that): what a save flushes
before the rename, a save or a resume racing another process that removed a directory first, a stale copy of the
same step, partial checkpoint directories named by trainer.resume, the loop's in-flight batches, the configured
keep_last, a process that does not own the directory, and the ranks' agreement inside ``restore``."""
from __future__ import annotations

import os
import shutil

import pytest

from grpo.runtime.local import WEIGHTS
from grpo.trainer import checkpoint, manifest
from grpo.trainer.run import LoopState
from tests.helpers import ROOT
from tests.trainer import test_checkpoint
from tests.trainer.test_checkpoint import _cfg, _fake_run, _Log, _names, _save, _with

built = test_checkpoint.built  # the run's checkpointed parts (a fixture)


def test_a_save_flushes_every_file_and_both_directories_before_the_rename(tmp_path, monkeypatch):
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))

    def write(tmp):
        (tmp / "w").write_text("w")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "x").write_text("x")

    checkpoint.save(tmp_path, 3, write)
    tmp, root = tmp_path / "checkpoints" / ".tmp-step_3", tmp_path / "checkpoints"
    assert sorted(synced) == sorted(str(p) for p in (tmp / checkpoint.MARKER, tmp / manifest.NAME, tmp / "sub" / "x",
                                                     tmp / "w", tmp, root))  # then renamed: step_3 holds them
    assert manifest.read(root / "step_3").keys() == {checkpoint.MARKER, "sub/x", "w"}  # every file but itself


def _racing(monkeypatch, names):
    """shutil.rmtree as it goes when another process removed one of ``names`` just before (a user cleaning up,
    another node on a shared filesystem): the removal finds nothing there."""
    real = shutil.rmtree

    def rmtree(path, ignore_errors=False, **kw):
        if os.path.basename(path) in names:
            real(path)
        return real(path, ignore_errors=ignore_errors, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)


def test_a_save_and_a_resume_go_on_when_another_process_removed_a_directory_first(tmp_path, monkeypatch, capsys):
    for step in (1, 2):
        _save(tmp_path, step)
    (tmp_path / "checkpoints" / ".tmp-step_0").mkdir()  # a save that crashed earlier
    _racing(monkeypatch, {"step_1", ".tmp-step_0", "step_4", "final"})
    checkpoint.save(tmp_path, 3, lambda tmp: None)  # prunes step_1 (keep_last 2 by default) and .tmp-step_0
    assert _names(tmp_path) == ["step_2", "step_3"] and os.listdir(tmp_path / "checkpoints") == ["step_2", "step_3"]
    _save(tmp_path, 4, keep_last=5)
    (tmp_path / "final").mkdir()
    checkpoint.abandon_after(_fake_run()[0], _cfg(tmp_path), _Log(0), 3)
    assert _names(tmp_path) == ["step_2", "step_3"] and not (tmp_path / "final").exists()
    assert "removed step_4, final/" in capsys.readouterr().err


def test_a_stale_copy_of_the_same_step_is_replaced_not_merged(tmp_path):
    stale = tmp_path / "checkpoints" / ".tmp-step_5"
    stale.mkdir(parents=True)
    (stale / "old").write_text("a save of step 5 that crashed")
    _save(tmp_path, 5)
    assert sorted(os.listdir(tmp_path / "checkpoints" / "step_5")) == [checkpoint.MARKER, manifest.NAME, "w"]


def test_resume_refuses_a_directory_missing_its_marker_its_manifest_or_its_state(tmp_path):
    from grpo.errors import SetupError

    p = tmp_path / "ckpt"
    p.mkdir()
    (p / checkpoint.MARKER).write_text("1\n")
    with pytest.raises(SetupError, match="is damaged: MANIFEST.json is missing"):
        checkpoint.resolve_resume(str(p), tmp_path)  # marked complete, no manifest, no trainer_state.pt
    (p / checkpoint.MARKER).unlink()
    (p / checkpoint.LEGACY_STATE).write_text("")
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        checkpoint.resolve_resume(str(p), tmp_path)  # a state, never marked complete
    (p / checkpoint.MARKER).write_text("1\n")
    assert checkpoint.resolve_resume(str(p), tmp_path) == p  # written before manifests: taken as it is
    (p / "trainer_state.json").write_text("{}")
    with pytest.raises(SetupError, match="MANIFEST.json is missing"):  # today's format always carries one
        checkpoint.resolve_resume(str(p), tmp_path)


def test_a_single_process_save_keeps_the_configured_number_and_the_in_flight_batches(built, tmp_path):
    run, cfg = built
    cfg = _with(cfg, output_dir=str(tmp_path), keep_last=1)
    for step in (1, 2):
        path = checkpoint.save_checkpoint(run, LoopState(step=step, in_flight={"step": step, "batches": ["b"]}), cfg)
    assert _names(tmp_path) == ["step_2"] and not list(path.glob("rank_*.pt"))  # one process: no rank files
    state = checkpoint.restore(run, _with(cfg, resume="auto"))
    assert state.step == 2 and state.in_flight == {"step": 2, "batches": ["b"]}


def test_a_process_that_does_not_own_the_directory_writes_its_files_only(built, tmp_path):
    run, cfg = built
    cfg = _with(cfg, output_dir=str(tmp_path))
    run.owns_output_dir = False  # another rank on a shared filesystem: rank 0 created the directory
    tmp = tmp_path / "checkpoints" / ".tmp-step_3"
    tmp.mkdir(parents=True)
    assert checkpoint.save_checkpoint(run, LoopState(step=3), cfg) == tmp_path / "checkpoints" / "step_3"
    assert not (tmp_path / "checkpoints" / "step_3").exists() and os.listdir(tmp) == [WEIGHTS]


def test_restore_resumes_the_newest_step_every_rank_holds(built, tmp_path):
    """Two ranks, one output_dir each: the other rank's node died before completing step_4."""
    run, cfg = built
    cfg = _with(cfg, output_dir=str(tmp_path))
    for step in (2, 4):
        checkpoint.save_checkpoint(run, LoopState(step=step), cfg)
    rt = run.runtime
    rt.world_size = 2
    rt.gather = lambda obj: [obj, ("step_2", ["step_2"], None)]
    assert checkpoint.restore(run, _with(cfg, resume="auto")).step == 2


def test_a_resume_reports_a_changed_warmup_and_schedule(built, tmp_path, capsys):
    run, cfg = built
    cfg = _with(cfg, output_dir=str(tmp_path))
    checkpoint.save_checkpoint(run, LoopState(step=1), cfg)
    checkpoint.restore(run, _with(cfg, resume="auto", warmup_steps=2, lr_schedule="constant"))
    assert "trainer.warmup_steps 4 -> 2, trainer.lr_schedule cosine -> constant" in capsys.readouterr().err


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_by_the_restore(built, tmp_path):
    """A checkpoint in the earlier format (no manifest, a trainer_state.pt) that someone crafted: refused in one
    line naming what it would run; nothing ran."""
    import torch

    from grpo.errors import SetupError
    from tests.trainer.test_state_files import _Payload

    run, cfg = built
    ckpt = tmp_path / "theirs" / "step_1"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoint.MARKER).write_text("1\n")
    torch.save({"step": 1, "optimizer": _Payload(tmp_path / "ran")}, ckpt / checkpoint.LEGACY_STATE)
    with pytest.raises(SetupError, match=r"refusing .*trainer_state.pt: its pickle names posix.system"):
        checkpoint.restore(run, _with(cfg, resume=str(ckpt)))
    assert not (tmp_path / "ran").exists()


def test_with_many_processes_the_step_resumed_verifies_on_every_rank_that_checked_it(built, tmp_path, capsys):
    """Rank 0 owns the directory and finds step_4's weights changed (same size: only the checksum tells); rank 1,
    which checks sizes only, sees step_4 whole: every rank resumes step_2, and rank 0 keeps step_4 aside."""
    run, cfg = built
    cfg = _with(cfg, output_dir=str(tmp_path))
    for step in (2, 4):
        checkpoint.save_checkpoint(run, LoopState(step=step), cfg)
    weights = tmp_path / "checkpoints" / "step_4" / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    rt = run.runtime
    rt.world_size = 2
    rt.gather = lambda obj: [obj, ("step_4", ["step_2", "step_4"], None)]
    assert checkpoint.restore(run, _with(cfg, resume="auto")).step == 2
    assert "checkpoint step_4 is damaged (trainable.safetensors does not match its checksum" in capsys.readouterr().err
    assert (tmp_path / "checkpoints" / "damaged-step_4" / WEIGHTS).read_bytes() == bytes(data)


def test_with_many_processes_a_damaged_explicit_checkpoint_on_one_rank_stops_every_rank(built, tmp_path):
    from grpo.errors import SetupError

    run, cfg = built
    cfg = _with(cfg, output_dir=str(tmp_path))
    path = checkpoint.save_checkpoint(run, LoopState(step=2), cfg)
    rt = run.runtime
    rt.world_size = 2
    rt.gather = lambda obj: [obj, ("step_2", ["step_2"], "on the other node: trainer_state.json is missing")]
    with pytest.raises(SetupError, match="^on the other node: trainer_state.json is missing$"):
        checkpoint.restore(run, _with(cfg, resume=str(path)))  # this rank's copy verifies: the other's stops it too


def test_final_damage_names_a_missing_or_damaged_final_and_passes_a_verified_or_pre_manifest_one(tmp_path):
    assert checkpoint.final_damage(tmp_path) == "there is no final/"
    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"weights")
    assert checkpoint.final_damage(tmp_path) is None  # written before manifests: a model, no manifest
    manifest.write(final)
    assert checkpoint.final_damage(str(tmp_path)) is None  # verifies
    (final / "model.safetensors").write_bytes(b"weights cut")
    why = checkpoint.final_damage(tmp_path)
    assert why is not None and "model.safetensors" in why
    (final / manifest.NAME).unlink()
    (final / "model.safetensors").unlink()
    (final / "config.json").write_text("{}")  # no manifest and no model: the manifest's own complaint
    assert checkpoint.final_damage(tmp_path) == manifest.problem(final) is not None


def test_a_damaged_final_is_set_aside_and_kept_under_a_free_name(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "a").write_text("1")
    first = checkpoint.set_final_aside(tmp_path)
    assert first == tmp_path / "damaged-final" and (first / "a").read_text() == "1"
    assert not (tmp_path / "final").exists()
    (tmp_path / "final").mkdir()
    assert checkpoint.set_final_aside(str(tmp_path)) == tmp_path / "damaged-2-final" and first.exists()


LEGACY_FIXTURE = ROOT / "tests" / "fixtures" / "pre_redesign_checkpoint" / "step_1"


def test_reading_a_pre_manifest_checkpoint_says_so_once_unless_asked_not_to(tmp_path, capsys):
    """A checkpoint in the format before manifests and plain-data state: its state loads, with a one-time note
    that it was not verified (the default); ``say=False`` (the ranks that do not print) reads it quietly."""
    said, quiet = tmp_path / "said", tmp_path / "quiet"
    shutil.copytree(LEGACY_FIXTURE, said)
    shutil.copytree(LEGACY_FIXTURE, quiet)
    assert checkpoint.load_state(said)["step"] == 1
    assert "was written before checkpoints carried a manifest" in capsys.readouterr().err
    checkpoint.load_state(said)
    assert capsys.readouterr().err == ""  # once for a checkpoint
    assert checkpoint.load_state(quiet, say=False)["step"] == 1
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("rank", [0, 1])
def test_only_the_main_rank_says_what_it_read_of_a_checkpoint(built, tmp_path, monkeypatch, rank):
    """Two processes: the restore reads the run's state with its one-time notes said on rank 0 only, and each
    rank's own file quietly on every rank."""
    run, cfg = built
    cfg = _with(cfg, output_dir=str(tmp_path))
    rt = run.runtime
    rt.rank, rt.world_size = rank, 2
    rt.gather = lambda obj: [obj, obj]  # both ranks see the same checkpoints
    checkpoint.save_checkpoint(run, LoopState(step=1), cfg)
    read, real = [], checkpoint.load_state
    monkeypatch.setattr(checkpoint, "load_state", lambda ckpt, name=checkpoint.STATE, say=True:
                        read.append((name, bool(say))) or real(ckpt, name, say))
    assert checkpoint.restore(run, _with(cfg, resume="auto")).step == 1
    assert read == [(checkpoint.STATE, rank == 0), (f"rank_{rank}", False)]


def test_a_finished_run_resumed_with_a_changed_schedule_says_nothing_takes_effect(built, tmp_path, capsys):
    """At max_steps nothing trains: a changed schedule is not announced as in effect from the next step."""
    run, cfg = built
    cfg = _with(cfg, output_dir=str(tmp_path))
    checkpoint.save_checkpoint(run, LoopState(step=cfg.trainer.max_steps), cfg)
    checkpoint.restore(run, _with(cfg, resume="auto", warmup_steps=2))
    err = capsys.readouterr().err
    assert f"(step {cfg.trainer.max_steps})" in err and "changed since the checkpoint" not in err
    other = _with(cfg, output_dir=str(tmp_path / "b"))
    checkpoint.save_checkpoint(run, LoopState(step=cfg.trainer.max_steps - 1), other)
    checkpoint.restore(run, _with(other, resume="auto", warmup_steps=2))
    assert f"in effect from step {cfg.trainer.max_steps}: trainer.warmup_steps 4 -> 2" in capsys.readouterr().err
