"""Multi-turn episodes through the real command line: a 2-step smoke run with a plain-text environment, and a bad
tool path refused at start with one line."""
import json
import subprocess
import sys

import pytest

ENV = '''
class Steps:
    """Answers each turn with an observation; the third turn ends the episode. reward(): 1 after three turns."""

    def reset(self, row):
        self.turns = 0
        return "Think in steps."

    def step(self, text):
        self.turns += 1
        return None if self.turns >= 3 else f"\\n[observation {self.turns}]\\n"

    def reward(self):
        return 1.0 if self.turns >= 3 else 0.0
'''


def _cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "grpo.train", "recipe=smoke", *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_smoke_run_with_an_environment(tmp_path, lora):
    (tmp_path / "smoke_env.py").write_text(ENV)
    out = tmp_path / "run"
    extra = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"] if lora else []
    p = _cli(tmp_path, f"trainer.output_dir={out}", "rollout.environment=smoke_env:Steps", "rollout.max_turns=3",
             "rollout.max_new_tokens=8", "rollout.max_tool_tokens=16", "trainer.eval_every=2", "data.num_eval=2",
             *extra)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["episode/turns_mean"] == 3.0 and r["episode/tool_calls_mean"] == 2.0  # two observations each
        assert r["episode/max_turns_frac"] == 0.0 and r["episode/tool_failures"] == 0
        assert r["reward/Steps"] == 1.0 and r["grad_norm"] > 0
        assert r["episode/tool_tokens_mean"] > 0
        # completions hold the observations too; the loss's token counts do not
        assert r["completion_len_mean"] >= 3 + r["episode/tool_tokens_mean"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    roles = [t["role"] for t in samples[0]["episode"]["turns"]]
    assert roles == ["assistant", "user", "assistant", "user", "assistant"]
    assert "[observation 1]" in samples[0]["completion"] and "[observation 2]" in samples[0]["completion"]
    assert "held-out" in p.stderr
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert evals and any(k.endswith("turns_mean") for k in evals[-1])


def test_a_bad_tool_fails_before_anything_loads(tmp_path):
    out = tmp_path / "run"
    p = _cli(tmp_path, f"trainer.output_dir={out}", "rollout.tools=[no_such_pkg.tools:calc]")
    assert p.returncode == 2 and not out.exists()
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout.tools[0]='no_such_pkg.tools:calc': cannot import module"), p.stderr[-500:]


SEEN = '''
SEEN = []


class Briefed:
    """reset(row) adds a line to the prompt; the episode ends after its first turn."""

    def reset(self, row):
        return "Answer in one line."

    def step(self, text):
        return None


def record(prompts, completions, **columns):
    SEEN.extend(prompts)
    return [0.0] * len(completions)
'''


def test_rewards_and_samples_see_the_prompt_with_the_text_reset_added(tmp_path, monkeypatch, cfg_factory):
    """The text an environment's reset(row) adds is part of the prompt the model answered: the rewards' ``prompts``
    (training and held-out) and samples.jsonl show it."""
    from grpo.loop import train

    (tmp_path / "seen_env.py").write_text(SEEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    try:
        import seen_env

        cfg = cfg_factory({"rollout": {"environment": "seen_env:Briefed", "max_turns": 1},
                           "reward": {"functions": {"seen": {"fn": "seen_env:record"}}},
                           "trainer": {"max_steps": 1}, "data": {"num_eval": 2}})
        train(cfg)
        # held-out before (2 prompts), one training rollout (2 prompts x G=4), held-out after (2 prompts)
        assert len(seen_env.SEEN) == 2 + 8 + 2
        assert all(p.endswith("\n\nAnswer in one line.") for p in seen_env.SEEN)
        samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
        assert samples and all(s["prompt"].endswith("\n\nAnswer in one line.") for s in samples)
    finally:
        sys.modules.pop("seen_env", None)
