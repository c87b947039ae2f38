"""grpo/trainer/resume.py: which checkpoint trainer.resume takes. ``auto`` and a folder of checkpoints take the
newest that verifies (by step number) and say which they passed over; an explicit damaged one names its bad file;
a damaged one is moved aside, never deleted."""
from __future__ import annotations

import pytest

from grpo.errors import SetupError
from grpo.trainer import manifest, resume


def _ckpt(out, step, files=("w",)):
    d = resume.checkpoints_dir(out) / f"step_{step}"
    d.mkdir(parents=True)
    for name in files:
        (d / name).write_text(f"{name} of {step}")
    (d / resume.MARKER).write_text(f"{step}\n")
    manifest.write(d)
    return d


def test_damage_names_the_marker_the_manifest_or_the_file(tmp_path):
    d = _ckpt(tmp_path, 1)
    assert resume.damage(d) is None
    (d / "w").write_text("w of 2")  # same size
    assert resume.damage(d, checksums=False) is None and "w does not match its checksum" in resume.damage(d)
    (d / resume.MARKER).unlink()
    assert resume.damage(d) == "COMPLETE is missing: not a complete checkpoint"


def test_a_checkpoint_from_before_manifests_is_taken_as_it_is_but_not_todays_format_without_one(tmp_path):
    d = tmp_path / "step_1"
    d.mkdir()
    (d / resume.MARKER).write_text("1\n")
    (d / resume.LEGACY_STATE).write_bytes(b"x")
    assert resume.damage(d) is None
    (d / "trainer_state.json").write_text("{}")
    assert resume.damage(d) == "MANIFEST.json is missing"
    (d / "trainer_state.json").unlink()
    (d / resume.LEGACY_STATE).unlink()
    assert resume.damage(d) == "MANIFEST.json is missing"


def test_step_dirs_are_newest_first_by_number_and_only_directories(tmp_path):
    root = resume.checkpoints_dir(tmp_path)
    for name in ("step_9", "step_10", "step_2", "damaged-step_11", ".tmp-step_12"):
        (root / name).mkdir(parents=True)
    (root / "step_13").write_text("a file")
    assert [p.name for p in resume.step_dirs(root)] == ["step_10", "step_9", "step_2"]
    assert resume.step_dirs(tmp_path / "none") == []


def test_auto_takes_the_newest_that_verifies_and_lists_those_it_passed_over(tmp_path):
    for step in (2, 9, 10):
        _ckpt(tmp_path, step)
    assert resume.choose("auto", tmp_path) == (resume.checkpoints_dir(tmp_path) / "step_10", [])
    (resume.checkpoints_dir(tmp_path) / "step_10" / "w").write_text("")
    (resume.checkpoints_dir(tmp_path) / "step_9" / resume.MARKER).unlink()
    found, skipped = resume.choose("auto", tmp_path)
    assert found.name == "step_2"
    assert [(p.name, why) for p, why in skipped] == [("step_10", "w has 0 bytes, the manifest says 7"),
                                                    ("step_9", "COMPLETE is missing: not a complete checkpoint")]
    assert resume.resolve_resume("auto", tmp_path).name == "step_2"
    (resume.checkpoints_dir(tmp_path) / "step_2" / manifest.NAME).write_text("")
    with pytest.raises(SetupError, match=r"trainer.resume=auto: no checkpoint in .* verifies \(the newest, step_10: "
                                         r"w has 0 bytes"):
        resume.choose("auto", tmp_path)


@pytest.mark.parametrize("value", [None, ""])
def test_no_resume_and_an_empty_directory(tmp_path, value):
    assert resume.choose(value, tmp_path) == (None, [])
    assert resume.choose("auto", tmp_path) == (None, [])


def test_a_folder_of_checkpoints_or_the_run_directory_is_its_newest_that_verifies(tmp_path):
    _ckpt(tmp_path, 1)
    (_ckpt(tmp_path, 2) / "w").unlink()
    for folder in (resume.checkpoints_dir(tmp_path), tmp_path):
        found, skipped = resume.choose(str(folder), tmp_path / "elsewhere")
        assert found.name == "step_1" and [(p.name, why) for p, why in skipped] == [("step_2", "w is missing")]
    (resume.checkpoints_dir(tmp_path) / "step_1" / "w").unlink()
    with pytest.raises(SetupError, match=r"no checkpoint in this folder verifies \(the newest, step_2: w is missing"):
        resume.choose(str(tmp_path), tmp_path)


def test_an_explicit_path_missing_incomplete_or_damaged_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        resume.choose(str(tmp_path / "nope"), tmp_path)
    d = _ckpt(tmp_path, 3)
    assert resume.choose(str(d), tmp_path) == (d, [])
    (d / "w").write_text("w of 4")
    assert resume.resolve_resume(str(d), tmp_path) == d  # before the model loads: sizes only
    with pytest.raises(SetupError, match=r"is damaged: w does not match its checksum .*; resume from another"):
        resume.choose(str(d), tmp_path)
    (d / resume.MARKER).unlink()
    with pytest.raises(FileNotFoundError, match=r"is not a complete checkpoint \(no COMPLETE marker\)"):
        resume.choose(str(d), tmp_path)
    (tmp_path / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        resume.choose(str(tmp_path / "plain"), tmp_path)  # no marker, no checkpoints in it


def test_set_aside_keeps_each_damaged_checkpoint_under_a_new_name_and_says_so(tmp_path, capsys):
    root = resume.checkpoints_dir(tmp_path)
    (root / "damaged-step_3").mkdir(parents=True)  # from an earlier resume
    kept = []
    for _ in range(2):
        d = _ckpt(tmp_path, 3)
        resume.set_aside([(d, "w is missing")], root / "step_2", say=True)
        kept.append(sorted(p.name for p in root.iterdir()))
    assert kept[-1] == ["damaged-2-step_3", "damaged-3-step_3", "damaged-step_3"]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (f"[grpo] checkpoint step_3 is damaged (w is missing): resuming from step_2; it is kept as "
                        f"{root / 'damaged-2-step_3'}")
    assert (root / "damaged-3-step_3" / "w").read_text() == "w of 3"
    resume.set_aside([(_ckpt(tmp_path, 4), "x")], root / "step_2", say=False)
    assert capsys.readouterr().err == "" and (root / "damaged-step_4").is_dir()


def test_only_a_verifying_resume_reads_the_files_and_latest_of_nothing_is_none(tmp_path):
    assert resume.latest(tmp_path) is None
    for step in (1, 2):
        _ckpt(tmp_path, step)
    (resume.checkpoints_dir(tmp_path) / "step_2" / "w").write_text("w of 3")  # same size: only the checksum tells
    for where in ("auto", str(resume.checkpoints_dir(tmp_path))):
        assert resume.choose(where, tmp_path)[0].name == "step_1"  # checked by default
        assert resume.choose(where, tmp_path, checksums=True)[0].name == "step_1"
        assert resume.choose(where, tmp_path, checksums=False) == (resume.checkpoints_dir(tmp_path) / "step_2", [])
    assert resume.newest_intact(resume.checkpoints_dir(tmp_path))[0].name == "step_1"
    assert resume.newest_intact(resume.checkpoints_dir(tmp_path), checksums=False)[0].name == "step_2"


def test_verls_resume_modes_are_refused_naming_ours_unless_a_directory_has_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for mode in ("disable", "resume_path"):
        with pytest.raises(FileNotFoundError, match=rf"^trainer.resume={mode} is verl's; ours: null \(a fresh run\), "
                                                   "auto or a path$"):
            resume.choose(mode, tmp_path)
    (tmp_path / "disable").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        resume.choose("disable", tmp_path)  # a directory of that name is a path like any other
