"""grpo-report: a real 2-run sweep of the smoke recipe, a still-running run, and a mix of both."""
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
