"""grpo/rewards/worker.py: a reward run in the worker process, killed after reward.timeout_s."""
import pytest

from grpo.errors import RewardTimeout
from grpo.rewards.worker import RewardWorker


def test_a_builtin_scores_in_the_worker_and_a_hang_is_killed(tmp_path, monkeypatch):
    (tmp_path / "slowrew_xyz.py").write_text("import time\ndef slow(prompts, completions, **_):\n"
                                             "    time.sleep(30)\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    w = RewardWorker()
    try:
        assert w.call("number_only", {}, ["p", "p"], ["12", "ab"], {}, timeout_s=60) == [1.0, 0.0]
        with pytest.raises(RewardTimeout, match="did not return within reward.timeout_s=1"):
            w.call("slowrew_xyz:slow", {}, ["p"], ["x"], {}, timeout_s=1)
    finally:
        w.kill()
