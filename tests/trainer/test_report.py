"""grpo-report: a real 2-run sweep of the smoke recipe, a still-running run, and a mix of both (slow); then each part
of the report on synthetic runs: discovery, the hydra files, the table, the text, the plots read from their figures."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.trainer.report import PLOTS, find_runs, load_run, report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def table_rows(md: str) -> list[list[str]]:
    """The data rows of report.md's final-metrics table, as lists of cells."""
    lines = [l for l in md.splitlines() if l.startswith("|")]
    assert lines[0].startswith("| run |") and set(lines[1]) <= set("|-")
    return [[c.strip() for c in l.strip("|").split(" | ")] for l in lines[2:]]


def assert_valid_png(path: Path):
    import matplotlib.image as mpimg

    assert path.is_file(), path
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 5000, path
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400, img.shape
    assert img[..., :3].std() > 0.01, f"{path} is blank"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    p = subprocess.run([sys.executable, "-m", "grpo.train", "-m", "recipe=smoke", "algorithm.group_size=2,3",
                        "trainer.max_steps=2", f"hydra.sweep.dir={root}/sweep"],
                       capture_output=True, text=True, cwd=root, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return root / "sweep"


@pytest.mark.slow  # the shared fixture runs a 2-run smoke sweep (~30 s on 2 cores)
def test_report_on_a_two_run_sweep(sweep):
    # the Hydra multirun: one run directory per group size
    names = sorted(d.parent.name for d in sweep.glob("*/metrics.jsonl"))
    assert len(names) == 2 and "group_size=2" in names[0] and "group_size=3" in names[1]
    p = subprocess.run([sys.executable, "-m", "grpo.trainer.report", str(sweep)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    md = (sweep / "report.md").read_text()
    for name in PLOTS:
        assert_valid_png(sweep / name)
        assert f"({name})" in md
    rows = table_rows(md)
    assert len(rows) == 2
    assert "algorithm.group_size=2" in rows[0][0] and "algorithm.group_size=3" in rows[1][0]
    assert "`recipe=smoke`" in md and "`trainer.max_steps=2`" in md   # common overrides, above the table
    for r in rows:
        assert r[1] == "finished" and r[2] == "2/2"
        float(r[3]), float(r[4]), float(r[5]), float(r[6]), float(r[7])   # reward, eval before/after, kl, s/step


@pytest.mark.slow  # the shared fixture runs a 2-run smoke sweep (~30 s on 2 cores)
def test_report_on_a_running_run_and_a_mix(sweep, tmp_path):
    src = sorted(d for d in sweep.iterdir() if (d / "metrics.jsonl").exists())[0]
    live = tmp_path / "live" / "run"
    shutil.copytree(src, live)
    shutil.rmtree(live / "final")
    text = (live / "metrics.jsonl").read_text()
    lines = text.splitlines(keepends=True)
    assert json.loads(lines[1])["step"] == 1
    # step 0 (held-out before) and step 1 complete, step 2 cut in the middle of its line
    (live / "metrics.jsonl").write_text(lines[0] + lines[1] + lines[2][: len(lines[2]) // 2])

    run = load_run(live)
    assert not run.finished and run.steps_done == 1 and [e["step"] for e in run.evals] == [0]

    out = tmp_path / "out"
    from grpo.trainer.report import main

    main([str(live), "--out", str(out)])
    rows = table_rows((out / "report.md").read_text())
    assert len(rows) == 1 and rows[0][1] == "running" and rows[0][2] == "1/2" and rows[0][5] == "–"
    for name in PLOTS:
        assert_valid_png(out / name)

    # a mix: the whole sweep and the running run, default --out = their common parent
    path = report([sweep, live])
    assert path.parent == Path(os.path.commonpath([sweep.resolve(), live.resolve()]))
    rows = table_rows(path.read_text())
    assert [r[1] for r in rows] == ["finished", "finished", "running"]
    assert "not finished" in path.read_text()


def _write(run: Path, lines: list[dict], tail: str = "", final: bool = False, overrides=None):
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines) + tail)
    if final:
        (run / "final").mkdir()
    if overrides is not None:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))


def test_report_without_training(tmp_path):
    """Synthetic runs: no eval/accuracy (reward_mean instead), only the step-0 line, an empty file, two sweeps."""
    step = {"loss": 0.0, "reward_std": 0.1, "clip_ratio": 0.0, "completion_len_mean": 10.0, "kl": 0.01}
    for sweep, lr in (("a", "1e-5"), ("b", "1e-5")):
        for i, g in enumerate((2, 16)):
            _write(tmp_path / sweep / f"{i}_algorithm.group_size={g}",
                   [{"step": 0, "eval/reward_mean": 0.1}]
                   + [{"step": s, "reward_mean": 0.1 * s, "step_time_s": 100.0, **step} for s in (1, 2, 3)]
                   + [{"step": 3, "eval/reward_mean": 0.4}], final=True,
                   overrides=[f"algorithm.group_size={g}", f"trainer.lr={lr}"])
    _write(tmp_path / "c" / "started", [{"step": 0, "eval/accuracy": 0.2}], tail='{"step": 1, "rew')
    _write(tmp_path / "c" / "empty", [])
    dirs = find_runs([tmp_path / "a", tmp_path / "c", tmp_path / "b"])
    assert [d.parent.name + "/" + d.name for d in dirs] == [
        "a/0_algorithm.group_size=2", "a/1_algorithm.group_size=16", "c/empty", "c/started",
        "b/0_algorithm.group_size=2", "b/1_algorithm.group_size=16"]
    md = report([tmp_path / "a", tmp_path / "c", tmp_path / "b"], tmp_path / "out").read_text()
    rows = table_rows(md)
    assert len(rows) == 6
    labels = [r[0] for r in rows]
    assert len(set(labels)) == 6                        # same overrides in two sweeps are told apart
    assert rows[0][5].startswith("0.400") and "¹" in rows[0][5]    # eval/reward_mean stands in for accuracy
    assert rows[0][8] == "5.0 min"
    assert rows[3][1] == "running" and rows[3][4] == "0.200" and rows[3][3] == "–"
    for name in PLOTS:
        assert_valid_png(tmp_path / "out" / name)


def test_no_runs_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "grpo.trainer.report", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: no runs") and "Traceback" not in p.stderr


def _fake_run(tmp_path: Path, name: str, steps: int) -> Path:
    run = tmp_path / name
    run.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.5}]
    rows += [{"step": s, "reward_mean": 0.5, "kl": None, "completion_len_mean": 4.0, "step_time_s": 1.0}
             for s in range(1, steps + 1)]
    rows += [{"step": steps, "eval/accuracy": 0.75}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_identical_runs_stay_visible_and_a_single_step_has_whole_ticks(tmp_path, monkeypatch):
    """heldout.png: two identical runs are drawn with different markers and dashes (one would hide the other);
    a one-step run gets integer step ticks, not 0.96, 0.98, ..."""
    import matplotlib.figure

    from grpo.trainer import report as rep

    runs = [load_run(_fake_run(tmp_path, n, 1)) for n in ("a", "b")]
    rep._label_runs(runs)
    seen = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: seen.append(fig))
    rep.write_plots(runs, tmp_path)
    heldout = seen[1].axes[0]
    styles = {(line.get_marker(), line.get_linestyle()) for line in heldout.get_lines()}
    assert len(styles) == 2
    for ax in (heldout, seen[0].axes[0]):  # reward.png has a single point at step 1
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    kl_length = seen[2]
    assert [ax.get_title() for ax in kl_length.axes] == ["mean completion length (tokens)"]  # beta = 0: no KL panel


def test_reward_curve_of_a_run_without_reference_has_no_kl_panel(tmp_path, monkeypatch):
    """beta = 0: kl is null in every line, so reward_curve.png draws no KL panel (a line at 0 would claim a
    measurement); a measured kl gets its panel."""
    import matplotlib.figure

    from grpo.trainer.logger import plot_curves

    seen, save = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *a, **k: (seen.append([ax.get_title() for ax in self.axes]), save(self, *a, **k)))
    rows = [{"step": s, "reward_mean": 0.1 * s, "kl": None, "completion_len_mean": 3.0} for s in (1, 2)]
    plot_curves(rows, tmp_path / "none.png")
    plot_curves([{**r, "kl": 0.01} for r in rows], tmp_path / "kl.png")
    assert seen == [["reward_mean", "completion_len_mean"], ["reward_mean", "kl", "completion_len_mean"]]


# ------------------------------------------------------------------------------------ unit level (no PNG written)
# The tests below replace Figure.savefig where a plot would be written: what each panel shows is read from the
# figure, and `make mutate` does not pay for PNG encoding in every mutant's run.
import math  # noqa: E402

import matplotlib.figure  # noqa: E402
import matplotlib.pyplot  # noqa: E402,F401  (imported at collection: every mutant's run is forked after it)

from grpo.trainer import report as rep  # noqa: E402
from grpo.trainer.report import RunLog  # noqa: E402


@pytest.fixture
def figures(monkeypatch):
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **k: saved.append((fig, path, k)))
    return saved


def runlog(label="r", rows=(), evals=(), eval_key="eval/accuracy", finished=True, max_steps=None, path=None,
           overrides=()):
    rows = list(rows)
    times, t = [], 0.0
    for m in rows:
        t += m.get("step_time_s") or 0.0
        times.append(t)
    return RunLog(path=Path(path or f"/runs/{label}"), overrides=list(overrides), rows=rows, evals=list(evals),
                  eval_key=eval_key, finished=finished, max_steps=max_steps, label=label, times=times)


def test_find_runs_skips_what_a_run_writes_besides_itself_and_each_run_once(tmp_path):
    for skip in ("final", "checkpoints", ".hydra", ".tmp-final", "wandb", "__pycache__"):
        _write(tmp_path / "sweep" / skip / "x", [{"step": 1}])
    _write(tmp_path / "sweep" / "10_b", [{"step": 1}])
    _write(tmp_path / "sweep" / "2_a", [{"step": 1}])
    _write(tmp_path / "sweep" / "2_a" / "inner", [{"step": 1}])  # inside a run: not another run
    _write(tmp_path / "one", [{"step": 1}])
    got = rep.find_runs([tmp_path / "sweep", tmp_path / "one", tmp_path / "sweep" / "2_a", str(tmp_path / "one")])
    assert got == [(tmp_path / "sweep" / "2_a").resolve(), (tmp_path / "sweep" / "10_b").resolve(),
                   (tmp_path / "one").resolve()]
    (tmp_path / "odd" / "metrics.jsonl").mkdir(parents=True)  # a directory named like the file: no run
    assert rep.find_runs([tmp_path / "odd"]) == []


def test_overrides_and_max_steps_from_the_runs_hydra_files(tmp_path):
    r = tmp_path / "r"
    _write(r, [], overrides=["algorithm.group_size=4", "hydra.job.chdir=true", "+hydra.x=1", "~hydra.y",
                             "trainer.output_dir=/x", "+trainer.output_dir=/y", "trainer.lr=1e-5", "+a=1", 3])
    assert rep._overrides(r) == ["algorithm.group_size=4", "trainer.lr=1e-5", "+a=1", "3"]
    assert rep._overrides(tmp_path) == [] and rep._max_steps(tmp_path) is None  # no .hydra
    (r / ".hydra" / "config.yaml").write_text("trainer:\n  max_steps: 12\n")
    assert rep._max_steps(r) == 12
    (r / ".hydra" / "config.yaml").write_text("trainer: {}\n")
    assert rep._max_steps(r) is None  # no max_steps in it: unknown
    (r / ".hydra" / "overrides.yaml").write_text("[unclosed\n")
    assert rep._overrides(r) == []  # unreadable: no overrides rather than a crash
    (r / ".hydra" / "overrides.yaml").write_text("")
    assert rep._overrides(r) == []


def test_a_number_is_finite_and_not_a_bool():
    assert [rep._num(v) for v in (1, 2.5, True, math.nan, math.inf, "3", None)] == [1.0, 2.5, None, None, None,
                                                                                   None, None]
    assert type(rep._num(1)) is float


def test_load_run_keeps_each_steps_last_line_the_times_and_the_evaluations_at_their_time(tmp_path):
    r = tmp_path / "run"
    _write(r, [{"step": 0, "eval/accuracy": 0.25, "eval/reward_mean": 0.5},
               {"step": 2, "reward_mean": 0.9, "step_time_s": 5.0},
               {"step": 1, "reward_mean": 0.1, "step_time_s": 2.0},
               {"step": 2, "reward_mean": 0.2, "step_time_s": 3.0},  # step 2 again (a resume): this one
               {"step": 3, "reward_mean": 0.3, "step_time_s": None}, {"step": "4", "reward_mean": 1.0},
               {"step": 3, "eval/accuracy": 0.5}, {"step": 5, "eval/accuracy": math.nan},
               {"step": "6", "eval/accuracy": 1.0}, {"eval/accuracy": 1.0}, {"step": 2, "eval/accuracy": 0.375}],
           final=True)
    (r / ".hydra").mkdir()
    (r / ".hydra" / "config.yaml").write_text("trainer:\n  max_steps: 9\n")
    run = load_run(r)
    assert [m["reward_mean"] for m in run.rows] == [0.1, 0.2, 0.3] and run.steps_done == 3
    assert run.times == [2.0, 5.0, 5.0] and run.finished and run.max_steps == 9 and run.path == r
    assert run.eval_key == "eval/accuracy"  # accuracy before reward_mean
    assert run.evals == [{"step": 0, "t": 0.0, "value": 0.25}, {"step": 2, "t": 5.0, "value": 0.375},
                         {"step": 3, "t": 5.0, "value": 0.5}]
    plain = tmp_path / "plain"
    _write(plain, [{"step": 0, "eval/reward_mean": 0.5}, {"step": 1, "reward_mean": 0.5}])
    p = load_run(plain)
    assert (p.eval_key, p.finished, p.max_steps, p.overrides, p.times) == ("eval/reward_mean", False, None, [], [0.0])
    assert p.evals == [{"step": 0, "t": 0.0, "value": 0.5}]
    _write(tmp_path / "none", [{"step": 1, "reward_mean": 0.5}])
    none = load_run(tmp_path / "none")
    assert none.eval_key is None and none.evals == [] and RunLog(tmp_path, [], [], [], None, False).steps_done == 0


def test_labels_are_the_overrides_a_run_does_not_share(tmp_path):
    a = runlog(path=tmp_path / "s1" / "0", overrides=["x=1", "lr=1", "g=2"])
    b = runlog(path=tmp_path / "s1" / "1", overrides=["g=4", "x=1", "lr=1"])
    c = runlog(path=tmp_path / "s2" / "0", overrides=["x=1", "lr=1", "g=2"])
    assert rep._label_runs([a, b, c]) == ["x=1", "lr=1"]  # the common ones, in the first run's order
    assert [r.label for r in (a, b, c)] == ["g=2 [s1/0]", "g=4", "g=2 [s2/0]"]
    solo = runlog(path=tmp_path / "solo", overrides=["g=2", "x=1"])
    assert rep._label_runs([solo]) == [] and solo.label == "g=2 x=1"  # one run: its own overrides
    bare = [runlog(path=tmp_path / "p" / "a"), runlog(path=tmp_path / "p" / "b")]
    assert rep._label_runs(bare) == [] and [r.label for r in bare] == ["a", "b"]  # no overrides: the directory
    assert rep._label_runs([]) == []


def test_the_time_axis_unit_keeps_the_numbers_readable():
    def unit(seconds):
        return rep._time_unit([runlog(rows=[{"step": 1, "step_time_s": seconds}]), runlog()])

    assert [unit(s) for s in (179.9, 180, 3 * 3600 - 1, 3 * 3600)] == [
        ("seconds", 1.0), ("minutes", 60.0), ("minutes", 60.0), ("hours", 3600.0)]
    assert rep._time_unit([]) == ("seconds", 1.0)


def test_a_series_against_step_or_time_skips_what_is_not_a_number():
    r = runlog(rows=[{"step": 1, "kl": 0.5, "step_time_s": 60.0}, {"step": 2, "kl": None, "step_time_s": 60.0},
                     {"step": 3, "kl": math.inf, "step_time_s": 60.0}, {"step": 4, "kl": 0.25, "step_time_s": 60.0}])
    assert rep._series(r, "kl") == ([1, 4], [0.5, 0.25])
    assert rep._series(r, "kl", 60.0) == ([1.0, 4.0], [0.5, 0.25])
    assert rep._series(r, "missing") == ([], [])


def test_durations_and_cells():
    assert [rep._duration(s) for s in (None, 5, 119.4, 120, 3 * 3600 - 6, 3 * 3600, 360000)] == [
        "–", "5 s", "119 s", "2.0 min", "179.9 min", "3.00 h", "100.00 h"]
    assert rep._fmt(None) == "–" and rep._fmt(0.12345) == "0.123" and rep._fmt(0.12345, ".1f") == "0.1"
    assert rep._cell("a|b\nc") == "a\\|b c"


def test_the_final_metrics_table(tmp_path):
    step = {"reward_mean": 0.5, "kl": 0.012345, "step_time_s": 2.0}
    done = runlog("g=2", rows=[{"step": 1, **step}, {"step": 2, **step, "reward_mean": 0.75, "step_time_s": 4.0}],
                  evals=[{"step": 0, "t": 0.0, "value": 0.25}, {"step": 2, "t": 6.0, "value": 0.5}], max_steps=2,
                  path=tmp_path / "sweep" / "0")
    early = runlog("g|4", rows=[{"step": 1, **step}, {"step": 2, **step}],
                   evals=[{"step": 0, "t": 0.0, "value": 0.25}, {"step": 1, "t": 2.0, "value": 0.3}], max_steps=4,
                   path=tmp_path / "other")
    running = runlog("live", rows=[{"step": 1, "reward_mean": 0.1, "kl": None, "step_time_s": None}],
                     evals=[{"step": 1, "t": 0.0, "value": 0.2}], eval_key="eval/reward_mean", finished=False,
                     path=tmp_path / "runs" / "live")
    empty = runlog("empty", eval_key=None, finished=False, path=tmp_path / "sweep" / "1")
    before_only = runlog("b0", evals=[{"step": 0, "t": 0.0, "value": 0.25}], path=tmp_path / "sweep" / "2")
    lines = rep.table([done, early, running, empty, before_only], tmp_path / "sweep")
    assert lines[:2] == ["| run | status | steps | final reward_mean | held-out before | held-out after | final kl "
                         "| mean s/step | wall-clock | directory |", "|---|---|---|---|---|---|---|---|---|---|"]
    assert lines[2] == "| `g=2` | finished | 2/2 | 0.750 | 0.250 | 0.500 | 0.0123 | 3.00 | 6 s | `0` |"
    # the last evaluation before the last step is said so
    assert lines[3] == ("| `g\\|4` | finished | 2/4 | 0.500 | 0.250 | 0.300 (step 1) | 0.0123 | 2.00 | 4 s "
                        "| `../other` |")
    assert lines[4] == "| `live` | running | 1 | 0.100 | – | 0.200 (step 1) ¹ | n/a | – | 0 s | `../runs/live` |"
    assert lines[5] == "| `empty` | running | 0 | – | – | – | n/a | – | – | `1` |"
    assert lines[6] == "| `b0` | finished | 0 | – | 0.250 | – | n/a | – | – | `2` |"  # step 0 is not after
    ran = runlog("ran", rows=[{"step": 3, **step}], evals=[{"step": 3, "t": 2.0, "value": 0.5}], finished=False)
    assert rep.table([ran], tmp_path)[2].split(" | ")[5] == "0.500 (step 3)"  # not finished: maybe not the last


def test_a_run_on_another_drive_is_shown_by_its_own_path(tmp_path, monkeypatch):
    def other_drive(path, start):
        raise ValueError("path is on mount 'D:', start on mount 'C:'")

    monkeypatch.setattr(rep.os.path, "relpath", other_drive)
    assert rep.table([runlog("w", path=tmp_path / "w")], tmp_path)[2].endswith(f"| `{tmp_path / 'w'}` |")


def test_render_says_what_the_numbers_are(tmp_path, figures):
    one = runlog("a", rows=[{"step": 1, "reward_mean": 0.5, "kl": 0.1}], path=tmp_path / "a")
    md = rep.render([one], tmp_path, ["x=1", "y=2"]).splitlines()
    assert md[:4] == ["# GRPO report: 1 run", "", "Common overrides: `x=1` `y=2`", ""]
    assert md[4:7] == ["## Final metrics", "", md[6]] and md[6].startswith("| run |")
    assert md[9] == ""
    assert md[10] == ("*held-out*: greedy accuracy on the held-out prompts, before training (step 0) and after the "
                      "last step; *wall-clock*: the sum of `step_time_s` (held-out evaluation not included); *final "
                      "kl*: n/a for a run without a reference model (`algorithm.beta=0`).")
    assert md[11:] == ["", "## Reward", "", "![reward](reward.png)", "", "## Held-out accuracy", "",
                       "![held-out](heldout.png)", "", "## KL and completion length", "",
                       "![kl and length](kl_length.png)"]  # (and the file's last newline)
    assert figures == []  # no evaluation sets: no eval_sets.png
    two = [runlog("a", eval_key="eval/reward_mean", finished=False, rows=[{"step": 1, "reward_mean": 0.5}]),
           runlog("b", finished=False, eval_key=None)]
    md2 = rep.render(two, tmp_path, [])
    assert md2.startswith("# GRPO report: 2 runs\n\n2 runs are not finished (no `final/` yet: still going, or "
                          "stopped before the end); their numbers are as far as they got.\n\n## Final metrics")
    assert "greedy accuracy (`eval/accuracy`) on the held-out" in md2
    assert "\n¹ this run has no reward named `accuracy`; its held-out column is `eval/reward_mean`.\n" in md2
    assert md2.endswith("## Completion length\n\n![completion length](kl_length.png) (no KL panel: no run has a "
                        "reference model, `algorithm.beta=0`)\n")
    one_running = rep.render([runlog("a", finished=False), one], tmp_path, [])
    assert "\n1 run is not finished (no `final/` yet: still going, or stopped before the end); its numbers are as " \
           "far as it got.\n" in one_running and "Common overrides" not in one_running and "¹" not in one_running


def test_the_plots_panels_lines_and_legend(tmp_path, figures):
    rows = [{"step": s, "reward_mean": s / 10, "kl": s / 100, "completion_len_mean": 10.0 * s,
             "step_time_s": 120.0} for s in (1, 2, 3)]
    a = runlog("a", rows=rows, evals=[{"step": 0, "t": 0.0, "value": 0.25}, {"step": 3, "t": 360.0, "value": 0.5}])
    b = runlog("b", rows=[{"step": 1, "reward_mean": 0.2, "kl": None, "step_time_s": 60.0}], evals=[])
    assert rep.write_plots([a, b], tmp_path) == ["reward.png", "heldout.png", "kl_length.png"]
    (reward, p1, k1), (heldout, p2, _), (kl_length, p3, _) = figures
    assert (p1, p2, p3, k1) == (tmp_path / "reward.png", tmp_path / "heldout.png", tmp_path / "kl_length.png",
                                {"dpi": 110})
    tlabel = "wall-clock minutes (sum of step_time_s)"  # 6 minutes: minutes
    assert [(ax.get_title(), ax.get_xlabel()) for ax in reward.axes] == [
        ("training reward_mean", "step"), ("training reward_mean", tlabel)]
    assert [(ax.get_title(), ax.get_xlabel()) for ax in heldout.axes] == [
        ("held-out accuracy (greedy)", "step"), ("held-out accuracy (greedy)", tlabel)]
    assert [(ax.get_title(), ax.get_xlabel()) for ax in kl_length.axes] == [
        ("KL to the reference", "step"), ("mean completion length (tokens)", "step")]
    assert [list(line.get_ydata()) for line in kl_length.axes[1].get_lines()] == [[10.0, 20.0, 30.0]]
    assert kl_length.axes[1].get_xlim() != (0, 2)  # a step axis: integer_steps (b has one step, a three)
    by_step, by_time = reward.axes
    (la, lb), (ta, tb) = by_step.get_lines(), by_time.get_lines()
    assert list(la.get_xdata()) == [1, 2, 3] and list(la.get_ydata()) == [0.1, 0.2, 0.3]
    assert list(ta.get_xdata()) == [2.0, 4.0, 6.0] and list(tb.get_xdata()) == [1.0]
    assert (la.get_label(), lb.get_label(), la.get_color(), lb.get_color()) == ("a", "b", "C0", "C1")
    # each run its own marker and dash, the later ones smaller and hollow: identical runs stay visible
    assert (la.get_marker(), lb.get_marker(), la.get_linestyle(), lb.get_linestyle()) == ("o", "s", "-", "--")
    assert (la.get_markersize(), lb.get_markersize(), la.get_linewidth()) == (7, 5.5, 1.4)
    assert la.get_markerfacecolor() != "none" and lb.get_markerfacecolor() == "none"
    h_step, h_time = heldout.axes
    (ha,) = h_step.get_lines()
    assert list(ha.get_xdata()) == [0, 3] and list(ha.get_ydata()) == [0.25, 0.5]
    assert list(h_time.get_lines()[0].get_xdata()) == [0.0, 6.0]
    assert [t.get_text() for t in h_step.texts] == []
    (legend,) = reward.legends
    assert [t.get_text() for t in legend.get_texts()] == ["a", "b"] and legend._ncols == 2 and legend._loc == 8
    assert legend.get_texts()[0].get_fontsize() == 8 and not legend.get_frame_on()
    assert by_step.title.get_fontsize() == 10 and by_step.xaxis.get_gridlines()[0].get_alpha() == 0.3
    assert tuple(reward.get_size_inches()) == pytest.approx((10.4, 3.6))
    (kl_a,) = kl_length.axes[0].get_lines()  # b logged no kl: no line, no marker
    assert list(kl_a.get_ydata()) == [0.01, 0.02, 0.03]


def test_a_panel_without_data_says_so_and_the_legend_comes_from_a_panel_that_has_some(tmp_path, figures):
    a = runlog("a", rows=[{"step": 1, "reward_mean": 0.5}], evals=[{"step": 2, "t": 1.0, "value": 0.5}],
               eval_key="eval/reward_mean")
    rep._draw(tmp_path / "x.png", [("empty", "step", lambda r: ([], [])), ("full", "step", lambda r: ([1], [2.0]))],
              [a])
    ((fig, _, _),) = figures
    empty, full = fig.axes
    (text,) = empty.texts
    assert (text.get_text(), text.get_position(), text.get_transform()) == ("no data yet", (0.5, 0.5),
                                                                             empty.transAxes)
    assert (text.get_ha(), text.get_va(), text.get_color()) == ("center", "center", "0.5")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a"] and full.get_xlim() == (0, 2)
    figures.clear()
    rep._draw(tmp_path / "y.png", [("none", "step", lambda r: ([], []))], [a])
    assert figures[0][0].legends == []
    figures.clear()
    rep.write_plots([a, runlog("b", eval_key="eval/accuracy")], tmp_path)
    assert figures[1][0].axes[0].get_title() == "held-out accuracy (or reward_mean) (greedy)"
    figures.clear()
    rep.write_plots([a], tmp_path)
    assert figures[1][0].axes[0].get_title() == "held-out reward_mean (greedy)"
    assert figures[0][0].axes[1].get_xlabel() == "wall-clock seconds (sum of step_time_s)"
    assert [ax.get_title() for ax in figures[2][0].axes] == ["mean completion length (tokens)"]


def test_many_points_have_no_markers_and_many_runs_cycle_their_styles(tmp_path, figures, monkeypatch):
    layouts, tight = [], matplotlib.figure.Figure.tight_layout
    monkeypatch.setattr(matplotlib.figure.Figure, "tight_layout",
                        lambda fig, **k: (layouts.append(k), tight(fig, **k)))
    many = runlog("many", rows=[{"step": s, "reward_mean": 0.5} for s in range(1, 31)])
    few = runlog("few", rows=[{"step": s, "reward_mean": 0.5} for s in range(1, 30)])
    runs = [many, few] + [runlog(f"r{i}", rows=[{"step": 1, "reward_mean": 0.5}]) for i in range(2, 11)]
    rep._draw(tmp_path / "x.png", [("t", "step", lambda r: rep._series(r, "reward_mean"))], runs)
    ((fig, _, _),) = figures
    lines = fig.axes[0].get_lines()
    assert lines[0].get_marker() == "None" and lines[1].get_marker() == "s"
    assert [line.get_marker() for line in lines[7:9]] == ["o", "s"]  # seven markers, then again
    assert [line.get_linestyle() for line in lines[:5]] == ["-", "--", ":", "-.", "-"]
    assert [line.get_color() for line in lines] == [f"C{i % 10}" for i in range(11)]
    assert [line.get_markersize() for line in lines[2:5]] == [4.0, 2.5, 2.5]  # never below 2.5
    assert fig.legends[0]._ncols == 3  # at most three columns
    # the legend's rows (4 for 11 labels, 3 a row) keep the panels clear of it, up to 40% of the figure
    for n in (2, 16):
        rep._draw(tmp_path / "x.png", [("t", "step", lambda r: ([1], [1.0]))], runs[:1] * n)
    rep._draw(tmp_path / "x.png", [("t", "step", lambda r: ([], []))], runs[:1])  # no legend
    assert layouts == [{"rect": (0, 0.32, 1, 1)}, {"rect": (0, 0.08, 1, 1)}, {"rect": (0, 0.4, 1, 1)}, {}]


def test_report_writes_report_md_where_asked_and_main_says_what_it_wrote(tmp_path, capsys, monkeypatch):
    plotted = []  # the plots are the tests' above; here: which runs go to them, and where
    monkeypatch.setattr(rep, "write_plots", lambda runs, out: plotted.append(([r.label for r in runs], out)))
    monkeypatch.setattr(rep.report_eval, "plot", lambda runs, all_series, out: plotted.append(("eval_sets", out)))
    _write(tmp_path / "s" / "a", [{"step": 0, "eval/pass@2": 0.5}, {"step": 1, "reward_mean": 0.5}],
           overrides=["g=2", "x=1"])
    _write(tmp_path / "t" / "b", [{"step": 1, "reward_mean": 0.5}], overrides=["g=4", "x=1"])
    out = tmp_path / "deep" / "out"
    path = report([tmp_path / "s" / "a"], out)
    assert path == out / "report.md" and path.read_text().startswith("# GRPO report: 1 run\n")
    assert plotted == [(["g=2 x=1"], out), ("eval_sets", out)]
    assert "\n| `g=2 x=1` | running | 1 | 0.500 | – | – | n/a | – | 0 s | `../../s/a` |\n" in path.read_text()
    md = report([tmp_path / "s" / "a", tmp_path / "t"], out).read_text()
    assert "Common overrides: `x=1`" in md and plotted[-2:] == [(["g=2", "g=4"], out), ("eval_sets", out)]
    assert report([str(tmp_path / "s")]) == tmp_path / "s" / "report.md"  # one path: into it
    monkeypatch.chdir(tmp_path)
    assert report(["s"]) == Path("s") / "report.md"  # as given
    assert report([tmp_path / "s", tmp_path / "t"]) == tmp_path / "report.md"  # several: their common parent
    rep.main([str(tmp_path / "s"), str(tmp_path / "t"), "--out", str(out)])
    assert capsys.readouterr().out == f"report: {out / 'report.md'} (2 runs; plots: reward.png, heldout.png, " \
                                      "kl_length.png, eval_sets.png)\n"
    rep.main([str(tmp_path / "t")])
    assert capsys.readouterr().out == f"report: {tmp_path / 't' / 'report.md'} (1 run; plots: reward.png, " \
                                      "heldout.png, kl_length.png)\n"
    for bad, says in (([str(tmp_path / "nowhere")], f"error: {tmp_path / 'nowhere'} does not exist"),
                      ([str(out)], f"error: no runs (directories with a metrics.jsonl) under {out}")):
        with pytest.raises(SystemExit) as e:
            rep.main(bad)
        assert e.value.code == 2 and capsys.readouterr().err == says + "\n"
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as e:
        rep.main(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.splitlines() == [
        "usage: grpo-report [-h] [--out OUT] paths [paths ...]", "",
        "Compare GRPO runs: report.md and PNG plots.", "", "positional arguments:",
        "  paths       run directories, sweep directories, or any mix", "", "options:",
        "  -h, --help  show this help message and exit",
        "  --out OUT   where to write report.md and the PNGs (default: the path given, or the common parent of "
        "several)"]
    with pytest.raises(FileNotFoundError, match="no runs"):
        report([out, tmp_path / "deep"])
