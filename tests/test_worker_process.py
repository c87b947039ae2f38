"""grpo/worker_process.py: a spawned worker that answers requests and is SIGKILLed when one overruns."""
import time

from grpo.worker_process import KillableWorker


def _handle(request):
    kind, value = request
    if kind == "sleep":
        time.sleep(value)
    if kind == "raise":
        raise ValueError(value)
    return value * 2


def _describe(e):
    return f"{type(e).__name__}: {e}"


def test_replies_errors_and_a_timeout_that_kills_the_worker():
    w = KillableWorker("test-worker", _handle, _describe)
    try:
        assert w.request(("double", 21), timeout_s=60) == ("ok", 42)
        assert w.request(("raise", "no"), timeout_s=60) == ("error", "ValueError: no")
        assert w.request(("sleep", 30), timeout_s=0.5) == ("timeout", None) and not w.alive()
        assert w.request(("double", 2), timeout_s=60) == ("ok", 4)  # started again on the next request
    finally:
        w.kill()
