"""scripts/bench_vision.py (docs/benchmarks.md, "Vision-language"): one measurement per layout at the --quick
shape, in this process: the standard layout sends the picture through the tower G times, the shared once, both give
the same log-probs; the table alternates fresh workers and reports both layouts. Behaviour, never speed."""
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_vision as bv  # noqa: E402


@pytest.fixture(scope="module")
def measured():
    return {layout: bv.measure(bv.QUICK, layout) for layout in bv.LAYOUTS}


def test_the_tower_runs_once_per_group_in_the_shared_layout_only(measured):
    assert measured["standard"]["images_encoded"] == bv.QUICK["G"]
    assert measured["shared"]["images_encoded"] == 1
    # a 56x56 picture on 14-pixel patches merged 2x2: 4 image tokens in the prompt, in both layouts
    assert measured["standard"]["prompt_tokens"] == measured["shared"]["prompt_tokens"]
    assert measured["shared"]["logp_sum"] == pytest.approx(measured["standard"]["logp_sum"], abs=1e-4)
    assert all(m["cpu_s"] >= 0 and m["peak_mib"] >= 0 for m in measured.values())


def test_the_layouts_alternate_and_the_table_reports_both(monkeypatch, measured, capsys):
    order = []

    def worker(spec, layout):  # the measurements above stand in for fresh workers
        order.append(layout)
        return measured[layout]

    monkeypatch.setattr(bv, "run_worker", worker)
    assert bv.main(["--quick", "--repeats", "3"]) == 0
    assert order == ["standard", "shared", "shared", "standard", "standard", "shared"]
    out = capsys.readouterr().out
    assert out.startswith("# load average before: ") and "# load average after: " in out
    assert "| standard | 2 |" in out and "| shared | 1 |" in out and "| standard / shared |" in out
    assert "1 picture of 56x56" in out and "median of 3 fresh processes per layout" in out
