"""grpo/train.py: the entry point checks the command line before torch or a model is touched."""
from tests.helpers import train_cli_error


def test_a_mistyped_key_is_one_line_and_no_run_directory(tmp_path, monkeypatch, capsys):
    code, err = train_cli_error(tmp_path, monkeypatch, capsys, "trainer.max_stepz=1")
    assert code != 0 and "trainer.max_stepz" in err and "trainer.max_steps" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
