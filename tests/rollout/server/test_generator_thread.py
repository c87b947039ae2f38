"""grpo/rollout/server/generator_thread.py against fake servers holding a real tiny model (the weights go through the
real gloo channel), driven by the trainer's real schedule (`AsyncBatches`) while the trainer's weights change between
steps: no push while a request of an older version is out, on every server; each step's requests are answered by
servers holding the schedule's version; every push carries the weights of the version published (the sync check
against the trainer's log-probs at publication passes, and the servers end with the last version's weights)."""
from types import SimpleNamespace

import pytest
import torch

from grpo.batch import Batch
from grpo.models import char_tokenizer, tiny_model
from grpo.rollout.base import Sampling
from grpo.rollout.generator_process import Generated
from grpo.rollout.server.client import ServerError
from grpo.rollout.server.generator_thread import ServerGenerator
from grpo.runtime.local import LocalRuntime
from grpo.trainer import pipeline
from grpo.trainer.pipeline import AsyncBatches, sampled_with
from tests.rollout.server.test_backend import TINY, _backend


class _Runtime:
    is_main = False
    full_weights = LocalRuntime.full_weights   # one process: the parameters as they are


class _Run:
    def __init__(self, policy):
        self.policy, self.runtime, self.state = policy, _Runtime(), None
        self.sampler, self.settings = SimpleNamespace(prompts=self), SimpleNamespace(collect=None)

    def load_state_dict(self, s):
        self.state = s


def _sample(backend):
    """A step's batch: two groups whose prompts name the step, from the servers."""
    def sample(step: int, version: int) -> Generated:
        out = backend.generate([[1, 3, step], [1, 4, step]], 2, Sampling(4), seed=step)
        batch = Batch([{}, {}], [[1, 3, step], [1, 4, step]], out.ids, out.truncated, torch.zeros(4),
                      torch.zeros(4), stats={}, sampling_logps=out.logprobs, versions=out.versions)
        return Generated(step, version, batch, sampler={"after": step})
    return sample


def _train(trainer, fakes_, lag: int, steps: int):
    """The trainer's loop without a loss: take each step's batch, then change the weights (the optimizer)."""
    backend = _backend(trainer, fakes_)
    gen = ServerGenerator(backend, trainer, _sample(backend))
    src, got, published = AsyncBatches(_Run(trainer), gen, lag, steps), {}, {}
    try:
        for t in range(1, steps + 1):
            published[t - 1] = {k: v.clone() for k, v in trainer.state_dict().items()}
            got[t] = src.batch(t)
            with torch.no_grad():
                for p in trainer.parameters():
                    p.add_(torch.randn_like(p) * 1e-2)
    finally:
        src.close()
    return backend, got, published


@pytest.fixture
def no_finish(monkeypatch):
    monkeypatch.setattr(pipeline.experience, "finish", lambda batch, *a: batch)


@pytest.mark.parametrize("lag", [1, 2])
def test_no_push_while_an_older_request_is_out_on_any_server(fakes, no_finish, lag):
    tok = char_tokenizer()
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    servers = [fakes(model=tiny_model("llama", len(tok), seed=2, **TINY), delay_s=0.02) for _ in range(2)]
    steps = 6
    backend, got, published = _train(trainer, servers, lag, steps)
    versions = sorted({sampled_with(t, lag) for t in range(1, steps + 1)})
    for fake in servers:
        pushes = [(a, b) for path, body, a, b, _ in fake.spans
                  if path == "/collective_rpc" and body["method"] == "grpo_receive"]
        samples = [(body["prompt"][-1], a, b, held) for path, body, a, b, held in fake.spans
                   if path == "/v1/completions" and "n" in body]
        assert len(pushes) == len(versions) and fake.received == len(versions)  # every server, every version
        assert samples, "a server got no request"  # the groups are spread over both servers
        for step, a, b, held in samples:
            assert held == backend.label(sampled_with(step, lag)), (step, held)
            assert not any(pa < b and a < pb for pa, pb in pushes), f"a push overlapped a request of step {step}"
        last = published[versions[-1]]  # the servers hold the weights of the last version published, exactly
        assert all(torch.equal(fake.model.state_dict()[k], last[k]) for k in last)
    assert backend.stats()["server/sync_logprob_gap"] < 1e-5
    for t, batch in got.items():
        assert batch.versions == [sampled_with(t, lag)] * 2, t
        assert batch.stats["async/staleness_max"] == t - 1 - sampled_with(t, lag)
        assert batch.stats["time/weights_load_s"] >= 0 and batch.stats["time/generator_busy_s"] > 0


def test_a_server_that_keeps_old_weights_stops_the_run_in_one_line(fakes, no_finish):
    tok = char_tokenizer()
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    stale = fakes(model=tiny_model("llama", len(tok), seed=1, **TINY), stale=True)
    with pytest.raises(ServerError) as e:
        _train(trainer, [stale], lag=1, steps=4)
    assert "weight sync check failed" in str(e.value) and "\n" not in str(e.value)


def test_a_failure_on_the_worker_thread_comes_back_in_one_line(fakes):
    tok = char_tokenizer()
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    backend = _backend(trainer, [fakes(model=tiny_model("llama", len(tok), seed=1, **TINY))])

    def broken(step, version):
        raise ValueError("reward exploded\nsecond line")

    gen = ServerGenerator(backend, trainer, broken)
    gen.publish(0)
    gen.submit(1, 0)
    with pytest.raises(pipeline.GeneratorError, match="ValueError: reward exploded$"):
        gen.receive(timeout=30)
    gen.close()


def test_a_request_before_its_weights_is_refused(fakes):
    tok = char_tokenizer()
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    backend = _backend(trainer, [fakes(model=tiny_model("llama", len(tok), seed=1, **TINY))])
    gen = ServerGenerator(backend, trainer, _sample(backend))
    gen.publish(0)
    gen.submit(1, 1)  # version 1 was never published
    with pytest.raises(pipeline.GeneratorError, match="published out of order"):
        gen.receive(timeout=30)
    gen.close()


# ------------------------------------------------------------------------------- against a recording backend (fast)
class _Servers:
    """A `ServerBackend` stand-in: records each push (its version, the snapshot's tensors) and each check."""
    check_ids, device = [1, 5, 6, 7], "cpu"

    def __init__(self, fail_check=None, sends=True):
        self.version, self.log, self.fail_check = None, [], fail_check
        self.transfer = object() if sends else None  # rank 0 sends; another training rank has no weight channel

    def push(self, weights, version):
        import time

        self.log.append(("push", version, {k: (v.clone(), id(v)) for k, v in weights}))
        time.sleep(0.02)
        self.version = version

    def check(self, mine=None):
        self.log.append(("check", mine))
        if self.fail_check:
            raise self.fail_check


def _recording(servers, log):
    def sample(step, version):
        log.append(("sample", step, version, servers.version))
        return Generated(step, version, batch=None, sampler={"after": step})
    return sample


def _received(gen, timeout=None, within_s=10.0):
    """``gen.receive(timeout)`` on a thread of its own, failed when it has not come back within ``within_s``: a
    broken deadline shows in seconds instead of hanging the test (and a mutation run) until something kills it."""
    import threading

    out = {}

    def call():
        try:
            out["batch"] = gen.receive(timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - handed back to the test as raised
            out["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(within_s)
    assert not t.is_alive(), f"receive(timeout={timeout}) did not come back within {within_s} s"
    if "error" in out:
        raise out["error"]
    return out["batch"]


def test_the_worker_pushes_each_published_snapshot_before_the_steps_that_use_it():
    from grpo.rollout.server.backend import trainer_logprobs

    tok = char_tokenizer()
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    servers = _Servers()
    gen = ServerGenerator(servers, trainer, _recording(servers, servers.log))
    assert gen.thread.daemon and gen.thread.name == "grpo-server-generator" and gen.closers == []
    name, first = next(iter(trainer.state_dict().items()))
    want = trainer_logprobs(trainer, servers.check_ids)
    before = first.clone()
    gen.publish(0)
    with torch.no_grad():  # the optimizer steps before the worker pushes: the snapshot is version 0's
        first.add_(1.0)
    gen.submit(1, 0)
    gen.submit(2, 0)
    got = [_received(gen, 10) for _ in range(2)]
    gen.publish(1)
    gen.submit(3, 1)
    got.append(_received(gen, 10))
    gen.close()
    kinds = [e[0] for e in servers.log]
    assert kinds == ["push", "check", "sample", "sample", "push", "check", "sample"]
    assert [e[1:] for e in servers.log if e[0] == "sample"] == [(1, 0, 0), (2, 0, 0), (3, 1, 1)]
    pushed0, pushed1 = servers.log[0][2], servers.log[4][2]
    assert servers.log[0][1] == 0 and servers.log[4][1] == 1
    assert torch.equal(pushed0[name][0], before) and pushed1[name][1] == pushed0[name][1]  # buffers reused
    assert torch.equal(pushed1[name][0], first) and pushed0[name][1] != id(first)
    assert torch.equal(servers.log[1][1], want)  # the trainer's log-probs of the snapshot, taken at publication
    assert [g.step for g in got] == [1, 2, 3] and all(g.wait_s >= 0 and g.busy_s >= 0 for g in got)
    assert got[0].load_s >= 0.02 and got[1].load_s == 0 and got[2].load_s >= 0.02  # each push counted once
    assert not gen.thread.is_alive()


def test_a_rank_that_does_not_send_keeps_no_snapshot_but_takes_part_in_each_push_and_check():
    """Several training processes: every rank publishes at the same step (under ZeRO-3 each weight is gathered, a
    collective), only the sending rank keeps the snapshot; the others' workers push nothing (they wait for rank 0's
    push there) and check with the trainer's log-probs of the same version."""
    from grpo.rollout.server.backend import trainer_logprobs

    tok = char_tokenizer()
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    servers = _Servers(sends=False)
    gen = ServerGenerator(servers, trainer, _recording(servers, servers.log))
    gen.publish(0)
    gen.submit(1, 0)
    _received(gen, 10)
    gen.close()
    assert [e[0] for e in servers.log] == ["push", "check", "sample"]
    assert servers.log[0][1:] == (0, {})  # version 0, no weights of its own to send
    assert torch.equal(servers.log[1][1], trainer_logprobs(trainer, servers.check_ids))


def test_receive_raises_the_workers_failure_and_says_when_nothing_comes():
    from grpo.errors import GRPOError

    tok = char_tokenizer()
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    own = ServerError("weight sync check failed: a line")
    gen = ServerGenerator(_Servers(fail_check=own), trainer, lambda s, v: None)
    gen.publish(0)
    with pytest.raises(GRPOError) as e:
        _received(gen, 10)
    assert e.value is own  # the project's own errors as they are
    with pytest.raises(pipeline.GeneratorError, match="^the server generator's thread has stopped$"):
        _received(gen, 10)
    closed = []
    idle = ServerGenerator(_Servers(), trainer, lambda s, v: None, closers=[lambda: closed.append(1),
                                                                          lambda: closed.append(2)])
    with pytest.raises(TimeoutError, match="no batch from the rollout servers in time"):
        _received(idle, 0.1)
    idle.todo.put(("sample", 9, 9))  # never started: dropped at close (the servers hold no version 9)
    idle.close()
    assert closed == [1, 2] and not idle.thread.is_alive() and idle.done.empty()
    early = ServerGenerator(_Servers(), trainer, lambda s, v: None)
    early.submit(1, 0)  # before any push
    with pytest.raises(pipeline.GeneratorError, match="^the server generator failed: RuntimeError: step 1 wants the "
                                                      "weights of version 0, the servers hold None: published out of "
                                                      "order$"):
        _received(early, 10)
    early.close()
    bare = ServerGenerator(_Servers(), trainer, lambda s, v: None)
    bare.done.put(("error", KeyError()))
    with pytest.raises(pipeline.GeneratorError, match="^the server generator failed: KeyError: $"):
        _received(bare)
    bare.close()


class _SlowServers(_Servers):
    def push(self, weights, version):
        import time

        super().push(weights, version)
        time.sleep(0.2)


def _slow_sample(servers, seconds):
    def sample(step, version):
        import time

        time.sleep(seconds)
        return Generated(step, version, batch=None, sampler={})
    return sample


def test_receive_waits_for_a_late_batch_and_a_timeout_ends_at_the_first_poll_past_it(monkeypatch):
    import time
    import types

    from grpo.rollout.server import generator_thread as generator

    trainer = tiny_model("llama", len(char_tokenizer()), seed=1, **TINY)
    servers = _Servers()
    gen = ServerGenerator(servers, trainer, _slow_sample(servers, 1.5))
    gen.publish(0)
    gen.submit(1, 0)
    gen.submit(2, 0)
    assert _received(gen, 5).step == 1  # comes after the first 1 s poll, well before its deadline
    assert _received(gen, None).step == 2  # no timeout: waits as long as it takes
    gen.close()
    idle = ServerGenerator(_Servers(), trainer, lambda s, v: None)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        _received(idle, 0.1)
    assert time.monotonic() - t0 < 1.8  # told at the first poll (1 s), not later
    clock = iter([100.0, 105.0])  # the deadline, then the first poll exactly at it
    monkeypatch.setattr(generator, "time", types.SimpleNamespace(time=lambda: next(clock)))
    with pytest.raises(TimeoutError):
        _received(idle, 5)
    monkeypatch.undo()
    idle.close()


def test_close_gives_a_stuck_task_wait_s_then_leaves_it_to_its_thread():
    import threading
    import time

    trainer = tiny_model("llama", len(char_tokenizer()), seed=1, **TINY)
    release = threading.Event()
    closed = []
    stuck = ServerGenerator(_Servers(), trainer, lambda s, v: release.wait(30), closers=[lambda: closed.append(1)])
    stuck.publish(0)
    stuck.submit(1, 0)
    time.sleep(0.3)  # the worker is in the sample now
    t0 = time.monotonic()
    stuck.close(wait_s=0.3)
    assert time.monotonic() - t0 < 5 and stuck.thread.is_alive() and closed == [1]
    release.set()
    idle = ServerGenerator(_Servers(), trainer, lambda s, v: None)
    joins, join = [], idle.thread.join
    idle.thread.join = lambda timeout=None: (joins.append(timeout), join(timeout))[1]
    idle.close()
    assert joins == [10.0] and not idle.thread.is_alive()


def test_a_batch_times_its_wait_its_sampling_and_every_push_before_it():
    import time

    trainer = tiny_model("llama", len(char_tokenizer()), seed=1, **TINY)
    servers = _SlowServers()
    t0 = time.time()
    gen = ServerGenerator(servers, trainer, _slow_sample(servers, 0.3))
    gen.publish(0)
    gen.publish(1)
    gen.submit(1, 1)
    got = _received(gen, 10)
    elapsed = time.time() - t0
    gen.close()
    assert got.load_s >= 0.4  # both pushes (0.2 s each) count
    assert got.busy_s >= 0.3 and got.wait_s >= 0
    assert got.wait_s + got.load_s + got.busy_s <= elapsed  # the three split the worker's time, none twice


class _LoraServers(_Servers):
    """Servers syncing LoRA adapters: the backend hands over the snapshot (an `Adapter`, not weights by name)."""
    adapters = "the adapters"

    def __init__(self):
        super().__init__()
        self.read = []

    def weights(self, model):
        self.read.append(model)
        return SimpleNamespace(a_and_b=len(self.read))

    def push(self, weights, version):
        self.log.append(("push", version, weights))
        self.version = version


def test_with_lora_adapters_the_backend_reads_the_snapshot_and_the_worker_pushes_it_as_it_is():
    from grpo.rollout.server.backend import trainer_logprobs

    tok = char_tokenizer()
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    servers = _LoraServers()
    gen = ServerGenerator(servers, trainer, _recording(servers, servers.log))
    want = trainer_logprobs(trainer, servers.check_ids)
    gen.publish(0)
    gen.submit(1, 0)
    got = _received(gen, 10)
    gen.close()
    assert servers.read == [trainer] and got.step == 1
    assert [e[0] for e in servers.log] == ["push", "check", "sample"]
    assert servers.log[0][1:] == (0, SimpleNamespace(a_and_b=1)) and gen.free.empty()  # no buffers to reuse
    assert torch.equal(servers.log[1][1], want)


def _gathering(log):
    """A runtime's ``full_weights`` that records each weight it makes whole (a ZeRO-3 gather is a collective)."""
    import contextlib

    @contextlib.contextmanager
    def full_weights(params):
        log.append(len(params))
        yield False
    return full_weights


@pytest.mark.parametrize("sends", [True, False])
def test_every_rank_gathers_every_weight_through_the_runtime_and_only_the_sender_keeps_them(sends):
    tok = char_tokenizer()
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    servers, gathered = _Servers(sends=sends), []
    gen = ServerGenerator(servers, trainer, _recording(servers, servers.log), full_weights=_gathering(gathered))
    gen.publish(0)
    gen.submit(1, 0)
    _received(gen, 10)
    gen.close()
    names = list(trainer.state_dict())
    assert len(gathered) == len(names) and set(gathered) <= {0, 1}  # each weight once, the non-sender's too
    pushed = servers.log[0][2]
    assert list(pushed) == (names if sends else [])
    if sends:
        assert all(torch.equal(pushed[k][0], v) for k, v in trainer.state_dict().items())


def test_a_weight_whose_dtype_changed_gets_a_new_buffer():
    tok = char_tokenizer()
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    servers = _Servers()
    gen = ServerGenerator(servers, trainer, _recording(servers, servers.log))
    gen.publish(0)
    gen.submit(1, 0)
    _received(gen, 10)
    trainer.to(torch.float64)  # same shapes, another dtype
    gen.publish(1)
    gen.submit(2, 1)
    _received(gen, 10)
    gen.close()
    first, second = servers.log[0][2], servers.log[3][2]
    assert all(t.dtype == torch.float32 for t, _ in first.values())
    assert all(t.dtype == torch.float64 for t, _ in second.values())


class _GatedServers(_Servers):
    """Pushes only once the test opens the gate: the trainer's next optimizer step surely comes first."""

    def __init__(self):
        import threading

        super().__init__()
        self.gate = threading.Event()

    def push(self, weights, version):
        assert self.gate.wait(10), "the test never opened the gate"
        super().push(weights, version)


def test_the_snapshot_is_a_copy_the_optimizer_step_after_publish_does_not_reach():
    tok = char_tokenizer()
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    servers = _GatedServers()
    gen = ServerGenerator(servers, trainer, _recording(servers, servers.log))
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    gen.publish(0)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(1.0)
    servers.gate.set()
    gen.submit(1, 0)
    _received(gen, 10)
    gen.close()
    pushed = servers.log[0][2]
    assert list(pushed) == list(before) and all(torch.equal(pushed[k][0], v) for k, v in before.items())
