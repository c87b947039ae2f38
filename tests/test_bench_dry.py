"""scripts/bench_trl.py (make bench) without TRL: the plan, and one quick run of this framework's whole step."""
import json
import subprocess
import sys

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "bench_trl.py"


def test_bench_dry_run_plans_interleaved_runs():
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--repeats", "2"], capture_output=True, text=True,
                       check=True)
    lines = [ln.split() for ln in p.stdout.splitlines() if ln.startswith("  ")]
    assert len(lines) == 2 * 2 * 2 * 3  # models x shapes x repeats x systems
    assert [ln[-1] for ln in lines[:6]] == ["ours", "ours-noshare", "trl"] * 2  # interleaved A B C A B C
    assert {tuple(ln[1:4]) for ln in lines} == {("P=64", "S=64", "G=8"), ("P=1024", "S=32", "G=8")}


def test_bench_gpu_script_dry_run():
    p = subprocess.run(["bash", str(ROOT / "scripts" / "bench_gpu.sh"), "--dry-run"], capture_output=True,
                       text=True, check=True, env={"PATH": "/usr/bin:/bin", "BENCH_PY": sys.executable})
    assert "cuda, bfloat16" in p.stdout and "qwen05" in p.stdout and p.stdout.count("trl") == 4
    p = subprocess.run(["bash", str(ROOT / "scripts" / "bench_gpu.sh"), "--dry-run", "prefix"], capture_output=True,
                       text=True, check=True, env={"PATH": "/usr/bin:/bin", "BENCH_PY": sys.executable})
    kernels = [ln.split("--kernel ")[1].split()[0] for ln in p.stdout.splitlines()]
    assert kernels == ["flex", "grouped"] and p.stdout.count("--device cuda --dtype bfloat16") == 2


def test_bench_quick_ours_whole_step(tmp_path):
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--systems", "ours,ours-noshare", "--python",
                        sys.executable, "--peak-tflops", "1", "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())["results"]["quick/16x8x4"]
    for system in ("ours", "ours-noshare"):
        (run,) = res["runs"][system]
        assert run["completion_tokens"] == [2 * 4 * 8]  # 2 prompts x G=4, exactly S=8 tokens each
        assert run["step_s"][0] > 0 and run["peak_rss_mib"] > 0
        assert res["summary"][system]["mfu"] > 0
    assert "| quick | 16 | 8 | 4 | ours |" in p.stdout
