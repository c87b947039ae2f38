"""grpo/rollout/episodes/worker.py: tool calls in a separate process, an overrunning one killed."""
from grpo.rollout.episodes.worker import ToolWorker


def test_a_tool_call_runs_in_the_worker_and_a_bad_one_is_an_error_for_the_model():
    w = ToolWorker(None, timeout_s=60)
    try:
        ok = w.call((0, 0), "calculate", {"expression": "6 * 7"}, "grpo.rollout.episodes.calculator:calculate")
        assert ok.ok and "42" in ok.text
        bad = w.call((0, 1), "calculate", {"expression": "__import__('os')"},
                     "grpo.rollout.episodes.calculator:calculate")
        assert not bad.ok or "rror" in bad.text
    finally:
        w.kill()
