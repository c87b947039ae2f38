"""Compare runs: ``grpo-report <run or sweep dir>... [--out DIR]``.

Finds every run (a directory holding ``metrics.jsonl``) under the given paths — one run, a Hydra
sweep, or several of either — and writes ``report.md`` and PNG plots into ``--out``:

- ``reward.png``: training reward_mean against step and against wall-clock time;
- ``heldout.png``: held-out accuracy (``eval/accuracy``, else ``eval/reward_mean``) against step and time;
- ``kl_length.png``: KL to the reference and mean completion length against step;
- a table of final metrics, one row per run;
- with sampled evaluation or named evaluation sets (evaluation.*): ``eval_sets.png`` (pass@k, maj@k, mean@n and
  accuracy of each set against step) and a table of them before training and at the last evaluation.

Wall-clock time is the cumulative ``step_time_s`` (training steps only; held-out evaluation is not
counted). Runs still going (a half-written last line, no ``final/`` yet) are read as far as they got.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grpo.trainer import report_eval
from grpo.trainer.logger import integer_steps, read_metrics

PLOTS = ("reward.png", "heldout.png", "kl_length.png")
_SKIP_DIRS = {"final", "checkpoints", ".hydra", ".tmp-final", "wandb", "__pycache__"}


@dataclass
class RunLog:
    path: Path
    overrides: list[str]
    rows: list[dict]                      # training steps (lines with reward_mean), in step order
    evals: list[dict]                     # lines with held-out metrics: {"step", "t", "value"}
    eval_key: str | None                  # eval/accuracy or eval/reward_mean
    finished: bool
    max_steps: int | None = None
    label: str = ""
    times: list[float] = field(default_factory=list)  # cumulative step_time_s after each row

    def _steps_done(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0

    # a property by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
    steps_done = property(_steps_done)


# ------------------------------------------------------------------------------------ discovery
def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Every directory with a metrics.jsonl at or under ``paths``: in the order the paths are given,
    natural order (``2_...`` before ``10_...``) within each, without duplicates."""
    found: dict[Path, None] = {}
    for p in map(Path, paths):
        here = []
        for dirpath, dirnames, filenames in os.walk(p):  # a run given itself is the walk's first directory
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            if "metrics.jsonl" in filenames:
                here.append(Path(dirpath).resolve())
                dirnames[:] = []          # a run does not contain other runs
        for d in sorted(here, key=_natural):
            found.setdefault(d, None)
    return list(found)


def _overrides(run_dir: Path) -> list[str]:
    f = run_dir / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return []
    try:
        from omegaconf import OmegaConf

        items = OmegaConf.to_container(OmegaConf.load(f))
    except Exception:
        return []
    return [str(o) for o in items or [] if not str(o).lstrip("+~").startswith(("hydra.", "trainer.output_dir="))]


def _max_steps(run_dir: Path) -> int | None:
    f = run_dir / ".hydra" / "config.yaml"
    if not f.is_file():
        return None
    try:
        from omegaconf import OmegaConf

        v = OmegaConf.load(f).trainer.max_steps
        return int(v)
    except Exception:
        return None


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def load_run(run_dir: Path) -> RunLog:
    lines = read_metrics(run_dir / "metrics.jsonl")
    by_step: dict[int, dict] = {}
    for m in lines:
        if "reward_mean" in m and isinstance(m.get("step"), int):
            by_step[m["step"]] = m             # a resumed run may have rewritten a step; keep the last
    rows = [by_step[s] for s in sorted(by_step)]
    times, t = [], 0.0
    for m in rows:
        t += _num(m.get("step_time_s")) or 0.0
        times.append(t)
    keys = {k for m in lines for k in m if k.startswith("eval/")}
    eval_key = next((k for k in ("eval/accuracy", "eval/reward_mean") if k in keys), None)
    evals: dict[int, dict] = {}
    if eval_key:
        for m in lines:
            v, step = _num(m.get(eval_key)), m.get("step")
            if v is None or not isinstance(step, int):
                continue
            done = [tt for r, tt in zip(rows, times) if r["step"] <= step]
            evals[step] = {"step": step, "t": done[-1] if done else 0.0, "value": v}
    return RunLog(path=run_dir, overrides=_overrides(run_dir), rows=rows, evals=[evals[s] for s in sorted(evals)],
               eval_key=eval_key, finished=(run_dir / "final").is_dir(), max_steps=_max_steps(run_dir), times=times)


def _label_runs(runs: list[RunLog]) -> list[str]:
    """Short labels: the overrides in which runs differ (the common ones go above the table)."""
    common = set.intersection(*(set(r.overrides) for r in runs)) if runs else set()
    if len(runs) == 1:
        common = set()
    labels = []
    for r in runs:
        own = [o for o in r.overrides if o not in common]
        labels.append(" ".join(own) if own else r.path.name)
    # identical labels (the same override in two sweeps): add the sweep directory to each of them
    shared = {lab for lab in labels if labels.count(lab) > 1}
    labels = [f"{lab} [{r.path.parent.name}/{r.path.name}]" if lab in shared else lab for r, lab in zip(runs, labels)]
    for r, lab in zip(runs, labels):
        r.label = lab
    return [o for o in runs[0].overrides if o in common] if runs else []


# ---------------------------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _time_unit(runs: list[RunLog]) -> tuple[str, float]:
    """(name, seconds per unit) that keeps the wall-clock axis readable."""
    longest = max((r.times[-1] for r in runs if r.times), default=0.0)
    if longest < 180:
        return "seconds", 1.0
    if longest < 3 * 3600:
        return "minutes", 60.0
    return "hours", 3600.0


def _series(run: RunLog, key: str, unit: float | None = None) -> tuple[list[float], list[float]]:
    """(steps, values) of a training metric, or (wall-clock / unit, values) when ``unit`` is given."""
    xs, ys = [], []
    for m, t in zip(run.rows, run.times):
        v = _num(m.get(key))
        if v is not None:
            xs.append(m["step"] if unit is None else t / unit)
            ys.append(v)
    return xs, ys


_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_DASHES = ("-", "--", ":", "-.")


def _draw(path: Path, panels: list[tuple[str, str, object]], runs: list[RunLog]) -> None:
    """One figure, one panel per (title, x label, fn(run) -> (xs, ys)), one line per run."""
    plt = _plt()

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
    for ax, (title, xlabel, get) in zip(axes[0], panels):
        drawn, all_x = False, []
        for i, run in enumerate(runs):
            xs, ys = get(run)
            if xs:
                # each run its own marker and dash, later ones smaller: identical runs stay visible
                ax.plot(xs, ys, marker=_MARKERS[i % len(_MARKERS)] if len(xs) < 30 else None,
                        ms=max(7 - 1.5 * i, 2.5), mfc="none" if i else None, lw=1.4,
                        ls=_DASHES[i % len(_DASHES)], color=f"C{i % 10}", label=run.label)
                drawn, all_x = True, all_x + list(xs)
        if not drawn:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="0.5")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        if xlabel == "step":
            integer_steps(ax, all_x)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if not handles:
        for ax in axes[0][1:]:
            handles, labels = ax.get_legend_handles_labels()
            if handles:
                break
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
        rows = -(-len(labels) // 3)
        fig.tight_layout(rect=(0, min(0.08 * rows, 0.4), 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(runs: list[RunLog], out: Path) -> list[str]:
    ekeys = {r.eval_key for r in runs if r.eval_key}
    ename = "accuracy" if ekeys == {"eval/accuracy"} else ("reward_mean" if ekeys == {"eval/reward_mean"}
                                                          else "accuracy (or reward_mean)")

    uname, unit = _time_unit(runs)
    tlabel = f"wall-clock {uname} (sum of step_time_s)"

    def ev(u):
        return lambda r: ([e["step"] if u is None else e["t"] / u for e in r.evals], [e["value"] for e in r.evals])

    _draw(out / "reward.png", [("training reward_mean", "step", lambda r: _series(r, "reward_mean")),
                               ("training reward_mean", tlabel, lambda r: _series(r, "reward_mean", unit))], runs)
    _draw(out / "heldout.png", [(f"held-out {ename} (greedy)", "step", ev(None)),
                                (f"held-out {ename} (greedy)", tlabel, ev(unit))], runs)
    length = ("mean completion length (tokens)", "step", lambda r: _series(r, "completion_len_mean"))
    kl = ("KL to the reference", "step", lambda r: _series(r, "kl"))
    # beta = 0 everywhere: there is no reference, so no KL panel (a line at 0 would claim a measurement)
    _draw(out / "kl_length.png", [kl, length] if any(_series(r, "kl")[0] for r in runs) else [length], runs)
    return list(PLOTS)


# -------------------------------------------------------------------------------------- markdown
def _fmt(v, spec: str = ".3f") -> str:
    return "–" if v is None else format(v, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 3 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def table(runs: list[RunLog], out: Path) -> list[str]:
    lines = ["| run | status | steps | final reward_mean | held-out before | held-out after | final kl "
             "| mean s/step | wall-clock | directory |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        last = r.rows[-1] if r.rows else {}
        before = next((e for e in r.evals if e["step"] == 0), None)
        later = [e for e in r.evals if e["step"] > 0]
        after = later[-1] if later else None
        after_s = _fmt(after and after["value"])
        if after and not (r.finished and after["step"] >= r.steps_done):
            after_s += f" (step {after['step']})"
        if r.eval_key and r.eval_key != "eval/accuracy":
            after_s += " ¹"
        step_times = [v for v in (_num(m.get("step_time_s")) for m in r.rows) if v is not None]
        mean_t = sum(step_times) / len(step_times) if step_times else None
        steps = f"{r.steps_done}/{r.max_steps}" if r.max_steps is not None else str(r.steps_done)
        total = r.times[-1] if r.times else None
        try:
            rel = os.path.relpath(r.path, out)
        except ValueError:  # another drive (Windows)
            rel = str(r.path)
        lines.append("| " + " | ".join([
            f"`{_cell(r.label)}`", "finished" if r.finished else "running", steps,
            _fmt(_num(last.get("reward_mean"))), _fmt(before and before["value"]), after_s,
            _fmt(_num(last.get("kl")), ".4f") if _series(r, "kl")[0] else "n/a", _fmt(mean_t, ".2f"),
            _duration(total), f"`{_cell(rel)}`"]) + " |")
    return lines


def render(runs: list[RunLog], out: Path, common: list[str]) -> str:
    ekeys = {r.eval_key for r in runs if r.eval_key}
    running = sum(not r.finished for r in runs)
    md = [f"# GRPO report: {len(runs)} run{'s' if len(runs) != 1 else ''}", ""]
    if common:
        md += ["Common overrides: " + " ".join(f"`{o}`" for o in common), ""]
    if running:
        md += [f"{running} run{'s are' if running > 1 else ' is'} not finished (no `final/` yet: still going, "
               f"or stopped before the end); {'their' if running > 1 else 'its'} numbers are as far as "
               f"{'they' if running > 1 else 'it'} got.", ""]
    md += ["## Final metrics", ""]
    md += table(runs, out)
    md += ["", "*held-out*: greedy " + ("accuracy" if ekeys <= {"eval/accuracy"} else "accuracy (`eval/accuracy`)")
           + " on the held-out prompts, before training (step 0) and after the last step; "
           "*wall-clock*: the sum of `step_time_s` (held-out evaluation not included); *final kl*: n/a for a run "
           "without a reference model (`algorithm.beta=0`)."]
    if any(r.eval_key == "eval/reward_mean" for r in runs):
        md += ["¹ this run has no reward named `accuracy`; its held-out column is `eval/reward_mean`."]
    has_kl = any(_series(r, "kl")[0] for r in runs)
    md += ["", "## Reward", "", "![reward](reward.png)", "",
           "## Held-out accuracy", "", "![held-out](heldout.png)", "",
           "## KL and completion length" if has_kl else "## Completion length", "",
           "![kl and length](kl_length.png)" if has_kl else
           "![completion length](kl_length.png) (no KL panel: no run has a reference model, `algorithm.beta=0`)", ""]
    md += report_eval.section(runs, out)  # sampled metrics and named evaluation sets: eval_sets.png and a table
    return "\n".join(md)


def report(paths: list[str | Path], out: str | Path | None = None) -> Path:
    """Write report.md and the plots; returns the path of report.md. Raises FileNotFoundError without runs."""
    paths = [Path(p) for p in paths]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{missing[0]} does not exist")
    dirs = find_runs(paths)
    if not dirs:
        raise FileNotFoundError(f"no runs (directories with a metrics.jsonl) under {', '.join(map(str, paths))}")
    if out is None:
        out = paths[0] if len(paths) == 1 else Path(os.path.commonpath([p.resolve() for p in paths]))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [load_run(d) for d in dirs]
    common = _label_runs(runs)
    write_plots(runs, out)
    path = out / "report.md"
    path.write_text(render(runs, out.resolve(), common))
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="grpo-report", description="Compare GRPO runs: report.md and PNG plots.")
    ap.add_argument("paths", nargs="+", help="run directories, sweep directories, or any mix")
    ap.add_argument("--out", default=None, help="where to write report.md and the PNGs "
                                                "(default: the path given, or the common parent of several)")
    args = ap.parse_args(argv)
    try:
        path = report(args.paths, args.out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    n = len(find_runs(args.paths))
    plots = [*PLOTS, *([report_eval.PLOT] if f"]({report_eval.PLOT})" in path.read_text() else [])]
    print(f"report: {path} ({n} run{'s' if n != 1 else ''}; plots: {', '.join(plots)})")


if __name__ == "__main__":
    main()
