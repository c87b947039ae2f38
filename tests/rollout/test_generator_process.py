"""grpo/rollout/generator_process.py: the generator process's protocol with a trivial worker built in the child: weights
arrive (through shared memory) before the requests that follow them, results come back in order with their
timings, a failure comes back as one line, a dead process is reported, close stops it."""
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from grpo.rollout.generator_process import Generated, GeneratorError, GeneratorProcess


class Echo:
    """Samples nothing: answers each request with the sum of the weights it holds."""

    def __init__(self, spec):
        self.spec, self.version, self.weights = spec, None, {}

    def load(self, version, weights):
        self.version, self.weights = version, {k: v.clone() for k, v in weights.items()}

    def sample(self, step, version):
        if step == self.spec.get("fail_at"):
            raise ValueError("a reward function broke\nsecond line")
        if step == self.spec.get("die_at"):
            os.kill(os.getpid(), signal.SIGKILL)
        total = float(sum(v.sum() for v in self.weights.values()))
        return Generated(step, version, batch=(self.version, total), sampler={"step": step})


def build(spec):
    return Echo(spec)


def test_weights_then_requests_in_order():
    gen = GeneratorProcess(build, {})
    try:
        w = torch.ones(3)
        gen.publish(0, {"w": w})
        w.add_(1.0)  # the trainer goes on changing its weights: the generator has its own copy of version 0
        gen.submit(1, 0)
        gen.submit(2, 0)
        gen.publish(1, {"w": w})
        gen.submit(3, 1)
        got = [gen.receive(timeout=60) for _ in range(3)]
        assert [(g.step, g.version, g.batch) for g in got] == [(1, 0, (0, 3.0)), (2, 0, (0, 3.0)), (3, 1, (1, 6.0))]
        assert all(g.wait_s >= 0 and g.busy_s >= 0 for g in got) and got[2].sampler == {"step": 3}
    finally:
        gen.close()
    assert not gen.proc.is_alive()


def test_a_failure_comes_back_as_one_line():
    gen = GeneratorProcess(build, {"fail_at": 1})
    try:
        gen.publish(0, {"w": torch.zeros(1)})
        gen.submit(1, 0)
        with pytest.raises(GeneratorError, match="^the generator process failed: ValueError: a reward function "
                                                 "broke$"):
            gen.receive(timeout=60)
    finally:
        gen.close()


def test_a_dead_generator_is_reported_not_waited_for():
    gen = GeneratorProcess(build, {"die_at": 1})
    try:
        gen.publish(0, {"w": torch.zeros(1)})
        gen.submit(1, 0)
        with pytest.raises(GeneratorError, match="died"):
            gen.receive(timeout=60)
    finally:
        gen.close()


def test_a_loaded_slot_is_reused_with_the_new_weights():
    """Once a batch of version v came back, the shared-memory slot of v (loaded before it) takes a later version:
    no fresh shared memory per step, and the generator sees the new values, not the old."""
    gen = GeneratorProcess(build, {})
    try:
        gen.publish(0, {"w": torch.ones(3)})
        first = gen._loading[0][1]["w"]
        gen.submit(1, 0)
        assert gen.receive(timeout=60).batch == (0, 3.0)
        gen.publish(1, {"w": torch.full((3,), 2.0)})
        assert gen._loading[1][1]["w"] is first  # the same slot
        gen.submit(2, 1)
        assert gen.receive(timeout=60).batch == (1, 6.0)
    finally:
        gen.close()


# ------------------------------------------------------------------------------- in this process (mutation testing)
class _Proc:
    def __init__(self, alive=True, exitcode=None, stubborn=False):
        self.alive, self.exitcode, self.joined, self.stubborn, self.pid = alive, exitcode, [], stubborn, 4242

    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        self.joined.append(timeout)
        self.alive = self.alive and self.stubborn


class _Pipe:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def _handle(alive=True, exitcode=None):
    """A `GeneratorProcess` without its process: its pipe to the child records, its inbox is filled by the test."""
    import queue

    gen = GeneratorProcess.__new__(GeneratorProcess)
    gen.proc, gen._send, gen._free, gen._loading, gen.inbox = _Proc(alive, exitcode), _Pipe(), [], {}, queue.Queue()
    return gen


def test_publish_copies_into_shared_slots_reused_only_after_a_batch_of_that_version_came_back():
    gen = _handle()
    w = {"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.int64)}
    gen.publish(0, w)
    kind, version, slot = gen._send.sent[-1]
    assert (kind, version) == ("weights", 0) and slot["a"].is_shared() and slot["a"] is not w["a"]
    assert torch.equal(slot["a"], w["a"]) and slot["b"].dtype == torch.int64
    w["a"].add_(1)
    assert torch.equal(slot["a"], torch.ones(2))  # a copy: the trainer goes on changing its own
    gen.publish(1, w)
    second = gen._send.sent[-1][2]
    assert second["a"] is not slot["a"] and sorted(gen._loading) == [0, 1]  # version 0's slot is still loading
    gen.inbox.put(("batch", Generated(1, 0, None, {})))
    assert gen.receive(timeout=5).step == 1 and sorted(gen._loading) == [1] and len(gen._free) == 1
    gen.publish(2, {"a": torch.ones(5), "b": w["b"]})  # another shape: a fresh slot, the free one kept
    assert gen._send.sent[-1][2]["a"].shape == (5,) and len(gen._free) == 1
    gen.publish(3, {"a": torch.full((2,), 7.0), "b": w["b"]})
    assert gen._send.sent[-1][2]["a"] is slot["a"] and torch.equal(slot["a"], torch.full((2,), 7.0)) and not gen._free
    gen.inbox.put(("batch", Generated(4, 3, None, {})))
    gen.receive(timeout=5)
    assert gen._loading == {} and len(gen._free) == 3  # versions 1, 2, 3 loaded before the batch of version 3
    gen.submit(5, 3)
    assert gen._send.sent[-1] == ("sample", 5, 3)


def test_receive_reports_a_failure_a_dead_process_and_a_timeout_in_one_line():
    import time

    gen = _handle()
    gen.inbox.put(("error", "ValueError: boom"))
    with pytest.raises(GeneratorError, match="^the generator process failed: ValueError: boom$"):
        gen.receive(timeout=5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no batch from the generator in time"):
        gen.receive(timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 1.0  # the wait is bounded by the timeout, not by the 1 s poll
    dead = _handle(alive=False, exitcode=-9)
    with pytest.raises(GeneratorError, match=r"^the generator process died \(exit code -9\)$"):
        dead.receive(timeout=5)
    dead.inbox.put(("batch", Generated(1, 0, None, {})))
    assert dead.receive().step == 1  # what it sent before it died is still read
    gen.close()
    assert gen._send.sent[-1] == ("stop",) and gen.proc.joined == [5]
    dead.close()
    assert dead._send.sent == [] and dead.proc.joined == []


class _Scripted:
    """An inbox that answers each ``get`` from a script (an exception is raised, a message returned) and records the
    timeout it was asked to wait; past the script the process is dead, so a loop that should have ended fails."""

    def __init__(self, gen, *script):
        import queue

        self.gen, self.script, self.waits, self.empty = gen, list(script), [], lambda: True
        self.Empty = queue.Empty

    def get(self, timeout):
        self.waits.append(timeout)
        if not self.script:
            self.gen.proc.alive = False
            raise self.Empty
        got = self.script.pop(0)
        if got is self.Empty:
            raise got
        return got


def test_receive_polls_at_most_a_second_at_a_time_and_a_timeout_ends_at_its_deadline(monkeypatch):
    import queue

    from grpo.rollout import generator_process as generator

    gen = _handle()
    gen.inbox = _Scripted(gen, queue.Empty, ("batch", Generated(1, 0, None, {})))
    assert gen.receive().step == 1 and gen.inbox.waits == [1.0, 1.0]  # no timeout: polls until a batch comes
    monkeypatch.setattr(generator, "time", SimpleNamespace(time=lambda: 100.0))  # a clock that stands still
    gen.inbox = _Scripted(gen, queue.Empty, ("batch", Generated(2, 0, None, {})))
    assert gen.receive(timeout=5).step == 2 and gen.inbox.waits == [1.0, 1.0]  # a long timeout: 1 s polls too
    gen.inbox = _Scripted(gen, queue.Empty)
    with pytest.raises(TimeoutError, match="no batch from the generator in time"):
        gen.receive(timeout=0)  # the deadline is now: one poll, then the timeout (not another poll)
    assert gen.inbox.waits == [0.0]


def test_close_kills_a_generator_that_does_not_stop_and_waits_for_it(monkeypatch):
    from grpo.rollout import generator_process as generator

    killed = []
    gen = _handle()
    gen.proc.stubborn = True
    monkeypatch.setattr(generator.os, "kill", lambda pid, sig: killed.append((pid, sig)) or
                        setattr(gen.proc, "stubborn", False))
    gen.close()
    assert gen._send.sent == [("stop",)] and killed == [(4242, signal.SIGKILL)] and gen.proc.joined == [5, 5]
    assert not gen.proc.is_alive()


def test_the_reader_thread_moves_every_message_until_the_pipe_closes():
    import multiprocessing as mp
    import queue
    import threading

    from grpo.rollout.generator_process import _read_into

    theirs, mine = mp.Pipe(duplex=False)
    inbox = queue.Queue()
    reader = threading.Thread(target=_read_into, args=(theirs, inbox))
    reader.start()
    for msg in (("ready", None), ("batch", 1), ("batch", 2)):
        mine.send(msg)
    mine.close()
    reader.join(timeout=10)
    assert not reader.is_alive() and [inbox.get_nowait() for _ in range(3)] == [("ready", None), ("batch", 1),
                                                                              ("batch", 2)]


class _Side:
    def __init__(self, fail=False):
        self.loaded, self.fail = [], fail

    def load(self, version, weights):
        self.loaded.append((version, dict(weights)))

    def sample(self, step, version):
        if self.fail:
            raise ValueError("no such column\nmore")
        return Generated(step, version, batch=list(self.loaded), sampler={})


def _serve_here(monkeypatch, tmp_path, build, messages):
    """`_serve` run in this process's main thread (its signal handler needs it), the trainer's messages sent first."""
    import multiprocessing as mp
    import signal
    import sys

    from grpo.rollout import generator_process as generator

    said = []
    monkeypatch.setattr(generator, "_die_with_parent", lambda: said.append("pdeathsig"))
    monkeypatch.setattr(generator.signal, "signal", lambda sig, how: said.append((sig, how)))
    monkeypatch.setattr(generator.os, "getppid", lambda: 1)  # orphaned once the messages are read: never a hang
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setattr(sys, "path", list(sys.path))
    req_r, req_w = mp.Pipe(duplex=False)
    res_r, res_w = mp.Pipe(duplex=False)
    for msg in messages:
        req_w.send(msg)
    generator._serve(req_r, res_w, build, "spec", sys.path[:1] + ["/nowhere"], str(tmp_path))
    import os

    assert os.getcwd() == str(tmp_path) and sys.path[-1] == "/nowhere"
    assert said == ["pdeathsig", (signal.SIGINT, signal.SIG_IGN)]
    out = []
    while res_r.poll(0.1):
        out.append(res_r.recv())
    return out


def test_serve_loads_weights_then_samples_in_order_and_times_each_batch(monkeypatch, tmp_path):
    side = _Side()
    got = _serve_here(monkeypatch, tmp_path, lambda spec: side if spec == "spec" else None,
                      [("weights", 0, {"w": 1}), ("sample", 1, 0), ("weights", 1, {"w": 2}), ("sample", 2, 1),
                       ("stop",), ("sample", 3, 1)])
    assert [k for k, _ in got] == ["ready", "batch", "batch"]  # nothing after the stop
    (_, first), (_, second) = got[1:]
    assert (first.step, first.version, first.batch) == (1, 0, [(0, {"w": 1})])
    assert second.batch == [(0, {"w": 1}), (1, {"w": 2})]
    assert all(g.wait_s >= 0 and g.busy_s >= 0 and g.load_s >= 0 for g in (first, second))


def test_serve_times_the_wait_the_sampling_and_every_load_since_the_previous_batch(monkeypatch, tmp_path):
    """A clock that reads one second later at each reading: the readings are idle (100), load (101-102), load
    (103-104), sample (105-106), idle (107), sample (108-109). A batch's wait is the time since the previous batch
    less the loads in it, its load time the sum of them."""
    from grpo.rollout import generator_process as generator

    clock = iter(range(100, 200))
    monkeypatch.setattr(generator, "time", SimpleNamespace(time=lambda: float(next(clock))))
    got = _serve_here(monkeypatch, tmp_path, lambda spec: _Side(),
                      [("weights", 0, {}), ("weights", 1, {}), ("sample", 1, 1), ("sample", 2, 1), ("stop",)])
    (_, first), (_, second) = got[1:]
    assert (first.wait_s, first.busy_s, first.load_s) == (3.0, 1.0, 2.0)
    assert (second.wait_s, second.busy_s, second.load_s) == (1.0, 1.0, 0.0)


def test_serve_sends_a_failed_build_or_sample_back_as_one_line(monkeypatch, tmp_path):
    def broken(spec):
        raise ImportError("no module named rewards_x")

    assert _serve_here(monkeypatch, tmp_path, broken, []) == [("error", "ImportError: no module named rewards_x")]
    got = _serve_here(monkeypatch, tmp_path, lambda spec: _Side(fail=True), [("sample", 1, 0), ("sample", 2, 0)])
    assert got == [("ready", None), ("error", "ValueError: no such column")]


def test_serve_ends_when_orphaned_and_reads_on_a_daemon_thread(monkeypatch, tmp_path):
    """No stop message: the loop ends at its first idle poll once the parent is gone (ppid 1); the thread reading the
    requests never keeps the process alive."""
    import threading

    from grpo.rollout import generator_process as generator

    started = []  # recorded at start: the reader ends by itself once the test's end of the pipe is gone

    class Recorded(threading.Thread):
        def start(self):
            started.append(self)
            super().start()

    monkeypatch.setattr(generator.threading, "Thread", Recorded)
    got = _serve_here(monkeypatch, tmp_path, lambda spec: _Side(), [("sample", 1, 0)])
    assert [k for k, _ in got] == ["ready", "batch"]
    readers = [t for t in started if "_read_into" in t.name]
    assert readers and all(t.daemon for t in readers)
