"""A damaged newest checkpoint (issue 41): each of its files truncated, emptied or deleted in turn. ``resume=auto``
passes over it with one line naming the file, keeps it as ``damaged-step_3`` and continues from step 2 with the
metrics of a resume from step 2; ``resume=<that checkpoint>`` stops in one line naming the file. Also final/.

One three-step smoke run (tiny model, a checkpoint every step) and one resume of it from step 2 are shared by every
case (module fixture); each case copies the run and trains one step."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from grpo.errors import SetupError
from grpo.trainer import checkpoint, manifest
from grpo.trainer.loop import train
from tests.e2e.test_reliability import assert_same_run, steps

FILES = ["COMPLETE", "MANIFEST.json", "trainable.safetensors", "trainer_state.json", "trainer_state.safetensors"]
DAMAGE = ["truncate", "empty", "delete"]


def damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    else:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if how == "truncate" else b"")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(make config, the three-step run's directory, what a resume from its step 2 logged)``."""
    from omegaconf import OmegaConf

    from grpo.config.schema import load
    from tests.helpers import smoke_raw

    root = tmp_path_factory.mktemp("damaged")

    def cfg(out, **trainer):
        raw = OmegaConf.merge(smoke_raw(), {"trainer": {"max_steps": 3, "save_every": 1, "keep_last": 3,
                                                        "output_dir": str(out), **trainer}})
        return load(OmegaConf.to_container(raw, resolve=True))

    train(cfg(root / "full"))
    shutil.copytree(root / "full", root / "from2")
    train(cfg(root / "from2", resume=str(root / "from2" / "checkpoints" / "step_2")))
    return cfg, root / "full", steps(root / "from2")


def test_every_file_of_a_checkpoint_is_in_its_manifest_and_verifies(runs):
    _, full, _ = runs
    step3 = full / "checkpoints" / "step_3"
    assert sorted(p.name for p in step3.iterdir()) == FILES  # the cases below cover each of them
    assert sorted(manifest.read(step3)) == sorted(set(FILES) - {manifest.NAME})
    assert checkpoint.damage(step3) is None and manifest.problem(full / "final") is None


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_auto_resume_passes_over_a_damaged_checkpoint_and_continues_from_the_previous(runs, tmp_path, capsys,
                                                                                      name, how):
    cfg, full, from2 = runs
    out = tmp_path / "run"
    shutil.copytree(full, out)
    shutil.rmtree(out / "final")  # the run stopped before its final model: the resume trains step 3 again
    damage(out / "checkpoints" / "step_3" / name, how)
    capsys.readouterr()
    assert train(cfg(out, resume="auto"))["steps"] == 3
    said = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert len(said) == 1 and f"checkpoint step_3 is damaged ({name}" in said[0] and "resuming from step_2" in said[0]
    kept = out / "checkpoints" / "damaged-step_3"
    assert (kept / name).exists() == (how != "delete") and f"kept as {kept}" in said[0]  # kept as it was found
    if how != "delete":
        assert (kept / name).stat().st_size < (full / "checkpoints" / "step_3" / name).stat().st_size
    assert_same_run({3: steps(out)[3]}, {3: from2[3]})
    assert checkpoint.damage(out / "checkpoints" / "step_3") is None  # written again, whole


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_resume_from_a_damaged_checkpoint_stops_in_one_line_naming_the_file(runs, tmp_path, name, how):
    cfg, full, _ = runs
    step3 = tmp_path / "step_3"
    shutil.copytree(full / "checkpoints" / "step_3", step3)
    damage(step3 / name, how)
    with pytest.raises((SetupError, FileNotFoundError)) as e:
        train(cfg(tmp_path / "new", resume=str(step3)))
    message = str(e.value)
    assert "\n" not in message and name in message
    assert not (tmp_path / "new").exists()  # refused before anything was made


def test_a_flipped_byte_is_found_by_the_checksum_and_the_damaged_file_named(runs, tmp_path, capsys):
    cfg, full, from2 = runs
    out = tmp_path / "run"
    shutil.copytree(full, out)
    shutil.rmtree(out / "final")
    state = out / "checkpoints" / "step_3" / "trainer_state.safetensors"
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum tells
    state.write_bytes(bytes(data))
    with pytest.raises(SetupError, match="trainer_state.safetensors does not match its checksum"):
        train(cfg(tmp_path / "new", resume=str(out / "checkpoints" / "step_3")))
    assert train(cfg(out, resume="auto"))["steps"] == 3
    assert "checkpoint step_3 is damaged (trainer_state.safetensors does not match" in capsys.readouterr().err
    assert_same_run({3: steps(out)[3]}, {3: from2[3]})


@pytest.mark.parametrize("resume", ["checkpoints", "."])
def test_a_folder_of_checkpoints_resumes_its_newest_that_verifies(runs, tmp_path, capsys, resume):
    """``trainer.resume=<run>/checkpoints`` (or the run directory): its newest checkpoint that verifies."""
    cfg, full, from2 = runs
    out = tmp_path / "run"
    shutil.copytree(full, out)
    shutil.rmtree(out / "final")
    damage(out / "checkpoints" / "step_3" / "trainable.safetensors", "truncate")
    assert checkpoint.resolve_resume(str(out / resume), out) == out / "checkpoints" / "step_2"
    assert train(cfg(out, resume=str(out / resume)))["steps"] == 3
    assert "resuming from step_2" in capsys.readouterr().err
    assert_same_run({3: steps(out)[3]}, {3: from2[3]})


def test_auto_refuses_when_no_checkpoint_verifies_and_leaves_them(runs, tmp_path):
    cfg, full, _ = runs
    out = tmp_path / "run"
    shutil.copytree(full, out)
    for step in (1, 2, 3):
        damage(out / "checkpoints" / f"step_{step}" / "trainer_state.json", "empty")
    with pytest.raises(SetupError, match=r"no checkpoint in .* verifies \(the newest, step_3: trainer_state.json"):
        train(cfg(out, resume="auto"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1", "step_2", "step_3"]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_final_model_is_kept_aside_and_saved_again(runs, tmp_path, capsys, how):
    cfg, full, _ = runs
    out = tmp_path / "run"
    shutil.copytree(full, out)
    damage(out / "final" / "model.safetensors", how)
    out_ = train(cfg(out, resume="auto"))
    assert out_.get("final_saved") and "final/ is damaged (model.safetensors" in capsys.readouterr().err
    assert manifest.problem(out / "final") is None and (out / "damaged-final").is_dir()
    assert (out / "final" / "model.safetensors").read_bytes() == (full / "final" / "model.safetensors").read_bytes()


def _resume_block() -> list[list[str]]:
    import re
    import shlex

    from tests.helpers import ROOT

    text = (ROOT / "docs" / "reliability.md").read_text().split("## Resume", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_the_resume_commands_of_the_docs_do_what_they_say(tmp_path, monkeypatch, capsys):
    """docs/reliability.md's three resume commands, in that order (the smoke recipe is already small; no held-out
    evaluation): step_1 and step_2 written; step 2 trained again from step 1 with the same numbers; the folder's
    newest checkpoint, step 2, continued to step 3."""
    import sys

    from grpo import train as cli

    commands = _resume_block()
    assert [c[0] for c in commands] == ["grpo-train"] * 3
    monkeypatch.chdir(tmp_path)
    for words in commands:
        monkeypatch.setattr(sys, "argv", [*words, "data.num_eval=0"])
        try:
            cli.main()
        except SystemExit as e:
            assert e.code in (0, None), capsys.readouterr().err[-2000:]
    a, b, c = (tmp_path / "runs" / x for x in "abc")
    assert [p.name for p in checkpoint.complete_checkpoints(a)] == ["step_1", "step_2"]
    assert sorted(steps(b)) == [2] and sorted(steps(c)) == [3]
    assert_same_run({2: steps(a)[2]}, steps(b))
    assert f"resumed from {Path('runs/a/checkpoints/step_2')} (step 2)" in capsys.readouterr().err
