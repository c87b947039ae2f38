"""grpo/rollout/episodes/worker.py: tool calls in a separate process, an overrunning one killed."""
import itertools

import pytest

from grpo.rollout.episodes import worker as tool_worker
from grpo.rollout.episodes.worker import CallResult, ToolWorker, as_text
from grpo.worker_process import KillableWorker


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


# ------------------------------------------------------------------------------- in this process
# (the trainer's side over a stand-in for the process: `request` runs the handler here, or answers with the status
# a test sets; what mutation testing runs)
F = "tests.tool_fixtures"


class Here(ToolWorker):
    def __init__(self, environment, timeout_s=2.5):
        super().__init__(environment, timeout_s)
        self.up, self.sent, self.answers, self.starts = False, [], [], 0

    def request(self, message, timeout_s):
        if not self.up:
            self.up = True
            self.starts += 1
            self.start()
        self.sent.append((message, timeout_s))
        status = self.answers.pop(0) if self.answers else None
        if status in ("timeout", "died"):
            self.kill()
            return status, None
        if status == "error":
            return "error", "ValueError: told to fail"
        try:
            return "ok", tool_worker._handle(message)
        except Exception as e:  # noqa: BLE001
            return "error", tool_worker._describe(e)

    def alive(self):
        return self.up

    def kill(self):
        self.up = False
        tool_worker._envs.clear()


@pytest.fixture
def here(monkeypatch):
    monkeypatch.setattr(KillableWorker, "start", lambda self: None)  # no process: `Here.request` serves
    tool_worker._envs.clear()
    yield Here
    tool_worker._envs.clear()


def test_the_worker_is_named_and_serves_with_its_handler():
    w = ToolWorker("m:E", 3.0)
    assert (w.name, w.handler, w.describe, w.environment, w.timeout_s) == ("grpo-tool-worker", tool_worker._handle,
                                                                         tool_worker._describe, "m:E", 3.0)
    assert (w.history, w.lost, w.proc) == ({}, set(), None) and CallResult("x", True, 1.0).timed_out is False


def test_calls_steps_and_their_history(here, monkeypatch):
    clock = itertools.chain([10.0, 10.5, 20.0, 21.25, 30.0, 30.5, 40.0, 40.25, 50.0, 50.0], itertools.count(60.0))
    monkeypatch.setattr(tool_worker.time, "perf_counter", lambda: next(clock))
    w = here(f"{F}:Counter")
    assert w.reset((0, 0), {"start": 3}) == "The counter starts at 3."
    assert w.sent == [(("new", (0, 0), f"{F}:Counter", {"start": 3}), 2.5)]
    assert w.call((0, 0), "add", {"a": 1, "b": 2}, f"{F}:add") == CallResult("3", True, 0.5)
    assert w.sent[-1] == (("fn", f"{F}:add", {"a": 1, "b": 2}), 2.5)
    assert w.call((0, 0), "increment", {"by": 4}, None) == CallResult("7", True, 1.25)
    assert w.sent[-1] == (("call", (0, 0), "increment", {"by": 4}), 2.5)
    # what rebuilds the episode's environment: reset and its method calls (not the functions', which hold no state)
    assert w.history == {(0, 0): [("new", (0, 0), f"{F}:Counter", {"start": 3}),
                                  ("call", (0, 0), "increment", {"by": 4})]}
    w.answers = ["error"]
    assert w.call((0, 0), "increment", {"by": 1}, None) == CallResult("Error: ValueError: told to fail", False, 0.5)
    assert len(w.history[(0, 0)]) == 2  # a failed call changed nothing
    w.answers = ["timeout"]
    assert w.call((0, 0), "increment", {"by": 1}, None) == CallResult("Error: tool increment timed out after 2.5 s",
                                                                      False, 0.25, True)
    w.answers = [None, None, "died"]  # the restarted worker replays the episode's two requests, then dies
    assert w.call((0, 0), "add", {"a": 1, "b": 2}, f"{F}:add") == CallResult("Error: the tool worker process died",
                                                                            False, 0.0)
    echo = here(f"{F}:Echo")
    echo.reset((1, 0), {"stop_at": 2})
    assert echo.step((1, 0), "hi").text == "\nobs1: 2\n" and echo.step((1, 0), "hi").text is None
    assert [r[0] for r in echo.history[(1, 0)]] == ["new", "step", "step"] and echo.history[(1, 0)][1][2] == "hi"


def test_a_restarted_worker_replays_the_live_episodes_and_loses_one_that_fails(here):
    w = here(f"{F}:Counter")
    w.reset((0, 0), {"start": 1})
    w.call((0, 0), "increment", {"by": 10}, None)
    w.reset((0, 1), {"start": 2})
    w.call((0, 1), "increment", {"by": 20}, None)
    w.call((0, 1), "increment", {"by": 30}, None)
    w.answers = ["timeout"]
    assert w.call((0, 0), "increment", {"by": 5}, None).timed_out
    w.answers = [None, None, "error"]  # the replay: (0, 0)'s reset and call, then (0, 1)'s reset fails
    sent = len(w.sent)
    assert w.call((0, 0), "increment", {"by": 1}, None).text == "12" and w.starts == 2
    assert [m for m, _ in w.sent[sent:]] == [("new", (0, 0), f"{F}:Counter", {"start": 1}),
                                             ("call", (0, 0), "increment", {"by": 10}),
                                             ("new", (0, 1), f"{F}:Counter", {"start": 2}),
                                             ("call", (0, 0), "increment", {"by": 1})]
    assert w.lost == {(0, 1)} and list(w.history) == [(0, 0)]
    lost = w.call((0, 1), "increment", {"by": 1}, None)
    assert lost == CallResult("Error: the environment was lost when another call timed out; tool increment not run",
                              False, 0.0)
    assert w.step((0, 1), "x").text.endswith("; step() not run") and w.reward((0, 1)) is None
    assert w.reward((0, 0)) == 12.0 and type(w.reward((0, 0))) is float
    before = len(w.sent)
    w.drop_all()
    assert w.sent[before:] == [(("drop",), 2.5)] and (w.history, w.lost) == ({}, set())
    assert tool_worker._envs == {}
    w.drop_all()  # nothing live: nothing sent
    w.reset((0, 0), {})
    w.kill()
    before = len(w.sent)
    w.drop_all()  # a dead worker holds no environments: nothing sent (and none started)
    assert len(w.sent) == before and w.history == {} and w.starts == 2


def test_a_reset_that_fails_names_the_environment_and_a_reward_needs_a_number(here):
    w = here(f"{F}:Counter", timeout_s=0.5)
    w.answers = ["timeout"]
    with pytest.raises(RuntimeError, match=r"^tests.tool_fixtures:Counter reset\(row\) failed: timed out after "
                                           r"rollout.tool_timeout_s=0.5$"):
        w.reset((0, 0), {})
    w.answers = ["error"]
    with pytest.raises(RuntimeError, match=r"^tests.tool_fixtures:Counter reset\(row\) failed: ValueError: told"):
        w.reset((0, 0), {})
    assert w.history == {}
    echo = here(f"{F}:Echo")
    assert echo.reset((0, 0), {}) is None
    assert echo.reward((0, 0)) == 0.0
    w.reset((0, 0), {"start": 4})
    w.answers = ["error"]
    assert w.reward((0, 0)) is None
    brief = here(f"{F}:Briefing")
    brief.reset((0, 0), {"brief": "b"})
    assert brief.reward((0, 0)) is None  # no reward() method


def test_the_handler_in_the_worker_process():
    tool_worker._envs.clear()
    assert tool_worker._handle(("fn", f"{F}:add", {"a": 2, "b": 3})) == "5"
    assert tool_worker._objects[f"{F}:add"] is __import__("tests.tool_fixtures").tool_fixtures.add
    assert tool_worker._handle(("new", "k", f"{F}:Counter", {"start": 1})) == "The counter starts at 1."
    assert tool_worker._handle(("new", "e", f"{F}:Echo", {"stop_at": 1})) is None
    assert tool_worker._handle(("call", "k", "increment", {"by": 2})) == "3"
    assert tool_worker._handle(("step", "e", "hi")) is None
    assert tool_worker._handle(("reward", "k")) == 3.0 and tool_worker._handle(("reward", "e")) == 1.0
    tool_worker._handle(("new", "b", f"{F}:Briefing", {"brief": {"x": 1}}))
    assert tool_worker._envs["b"].reset({"brief": 7}) == 7 and tool_worker._handle(("reward", "b")) is None
    assert tool_worker._handle(("new", "b2", f"{F}:Briefing", {"brief": 7})) == "7"
    assert tool_worker._handle(("step", "b", "x")) == "ok"
    assert tool_worker._handle(("drop",)) is None and tool_worker._envs == {}
    with pytest.raises(ValueError, match="unknown request 'nope'"):
        tool_worker._handle(("nope",))
    assert tool_worker._describe(ValueError("x" * 600)) == ("ValueError: " + "x" * 600)[:500]


def test_a_tools_value_as_the_text_the_model_reads():
    assert as_text("a") == "a" and as_text(3) == "3" and as_text({"k": [1, 2]}) == '{"k": [1, 2]}'
    assert as_text({1, 2}) == "{1, 2}" and as_text(None) == "null"
    loop = []
    loop.append(loop)
    assert as_text(loop) == "[[...]]"  # json refuses a circular value (ValueError): its repr


def test_a_lost_episode_does_not_stop_the_replay_of_the_next(here):
    w = here(f"{F}:Counter")
    w.reset((0, 0), {"start": 1})
    w.call((0, 0), "increment", {"by": 10}, None)
    w.reset((0, 1), {"start": 2})
    w.kill()
    w.answers = ["error"]  # (0, 0)'s reset fails in the replay; (0, 1) is rebuilt all the same
    assert w.call((0, 1), "increment", {"by": 3}, None).text == "5"
    assert [m[0] for m, _ in w.sent[-3:]] == ["new", "new", "call"] and w.lost == {(0, 0)}
    assert list(w.history) == [(0, 1)]
