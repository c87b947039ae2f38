"""The evaluation part of ``grpo-report``: every evaluated set of every run (the held-out split, each of
evaluation.sets) with its sampled metrics (pass@k, maj@k, mean@n) and its headline reward, as ``eval_sets.png`` (one
panel per set, against step) and a table of the values before training and at the last evaluation."""
from __future__ import annotations

import math
import re
from pathlib import Path

from grpo.trainer.logger import integer_steps, read_metrics

PLOT = "eval_sets.png"
HELD_OUT = "held-out"
_AT = re.compile(r"^(pass|maj|mean)@\d+$")
_DASHES = ("-", "--", ":", "-.")  # one per run


def series(run_dir: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{set: {metric: [(step, value)]}} of a run's metrics.jsonl: ``eval/<metric>`` is the held-out split's,
    ``eval/<set>/<metric>`` a named set's; the metrics kept are the @k ones and ``accuracy``."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for m in read_metrics(run_dir / "metrics.jsonl"):
        step = m.get("step")
        for key, v in m.items():
            if not key.startswith("eval/") or not isinstance(step, int):
                continue
            name, _, metric = key[len("eval/"):].rpartition("/")
            if not (_AT.match(metric) or metric == "accuracy") or not _finite(v):
                continue
            out.setdefault(name or HELD_OUT, {}).setdefault(metric, {})[step] = float(v)
    return {s: {k: sorted(v.items()) for k, v in sorted(ms.items(), key=lambda kv: _order(kv[0]))}
            for s, ms in out.items()}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _order(metric: str) -> tuple:
    kind, _, k = metric.partition("@")
    return ({"accuracy": 0, "mean": 1, "pass": 2, "maj": 3}[kind], int(k or 0))


def sampled(all_series: list[dict]) -> bool:
    """Whether any run logged a sampled metric (a greedy run's held-out accuracy is heldout.png's already)."""
    return any(_AT.match(k) for s in all_series for ms in s.values() for k in ms)


def plot(runs: list, all_series: list[dict], out: Path) -> None:
    """``runs``: the report's runs (their labels); one panel per set, a colour per metric, a dash per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(s for ser in all_series for s in ser))
    fig, axes = plt.subplots(1, len(sets), figsize=(5.2 * len(sets), 3.8), squeeze=False)
    colours: dict[str, str] = {}
    for ax, name in zip(axes[0], sets):
        steps = []
        for i, (run, ser) in enumerate(zip(runs, all_series)):
            for metric, pts in ser.get(name, {}).items():
                colour = colours.setdefault(metric, f"C{len(colours) % 10}")
                label = metric if len(runs) == 1 else f"{metric} {run.label}"
                ax.plot(*zip(*pts), marker="o", ms=4, lw=1.3, ls=_DASHES[i % len(_DASHES)], color=colour, label=label)
                steps += [p[0] for p in pts]
        ax.set_title(f"{name}", fontsize=10)
        ax.set_xlabel("step")
        integer_steps(ax, steps)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(out / PLOT, dpi=110)
    plt.close(fig)


def table(runs: list, all_series: list[dict]) -> list[str]:
    """One row per run and set: each metric as ``before → last`` (the evaluation at step 0 and the last one)."""
    metrics = sorted({k for ser in all_series for ms in ser.values() for k in ms}, key=_order)
    lines = ["| run | set | " + " | ".join(metrics) + " |", "|---|---|" + "---|" * len(metrics)]
    for run, ser in zip(runs, all_series):
        for name, ms in ser.items():
            cells = []
            for k in metrics:
                pts = ms.get(k, [])
                first = next((v for s, v in pts if s == 0), None)
                last = pts[-1] if pts and pts[-1][0] > 0 else None
                cells.append(("–" if first is None else f"{first:.3f}") + " → "
                             + ("–" if last is None else f"{last[1]:.3f}"))
            lines.append(f"| `{run.label}` | {name} | " + " | ".join(cells) + " |")
    return lines


def section(runs: list, out: Path) -> list[str]:
    """The report's "Evaluation sets" section (and its plot), or nothing when every run evaluated greedily."""
    all_series = [series(r.path) for r in runs]
    if not sampled(all_series) and all(set(s) <= {HELD_OUT} for s in all_series):
        return []
    plot(runs, all_series, out)
    return ["## Evaluation sets", "",
            "Each set's sampled metrics (evaluation.n samples per prompt: mean@n, pass@k with the unbiased estimator, "
            "maj@k by majority vote; docs/evaluation.md) and its accuracy, before training (step 0) → at the last "
            "evaluation.", "", *table(runs, all_series), "", f"![evaluation sets]({PLOT})", ""]
