"""grpo/rewards/worker.py: a reward run in the worker process, killed after reward.timeout_s."""
import pytest

from grpo.errors import RewardTimeout
from grpo.rewards import worker
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


# The trainer's side and the worker's handler without a process (`make mutate` selects these by name): `request`
# answered in this process, `_score` called here.

def _answering(monkeypatch, status, payload):
    w = RewardWorker()
    sent = []
    monkeypatch.setattr(w, "request", lambda message, timeout_s: sent.append((message, timeout_s)) or (status, payload))
    return w, sent


def test_the_worker_is_named_and_serves_score_and_sends_a_traceback_back():
    w = RewardWorker()
    assert (w.name, w.handler, w.describe) == ("grpo-reward-worker", worker._score, worker._traceback)
    assert w.proc is None  # no process until the first call


def test_call_sends_the_whole_request_with_its_timeout_and_returns_the_scores(monkeypatch):
    w, sent = _answering(monkeypatch, "ok", [1.0, None])
    assert w.call("m:f", {"scale": 2}, ["p1", "p2"], ["c1", "c2"], {"answer": ["a", "b"]}, timeout_s=1.5) == [1.0, None]
    assert sent == [(("m:f", {"scale": 2}, ["p1", "p2"], ["c1", "c2"], {"answer": ["a", "b"]}), 1.5)]


@pytest.mark.parametrize("status,payload,error,text", [
    ("timeout", None, RewardTimeout, "reward 'm:f' did not return within reward.timeout_s=2.5; killed"),
    ("died", None, RuntimeError, "reward worker died while running 'm:f'"),
    ("error", "Traceback ...\nValueError: bad row", RuntimeError,
     "reward 'm:f' raised in the worker:\nTraceback ...\nValueError: bad row"),
])
def test_a_timeout_a_dead_worker_and_a_raise_are_errors_naming_the_reward(monkeypatch, status, payload, error, text):
    w, _ = _answering(monkeypatch, status, payload)
    with pytest.raises(error) as e:
        w.call("m:f", {}, ["p"], ["c"], {}, timeout_s=2.5)
    assert str(e.value) == text and type(e.value) is error


def test_score_resolves_each_spec_once_and_calls_it_with_the_columns_and_the_arguments(monkeypatch):
    resolved, real = [], worker.resolve

    def scale(prompts, completions, answer, weight=1.0):
        return (weight * (c == a) for c, a in zip(completions, answer))  # any iterable: a list comes back

    def resolve(spec):
        resolved.append(spec)
        return {"m:scale": scale, "number_only": real("number_only")}[spec]

    monkeypatch.setattr(worker, "_resolved", {})
    monkeypatch.setattr(worker, "resolve", resolve)
    request = ("m:scale", {"weight": 2.0}, ["p", "p"], ["4", "5"], {"answer": ["4", "4"]})
    assert worker._score(request) == [2.0, 0.0]
    assert worker._score(request) == [2.0, 0.0]
    assert worker._score(("number_only", {}, ["p", "p"], ["12", "ab"], {})) == [1.0, 0.0]
    assert resolved == ["m:scale", "number_only"]


def test_the_text_sent_back_is_the_traceback_of_what_was_raised():
    try:
        raise ValueError("bad row 3")
    except ValueError as e:
        text = worker._traceback(e)
    assert text.startswith("Traceback (most recent call last):") and text.endswith("ValueError: bad row 3\n")
    assert "test_the_text_sent_back_is_the_traceback_of_what_was_raised" in text
