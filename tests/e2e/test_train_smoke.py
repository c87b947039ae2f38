"""End to end: the smoke recipe through the real command line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REQUIRED = {"step", "loss", "reward_mean", "reward_std", "kl", "clip_ratio", "completion_len_mean", "step_time_s",
            "reward/accuracy", "reward/format"}


def run_cli(tmp_path, *args, timeout=300):
    p = subprocess.run([sys.executable, "-m", "grpo.train", "recipe=smoke", *args], capture_output=True, text=True,
                       cwd=tmp_path, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def read(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_smoke_run_writes_metrics_trains_and_saves_a_loadable_model(tmp_path):
    out = tmp_path / "run"
    p = run_cli(tmp_path, f"trainer.output_dir={out}", "trainer.max_steps=3", "trainer.save_every=2",
                "algorithm.beta=0.1")
    rows = [r for r in read(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["completion_len_mean"] > 0 and r["step_time_s"] > 0
    # training changes the weights: the KL to the reference grows from 0
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1
    assert rows[-1]["kl"] > 0
    assert all(r["grad_norm"] > 0 for r in rows)
    assert (out / "checkpoints" / "step_2" / "COMPLETE").exists()
    assert (out / "checkpoints" / "step_3" / "COMPLETE").exists()
    assert "held-out accuracy" in p.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    ids = tok("What is 1 + 2?", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()


def test_console_script_with_a_reward_from_outside_the_project(tmp_path):
    """The user's module sits in the working directory and is named only on the command line."""
    import shutil

    (tmp_path / "outside_rewards.py").write_text(
        "def likes_digits(prompts, completions, answer, **columns):\n"
        "    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]\n")
    exe = shutil.which("grpo-train") or str(Path(sys.executable).parent / "grpo-train")
    out = tmp_path / "run"
    p = subprocess.run([exe, "recipe=smoke", f"trainer.output_dir={out}", "trainer.max_steps=2",
                        "+reward.functions.mine.fn=outside_rewards:likes_digits", "+reward.functions.mine.weight=2.0",
                        "~reward.functions.format"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [r for r in read(out / "metrics.jsonl") if "loss" in r]
    assert all("reward/mine" in r and "reward/format" not in r for r in rows)
    assert any(r["reward/mine"] > 0 for r in rows)
