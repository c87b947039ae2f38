"""grpo/train.py: the entry point checks the command line before torch or a model is touched."""
import sys

import pytest


def test_a_mistyped_key_is_one_line_and_no_run_directory(tmp_path, monkeypatch, capsys):
    from grpo import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo-train", "recipe=smoke", "trainer.max_stepz=1",
                                      f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as e:
        train.main()
    err = capsys.readouterr().err
    assert e.value.code != 0 and "trainer.max_stepz" in err and "trainer.max_steps" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
