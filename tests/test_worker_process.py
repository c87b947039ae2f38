"""grpo/worker_process.py: a spawned worker that answers requests and is SIGKILLed when one overruns."""
import time

import pytest

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


class _Conn:
    """A pipe end: ``recv`` returns the scripted items in order (an exception class or instance is raised), ``send``
    and ``poll`` are recorded."""

    def __init__(self, *items, polls=()):
        self.items, self.polls, self.sent, self.polled, self.closed = list(items), list(polls), [], [], False

    def recv(self):
        item = self.items.pop(0)
        if isinstance(item, BaseException) or (isinstance(item, type) and issubclass(item, BaseException)):
            raise item
        return item

    def send(self, message):
        if len(self.sent) >= 20:  # a serving loop that stopped reading: fail, not hang
            raise OSError("more replies than requests")
        self.sent.append(message)

    def poll(self, timeout):
        self.polled.append(timeout)
        return self.polls.pop(0)

    def close(self):
        self.closed = True


class _Process:
    started = []

    def __init__(self, target, args, daemon, name):
        self.target, self.args, self.daemon, self.name = target, args, daemon, name
        self.pid, self.up, self.joined = 4242 + len(_Process.started), False, []

    def start(self):
        self.up = True
        _Process.started.append(self)

    def is_alive(self):
        return self.up

    def join(self, timeout=None):
        self.joined.append(timeout)


class _Context:
    def __init__(self, *pipes):
        self.pipes, self.kinds = list(pipes), []

    def Pipe(self):  # noqa: N802 - multiprocessing's name
        return self.pipes.pop(0)


def _stand_ins(monkeypatch, *pipes):
    """``mp.get_context`` gives a context whose pipes are ``pipes`` (parent, child) and whose processes are
    `_Process`; ``os.kill`` records (pid, signal) and ends that process."""
    import os
    import signal

    import grpo.worker_process as wp

    ctx, killed = _Context(*pipes), []
    _Process.started = []
    ctx.Process = _Process

    def get_context(kind):
        ctx.kinds.append(kind)
        return ctx

    def kill(pid, sig):
        killed.append((pid, sig))
        for p in _Process.started:
            if p.pid == pid and sig == signal.SIGKILL:
                p.up = False

    monkeypatch.setattr(wp.mp, "get_context", get_context)
    monkeypatch.setattr(os, "kill", kill)
    return ctx, killed


def test_start_spawns_a_daemon_named_process_serving_the_handler_with_the_trainers_path_and_directory(monkeypatch):
    import os
    import sys

    import grpo.worker_process as wp

    parent, child = _Conn("ready"), _Conn()
    ctx, _ = _stand_ins(monkeypatch, (parent, child))
    w = KillableWorker("my-worker", _handle, _describe)
    assert (w.name, w.handler, w.describe, w.proc, w.conn) == ("my-worker", _handle, _describe, None, None)
    assert not w.alive()
    w.start()
    (p,) = _Process.started
    assert ctx.kinds == ["spawn"] and w.conn is parent and w.proc is p and w.alive()
    assert (p.target, p.args, p.daemon, p.name) == (wp._serve, (child, sys.path, os.getcwd(), _handle, _describe),
                                                    True, "my-worker")
    assert p.args[1] is not sys.path  # a copy: the worker's own list
    assert child.closed and not parent.closed and parent.items == []


def test_a_worker_that_does_not_say_ready_fails_to_start_naming_it(monkeypatch):
    _stand_ins(monkeypatch, (_Conn("no"), _Conn()))
    with pytest.raises(RuntimeError, match="^my-worker failed to start$"):
        KillableWorker("my-worker", _handle, _describe).start()


def test_request_starts_the_worker_once_and_again_after_a_timeout_or_a_death(monkeypatch):
    import signal

    first = _Conn("ready", (True, 42), (False, "ValueError: no"), polls=[True, True, False])
    second = _Conn("ready", EOFError, polls=[True])
    third = _Conn("ready", (True, 4), polls=[True])
    _, killed = _stand_ins(monkeypatch, (first, _Conn()), (second, _Conn()), (third, _Conn()))
    w = KillableWorker("w", _handle, _describe)
    assert w.request(("double", 21), timeout_s=60) == ("ok", 42)
    assert w.request(("raise", "no"), timeout_s=7.5) == ("error", "ValueError: no")
    assert len(_Process.started) == 1 and first.sent == [("double", 21), ("raise", "no")]
    p = _Process.started[0]
    assert w.request(("sleep", 30), timeout_s=0.5) == ("timeout", None)
    assert first.polled == [60, 7.5, 0.5] and killed == [(p.pid, signal.SIGKILL)] and p.joined == [5]
    assert w.proc is None and not w.alive()
    assert w.request(("crash", 0), timeout_s=3) == ("died", None)  # it exited: the pipe's end reads EOF
    q = _Process.started[1]
    assert second.sent == [("crash", 0)] and killed[1:] == [(q.pid, signal.SIGKILL)] and w.proc is None
    assert w.request(("double", 2), timeout_s=60) == ("ok", 4) and len(_Process.started) == 3


def test_a_worker_that_exited_is_started_again_on_the_next_request(monkeypatch):
    first, second = _Conn("ready", (True, 1), polls=[True]), _Conn("ready", (True, 2), polls=[True])
    _, killed = _stand_ins(monkeypatch, (first, _Conn()), (second, _Conn()))
    w = KillableWorker("w", _handle, _describe)
    assert w.request("a", timeout_s=1) == ("ok", 1)
    _Process.started[0].up = False  # it exited on its own
    assert w.request("b", timeout_s=1) == ("ok", 2) and len(_Process.started) == 2 and second.sent == ["b"]
    assert killed == []


def test_kill_joins_a_dead_process_without_a_signal_and_forgets_it_and_del_kills(monkeypatch):
    import signal

    _, killed = _stand_ins(monkeypatch, (_Conn("ready"), _Conn()), (_Conn("ready"), _Conn()))
    w = KillableWorker("w", _handle, _describe)
    w.kill()  # never started: nothing to do
    assert killed == [] and w.proc is None
    w.start()
    p = w.proc
    p.up = False
    w.kill()
    assert killed == [] and p.joined == [5] and w.proc is None
    w.start()
    q = w.proc
    w.__del__()
    assert killed == [(q.pid, signal.SIGKILL)] and q.joined == [5] and w.proc is None

    def broken():
        raise OSError("gone")

    w.kill = broken
    w.__del__()  # an interpreter shutting down may have lost os: __del__ never raises


def test_serve_ignores_ctrl_c_takes_the_path_and_directory_and_answers_until_the_pipe_closes(monkeypatch, tmp_path):
    import os
    import signal
    import sys

    import grpo.worker_process as wp

    def handle(request):
        if request == "interrupt":
            raise KeyboardInterrupt("stop")
        return _handle(request)

    for end in (EOFError, OSError("closed")):
        monkeypatch.setattr(sys, "path", list(sys.path))
        monkeypatch.chdir(tmp_path)
        (tmp_path / "there").mkdir(exist_ok=True)
        conn = _Conn(("double", 3), ("raise", "bad"), "interrupt", end)
        before = signal.getsignal(signal.SIGINT)
        try:
            assert wp._serve(conn, ["/the/trainers/path"], str(tmp_path / "there"), handle, _describe) is None
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        finally:
            signal.signal(signal.SIGINT, before)
        assert sys.path == ["/the/trainers/path"] and os.getcwd() == str(tmp_path / "there")
        assert conn.sent == ["ready", (True, 6), (False, "ValueError: bad"), (False, "KeyboardInterrupt: stop")]
