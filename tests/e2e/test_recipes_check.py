"""`make recipes-check` (scripts/recipes_check.py), scaled down: a CPU recipe runs its first step and checkpoint with
its peak memory and s/step; GPU / multi-process recipes are composed and validated without running."""
import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_recipes_check_runs_cpu_recipes_and_dry_runs_the_rest(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "scripts/recipes_check.py", "--recipes", "smoke,qwen-gsm8k,zero3-multi",
                        "--out", str(tmp_path / "runs"), "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {row["recipe"]: row for row in json.loads(out.read_text())}
    smoke = rows["smoke"]
    assert smoke["mode"] == "run" and smoke["ok"] and smoke["checkpoint"]
    assert smoke["peak_rss_mib"] > 100 and smoke["s_per_step"] > 0
    assert (tmp_path / "runs" / "smoke" / "final").is_dir()
    for name in ("qwen-gsm8k", "zero3-multi"):
        assert rows[name]["mode"] == "dry-run" and "launcher" in rows[name]["needs"] and "GPU" in rows[name]["needs"]
        assert not (tmp_path / "runs" / name).exists()  # composed and validated, never started
    table = r.stdout.split("\n\n")[-1]
    assert "peak MiB" in table and "s/step" in table and "smoke" in table


def test_a_failing_recipe_is_reported_and_fails_the_check(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "scripts/recipes_check.py", "--recipes", "smoke", "--out",
                        str(tmp_path / "runs"), "--json", str(out), "engine.max_tokens_per_micro_batch=8"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1
    row = json.loads(out.read_text())[0]
    assert not row["ok"] and "engine.max_tokens_per_micro_batch=8 is smaller" in row["error"]
