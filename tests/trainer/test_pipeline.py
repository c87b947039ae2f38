"""grpo/trainer/pipeline.py: the fixed-lag schedule, the in-flight bookkeeping against a recording generator (no
process), what a checkpoint stores and what a resume asks for, and the one-line refusals."""
import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from grpo.batch import Batch
from grpo.errors import SetupError
from grpo.rollout import registry
from grpo.rollout.generator_process import Generated
from grpo.runtime.base import Runtime
from grpo.trainer import pipeline
from grpo.trainer.pipeline import AsyncBatches, sampled_with


def test_the_schedule_is_a_fixed_lag_and_k0_is_the_synchronous_loop():
    assert [sampled_with(t, 0) for t in range(1, 6)] == [0, 1, 2, 3, 4]  # step t: the weights step t-1 left
    assert [sampled_with(t, 1) for t in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [sampled_with(t, 2) for t in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    # num_iterations = 2: a batch at steps 1, 3, 5, ...; the lag counts batches (K = 1: the previous batch's start)
    assert [sampled_with(t, 1, passes=2) for t in (1, 3, 5, 7)] == [0, 0, 2, 4]
    assert [sampled_with(t, 0, passes=2) for t in (1, 3, 5)] == [0, 2, 4]


class Recorder:
    """A generator that records what it is told and answers each request at once (in order)."""

    def __init__(self, runtime=None):
        self.calls, self.queue, self.held, self.runtime = [], [], None, runtime

    def publish(self, version, weights):
        assert self.runtime is None or self.runtime.gathered, "weights published outside Runtime.full_weights"
        self.calls.append(("publish", version, sorted(weights)))
        self.held = version

    def submit(self, step, version):
        assert version == self.held, "a request must come after the weights it samples with"
        self.calls.append(("submit", step, version))
        batch = Batch([{}], [[1]], [[[2], [3]]], [[False, False]], torch.zeros(2), torch.zeros(2), stats={},
                      versions=[version])
        self.queue.append(Generated(step, version, batch, sampler={"drawn_for": step}, wait_s=0.5))

    def receive(self, timeout=None):
        return self.queue.pop(0)

    def close(self):
        self.calls.append(("close",))


class Gathering(Runtime):
    """A runtime whose weights are whole only inside `full_weights` (as ZeRO-3's)."""
    is_main, gathered = False, False

    @contextlib.contextmanager
    def full_weights(self, params):
        self.gathered = True
        yield True
        self.gathered = False


def _run():
    policy = torch.nn.Linear(2, 2)
    policy.bias.requires_grad_(False)  # a frozen weight (LoRA's base): sent once, to a new generator only
    prompts = SimpleNamespace(state=None)
    prompts.load_state_dict = lambda s: setattr(prompts, "state", s)
    return SimpleNamespace(policy=policy, sampler=SimpleNamespace(prompts=prompts), runtime=Gathering(),
                           settings=SimpleNamespace(collect="collect settings"))


@pytest.fixture
def no_finish(monkeypatch):
    monkeypatch.setattr(pipeline.experience, "finish", lambda batch, runtime, s, reference: batch)


def test_every_step_is_asked_once_with_its_version_after_those_weights(no_finish):
    run = _run()
    gen = Recorder(run.runtime)  # the weights are read whole (gathered, under ZeRO-3) while they are published
    src = AsyncBatches(run, gen, lag=2, max_steps=6)
    stats = {t: src.batch(t).stats for t in range(1, 7)}
    submits = [c for c in gen.calls if c[0] == "submit"]
    assert [(s, v) for _, s, v in submits] == [(t, sampled_with(t, 2)) for t in range(1, 7)]
    publishes = [c for c in gen.calls if c[0] == "publish"]
    assert [v for _, v, _ in publishes] == [0, 1, 2, 3]  # version 4 and 5 would sample steps 7, 8: none
    assert publishes[0][2] == ["bias", "weight"] and all(p[2] == ["weight"] for p in publishes[1:])
    assert [stats[t]["async/staleness_max"] for t in range(1, 7)] == [0, 1, 2, 2, 2, 2]
    assert [stats[t]["async/in_flight"] for t in range(1, 7)] == [2, 2, 2, 2, 1, 0]
    assert all(stats[t]["time/generator_wait_s"] == 0.5 and stats[t]["time/trainer_wait_s"] >= 0 for t in stats)
    assert "trainer waited" in src.bottleneck() and "the generator 0.50 s" in src.bottleneck()


def test_a_checkpoint_stores_the_next_k_batches_and_a_resume_asks_only_for_the_rest(no_finish):
    gen, run = Recorder(), _run()
    src = AsyncBatches(run, gen, lag=2, max_steps=8)
    for t in (1, 2, 3):
        src.batch(t)
    saved = src.in_flight()
    assert sorted(saved["batches"]) == [4, 5] and saved["lag"] == 2
    assert [saved["batches"][s].version for s in (4, 5)] == [1, 2]  # versions older than the checkpoint's (3)
    assert run.sampler.prompts.state == {"drawn_for": 5}  # the checkpoint's sampler: after the stored batches' prompts
    again = Recorder()
    resumed = AsyncBatches(run, again, lag=2, max_steps=8, saved=saved)
    assert resumed.batch(4).versions == [1]  # the stored batch, not a new one
    assert again.calls == [("publish", 3, ["bias", "weight"]), ("submit", 6, 3)]
    assert resumed.batch(5).versions == [2] and resumed.batch(6).versions == [3]
    assert [c[1:] for c in again.calls if c[0] == "submit"] == [(6, 3), (7, 4), (8, 5)]


def test_with_several_passes_per_batch_only_batch_steps_are_asked_for_and_the_lag_counts_batches(no_finish):
    """num_iterations = 2, K = 1: a batch at steps 1, 3, 5, 7; the batch of step 5 is sampled with the weights when
    the batch of step 3 started (version 2) while steps 3 and 4 train; a checkpoint mid-batch (after step 3) stores
    the batch of step 5 and a resume asks for step 7 with version 4."""
    run = _run()
    gen = Recorder(run.runtime)
    src = AsyncBatches(run, gen, lag=1, max_steps=8, passes=2)
    stats = {t: src.batch(t).stats for t in (1, 3)}
    assert [c[1:] for c in gen.calls if c[0] == "submit"] == [(1, 0), (3, 0), (5, 2)]
    assert [c[1] for c in gen.calls if c[0] == "publish"] == [0, 2]
    assert [stats[t]["async/staleness_max"] for t in (1, 3)] == [0, 2]  # in loop steps: K x num_iterations
    saved = src.in_flight()
    assert {s: g.version for s, g in saved["batches"].items()} == {5: 2}
    again = Recorder(run.runtime)
    resumed = AsyncBatches(run, again, lag=1, max_steps=8, saved=saved, passes=2)
    assert resumed.batch(5).versions == [2] and resumed.batch(7).versions == [4]
    assert [c[1:] for c in again.calls] == [(4, ["bias", "weight"]), (7, 4)]  # step 9 is past max_steps


def test_the_generator_starts_at_the_first_batch_it_samples_and_never_when_every_step_left_is_in_flight(no_finish):
    """``generator`` given as the function that starts it: called once, at the first step that asks it for a batch
    (a fresh run: step 1); a resume whose remaining steps are all stored in its checkpoint trains them without one."""
    run, started = _run(), []

    def start():
        started.append(Recorder())
        return started[-1]

    src = AsyncBatches(run, start, lag=2, max_steps=4)
    assert not started and src.close() is None  # nothing started: nothing to close
    src.batch(1)
    assert len(started) == 1 and started[0].calls[0][:2] == ("publish", 0)
    src.batch(2)
    saved = src.in_flight()
    src.close()
    assert len(started) == 1 and started[0].calls[-1] == ("close",)
    resumed, started[:] = AsyncBatches(run, start, lag=2, max_steps=4, saved=saved), []
    assert resumed.batch(3).versions == [0] and resumed.batch(4).versions == [1]  # the stored batches
    assert resumed.in_flight()["batches"] == {} and not started
    resumed.close()
    again = AsyncBatches(run, start, lag=2, max_steps=5, saved=saved)  # one step more: asked of a generator
    again.batch(3)
    assert len(started) == 1 and [c[:2] for c in started[0].calls] == [("publish", 2), ("submit", 5)]


def test_a_checkpoint_at_the_end_holds_nothing_in_flight(no_finish):
    src = AsyncBatches(_run(), Recorder(), lag=1, max_steps=2)
    src.batch(1), src.batch(2)
    assert src.in_flight()["batches"] == {}


def test_a_resume_with_another_lag_is_refused():
    state = SimpleNamespace(in_flight={"lag": 2, "batches": {}})
    cfg = SimpleNamespace(rollout=SimpleNamespace(max_staleness=1))
    with pytest.raises(SetupError, match="rollout.max_staleness=2; resume with that value"):
        pipeline.batches(SimpleNamespace(), cfg, state)


@pytest.mark.parametrize("change,match", [
    ({"distributed": {"backend": "deepspeed"}, "algorithm": {"filter_zero_std_groups": True, "resample_zero_std": 2}},
     "algorithm.resample_zero_std=0"),
    ({"rollout": {"backend": "vllm"}}, "rollout.backend"),
])
def test_what_async_does_not_run_with_is_one_line(cfg_factory, change, match):
    cfg = cfg_factory({"rollout": {"max_staleness": 1}})
    for section, values in change.items():
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})
    try:
        pipeline.check(cfg)
    except SetupError as e:
        assert match in str(e) and "\n" not in str(e) and str(e).startswith("rollout.max_staleness=1")
    else:
        pytest.fail("not refused")
    pipeline.check(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_staleness=0)))


def test_zero_and_several_passes_run_asynchronously(cfg_factory):
    """What async now composes with: ZeRO-2/3 (one generator per rank), the zero-std filter on many ranks,
    num_iterations > 1; the server generator also with ZeRO, several passes and refill rounds together."""
    server = {"backend": "server", "server": {"urls": ["http://127.0.0.1:9"]}}
    refill, ds = {"filter_zero_std_groups": True, "resample_zero_std": 2}, {"backend": "deepspeed"}
    for rollout, change in (({}, {"distributed": {**ds, "zero_stage": 3}}),
                            ({}, {"distributed": ds, "algorithm": {"filter_zero_std_groups": True}}),
                            ({}, {"algorithm": {"num_iterations": 3}}),
                            ({}, {"algorithm": refill}),  # one process: refills
                            (server, {"distributed": {**ds, "zero_stage": 3},
                                      "algorithm": {"num_iterations": 2, **refill}})):
        pipeline.check(cfg_factory({"rollout": {"max_staleness": 2, **rollout}, **change}))


@pytest.mark.parametrize("server,match", [
    ({"sync_every": 2}, "rollout.server.sync_every=1"),
])
def test_the_server_generator_refuses_what_it_does_not_run_with_in_one_line(cfg_factory, server, match):
    cfg = cfg_factory({"rollout": {"max_staleness": 1, "backend": "server",
                                   "server": {"urls": ["http://127.0.0.1:9"], **server}}})
    with pytest.raises(SetupError, match=match) as e:
        pipeline.check(cfg)
    assert "\n" not in str(e.value) and str(e.value).startswith("rollout.max_staleness=1")
    pipeline.check(cfg_factory({"rollout": {"max_staleness": 1, "backend": "server",
                                            "server": {"urls": ["http://127.0.0.1:9"]}}}))  # gloo, every step: runs


# ------------------------------------------------------------------------------- the units mutation testing reaches
def _cfg(K=1, backend="hf", dist="none", device="cpu", filter_zero=False, resample=0, passes=1, **server):
    """The settings `check` reads, without composing a config (fast enough for every mutant)."""
    s = {"sync_every": 1, "weight_transfer": "auto", **server}
    return SimpleNamespace(rollout=SimpleNamespace(max_staleness=K, backend=backend, server=SimpleNamespace(**s)),
                           trainer=SimpleNamespace(device=device), distributed=SimpleNamespace(backend=dist),
                           algorithm=SimpleNamespace(filter_zero_std_groups=filter_zero, resample_zero_std=resample,
                                                     num_iterations=passes))


@pytest.mark.parametrize("kw,says", [
    ({"backend": "vllm"}, "rollout.max_staleness=1 drives the hf generator process or the rollout servers "
                          "(rollout.backend=vllm); use rollout.backend=hf or server"),
    ({"dist": "deepspeed", "filter_zero": True, "resample": 1},
     "rollout.max_staleness=1 with distributed.backend=deepspeed samples in one generator process per rank, which "
     "cannot agree on refill rounds (algorithm.resample_zero_std=1); use algorithm.resample_zero_std=0 (the zero-std "
     "filter alone works), rollout.backend=server, or distributed.backend=none"),
    ({"backend": "one-rank", "dist": "deepspeed"}, "rollout.max_staleness=1 with rollout.backend=one-rank runs one "
     "trainer process for now (distributed.backend=deepspeed); use distributed.backend=none, or rollout.backend=hf "
     "(a generator per rank)"),
    ({"backend": "one-rank", "passes": 2}, "rollout.max_staleness=1 with rollout.backend=one-rank trains each batch "
     "once for now (algorithm.num_iterations=2); use algorithm.num_iterations=1, or rollout.backend=hf"),
    ({"backend": "server", "sync_every": 2}, "rollout.max_staleness=1 pushes every version the schedule samples with "
     "(rollout.server.sync_every=2); the lag is rollout.max_staleness: use rollout.server.sync_every=1"),
])
def test_each_refusal_of_check_is_its_own_whole_line(kw, says, monkeypatch):
    # a backend of one's own that samples ahead from one trainer process, one pass per batch (no built-in one does)
    caps = registry.Capabilities(ahead="thread", ahead_ranks=False, ahead_passes=False)
    if kw.get("backend") == "one-rank":
        monkeypatch.setitem(registry.BACKENDS._items, "one-rank", registry.Backend("one-rank", caps, "unused:make"))
    with pytest.raises(SetupError) as e:
        pipeline.check(_cfg(**kw))
    assert str(e.value) == says or (len(says) < 20 and says in str(e.value))
    pipeline.check(_cfg(K=0, **kw))  # K = 0: nothing is refused


@pytest.mark.parametrize("kw", [{}, {"backend": "auto"}, {"dist": "deepspeed", "filter_zero": True},
                                {"filter_zero": True, "resample": 2}, {"dist": "deepspeed", "resample": 2},
                                {"passes": 3}, {"backend": "server"}, {"backend": "server", "device": "auto"},
                                {"backend": "server", "dist": "deepspeed", "filter_zero": True, "resample": 2,
                                 "passes": 2},
                                {"backend": "server", "device": "cuda", "weight_transfer": "gloo"},
                                {"backend": "server", "device": "cuda"},
                                {"backend": "server", "weight_transfer": "nccl"}])
def test_what_check_lets_through(kw):
    pipeline.check(_cfg(**kw))


@pytest.mark.parametrize("device,seen", [("auto", "cpu"), ("cpu", "cpu"), ("cuda", "cuda")])
def test_a_backends_own_refusal_is_asked_with_the_run_and_the_device_auto_resolved(device, seen, monkeypatch):
    """One pass per batch is what a backend without several passes may train; its own check is asked last, with
    the run's rollout section and the device (auto: cuda where there is one, else cpu)."""
    asked = []
    caps = registry.Capabilities(ahead="thread", ahead_ranks=False, ahead_passes=False)
    monkeypatch.setitem(registry.BACKENDS._items, "own", registry.Backend(
        "own", caps, "unused:make", refuse_ahead=lambda r, dev: asked.append((r, dev)) or None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = _cfg(backend="own", device=device, passes=1)
    pipeline.check(cfg)
    assert asked == [(cfg.rollout, seen)]


def test_the_server_refusals_follow_the_device_and_auto_is_resolved(cfg_factory):
    """Both weight paths push snapshots (nccl: `grpo.rollout.server.nccl.StreamSource`), so neither device is
    refused; ``rollout.backend=auto`` resolves to hf on the CPU (runs asynchronously) and the device ``auto`` to the
    CPU here."""
    base = cfg_factory({"rollout": {"max_staleness": 1, "backend": "server", "server": {"urls": ["http://h:1"]}}})
    on = lambda device, **server: dataclasses.replace(base, trainer=dataclasses.replace(  # noqa: E731
        base.trainer, device=device), rollout=dataclasses.replace(base.rollout, server=dataclasses.replace(
            base.rollout.server, **server)))
    pipeline.check(on("cuda"))
    pipeline.check(on("cuda", weight_transfer="gloo"))
    pipeline.check(on("cpu"))
    pipeline.check(on("auto"))  # no CUDA on these machines: the CPU, gloo
    assert registry.server_refusal(on("cpu").rollout.server, "cpu") is None
    assert "sync_every=3" in registry.server_refusal(on("cpu", sync_every=3).rollout.server, "cpu")
    auto = cfg_factory({"rollout": {"max_staleness": 1, "backend": "auto"}})
    pipeline.check(auto)
    assert registry.pick("auto", "cpu") == "hf" and registry.pick("server", "cpu") == "server"


def test_the_device_auto_is_cuda_where_there_is_one_and_auto_backend_follows_it(monkeypatch):
    """``trainer.device=auto`` with CUDA is the CUDA device (``weight_transfer=auto`` then means nccl, with
    snapshots: let through), and ``rollout.backend=auto`` resolves with that device (vllm on CUDA where vLLM is
    installed: refused)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pipeline.check(_cfg(backend="server", device="auto"))
    monkeypatch.setattr(registry, "vllm_available", lambda: True)
    with pytest.raises(SetupError, match=r"\(rollout.backend=auto\); use rollout.backend=hf or server"):
        pipeline.check(_cfg(backend="auto", device="auto"))
    assert registry.pick("auto", "cuda") == "vllm" and registry.pick("auto", "cpu") == "hf"


class _Gen(Recorder):
    """A recorder whose batches carry given versions and timings."""

    def __init__(self, runtime=None, versions=None, **times):
        super().__init__(runtime)
        self.versions, self.times = versions, times

    def submit(self, step, version):
        super().submit(step, version)
        self.queue[-1].batch.versions = self.versions
        self.queue[-1].__dict__.update(self.times)


def test_the_staleness_metrics_are_over_the_batchs_own_versions_and_the_times_are_the_generators(no_finish):
    """A batch whose samples carry several versions (a server run's groups) reports the mean and max staleness over
    them; without versions the batch's own; the generator's busy, wait and load times are passed on."""
    gen = _Gen(versions=[0, 0, 0, 2], busy_s=1.25, load_s=0.75, wait_s=0.5)
    src = AsyncBatches(_run(), gen, lag=1, max_steps=4)
    src.batch(1), src.batch(2)
    stats = src.batch(4 - 1).stats  # step 3: staleness 3 - 1 - v over versions 0, 0, 0, 2
    assert stats["async/staleness_mean"] == pytest.approx((2 + 2 + 2 + 0) / 4) and stats["async/staleness_max"] == 2
    assert (stats["time/generator_busy_s"], stats["time/weights_load_s"], stats["time/generator_wait_s"]) == \
        (1.25, 0.75, 0.5)
    assert stats["time/weights_publish_s"] >= 0 and stats["async/version"] == sampled_with(3, 1)
    plain = AsyncBatches(_run(), _Gen(versions=None), lag=2, max_steps=4)
    got = [plain.batch(t).stats for t in (1, 2, 3)]
    assert [s["async/staleness_mean"] for s in got] == [0, 1, 2] and [s["async/version"] for s in got] == [0, 0, 0]


def test_the_bottleneck_counts_waits_after_the_first_batch_and_is_said_on_the_main_rank(no_finish, capsys):
    run = _run()
    run.runtime.is_main = True
    gen = _Gen(wait_s=2.0)
    src = AsyncBatches(run, gen, lag=1, max_steps=12)
    src.batch(1)
    assert src.waits == {"trainer": 0.0, "generator": 0.0, "steps": 0}  # the first batch is always waited for
    for t in range(2, 10):
        src.batch(t)
    assert src.waits["steps"] == 8 and src.waits["generator"] == pytest.approx(16.0)
    assert capsys.readouterr().err == ""  # said every 10 steps only
    src.batch(10)
    err = capsys.readouterr().err
    assert err.startswith("[grpo] async K=1: the trainer waited ") and "the generator 2.00 s for weights" in err
    assert "training (the update) is the bottleneck" in err  # the generator waited longer than the trainer
    src.waits = {"trainer": 3.0, "generator": 1.0, "steps": 1}
    assert "waited 3.00 s per step for batches, the generator 1.00 s" in src.bottleneck()
    src.waits = {"trainer": 1.0, "generator": 1.0, "steps": 1}
    assert src.bottleneck().endswith("training (the update) is the bottleneck")  # a tie: neither side waits less
    src.waits = {"trainer": 0.004, "generator": 0.0, "steps": 1}
    assert src.bottleneck().endswith("trainer waited 0.00 s per step for batches, the generator 0.00 s for weights: "
                                     "neither is the bottleneck")
    src.waits = {"trainer": 0.005, "generator": 0.0, "steps": 1}  # printed as 0.01 s: a side did wait
    assert src.bottleneck().endswith("the generator 0.00 s for weights: generation (sampling and rewards) is the "
                                     "bottleneck")
    src.waits = {"trainer": 3.0, "generator": 1.0, "steps": 2}
    assert src.bottleneck().startswith("async K=1: the trainer waited 1.50 s per step for batches, the generator "
                                       "0.50 s for weights: generation (sampling and rewards) is the bottleneck")
    src.close()
    assert "generation (sampling and rewards)" in capsys.readouterr().err and gen.calls[-1] == ("close",)
    AsyncBatches(_run(), _Gen(), lag=1, max_steps=2).close()  # no step yet: nothing to say
    assert capsys.readouterr().err == ""
    run.runtime.is_main = False
    src._say("not on this rank")
    assert capsys.readouterr().err == ""


def test_a_step_never_asked_for_and_a_failed_generator_are_one_line_errors(no_finish):
    src = AsyncBatches(_run(), Recorder(), lag=1, max_steps=3)
    with pytest.raises(RuntimeError, match="the batch of step 3 was never asked of the generator"):
        src._take(3)

    class Broken(Recorder):
        def receive(self, timeout=None):
            raise pipeline.GeneratorError("the generator process died (exit code -9)")

    with pytest.raises(SetupError, match=r"^the generator process died \(exit code -9\)$"):
        AsyncBatches(_run(), Broken(), lag=1, max_steps=3).batch(1)


def test_the_sampler_a_checkpoint_saves_is_the_one_after_the_newest_batch_asked_for(no_finish):
    """Only the batch of the newest step asked for carries the sampler after every prompt drawn (batches may come
    back before it); a checkpoint before any batch keeps the trainer's own sampler. A publication of an old version,
    or with nothing to ask, sends nothing."""
    run = _run()
    src = AsyncBatches(run, Recorder(), lag=2, max_steps=6)
    src._publish(0)  # steps 1, 2, 3 asked for
    src._receive()
    assert src.sampler is None  # step 1's sampler is not the newest
    src._receive(), src._receive()
    assert src.sampler == {"drawn_for": 3}
    fresh = _run()
    AsyncBatches(fresh, Recorder(), lag=1, max_steps=2).in_flight()
    assert fresh.sampler.prompts.state is None
    gen = Recorder()
    src = AsyncBatches(_run(), gen, lag=1, max_steps=2)
    src._publish(0)
    src._publish(0)
    assert [c[0] for c in gen.calls] == ["publish", "submit", "submit"]
    src._publish(1)  # step 3 would sample with it: past max_steps
    assert len(gen.calls) == 3 and src.published == 0


def test_batches_picks_the_source_and_builds_the_generator_of_this_rank(cfg_factory, monkeypatch):
    """K = 0: the inline source (collect in the loop); K > 0 (or ``process=True``): the generator process built
    from this rank's spec, or the server generator for a backend that samples ahead on a thread (the server)."""
    from grpo.runtime.local import LocalRuntime
    from grpo.trainer import generators

    built, builders = [], []
    monkeypatch.setattr(generators, "GeneratorProcess", lambda build, spec, name: built.append((spec, name)) or
                        builders.append(build) or Recorder())
    servers = []
    monkeypatch.setattr(generators, "server_generator", lambda run: servers.append(run) or Recorder())
    monkeypatch.setattr(pipeline.experience, "collect", lambda *a: ("collected", a))
    rt = LocalRuntime("cpu", 1, 2)
    settings = SimpleNamespace(sampler=SimpleNamespace(backend="hf"), collect="collect")
    run = SimpleNamespace(runtime=rt, settings=settings, splits=SimpleNamespace(train=[{"p": 1}]), toolset=None,
                          sampler=SimpleNamespace(prompts=SimpleNamespace(state_dict=lambda: {"pos": 7})))
    state = SimpleNamespace(in_flight=None)
    cfg = cfg_factory({"algorithm": {"num_iterations": 2}, "trainer": {"max_steps": 5}})
    inline = pipeline.batches(run, cfg, state)
    assert isinstance(inline, pipeline.InlineBatches)
    assert inline.batch(1) == ("collected", (run.sampler, rt, "collect", run))
    assert inline.in_flight() is None and inline.close() is None and not built
    src = pipeline.batches(run, cfg, state, process=True)
    assert isinstance(src, AsyncBatches) and (src.lag, src.max_steps, src.passes) == (0, 5, 2) and src.run is run
    assert src.gen is None and not built  # started when the first batch is asked of it
    assert isinstance(src.start(), Recorder)
    (spec, name), = built
    assert name == "grpo-generator-1" and (spec.rank, spec.world_size, spec.device) == (1, 2, "cpu")
    assert (spec.settings, spec.train_rows, spec.sampler, spec.threads) == (settings, [{"p": 1}], {"pos": 7},
                                                                           torch.get_num_threads())
    assert spec.model is cfg.model and spec.toolset is None
    saved = {"lag": 2, "batches": {4: "stored"}}
    k2 = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_staleness=2))
    again = pipeline.batches(run, k2, SimpleNamespace(in_flight=saved))
    assert isinstance(again, AsyncBatches) and again.ready == {4: "stored"} and again.lag == 2
    assert pipeline.batches(run, k2, state, process=False).__class__ is pipeline.InlineBatches
    server = cfg_factory({"rollout": {"max_staleness": 1, "backend": "server", "server": {"urls": ["http://h:1"]}},
                          "trainer": {"max_steps": 3}})
    on_servers = SimpleNamespace(**{**vars(run), "settings": SimpleNamespace(sampler=SimpleNamespace(
        backend="server"))})
    src = pipeline.batches(on_servers, server, state)
    assert isinstance(src.start(), Recorder) and (src.lag, src.max_steps, src.passes) == (1, 3, 1) and len(built) == 1
    assert src.run is on_servers and servers == [on_servers] and src.ready == {}
    resumed = pipeline.batches(on_servers, server, SimpleNamespace(in_flight={"lag": 1, "batches": {2: "stored"}}))
    assert resumed.ready == {2: "stored"} and resumed.submitted == {2}
    gpu = SimpleNamespace(**{**vars(run), "runtime": SimpleNamespace(device=torch.device("cuda", 1), rank=0,
                                                                       world_size=1)})
    pipeline.batches(gpu, cfg, state, process=True).start()  # a CUDA rank's generator samples on its device
    assert built[-1][0].device == "cuda:1" and built[-1][1] == "grpo-generator-0"
    assert builders == [generators.build_process_side] * 2  # the child builds the process side from the spec


def test_the_trainer_finishes_each_batch_and_its_waits_are_times_not_sums_of_clocks(monkeypatch):
    import time

    run = _run()
    gathered, finished, full = [], [], run.runtime.full_weights
    run.runtime.full_weights = lambda params: gathered.append(params) or full(params)
    monkeypatch.setattr(pipeline.experience, "finish",
                        lambda batch, rt, s, ref: finished.append((rt, s, ref)) or batch)
    src = AsyncBatches(run, Recorder(run.runtime), lag=1, max_steps=3)
    t0 = time.time()
    stats = [src.batch(t).stats for t in (1, 2, 3)]
    took = time.time() - t0
    assert finished == [(run.runtime, "collect settings", run)] * 3  # the trainer's runtime, settings, reference
    assert all(0 <= s[k] <= took for s in stats for k in ("time/trainer_wait_s", "time/weights_publish_s"))
    assert 0 <= src.waits["trainer"] <= took and src.waits["steps"] == 2
    trainable = [p for p in run.policy.parameters() if p.requires_grad]
    assert [list(map(id, g)) for g in gathered] == [list(map(id, run.policy.parameters())), list(map(id, trainable))]


def test_the_publish_time_is_the_publishs_own_and_an_old_version_costs_none(no_finish, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(pipeline, "time", SimpleNamespace(time=lambda: now[0]))

    class Slow(Recorder):
        def publish(self, version, weights):
            now[0] += 1.0  # each publication: 1 s
            super().publish(version, weights)

    def start():
        now[0] += 5.0  # the generator's start: 5 s, not the publication's
        return Slow()

    src = AsyncBatches(_run(), start, lag=1, max_steps=4)
    assert src.batch(1).stats["time/weights_publish_s"] == 1.0
    src._publish(1)  # published ahead of step 2's batch, which then publishes nothing
    assert src.batch(2).stats["time/weights_publish_s"] == 0.0


def test_a_generator_that_reads_the_model_itself_is_handed_only_the_version():
    class Reading(Recorder):
        reads_model = True

        def publish(self, version, weights):
            self.calls.append(("publish", version, weights))
            self.held = version

    run = _run()
    gen = Reading()
    src = AsyncBatches(run, gen, lag=1, max_steps=3)
    src._publish(0)
    assert gen.calls[0] == ("publish", 0, None) and not run.runtime.gathered


def test_a_generator_error_caused_by_a_lost_rank_is_the_runtimes_one_line_and_without_a_cause_a_setup_error():
    class Lost(Exception):
        pass

    class Peers(Gathering):
        def peer_failure(self, error):
            return Lost(f"lost a rank: {error}")

    class Broken(Recorder):
        def __init__(self, cause):
            super().__init__()
            self.cause = cause

        def receive(self, timeout=None):
            raise pipeline.GeneratorError("the workers stopped") from self.cause

    run = _run()
    run.runtime = Peers()
    with pytest.raises(Lost, match="^lost a rank: gloo timed out$"):
        AsyncBatches(run, Broken(RuntimeError("gloo timed out")), lag=1, max_steps=3).batch(1)
    with pytest.raises(SetupError, match="^the workers stopped$"):  # no cause: the runtime is not asked
        AsyncBatches(run, Broken(None), lag=1, max_steps=3).batch(1)
