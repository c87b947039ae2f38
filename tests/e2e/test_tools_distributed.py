"""Multi-turn episodes on two DeepSpeed ZeRO-3 processes: rank 0's episodes end after one turn, rank 1's run three,
so rank 0 must keep generating stand-ins in lockstep (ZeRO-3 gathers each layer's weights from both ranks in every
forward) instead of hanging, and the step's metrics count every rank's episodes."""
import importlib.util
import json

import pytest

from tests.e2e.test_distributed import SMOKE, ZERO3, torchrun

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="distributed tests need deepspeed (pip install 'grpo[deepspeed]')")

ENV = '''
import os


class RankSteps:
    """Rank 0's episodes end after their first turn, rank 1's after their third (the worker inherits RANK)."""

    def reset(self, row):
        self.turns, self.stop_at = 0, 1 if os.environ.get("RANK", "0") == "0" else 3

    def step(self, text):
        self.turns += 1
        return None if self.turns >= self.stop_at else f" (turn {self.turns} seen)"

    def reward(self):
        return float(self.turns)
'''


@pytest.mark.slow
def test_ranks_finishing_at_different_turns_do_not_hang(tmp_path):
    (tmp_path / "rank_env.py").write_text(ENV)
    out = tmp_path / "run"
    p = torchrun("-m", "grpo.train", *SMOKE, *ZERO3, f"trainer.output_dir={out}",
                 "rollout.environment=rank_env:RankSteps", "rollout.max_turns=4", "rollout.max_new_tokens=6",
                 "rollout.max_tool_tokens=8", "data.num_eval=0",
                 cwd=tmp_path, timeout=400)
    assert p.returncode == 0, p.stderr[-4000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # 4 episodes of 1 turn (rank 0) and 4 of 3 turns (rank 1)
        assert r["episode/turns_mean"] == 2.0 and r["episode/tool_calls_mean"] == 1.0
        assert r["reward/RankSteps"] == 2.0 and not r["skipped"]
