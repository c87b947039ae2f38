"""scripts/bench_prefix_scaling.py (part of make bench-prefix): the plan, the memory cap, one real measurement per
layout on a tiny model, the table and the plot."""
import subprocess
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_prefix_scaling as bs  # noqa: E402

SCRIPT = ROOT / "scripts" / "bench_prefix_scaling.py"


def test_dry_run_plans_the_grid_without_running():
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, check=True,
                       timeout=120)
    assert p.stdout.startswith("# plan: 27 runs, layouts standard, shared, shared+ckpt, P (512, 2048, 8192), "
                               "G (4, 16, 64), S 256, cap 8.0 GiB")
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(rows) == 9 and all(ln.count("planned") == 6 for ln in rows)
    # the FLOP ceiling column is standard / shared FLOPs of the model in scripts/bench_prefix.py
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_prefix import TINY_LLAMA, ceilings

    cells = [c.strip() for c in rows[-1].strip("|").split("|")]
    assert cells[:4] == ["8192", "256", "64", "540672 / 24576"]
    assert cells[8] == f"{ceilings(TINY_LLAMA, 8192, 256, 64)['combined']:.2f}x"


def test_runs_predicted_over_the_cap_are_skipped(monkeypatch):
    calls = []

    def worker(job, max_gib):  # 1 MiB per token: the cap of 0.05 GiB (51 MiB) allows 51 tokens
        calls.append((job["layout"], job["P"], job["G"]))
        return {"cpu_s": 1.0, "peak_mib": float(bs.tokens(job["layout"], job["P"], job["S"], job["G"]))}

    monkeypatch.setattr(bs, "run_worker", worker)
    grid = dict(P=(8, 16), G=(2, 8), S=2)
    runs = bs.plan(grid, ("standard", "shared"))
    res = bs.run_all(bs.QUICK_LLAMA, runs, max_gib=0.05, dry=False)
    # standard with G=8: 80 and 144 tokens, the only runs over 51
    assert [r for r in runs if "skipped" in res[r]] == [("standard", 8, 2, 8), ("standard", 16, 2, 8)]
    assert res[("standard", 16, 2, 8)]["skipped"] == pytest.approx(144 / 1024)
    assert len(calls) == 6 and calls[0] == ("standard", 8, 2)  # smallest first: it sets the bytes per token


@pytest.mark.parametrize("layout", bs.LAYOUTS)
def test_measure_one_step(layout):
    got = bs.measure(bs.QUICK_LLAMA, layout, 16, 8, 2)
    assert got["cpu_s"] > 0 and got["peak_mib"] >= 0


def test_table_and_plot_from_measurements(tmp_path):
    grid = dict(P=(8, 16), G=(2,), S=4)
    layouts = ("standard", "shared")
    res = {run: bs.measure(bs.QUICK_LLAMA, *run) for run in bs.plan(grid, layouts)}
    text = bs.table(bs.QUICK_LLAMA, grid, res, layouts)
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(rows) == 2
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    std, shared = res[("standard", 8, 4, 2)]["cpu_s"], res[("shared", 8, 4, 2)]["cpu_s"]
    assert cells[6] == f"{std / shared:.2f}x"
    assert "FLOP model: analytic FLOPs x 3" in text
    png = tmp_path / "p.png"
    assert bs.plot(bs.QUICK_LLAMA, grid, res, layouts, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
