"""grpo/trainer/report_eval.py: grpo-report's evaluation sets: the series read from metrics.jsonl, the table of
before -> last, the plot's panels and lines (savefig replaced: no PNG is written), and when the section appears."""
import json
from pathlib import Path
from types import SimpleNamespace

import matplotlib.figure  # imported at collection: every `make mutate` mutant's run is forked after it
import matplotlib.pyplot  # noqa: F401
import pytest

from grpo.trainer import report_eval


def run(tmp_path: Path, name: str, lines: list[dict], tail: str = "") -> SimpleNamespace:
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + tail)
    return SimpleNamespace(path=d, label=name)


@pytest.fixture
def figures(monkeypatch):
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **k: saved.append((fig, path, k)))
    return saved


def test_the_series_of_each_set_keep_the_at_k_metrics_and_accuracy_in_their_order(tmp_path):
    r = run(tmp_path, "a", [
        {"step": 0, "eval/accuracy": 0.5, "eval/pass@4": 0.75, "eval/maj@4": 0.5, "eval/mean@4": 1,
         "eval/pass@16": 0.9, "eval/reward_mean": 0.3, "eval/gsm8k/pass@2": 0.25, "eval/gsm8k/reward/format": 1.0},
        {"step": 1, "reward_mean": 0.2, "loss": 0.1, "eval_like": 3.0},
        {"step": 2, "eval/accuracy": 0.6, "eval/pass@4": float("nan"), "eval/gsm8k/pass@2": True,
         "eval/maj@4": "0.9", "eval/mean@4": None},
        {"step": "3", "eval/accuracy": 0.9}, {"eval/accuracy": 0.1},  # no integer step: not a point
        {"step": 2, "eval/accuracy": 0.7},  # the same step again (a resume): the last value
        {"step": 1, "eval/gsm8k/pass@2": 0.5}], tail='{"step": 4, "eval/accu')
    got = report_eval.series(r.path)
    assert got == {"held-out": {"accuracy": [(0, 0.5), (2, 0.7)], "mean@4": [(0, 1.0)], "pass@4": [(0, 0.75)],
                                "pass@16": [(0, 0.9)], "maj@4": [(0, 0.5)]},
                   "gsm8k": {"pass@2": [(0, 0.25), (1, 0.5)]}}
    assert list(got["held-out"]) == ["accuracy", "mean@4", "pass@4", "pass@16", "maj@4"]
    assert type(got["held-out"]["mean@4"][0][1]) is float
    assert report_eval.series(run(tmp_path, "none", [{"step": 0, "eval/x": 1.0}]).path) == {}


def test_a_set_named_like_a_metric_and_metrics_like_at_k():
    assert report_eval._AT.match("pass@12") and not report_eval._AT.match("pass@k")
    assert not report_eval._AT.match("xpass@1") and not report_eval._AT.match("pass@1x")
    assert sorted(["maj@2", "pass@10", "accuracy", "pass@2", "mean@3"], key=report_eval._order) == [
        "accuracy", "mean@3", "pass@2", "pass@10", "maj@2"]


def test_sampled_is_any_at_k_metric_of_any_run():
    assert not report_eval.sampled([{"held-out": {"accuracy": []}}, {}])
    assert report_eval.sampled([{"held-out": {"accuracy": []}}, {"s": {"maj@2": []}}])
    assert not report_eval.sampled([])


def test_the_table_shows_each_run_and_set_before_and_at_the_last_evaluation():
    runs = [SimpleNamespace(label="a"), SimpleNamespace(label="b")]
    all_series = [{"held-out": {"accuracy": [(0, 0.5), (2, 0.625), (4, 0.75)], "pass@2": [(3, 0.8)]},
                   "gsm8k": {"maj@2": [(0, 0.25)]}},
                  {"held-out": {"accuracy": [(1, 0.1)], "mean@2": [(0, 0.2), (5, 0.3)]}}]
    assert report_eval.table(runs, all_series) == [
        "| run | set | accuracy | mean@2 | pass@2 | maj@2 |",
        "|---|---|---|---|---|---|",
        "| `a` | held-out | 0.500 → 0.750 | – → – | – → 0.800 | – → – |",
        "| `a` | gsm8k | – → – | – → – | – → – | 0.250 → – |",  # only step 0: nothing after training
        "| `b` | held-out | – → 0.100 | 0.200 → 0.300 | – → – | – → – |"]


def test_no_section_when_every_run_evaluated_greedily_on_the_held_out_split_only(tmp_path, figures):
    greedy = run(tmp_path, "g", [{"step": 0, "eval/accuracy": 0.5}, {"step": 2, "eval/accuracy": 0.6}])
    assert report_eval.section([greedy], tmp_path) == [] and figures == []


def test_the_section_and_its_plot(tmp_path, figures):
    a = run(tmp_path, "a", [{"step": 0, "eval/pass@2": 0.5, "eval/accuracy": 0.25},
                            {"step": 3, "eval/pass@2": 0.75, "eval/accuracy": 0.5}])
    b = run(tmp_path, "b", [{"step": 0, "eval/math/accuracy": 0.125}, {"step": 3, "eval/math/accuracy": 0.375}])
    md = report_eval.section([a, b], tmp_path)
    assert md == [
        "## Evaluation sets", "",
        "Each set's sampled metrics (evaluation.n samples per prompt: mean@n, pass@k with the unbiased estimator, "
        "maj@k by majority vote; docs/evaluation.md) and its accuracy, before training (step 0) → at the last "
        "evaluation.", "",
        "| run | set | accuracy | pass@2 |", "|---|---|---|---|",
        "| `a` | held-out | 0.250 → 0.500 | 0.500 → 0.750 |",
        "| `b` | math | 0.125 → 0.375 | – → – |", "",
        "![evaluation sets](eval_sets.png)", ""]
    ((fig, path, kwargs),) = figures
    assert path == tmp_path / "eval_sets.png" and kwargs == {"dpi": 110}
    held, math_ = fig.axes[:2]
    assert len(fig.axes) == 2 and [held.get_title(), math_.get_title()] == ["held-out", "math"]
    assert held.get_xlabel() == math_.get_xlabel() == "step"
    lines = {line.get_label(): line for ax in (held, math_) for line in ax.get_lines()}
    assert set(lines) == {"accuracy a", "pass@2 a", "accuracy b"}  # several runs: the run in every label
    acc_a, acc_b, pass_a = lines["accuracy a"], lines["accuracy b"], lines["pass@2 a"]
    assert list(acc_a.get_xdata()) == [0, 3] and list(acc_a.get_ydata()) == [0.25, 0.5]
    assert list(acc_b.get_ydata()) == [0.125, 0.375]
    # a colour per metric (the same in every panel), a dash per run
    assert acc_a.get_color() == acc_b.get_color() == "C0" and pass_a.get_color() == "C1"
    assert (acc_a.get_linestyle(), pass_a.get_linestyle(), acc_b.get_linestyle()) == ("-", "-", "--")
    assert (acc_a.get_marker(), acc_a.get_markersize(), acc_a.get_linewidth()) == ("o", 4, 1.3)
    assert [t.get_text() for t in held.get_legend().get_texts()] == ["accuracy a", "pass@2 a"]
    assert held.get_legend().get_texts()[0].get_fontsize() == 7 and not held.get_legend().get_frame_on()
    assert held.title.get_fontsize() == 10 and held.xaxis.get_gridlines()[0].get_alpha() == 0.3
    assert tuple(fig.get_size_inches()) == pytest.approx((10.4, 3.8))


def test_one_run_labels_its_lines_by_metric_and_a_single_step_has_whole_ticks(tmp_path, figures):
    one = run(tmp_path, "solo", [{"step": 5, "eval/maj@4": 0.5}])
    report_eval.section([one], tmp_path)
    ((fig, _, _),) = figures
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.get_lines()] == ["maj@4"]
    assert ax.get_xlim() == (4, 6)  # integer_steps: one step gets a span around it
    assert tuple(fig.get_size_inches()) == pytest.approx((5.2, 3.8))
    figures.clear()
    report_eval.section([run(tmp_path, "two", [{"step": 0, "eval/accuracy": 0.5},
                                               {"step": 3, "eval/accuracy": 0.6, "eval/maj@4": 0.5}])], tmp_path)
    assert figures[0][0].axes[0].get_xlim() != (2, 4)  # the panel's steps are every metric's, not the last one's


def test_colours_and_dashes_cycle(tmp_path, figures):
    metrics = [f"pass@{k}" for k in range(1, 12)]
    runs = [run(tmp_path, "r0", [{"step": 1, **{f"eval/{m}": 0.5 for m in metrics}}])]
    runs += [run(tmp_path, f"r{i}", [{"step": 1, "eval/pass@1": 0.5}]) for i in range(1, 5)]
    report_eval.section(runs, tmp_path)
    ((fig, _, _),) = figures
    lines = fig.axes[0].get_lines()
    assert [line.get_color() for line in lines[:11]] == [f"C{i % 10}" for i in range(11)]
    assert [line.get_linestyle() for line in lines[10:]] == ["-", "--", ":", "-.", "-"]
