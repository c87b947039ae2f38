"""grpo/trainer/logger.py: metrics.jsonl written and read back while a run writes it, the console line, train.log,
wandb (a fake module: what the logger hands it), the console's reward curve and the curves' PNG."""
import io
import json
import math
import os
import sys
import types

import matplotlib.figure  # imported at collection: every `make mutate` mutant's run is forked after it
import matplotlib.pyplot as plt
import pytest
import torch
from transformers.utils import logging as hf_logging

from grpo.trainer import logger
from grpo.trainer.logger import LOG, MetricsLogger, _Tee, ascii_curve, format_line, read_metrics, run_log


def test_a_half_written_last_line_is_skipped(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    assert read_metrics(p) == [{"step": 1, "loss": 0.5}] and read_metrics(tmp_path / "none.jsonl") == []
    p.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')  # a line cut by a crash, then a resume's lines
    assert read_metrics(p) == [{"step": 1}, {"step": 3}]


def test_the_curve_spans_the_values():
    text = ascii_curve([0.0, 0.5, 1.0], label="reward_mean")
    assert "1.000 |" in text and "0.000 |" in text and "reward_mean over 3 steps" in text
    assert ascii_curve([None]) == ""


def test_one_step_is_one_step():
    assert ascii_curve([0.5]).endswith("reward over 1 step")
    assert ascii_curve([0.5, 0.7]).endswith("reward over 2 steps")


# ------------------------------------------------------------------------------------------------ the console


class Terminal(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_bars_are_turned_off_only_off_a_terminal(monkeypatch):
    was = hf_logging.is_progress_bar_enabled()  # an earlier test's run may have turned them off: left as found
    hf_logging.enable_progress_bar()
    try:
        monkeypatch.setattr(sys, "stderr", Terminal(tty=True))
        assert logger.interactive()
        logger.quiet_when_not_interactive()
        assert hf_logging.is_progress_bar_enabled()
        monkeypatch.setattr(sys, "stderr", Terminal(tty=False))
        assert not logger.interactive()
        logger.quiet_when_not_interactive()
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_every_console_key_in_its_format_and_a_null_kl_reads_n_a():
    m = {"step": 7, "reward_mean": 0.51234, "reward_std": 0.1, "loss": -0.01234567, "kl": 0.00123456,
         "clip_ratio": 0.25, "completion_len_mean": 12.345, "grad_norm": 1.5, "step_time_s": 3.21, "other": 9}
    assert format_line(m) == ("step    7  reward 0.512  ± 0.100  loss -0.0123  kl 0.0012  clip 0.250  len 12.3  "
                              "|g| 1.500  s/step 3.2")
    assert format_line({"step": 2, "kl": None, "loss": None}) == "step    2  kl n/a"  # beta=0: no KL measured
    assert format_line({"loss": 0.5}) == "step    ?  loss +0.5000"


def test_the_tee_keeps_each_complete_line_and_a_redrawn_lines_last_state(tmp_path):
    screen = Terminal(tty=True)
    path = tmp_path / "run" / LOG
    tee = _Tee(screen, path)
    assert tee.write("before the directory\n") == len("before the directory\n")
    assert not path.exists()  # kept until the directory exists
    path.parent.mkdir()
    tee.write("bar 10%\rbar 50%\rbar 100%\nhalf")
    assert path.read_text() == "before the directory\nbar 100%\n"
    tee.write(" a line\nand a last\r, cut\r, cut again")
    tee.flush()
    assert tee.isatty() and tee.getvalue() == screen.getvalue()  # the terminal's own attributes
    tee.close()
    assert path.read_text() == "before the directory\nbar 100%\nhalf a line\n, cut again\n"
    assert screen.getvalue() == ("before the directory\nbar 10%\rbar 50%\rbar 100%\nhalf a line\n"
                                 "and a last\r, cut\r, cut again")
    assert tee._file.closed


def test_a_tee_without_a_partial_line_and_never_a_directory_writes_nothing(tmp_path):
    tee = _Tee(Terminal(tty=False), tmp_path / "none" / LOG)
    tee.write("x\n")
    tee.close()  # the directory never came: nothing is written anywhere
    assert not (tmp_path / "none").exists()
    done = _Tee(Terminal(tty=False), tmp_path / LOG)
    done.write("whole\nno newline")
    done.close()  # a last line without a newline (nor a redraw) still reaches the log
    assert (tmp_path / LOG).read_text() == "whole\nno newline\n"


def test_run_log_appends_and_a_nested_one_for_the_same_directory_writes_once(tmp_path, monkeypatch):
    screen = Terminal(tty=False)
    monkeypatch.setattr(sys, "stderr", screen)
    (tmp_path / LOG).write_text("an earlier run\n")
    with run_log(str(tmp_path)):
        assert isinstance(sys.stderr, _Tee) and sys.stderr.path == (tmp_path / LOG).absolute()
        with run_log(str(tmp_path)):
            print("once", file=sys.stderr)
        with run_log(str(tmp_path), enabled=False):
            print("still teed", file=sys.stderr)
    assert sys.stderr is screen
    assert (tmp_path / LOG).read_text() == "an earlier run\nonce\nstill teed\n"
    with run_log(str(tmp_path), enabled=False):
        assert sys.stderr is screen
    other = tmp_path / "other"
    other.mkdir()
    with run_log(str(tmp_path)):
        with run_log(str(other)):  # another directory: its own log, then the outer tee again
            print("inner", file=sys.stderr)
        assert sys.stderr.path == (tmp_path / LOG).absolute()
    assert (other / LOG).read_text() == "inner\n" and screen.getvalue() == "once\nstill teed\ninner\n"


def test_run_log_leaves_a_stderr_replaced_inside_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal(tty=False))
    replaced = Terminal(tty=False)
    with run_log(str(tmp_path)):
        print("teed", file=sys.stderr)
        sys.stderr = replaced  # someone else's redirection: not undone
    assert sys.stderr is replaced and (tmp_path / LOG).read_text() == "teed\n"


# ---------------------------------------------------------------------------------------------- metrics.jsonl
class FakeWandb:
    """The wandb module: ``init`` records its arguments and returns a run recording log/alert/finish calls."""

    def __init__(self):
        self.inits, self.calls = [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, data, step=None):
        self.calls.append(("log", data, step))

    def alert(self, title, text):
        self.calls.append(("alert", title, text))

    def finish(self):
        self.calls.append(("finish",))

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data


@pytest.fixture
def wandb(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=fake.init, Table=FakeWandb.Table))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    return fake


def test_a_disabled_logger_writes_and_prints_nothing(tmp_path, capsys, wandb):
    log = MetricsLogger(str(tmp_path / "run"), wandb_cfg={"mode": "online"}, enabled=False)
    log.log({"step": 1, "loss": 0.5})
    log.samples(1, [{"completion": "x", "reward": 1.0}])
    log.completions(1, [{"a": 1}])
    log.alert("t", "x")
    log.finish()
    assert not (tmp_path / "run").exists() and log.truncate_after(0) == 0 and log.logged_eval(0) == {}
    assert wandb.inits == [] and capsys.readouterr().err == ""


def test_each_step_is_one_json_line_with_tensors_as_numbers_and_non_finite_as_null(tmp_path, capsys, wandb):
    log = MetricsLogger(str(tmp_path / "a" / "run"))  # its directory made
    log.log({"step": 1, "loss": torch.tensor(0.25), "kl": float("nan"), "grad_norm": math.inf, "n": 3})
    log.log({"step": 2, "reward_mean": 0.5}, console=False)
    log.log({"step": 3, "reward_mean": 1.0}, progress="step 3/9 [00:01<00:02]")
    lines = (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 0.25, "kl": None, "grad_norm": None, "n": 3},
                                                    {"step": 2, "reward_mean": 0.5}, {"step": 3, "reward_mean": 1.0}]
    assert capsys.readouterr().err.splitlines() == ["step    1  loss +0.2500  kl n/a",
                                                    "step 3/9 [00:01<00:02]  reward 1.000"]
    assert wandb.inits == []  # wandb disabled by default: never imported


def test_wandb_gets_the_run_its_config_and_each_step(tmp_path, wandb):
    log = MetricsLogger(str(tmp_path), cfg_dict={"a": 1}, wandb_cfg={"mode": "offline", "name": "n1"})
    (init,) = wandb.inits
    run_id = (tmp_path / logger.WANDB_ID).read_text()
    assert init == {"project": "grpo", "name": "n1", "mode": "offline", "dir": str(tmp_path), "config": {"a": 1},
                    "id": run_id.strip(), "resume": "allow"}
    assert len(run_id) == 13 and run_id.endswith("\n") and int(run_id, 16) >= 0
    assert not log._online and sys.modules["wandb"] is not None
    assert os.environ["WANDB_SILENT"] == "true"
    log.log({"step": 4, "loss": 1.0}, console=False)
    log.alert("t", "x")  # offline: no alert leaves the machine
    log.completions(4, [{"prompt": "p", "completion": "c", "reward": 1.0}, {"prompt": "q", "completion": "d",
                                                                            "reward": 0.0}])
    log.completions(5, [])
    log.completions(6, [{"prompt": "r", "reward": 0.5}])  # one row
    log.finish()
    (kind, data, step), (kind2, tables, step2), (_, one, _), finish = wandb.calls
    assert (kind, data, step, kind2, step2, finish) == ("log", {"step": 4, "loss": 1.0}, 4, "log", 4, ("finish",))
    assert one["completions"].columns == ["step", "prompt", "reward"] and one["completions"].data == [[6, "r", 0.5]]
    table = tables["completions"]
    assert table.columns == ["step", "prompt", "completion", "reward"]
    assert table.data == [[4, "p", "c", 1.0], [4, "q", "d", 0.0]]
    MetricsLogger(str(tmp_path / "b"), wandb_cfg={"mode": "online", "project": "mine"})
    assert wandb.inits[1]["project"] == "mine" and wandb.inits[1]["name"] is None


def test_wandb_mode_from_the_environment_and_one_run_per_directory(tmp_path, wandb, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    log = MetricsLogger(str(tmp_path))  # no wandb section: the environment's mode
    assert log._online and wandb.inits[-1]["mode"] == "online"
    first = wandb.inits[-1]["id"]
    MetricsLogger(str(tmp_path), resumed=True)
    assert wandb.inits[-1]["id"] == first  # a resume continues the run
    MetricsLogger(str(tmp_path))
    assert wandb.inits[-1]["id"] != first  # a fresh start: a new one
    (tmp_path / "r").mkdir()
    MetricsLogger(str(tmp_path / "r"), resumed=True)  # resumed, no id kept: a new one, kept from now on
    assert wandb.inits[-1]["id"] == (tmp_path / "r" / logger.WANDB_ID).read_text().strip()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert not MetricsLogger(str(tmp_path), wandb_cfg={"mode": "online"})._online  # the environment's mode wins
    assert wandb.inits[-1]["mode"] == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    MetricsLogger(str(tmp_path), wandb_cfg={"mode": "online"})
    monkeypatch.setenv("WANDB_MODE", "dryrun")  # not a mode this logger knows: the config's stays
    MetricsLogger(str(tmp_path), wandb_cfg={"mode": "disabled"})
    assert len(wandb.inits) == 5


def test_a_resume_drops_the_lines_after_its_step_from_both_files(tmp_path, wandb):
    log = MetricsLogger(str(tmp_path))
    for s in (0, 1, 2, 3):
        log.log({"step": s, "reward_mean": s / 10}, console=False)
    log.log({"note": "no step"}, console=False)
    log.samples(2, [{"completion": "a", "reward": 1.0}])
    log.samples(3, [{"completion": "b", "reward": 0.0}, {"completion": "c", "reward": 0.5}])
    assert log.truncate_after(1) == 2  # metrics.jsonl lines only
    assert [json.loads(line) for line in log.path.read_text().splitlines()] == [
        {"step": 0, "reward_mean": 0.0}, {"step": 1, "reward_mean": 0.1}, {"note": "no step"}]
    assert (tmp_path / "samples.jsonl").read_text() == ""
    assert log.truncate_after(0) == 1  # a line without a step counts as step 0's
    assert [json.loads(line) for line in log.path.read_text().splitlines()] == [
        {"step": 0, "reward_mean": 0.0}, {"note": "no step"}]
    with log.path.open("a") as f:
        f.write('{"step": 1, "cut')  # nothing after step 1 to drop: the file is left as it is
    before = log.path.read_text()
    assert log.truncate_after(1) == 0 and log.path.read_text() == before
    other_rank = MetricsLogger(str(tmp_path), enabled=False)  # a rank that logs nothing touches rank 0's files
    assert other_rank.truncate_after(-1) == 0 and log.path.read_text() == before


def test_the_logged_evaluation_of_a_step(tmp_path, wandb):
    log = MetricsLogger(str(tmp_path))
    assert log.logged_eval(0) == {}  # no metrics.jsonl yet
    log.log({"step": 0, "reward_mean": 0.1}, console=False)
    log.log({"step": 0, "eval/accuracy": 0.5, "eval/gsm8k/pass@4": 0.75, "loss": 1.0}, console=False)
    log.log({"step": 0, "eval/accuracy": 0.9}, console=False)
    log.log({"step": 1, "eval/accuracy": 0.6}, console=False)
    assert log.logged_eval(0) == {"accuracy": 0.5, "gsm8k/pass@4": 0.75}  # the first at that step
    assert log.logged_eval(2) == {}
    assert MetricsLogger(str(tmp_path), enabled=False).logged_eval(0) == {}  # a rank that logs nothing reads nothing


def test_samples_go_to_samples_jsonl_and_one_console_line_each(tmp_path, capsys, wandb):
    log = MetricsLogger(str(tmp_path))
    long = "x" * 200
    log.samples(5, [{"completion": "a\nb", "reward": 0.5, "answer": 3}, {"completion": long, "reward": 1.0}])
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows == [{"step": 5, "completion": "a\nb", "reward": 0.5, "answer": 3},
                    {"step": 5, "completion": long, "reward": 1.0}]
    assert capsys.readouterr().err.splitlines() == ["  sample  reward=0.50  answer=3        | a\\nb",
                                                    "  sample  reward=1.00  answer=None     | " + "x" * 160]


# ------------------------------------------------------------------------------------------------- the curves
def test_the_curve_is_drawn_exactly():
    assert ascii_curve([0.0, 1.0, 0.5], height=2, label="r") == "\n".join([
        "  1.000 | █ ",
        "  0.500 | ██",
        "  0.000 |███",
        "        +---",
        "         r over 3 steps"])


def test_the_curve_scales_by_its_span_and_has_a_default_size():
    assert ascii_curve([1.0, 3.0, 2.0], height=2).splitlines()[:3] == ["  3.000 | █ ", "  2.000 | ██", "  1.000 |███"]
    rows = ascii_curve([float(i % 7) for i in range(100)]).splitlines()
    assert len(rows) == 9 + 2 and {len(r) for r in rows[:9]} == {9 + 60}  # 9 levels, 60 columns


def test_the_curve_averages_buckets_of_steps_when_they_outnumber_its_width():
    text = ascii_curve([0.0, 0.0, 1.0, 1.0, None, 1.0, 0.0], width=3, height=1)
    # six values in three buckets: [0, 0] [1, 1] [1, 0] -> 0, 1, 0.5
    assert text.splitlines() == ["  1.000 | █ ", "  0.000 |███", "        +---", "         reward over 6 steps"]
    flat = ascii_curve([2.0, 2.0], height=1).splitlines()  # no span: every column at the bottom and the top
    assert flat[:2] == ["  3.000 |  ", "  2.000 |██"]


def test_whole_step_ticks_and_a_single_step_gets_a_span():
    fig, ax = plt.subplots()
    logger.integer_steps(ax, [3, 3])
    assert ax.get_xlim() == (2, 4) and ax.xaxis.get_major_locator()._integer
    before = ax.get_xlim()
    logger.integer_steps(ax, [1, 5])
    logger.integer_steps(ax, [])
    assert ax.get_xlim() == before
    plt.close(fig)


def test_plot_curves_draws_each_logged_metric_against_step(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **k: seen.append((fig, path, k)))
    rows = [{"step": 1, "reward_mean": 0.1, "kl": None}, {"step": 2, "reward_mean": 0.3, "kl": 0.02},
            {"step": 3, "loss": 1.0}]
    logger.plot_curves(rows, tmp_path / "c.png")
    ((fig, path, kwargs),) = seen
    assert path == tmp_path / "c.png" and kwargs == {"dpi": 110}
    assert [ax.get_title() for ax in fig.axes] == ["reward_mean", "kl"]
    assert [ax.get_xlabel() for ax in fig.axes] == ["step", "step"]
    (reward,), (kl,) = (ax.get_lines() for ax in fig.axes)
    assert list(reward.get_xdata()) == [1, 2] and list(reward.get_ydata()) == [0.1, 0.3]
    assert list(kl.get_xdata()) == [2] and list(kl.get_ydata()) == [0.02] and kl.get_marker() == "."
    assert fig.axes[1].get_xlim() == (1, 3)  # one step: integer_steps' span
    assert reward.get_linewidth() == 1 and fig.axes[0].xaxis.get_gridlines()[0].get_alpha() == 0.3
    assert tuple(fig.get_size_inches()) == pytest.approx((9.0, 3.2))
    logger.plot_curves([{"step": 1, "loss": 1.0}], tmp_path / "none.png", keys=("reward_mean",))
    assert len(seen) == 1  # nothing to draw: no figure
    logger.plot_curves(rows, tmp_path / "r.png", keys=("loss",))
    assert [ax.get_title() for ax in seen[1][0].axes] == ["loss"]
