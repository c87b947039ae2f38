"""grpo/runtime/deepspeed.py in one process, without DeepSpeed or a process group: stand-ins for the `deepspeed`
module, its engine, torch.distributed's calls and the launcher's store. What the runtime asks of them, and what it
makes of their answers; the runs on several ranks are tests/e2e/test_distributed.py's and test_rank_failure.py's."""
import contextlib
import datetime
import json
import logging
import math
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

import grpo.engine.unwrap
import grpo.vision.models  # imported here, not by the first call of _coalesce_needed: once, not in every mutant's run
from grpo.errors import PeerLostError, SetupError
from grpo.runtime import deepspeed as ds_runtime
from grpo.runtime.deepspeed import DeepSpeedRuntime
from grpo.runtime.thread_view import ThreadView
from tests.under_mutmut import bounded_under_mutmut  # noqa: F401  (a mutant's endless loop: 3 s)


def _d(**kw):
    return SimpleNamespace(**{"zero_stage": 2, "timeout_s": 30, "offload_optimizer": False,
                              "gather_for_generation": False, **kw})


def _runtime(stage=2, rank=0, world_size=2, **kw):
    """A runtime built without its __init__ (which needs a launcher): the attributes __init__ sets."""
    rt = DeepSpeedRuntime.__new__(DeepSpeedRuntime)
    rt.d, rt.shape = _d(zero_stage=stage), "shape"
    rt.rank, rt.world_size, rt.local_rank = rank, world_size, kw.pop("local_rank", rank)
    rt.device, rt.stage, rt.bf16 = torch.device("cpu"), stage, False
    rt.timeout, rt.store, rt.lost = datetime.timedelta(seconds=30), None, None
    rt.engine = rt.model = rt.optimizer = rt.scheduler = rt.reference_engine = None
    rt.node_local, rt._expected, rt._backwards, rt.coalesce, rt._coalescing = False, None, 0, False, None
    rt._ds = kw.pop("ds", None)
    for k, v in kw.items():
        setattr(rt, k, v)
    return rt


# ------------------------------------------------------------------------------------------------ start-up
class _DeepSpeed(SimpleNamespace):
    """The `deepspeed` module: its op table, init_distributed and initialize recorded."""

    def __init__(self):
        super().__init__(ops=SimpleNamespace(__compatible_ops__={"deepspeed_shm_comm": True}), calls=[])

    def init_distributed(self, **kw):
        self.calls.append(("init_distributed", kw))

    def initialize(self, **kw):
        self.calls.append(("initialize", kw))
        return self.engine, "opt", "data", "sched"


@pytest.fixture
def started(monkeypatch):
    """What __init__ talks to: the launcher's variables, the deepspeed module, torch.distributed, atexit."""
    calls, fake = [], _DeepSpeed()
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    monkeypatch.setattr(ds_runtime, "launcher_env", lambda: (1, 4, 0))
    monkeypatch.setattr(ds_runtime, "check", lambda d, shape, world: calls.append(("check", d, shape, world)))
    monkeypatch.setattr(ds_runtime, "uses_bf16", lambda d, shape: calls.append(("bf16", d, shape)) or True)
    monkeypatch.setattr(ds_runtime, "_attempt_store", lambda r, w, t: calls.append(("store", r, w, t)) or "store")
    monkeypatch.setattr(ds_runtime.atexit, "register", lambda fn: calls.append(("atexit", fn)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **kw: calls.append(("init", a, kw)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(ds_runtime, "STORE", [])
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    return calls, fake


def test_on_cpu_it_joins_a_gloo_group_on_the_launchers_store_then_deepspeed(started, monkeypatch):
    calls, fake = started
    d = _d(zero_stage=3, timeout_s="12.5")
    monkeypatch.setattr(logging.getLogger("compilers"), "level", logging.NOTSET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rt = DeepSpeedRuntime(d, "shape")
        for old in ("all_gather_into_tensor", "reduce_scatter_tensor"):  # DeepSpeed's calls of torch's old names
            warnings.warn(f"torch.distributed.{old} is deprecated, use ... instead", FutureWarning)
        warnings.warn("torch.distributed.reduce is deprecated", FutureWarning)
    assert [str(w.message) for w in caught] == ["torch.distributed.reduce is deprecated"]
    assert logging.getLogger("compilers").level == logging.WARNING  # DeepSpeed's op checks compile test programs
    timeout = datetime.timedelta(seconds=12.5)
    assert (rt.rank, rt.world_size, rt.local_rank) == (1, 4, 0)
    assert calls == [("check", d, "shape", 4), ("bf16", d, "shape"), ("store", 1, 4, timeout),
                     ("init", ("gloo",), {"store": "store", "rank": 1, "world_size": 4, "timeout": timeout}),
                     ("atexit", ds_runtime._destroy_process_group)]
    assert fake.calls == [("init_distributed", {"dist_backend": "gloo", "auto_mpi_discovery": False,
                                                "verbose": False, "timeout": timeout})]
    assert ds_runtime.os.environ["DS_ACCELERATOR"] == "cpu"
    assert fake.ops.__compatible_ops__["deepspeed_shm_comm"] is False  # nothing to compile at start on CPU
    assert rt.device == torch.device("cpu") and rt.backend == "gloo" and rt.stage == 3 and rt.bf16 is True
    assert rt.timeout == timeout and rt.store == "store" and rt.lost is None and ds_runtime.STORE == ["store"]
    assert (rt.engine, rt.model, rt.optimizer, rt.scheduler, rt.reference_engine) == (None,) * 5
    assert (rt.node_local, rt._expected, rt._backwards, rt.coalesce, rt._coalescing) == (False, None, 0, False, None)
    assert rt._ds is fake and rt.process_group is True


def test_on_gpus_it_uses_nccl_on_the_local_rank_unless_the_trainer_asks_for_the_cpu(started, monkeypatch):
    calls, fake = started
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    rt = DeepSpeedRuntime(_d(), "shape")
    assert rt.backend == "nccl" and rt.device == torch.device("cuda", 0) and ("set_device", 0) in calls
    init = next(c for c in calls if c[0] == "init")
    assert init[1] == ("nccl",) and init[2]["device_id"] == torch.device("cuda", 0)
    assert fake.ops.__compatible_ops__["deepspeed_shm_comm"] is True and fake.calls[0][1]["dist_backend"] == "nccl"
    del calls[:]
    rt = DeepSpeedRuntime(_d(), "shape", device="cpu")
    assert rt.backend == "gloo" and rt.device == torch.device("cpu") and not any(c[0] == "set_device" for c in calls)
    assert ds_runtime.os.environ["DS_ACCELERATOR"] == "cuda"  # a launcher's own choice is kept
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake.ops = SimpleNamespace()  # a DeepSpeed without the op table: nothing to switch off
    assert DeepSpeedRuntime(_d(), "shape").backend == "gloo"


def test_a_group_made_already_is_used_as_it_is_and_without_deepspeed_it_says_what_to_install(started, monkeypatch):
    calls, fake = started
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    rt = DeepSpeedRuntime(_d(), "shape")
    assert [c[0] for c in calls] == ["check", "bf16"] and rt.store is None and len(fake.calls) == 1
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    with pytest.raises(SetupError, match=r"needs the deepspeed package .*pip install 'grpo\[deepspeed\]'"):
        DeepSpeedRuntime(_d(), "shape")


def test_the_attempts_store_is_prefixed_by_the_restart_count(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.distributed, "rendezvous",
                        lambda url, r, w, timeout: asked.append((url, r, w, timeout)) or iter([("base", r, w)]))
    monkeypatch.setattr(torch.distributed, "PrefixStore", lambda prefix, store: (prefix, store))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    t = datetime.timedelta(seconds=3)
    assert ds_runtime._attempt_store(1, 2, t) == ("grpo/attempt_0", "base") and asked == [("env://", 1, 2, t)]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert ds_runtime._attempt_store(1, 2, t) == ("grpo/attempt_2", "base")


def test_the_group_is_destroyed_at_exit_only_when_there_is_one_and_a_failure_there_is_quiet(monkeypatch):
    destroyed = []
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: destroyed.append(1))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    ds_runtime._destroy_process_group()
    assert destroyed == []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    ds_runtime._destroy_process_group()
    assert destroyed == [1]

    def fails():
        raise RuntimeError("the group is gone")

    monkeypatch.setattr(torch.distributed, "destroy_process_group", fails)
    ds_runtime._destroy_process_group()


# ------------------------------------------------------------------------------------------------ building
def test_setup_initializes_deepspeed_with_the_runs_config_and_returns_the_engine(monkeypatch):
    fake = _DeepSpeed()
    fake.engine = SimpleNamespace(name="engine")
    rt = _runtime(ds=fake)
    configs = []
    monkeypatch.setattr(ds_runtime, "ds_config", lambda d, shape, w, **kw: configs.append((d, shape, w, kw)) or
                        {"checkpoint": {"tag_validation": "Warn"}, "x": 1})
    monkeypatch.setattr(rt, "_coalesce_needed", lambda model: model == "model")
    assert rt.setup("model", "adamw", "sched") is fake.engine
    assert configs == [(rt.d, "shape", 2, {})]
    assert fake.calls == [("initialize", {"model": "model", "optimizer": "adamw", "dist_init_required": False,
                                          "config": {"checkpoint": {"tag_validation": "Warn"}, "x": 1}})]
    assert (rt.engine, rt.model, rt.optimizer, rt.scheduler, rt.coalesce) == (fake.engine, fake.engine, "adamw",
                                                                             "sched", True)
    rt.node_local = True  # each node's first rank writes the states: DeepSpeed is told so
    del fake.calls[:]
    rt.setup("other", "adamw", "sched")
    assert fake.calls[0][1]["config"] == {"checkpoint": {"tag_validation": "Warn", "use_node_local_storage": True},
                                          "x": 1}
    assert rt.coalesce is False
    monkeypatch.setattr(ds_runtime, "ds_config", lambda *a, **kw: {})
    del fake.calls[:]
    rt.setup("other", "adamw", "sched")
    assert fake.calls[0][1]["config"] == {"checkpoint": {"use_node_local_storage": True}}


def test_an_offloaded_optimizer_becomes_deepspeeds_cpu_adam_or_stays_torchs_with_deepspeed_told(monkeypatch):
    fake = _DeepSpeed()
    fake.engine = "engine"
    rt = _runtime(ds=fake)
    rt.d.offload_optimizer = True
    monkeypatch.setattr(ds_runtime, "ds_config", lambda *a, **kw: {})
    monkeypatch.setattr(rt, "_coalesce_needed", lambda model: False)

    class DeepSpeedCPUAdam:
        pass

    monkeypatch.setattr(rt, "_cpu_adam", lambda o, s: (DeepSpeedCPUAdam(), ("on cpu adam", o, s)))
    rt.setup("model", "adamw", "sched")
    assert fake.calls[0][1]["config"] == {} and rt.scheduler == ("on cpu adam", "adamw", "sched")
    assert type(fake.calls[0][1]["optimizer"]) is DeepSpeedCPUAdam
    monkeypatch.setattr(rt, "_cpu_adam", lambda o, s: (o, s))  # it could not be built
    del fake.calls[:]
    rt.setup("model", "adamw", "sched")
    assert fake.calls[0][1]["config"] == {"zero_force_ds_cpu_optimizer": False} and rt.optimizer == "adamw"


def _adam_module(monkeypatch, fails=None):
    made = []

    class DeepSpeedCPUAdam:  # not a torch optimizer: the first one made imports torch._dynamo (seconds)
        def __init__(self, params, **kw):
            if fails:
                raise fails
            made.append(kw)
            self.params = params

    adam = SimpleNamespace(DeepSpeedCPUAdam=DeepSpeedCPUAdam)
    monkeypatch.setitem(sys.modules, "deepspeed", SimpleNamespace(ops=SimpleNamespace(adam=adam)))
    monkeypatch.setitem(sys.modules, "deepspeed.ops", SimpleNamespace(adam=adam))
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", adam)
    monkeypatch.setattr(torch.optim.lr_scheduler, "LambdaLR", lambda opt, fn: SimpleNamespace(optimizer=opt, fn=fn))
    return made


def test_cpu_adam_takes_every_parameter_and_the_settings_of_torchs_adamw_and_its_schedule(monkeypatch):
    made = _adam_module(monkeypatch)
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    settings = {"betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1}
    # torch's AdamW as the loop makes it (its param_groups), after LambdaLR recorded initial_lr and set lr
    opt = SimpleNamespace(param_groups=[{"params": [a], "initial_lr": 0.5, "lr": 0.125, **settings},
                                        {"params": [b], "initial_lr": 0.5, "lr": 0.125, **settings}])
    sched = SimpleNamespace(lr_lambdas=[lambda step: 0.25])
    new, new_sched = _runtime()._cpu_adam(opt, sched)
    assert made == [{"lr": 0.5, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1, "adamw_mode": True}]
    assert new.params == [a, b]
    assert new_sched.optimizer is new and new_sched.fn is sched.lr_lambdas[0]  # the same schedule, on the new one
    del made[:]
    plain = SimpleNamespace(param_groups=[{"params": [a], "lr": 0.3, **settings}])  # no schedule attached yet
    _runtime()._cpu_adam(plain, sched)
    assert made[0]["lr"] == 0.3


def test_without_a_compiler_cpu_adam_keeps_torchs_optimizer_and_rank_0_says_why_in_one_line(monkeypatch, capsys):
    _adam_module(monkeypatch, fails=RuntimeError("ninja is required to load C++ extensions\nsecond line"))
    opt = SimpleNamespace(param_groups=[{"params": [], "lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8,
                                         "weight_decay": 0.0}])
    sched = "sched"
    assert _runtime(rank=1)._cpu_adam(opt, sched) == (opt, sched) and capsys.readouterr().err == ""
    assert _runtime(rank=0)._cpu_adam(opt, sched) == (opt, sched)
    assert capsys.readouterr().err == ("[grpo] DeepSpeedCPUAdam unavailable (ninja is required to load C++ "
                                       "extensions); offloaded optimizer uses torch AdamW (slower)\n")
    _adam_module(monkeypatch, fails=RuntimeError("x" * 200))
    _runtime(rank=0)._cpu_adam(opt, sched)
    assert f"({'x' * 120});" in capsys.readouterr().err


def test_a_vision_tower_trained_under_zero_1_or_2_needs_its_gradients_coalesced(monkeypatch):
    sides = {"vlm": ["tower weight"], "text": []}
    monkeypatch.setattr(grpo.engine.unwrap, "unwrap_model", lambda m: m.removeprefix("wrapped "))
    monkeypatch.setattr(grpo.vision.models, "image_side_params", lambda m: sides[m])
    rt = _runtime(stage=2, engine=SimpleNamespace(coalesce_grad_reduction=lambda: None))
    assert rt._coalesce_needed("wrapped vlm") is True
    assert rt._coalesce_needed("wrapped text") is False
    assert _runtime(stage=3, engine=rt.engine)._coalesce_needed("wrapped vlm") is False  # ZeRO-3 reduces per layer
    with pytest.raises(SetupError, match="under ZeRO-1 needs deepspeed>=0.19"):
        _runtime(stage=1, engine=SimpleNamespace())._coalesce_needed("vlm")


def test_the_reference_is_replicated_under_zero_2_and_an_engine_without_optimizer_under_zero_3(monkeypatch):
    class Model:
        def __init__(self):
            self.moves = []

        def to(self, x):
            self.moves.append(x)
            return self

    ref = Model()
    assert _runtime(stage=2).prepare_reference(ref) is ref and ref.moves == [torch.device("cpu")]
    ref = Model()
    assert _runtime(stage=2, bf16=True).prepare_reference(ref) is ref
    assert ref.moves == [torch.device("cpu"), torch.bfloat16]
    fake = _DeepSpeed()
    evals = []
    fake.engine = SimpleNamespace(eval=lambda: evals.append(1))
    rt = _runtime(stage=3, ds=fake)
    configs = []
    monkeypatch.setattr(ds_runtime, "ds_config", lambda d, shape, w, **kw: configs.append((d, shape, w, kw)) or "cfg")
    assert rt.prepare_reference(ref) is fake.engine and rt.reference_engine is fake.engine and evals == [1]
    assert configs == [(rt.d, "shape", 2, {"train": False})]
    assert fake.calls == [("initialize", {"model": ref, "config": "cfg", "dist_init_required": False})]


# ------------------------------------------------------------------------------------------------ training
class _Engine:
    """A DeepSpeed engine: what the runtime calls on it, in order."""

    def __init__(self, norm=1.5, applied=True, partitioned=False, coordinator=None, seen_flag=True):
        self.calls, self.norm, self.applied, self.partitioned = [], norm, applied, partitioned
        self.optimizer = SimpleNamespace()
        if seen_flag:
            self.optimizer.clear_backward_seen_flag = lambda: self.calls.append("clear_seen")
        if coordinator is not None:
            self.optimizer.parameter_offload = coordinator

    def set_gradient_accumulation_boundary(self, b):
        self.calls.append(("boundary", b))

    def backward(self, loss):
        self.calls.append(("backward", loss.item()))

    def step(self):
        self.calls.append("step")

    def get_global_grad_norm(self):
        return self.norm

    def was_step_applied(self):
        return self.applied

    def zero_optimization_partition_weights(self):
        return self.partitioned

    def coalesce_grad_reduction(self):
        engine = self

        class Coalescing:
            def __enter__(self):
                engine.calls.append("coalesce on")

            def __exit__(self, *exc):
                engine.calls.append(("coalesce off", exc))

        return Coalescing()


def test_only_the_last_announced_backward_is_the_boundary_and_each_loss_is_scaled_by_the_world_size():
    rt = _runtime(world_size=4, engine=_Engine())
    rt.expect_backwards(2)
    rt.backward(torch.tensor(0.5))
    rt.backward(torch.tensor(0.25))
    assert rt.engine.calls == [("boundary", False), "clear_seen", ("backward", 2.0),
                               ("boundary", True), "clear_seen", ("backward", 1.0)]
    rt = _runtime(world_size=1, engine=_Engine(seen_flag=False))
    rt.backward(torch.tensor(3.0))  # nothing announced: every backward is a boundary
    assert rt.engine.calls == [("boundary", True), ("backward", 3.0)]
    rt.expect_backwards(1)
    rt.backward(torch.tensor(1.0))
    rt.backward(torch.tensor(1.0))  # past the announced count: still the boundary
    assert rt.engine.calls[-2] == ("boundary", True)


def test_coalesced_backwards_reduce_once_after_the_last_and_never_at_a_boundary_of_their_own():
    rt = _runtime(world_size=2, engine=_Engine(seen_flag=False), coalesce=True)
    rt.expect_backwards(0)  # an idle step: nothing to coalesce
    assert rt.engine.calls == [] and rt._coalescing is None
    rt.expect_backwards(2)
    rt.backward(torch.tensor(1.0))
    assert rt._coalescing is not None
    rt.backward(torch.tensor(2.0))
    assert rt.engine.calls == ["coalesce on", ("boundary", False), ("backward", 2.0), ("boundary", False),
                               ("backward", 4.0), ("coalesce off", (None, None, None))]
    assert rt._coalescing is None


def test_step_applies_clips_and_schedules_or_reports_a_skipped_step_by_a_nan_norm():
    sched = []
    rt = _runtime(engine=_Engine(norm=torch.tensor(2.5)), scheduler=SimpleNamespace(step=lambda: sched.append(1)))
    rt.expect_backwards(1)
    rt.backward(torch.tensor(1.0))
    assert rt.step(1.0) == (2.5, True) and sched == [1] and (rt._expected, rt._backwards) == (None, 0)
    rt.engine = _Engine(norm=2.5, applied=False)  # skipped: the norm DeepSpeed keeps is the previous step's
    norm, applied = rt.step(1.0)
    assert math.isnan(norm) and applied is False and sched == [1]
    rt.engine = _Engine(norm=None, applied=False)
    norm, applied = rt.step(1.0)
    assert math.isnan(norm) and not applied
    rt.engine = _Engine(norm=float("inf"), applied=False)
    norm, applied = rt.step(1.0)
    assert norm == float("inf") and not applied and sched == [1]
    rt.engine = _Engine(norm=float("nan"), applied=True)
    with pytest.raises(SetupError, match="non-finite gradient norm"):
        rt.step(1.0)
    rt.engine = _Engine()
    rt.expect_backwards(2)
    rt.backward(torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="1 backward calls but 2 were announced"):
        rt.step(1.0)
    assert rt.engine.calls[-1] == ("backward", 2.0)  # no step was taken


def test_step_resets_the_zero3_prefetch_trace_of_the_trained_and_the_reference_engines():
    resets = []

    def coordinator(name):
        return SimpleNamespace(get_param_coordinator=lambda: SimpleNamespace(reset_step=lambda: resets.append(name)))

    rt = _runtime(stage=3, engine=_Engine(partitioned=True, coordinator=coordinator("policy")),
                  scheduler=SimpleNamespace(step=lambda: None))
    rt.reference_engine = _Engine(partitioned=True, coordinator=coordinator("reference"))
    rt.step(1.0)
    assert resets == ["policy", "reference"]
    rt.reference_engine = None
    rt.engine = _Engine(partitioned=False, coordinator=coordinator("policy"))
    rt.step(1.0)
    assert resets == ["policy", "reference"]  # ZeRO-2: no trace


def test_the_zero3_coordinator_is_the_optimizers_parameter_offload_or_the_optimizer_itself():
    coordinator = object()
    assert ds_runtime._param_offload(None) is None
    assert ds_runtime._param_offload(_Engine(partitioned=False, coordinator=coordinator)) is None
    assert ds_runtime._param_offload(_Engine(partitioned=True, coordinator=coordinator)) is coordinator
    engine = _Engine(partitioned=True)
    assert ds_runtime._param_offload(engine) is engine.optimizer  # ZeRO-3 without an optimizer of its own


# ------------------------------------------------------------------------------------------------ collectives
def test_reductions_are_one_float64_all_reduce_in_name_order(monkeypatch):
    seen = []

    def all_reduce(t, op=None, group=None):
        seen.append((t.tolist(), t.dtype, t.device, op, group))
        t.mul_(2)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    rt = _runtime()
    assert rt.all_reduce({"b": 1, "a": 0.5}) == {"a": 1.0, "b": 2.0}
    assert seen == [([0.5, 1.0], torch.float64, torch.device("cpu"), torch.distributed.ReduceOp.SUM, None)]
    assert rt.all_max({"x": 3}) == {"x": 6.0} and seen[-1][3] == torch.distributed.ReduceOp.MAX
    assert rt._reduce({"y": 1}, "op", group="g", device="cpu") == {"y": 2.0}  # another group's
    assert seen[-1][3:] == ("op", "g")
    assert rt.any_rank(True) is True and seen[-1][0] == [1.0]
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None, group=None: None)  # one rank
    assert rt.any_rank(False) is False and rt.any_rank(True) is True


def test_gather_barrier_and_a_thread_view_go_through_torch_distributed(monkeypatch):
    def all_gather_object(out, obj):
        out[:] = [f"{obj} of rank {r}" for r in range(len(out))]

    events = []
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: events.append("barrier"))
    monkeypatch.setattr(torch.distributed, "new_group", lambda **kw: events.append(kw) or "group")
    rt = _runtime(world_size=3)
    assert rt.gather("x") == ["x of rank 0", "x of rank 1", "x of rank 2"]
    rt.barrier()
    view = rt.thread_view()
    assert isinstance(view, ThreadView) and view._runtime is rt and view._group == "group"
    assert events == ["barrier", {"backend": "gloo", "timeout": rt.timeout}]


def test_a_lost_collective_is_one_line_naming_the_ranks_that_did_not_answer(monkeypatch):
    rt = _runtime(rank=1, world_size=3)
    monkeypatch.setattr(ds_runtime, "_roll_call", lambda r: [0, 2] if r is rt else None)
    lost = rt.peer_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                                        "peer [10.0.0.2]:5678\nmore detail"))
    assert isinstance(lost, PeerLostError)
    assert str(lost) == ("rank 1 of 3: a collective timed out or lost another rank (Connection closed by peer "
                         "[10.0.0.2]:5678); rank 0, 2 did not answer within 5 s: it failed (its message is above), "
                         "was killed, or hangs, or a step takes longer than distributed.timeout_s=30")
    monkeypatch.setattr(ds_runtime, "_roll_call", lambda r: [])
    text = str(rt.peer_failure(RuntimeError("Broken pipe" + "!" * 300)))
    assert text == ("rank 1 of 3: a collective timed out or lost another rank (Broken pipe" + "!" * 149 + "); "
                    "another rank failed (its message is above) or hangs, or a step takes longer than "
                    "distributed.timeout_s=30")

    class DistError(RuntimeError):
        pass

    monkeypatch.setattr(torch.distributed, "DistError", DistError)
    assert "(DistError)" in str(rt.peer_failure(DistError("")))  # any DistError, even without a message
    for error in (RuntimeError("CUDA out of memory"), ValueError("timed out waiting"), SetupError("broken pipe")):
        assert rt.peer_failure(error) is None
    for words in ("Timed out waiting", "connection reset by peer", "communicator was aborted",
                  "Collective operation timeout"):
        assert rt.peer_failure(RuntimeError(f"x {words} y")) is not None


class _Store:
    """The launcher's store: which ranks have said they are alive, the timeout set."""

    def __init__(self, alive=(), fail=None):
        self.keys, self.calls, self.fail = {f"alive/{r}" for r in alive}, [], fail

    def set_timeout(self, t):
        self.calls.append(("timeout", t))

    def set(self, key, value):
        if self.fail:
            raise self.fail
        self.calls.append(("set", key, value))
        self.keys.add(key)

    def check(self, keys):
        return all(k in self.keys for k in keys)


def test_the_roll_call_names_the_ranks_that_never_say_they_are_alive_once_a_process(monkeypatch):
    clock = iter([100.0, 105.0, 106.0])
    sleeps = []
    monkeypatch.setattr(ds_runtime.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(ds_runtime.time, "sleep", lambda s: sleeps.append(s))
    rt = SimpleNamespace(rank=1, world_size=4, lost=None, store=_Store(alive=[0]))
    assert ds_runtime._roll_call(rt) == [2, 3] and rt.lost == [2, 3]
    assert rt.store.calls == [("timeout", datetime.timedelta(seconds=5)), ("set", "alive/1", "1")]
    assert sleeps == [0.1]  # asked at the deadline (105), which is still waited for, then at 106: past it
    rt.store = _Store(alive=[0, 1, 2, 3])
    assert ds_runtime._roll_call(rt) == [2, 3]  # asked once a process
    monkeypatch.setattr(ds_runtime.time, "monotonic", lambda: 100.0)
    rt = SimpleNamespace(rank=0, world_size=2, lost=None, store=_Store(alive=[1]))
    assert ds_runtime._roll_call(rt) == [] and sleeps == [0.1]  # everyone answered at once


def test_a_roll_call_without_a_store_or_with_a_store_gone_names_no_one():
    rt = SimpleNamespace(rank=0, world_size=2)
    assert ds_runtime._roll_call(rt) == [] and rt.lost == []
    rt = SimpleNamespace(rank=0, world_size=2, lost=None, store=_Store(fail=RuntimeError("connection refused")))
    assert ds_runtime._roll_call(rt) == [] and rt.lost == []


def test_node_local_checkpoints_and_unwrap():
    rt = _runtime()
    rt.node_local_checkpoints(True)
    assert rt.node_local is True
    inner = object()
    rt.model = SimpleNamespace(module=inner)
    assert rt.unwrap() is inner and rt.unwrap(SimpleNamespace(module="m")) == "m" and rt.unwrap("plain") == "plain"


# ------------------------------------------------------------------------------------------------ generation
class _Param:
    def __init__(self):
        self.ds_active_sub_modules = {"layer"}


class _Gathered:
    """deepspeed.zero.GatheredParameters, recorded."""

    def __init__(self, log):
        self.log = log

    def __call__(self, params, **kw):
        log = self.log

        @contextlib.contextmanager
        def gathered():
            log.append(("gather", len(params), kw))
            try:
                yield
            finally:
                log.append("release")

        return gathered()


def _zero3(log, gather=True):
    hooks = [SimpleNamespace(remove=lambda i=i: log.append(("remove", i))) for i in range(3)]
    offload = SimpleNamespace(forward_hooks=hooks[:2], backward_hooks=hooks[2:], module="decoder",
                              _register_deepspeed_module=lambda m: log.append(("register", m)))
    params = [_Param(), _Param()]
    engine = _Engine(partitioned=True, coordinator=offload)
    engine.module = SimpleNamespace(parameters=lambda: iter(params))
    rt = _runtime(stage=3, engine=engine, ds=SimpleNamespace(zero=SimpleNamespace(GatheredParameters=_Gathered(log))))
    rt.d.gather_for_generation = gather
    return rt, offload, params


def test_zero3_generation_runs_on_gathered_weights_without_the_layer_hooks_and_puts_them_back(monkeypatch):
    log = []
    rt, offload, params = _zero3(log)
    with rt.generation_context() as options:
        assert options == {"synced_gpus": rt.any_rank}
        assert log == [("gather", 2, {}), ("remove", 0), ("remove", 1), ("remove", 2)]
        assert [p.ds_active_sub_modules for p in params] == [set(), set()]
        assert offload.forward_hooks == [] and offload.backward_hooks == []
    assert log[-2:] == [("register", "decoder"), "release"]
    del offload._register_deepspeed_module  # before deepspeed 0.16.4
    offload._register_hooks_recursively = lambda m: log.append(("old register", m))
    with pytest.raises(ValueError):
        with rt.generation_context():
            raise ValueError("generation failed")
    assert log[-2:] == [("old register", "decoder"), "release"]  # the hooks are back after a failure too


def test_zero3_generation_without_gathering_only_keeps_every_rank_stepping_and_zero2_changes_nothing():
    log = []
    rt, _, _ = _zero3(log, gather=False)
    with rt.generation_context() as options:
        assert options == {"synced_gpus": rt.any_rank}
    assert log == []
    rt = _runtime(stage=2, engine=_Engine(partitioned=False))
    with rt.generation_context() as options:
        assert options == {}
    rt = _runtime(stage=3, engine=_Engine(partitioned=False))
    with rt.generation_context() as options:
        assert options == {}


def test_full_weights_gather_only_the_given_parameters_under_zero3_for_reading():
    log = []
    rt, _, _ = _zero3(log)
    with rt.full_weights(p for p in [1, 2, 3]) as temporary:
        assert temporary is True and log == [("gather", 3, {"modifier_rank": None})]
    assert log[-1] == "release"
    with _runtime(stage=2).full_weights([1]) as temporary:
        assert temporary is False


def test_full_parameters_are_float_cpu_copies_gathered_under_zero3():
    log = []
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    module = SimpleNamespace(parameters=lambda: iter([w]), named_parameters=lambda: iter([("w", w)]))
    for stage, gathered in ((3, [("gather", 1, {}), "release"]), (2, [])):
        del log[:]
        rt = _runtime(stage=stage, engine=SimpleNamespace(module=module),
                      ds=SimpleNamespace(zero=SimpleNamespace(GatheredParameters=_Gathered(log))))
        full = rt.full_parameters()
        assert list(full) == ["w"] and full["w"].dtype == torch.float32 and not full["w"].requires_grad
        assert log == gathered
        full["w"].add_(1)
        assert w.float().tolist() == [1.0, 1.0]  # a copy


# ------------------------------------------------------------------------------------------------ save / load
class _Saver:
    def __init__(self, log, frozen=False, loaded="path"):
        p = torch.nn.Parameter(torch.zeros(1), requires_grad=not frozen)
        self.module = SimpleNamespace(parameters=lambda: iter([torch.nn.Parameter(torch.zeros(1)), p]))
        self.log, self.loaded = log, loaded

    def save_checkpoint(self, path, **kw):
        self.log.append(("save", path, kw))

    def load_checkpoint(self, path, **kw):
        self.log.append(("load", path, kw))
        return self.loaded, {}

    def _zero3_consolidated_16bit_state_dict(self, **kw):
        return ("consolidated", kw)


def _saving(monkeypatch, tmp_path, frozen=False, **kw):
    log = []
    rt = _runtime(engine=_Saver(log, frozen), **kw)
    monkeypatch.setattr(rt, "barrier", lambda: log.append("barrier"))
    (tmp_path / ds_runtime.TAG).mkdir()
    return rt, log


def test_every_rank_saves_its_partitions_between_barriers_and_rank_0_writes_the_world_file(monkeypatch, tmp_path):
    rt, log = _saving(monkeypatch, tmp_path, world_size=4)
    assert rt.save_model_state(tmp_path) is None
    assert log == ["barrier", ("save", str(tmp_path), {"tag": ds_runtime.TAG, "save_latest": False,
                                                      "exclude_frozen_parameters": False}), "barrier"]
    world = tmp_path / ds_runtime.TAG / ds_runtime.WORLD_FILE
    assert json.loads(world.read_text()) == {"world_size": 4, "zero_stage": 2}
    world.unlink()
    (tmp_path / "r1").mkdir()
    rt, log = _saving(monkeypatch, tmp_path / "r1", frozen=True, rank=1, world_size=4)
    rt.save_model_state(tmp_path / "r1")
    assert log[1][2]["exclude_frozen_parameters"] is True  # a LoRA run's frozen base is not saved
    assert not (tmp_path / "r1" / ds_runtime.TAG / ds_runtime.WORLD_FILE).exists()  # another rank: no world file
    rt.node_local, rt.local_rank = True, 0  # each node's first rank writes one too
    rt.save_model_state(tmp_path / "r1")
    assert (tmp_path / "r1" / ds_runtime.TAG / ds_runtime.WORLD_FILE).exists()
    (tmp_path / "r1" / ds_runtime.TAG / ds_runtime.WORLD_FILE).unlink()
    rt.local_rank = 1
    rt.save_model_state(tmp_path / "r1")
    assert not (tmp_path / "r1" / ds_runtime.TAG / ds_runtime.WORLD_FILE).exists()


def test_a_checkpoint_loads_only_when_deepspeed_wrote_it_with_as_many_processes(monkeypatch, tmp_path):
    rt, log = _saving(monkeypatch, tmp_path, world_size=2)
    with pytest.raises(SetupError, match="was not written by DeepSpeed"):
        rt.load_model_state(tmp_path)
    world = tmp_path / ds_runtime.TAG / ds_runtime.WORLD_FILE
    world.write_text(json.dumps({"world_size": 4, "zero_stage": 2}))
    with pytest.raises(SetupError, match="written by 4 processes but this run has 2; resume with 4 processes"):
        rt.load_model_state(tmp_path)
    world.write_text(json.dumps({"world_size": 2, "zero_stage": 2}))
    assert rt.load_model_state(tmp_path) is None
    assert log == [("load", str(tmp_path), {"tag": ds_runtime.TAG, "load_optimizer_states": True,
                                            "load_lr_scheduler_states": False, "load_module_strict": True})]
    rt.engine = _Saver(log, frozen=True, loaded=None)
    with pytest.raises(SetupError, match="DeepSpeed could not load checkpoint"):
        rt.load_model_state(tmp_path)
    assert log[-1][2]["load_module_strict"] is False  # the frozen base is not in the checkpoint


def test_the_final_weights_are_consolidated_under_zero3_only():
    assert _runtime(stage=2, engine=_Saver([]))._final_state_dict() is None
    rt = _runtime(stage=3, engine=_Saver([]))
    assert rt._final_state_dict() == ("consolidated", {"exclude_frozen_parameters": False})
    assert rt._final_state_dict(trainable_only=True) == ("consolidated", {"exclude_frozen_parameters": True})

