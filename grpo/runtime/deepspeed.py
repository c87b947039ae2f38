"""Many processes through DeepSpeed ZeRO-2 / ZeRO-3 (``distributed=zero2|zero3``).

`DeepSpeedRuntime` implements `grpo.runtime.base.Runtime`, so the training loop does not know which
runtime it has. It does not care which launcher started it: torchrun, ``deepspeed`` and
``accelerate launch`` all set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. NCCL is used
on GPUs and gloo on CPU; `deepspeed.initialize` is called directly with a config derived from the
recipe (see `ds_config`), never through accelerate's plugin.

How the loop's contract maps onto DeepSpeed:

- The loss of a micro-batch is this rank's share of the batch-wide loss (its normaliser is
  all-reduced), and DeepSpeed *averages* gradients over ranks, so `backward` multiplies by the
  world size: the reduced gradient is the gradient of the global loss, as with one process.
- `policy_update` runs a data-dependent number of micro-batches and then one `step`. It tells the
  runtime how many (`expect_backwards`, the same number on every rank: ZeRO-2/3 communicate inside
  every backward and ZeRO-3 inside every forward), and only the last backward is marked as the
  gradient-accumulation boundary (`engine.set_gradient_accumulation_boundary`).
- DeepSpeed clips to ``gradient_clipping`` (= trainer.max_grad_norm) and skips the update when the
  global gradient norm is not finite; the learning-rate schedule advances only on applied steps.
- ZeRO-3 partitions the weights: generation runs with ``synced_gpus`` (every rank keeps stepping
  until all are done) and, with distributed.gather_for_generation, on fully gathered weights; the
  frozen reference is partitioned too (a DeepSpeed engine without optimizer); the final model is
  consolidated on rank 0 into an ordinary Hugging Face directory.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path

import torch

from grpo.errors import GRPOError, PeerLostError, SetupError
from grpo.runtime.base import RunShape, Runtime
from grpo.runtime.deepspeed_config import TAG, WORLD_FILE, check, ds_config, launcher_env, uses_bf16

# what gloo / NCCL say when a collective timed out or a peer went away
PEER_LOST = ("timed out waiting", "connection closed by peer", "connection reset by peer", "broken pipe",
             "communicator was aborted", "collective operation timeout")
STORE: list = []  # the store the process group was made with (one per process, kept for `_roll_call`)


# ----------------------------------------------------------------------------------- runtime
class DeepSpeedRuntime(Runtime):
    process_group = True  # deepspeed.init_distributed's, kept until the process exits

    def __init__(self, d, shape: RunShape, device: str = "auto"):
        """``d``: the run's `DistributedConfig`; ``shape``: what else of the run DeepSpeed's config needs;
        ``device``: trainer.device (cpu: gloo on CPU even where CUDA is available)."""
        self.d, self.shape = d, shape
        self.rank, self.world_size, self.local_rank = launcher_env()
        check(d, shape, self.world_size)
        use_cuda = device != "cpu" and torch.cuda.is_available()
        if not use_cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        logging.getLogger("compilers").setLevel(logging.WARNING)  # DeepSpeed's op checks compile test programs
        try:
            import deepspeed
        except ImportError as e:
            raise SetupError(f"distributed.backend=deepspeed needs the deepspeed package ({e}); "
                             "pip install 'grpo[deepspeed]'") from None
        self._ds = deepspeed
        if not use_cuda:  # gloo does all the talking on CPU: no shared-memory op to compile at start
            with contextlib.suppress(Exception):
                deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")
        warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated")
        if use_cuda:
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        self.backend = "nccl" if use_cuda else "gloo"
        self.stage = d.zero_stage
        self.bf16 = uses_bf16(d, shape)
        # every collective (ours and DeepSpeed's) waits at most distributed.timeout_s for the other ranks
        self.timeout = datetime.timedelta(seconds=float(d.timeout_s))
        if not torch.distributed.is_initialized():
            kwargs = {"device_id": self.device} if use_cuda else {}
            STORE[:] = [_attempt_store(self.rank, self.world_size, self.timeout)]
            torch.distributed.init_process_group(self.backend, store=STORE[0],
                                                 rank=self.rank, world_size=self.world_size, timeout=self.timeout,
                                                 **kwargs)
            atexit.register(_destroy_process_group)
        deepspeed.init_distributed(dist_backend=self.backend, auto_mpi_discovery=False, verbose=False,
                                   timeout=self.timeout)
        self.store, self.lost = (STORE or [None])[0], None  # the launcher's store: a roll call when a rank is lost
        self.engine = self.model = self.optimizer = self.scheduler = None
        self.reference_engine = None
        self.node_local = False
        self._expected: int | None = None
        self._backwards = 0
        self.coalesce, self._coalescing = False, None

    # ---------------------------------------------------------------------------- building
    def setup(self, model, optimizer, scheduler):
        if self.d.offload_optimizer:
            optimizer, scheduler = self._cpu_adam(optimizer, scheduler)
        config = ds_config(self.d, self.shape, self.world_size)
        if self.node_local:
            config["checkpoint"] = {**config.get("checkpoint", {}), "use_node_local_storage": True}
        if self.d.offload_optimizer and type(optimizer).__name__ != "DeepSpeedCPUAdam":
            config["zero_force_ds_cpu_optimizer"] = False
        self.engine, _, _, _ = self._ds.initialize(model=model, optimizer=optimizer, config=config,
                                                   dist_init_required=False)
        self.model, self.optimizer, self.scheduler = self.engine, optimizer, scheduler
        self.coalesce = self._coalesce_needed(model)
        return self.model

    def _coalesce_needed(self, model) -> bool:
        """Whether each step's gradients are reduced once, after its last backward, in parameter order
        (DeepSpeed's ``coalesce_grad_reduction``), instead of in every backward in the order its hooks fire:
        a vision-language model whose image side trains under ZeRO-1/2. A backward with images reaches the
        vision tower's parameters in the order of its graph, one without images (text prompts, an idle
        micro-batch) only through a zero term (grpo/engine/vision_logprobs.py), in another order; reduced in
        hook order, the ranks would add up the buckets of different parameters. Every rank then holds its
        full gradients until the step (as ZeRO-1 does)."""
        from grpo.engine.unwrap import unwrap_model
        from grpo.vision.models import image_side_params

        if self.stage >= 3 or not image_side_params(unwrap_model(model)):
            return False
        if not hasattr(self.engine, "coalesce_grad_reduction"):
            raise SetupError(f"a vision-language model with a trainable vision tower under ZeRO-{self.stage} needs "
                             "deepspeed>=0.19 (coalesce_grad_reduction); upgrade it, or set "
                             "model.freeze_vision_tower=true")
        return True

    def _cpu_adam(self, optimizer, scheduler):
        """ZeRO-Offload wants DeepSpeed's CPU Adam (a compiled op); keep torch AdamW when it cannot be built."""
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            g = optimizer.param_groups[0]
            params = [p for group in optimizer.param_groups for p in group["params"]]
            new = DeepSpeedCPUAdam(params, lr=g["initial_lr"] if "initial_lr" in g else g["lr"], betas=g["betas"],
                                   eps=g["eps"], weight_decay=g["weight_decay"], adamw_mode=True)
        except Exception as e:  # no compiler / ninja: the op cannot be built
            if self.is_main:
                print(f"[grpo] DeepSpeedCPUAdam unavailable ({str(e).splitlines()[0][:120]}); "
                      "offloaded optimizer uses torch AdamW (slower)", file=sys.stderr)  # line-buffered: no flush
            return optimizer, scheduler
        return new, torch.optim.lr_scheduler.LambdaLR(new, scheduler.lr_lambdas[0])

    def prepare_reference(self, reference):
        """The frozen reference: replicated under ZeRO-2, partitioned (an engine without optimizer) under ZeRO-3."""
        if self.stage < 3:
            reference = reference.to(self.device)
            return reference.to(torch.bfloat16) if self.bf16 else reference
        config = ds_config(self.d, self.shape, self.world_size, train=False)
        engine, _, _, _ = self._ds.initialize(model=reference, config=config, dist_init_required=False)
        engine.eval()
        self.reference_engine = engine
        return engine

    # ---------------------------------------------------------------------------- training
    def expect_backwards(self, n: int) -> None:
        """The next ``n`` backward calls (the same number on every rank) make one optimizer step."""
        self._expected, self._backwards = n, 0
        if self.coalesce and n:
            self._coalescing = self.engine.coalesce_grad_reduction()
            self._coalescing.__enter__()

    def backward(self, loss: torch.Tensor) -> None:
        self._backwards += 1
        boundary = self._expected is None or self._backwards >= self._expected
        coalescing = self._coalescing is not None
        self.engine.set_gradient_accumulation_boundary(boundary and not coalescing)
        opt = self.engine.optimizer
        if hasattr(opt, "clear_backward_seen_flag"):  # what engine.forward does; the prefix engine calls the module
            opt.clear_backward_seen_flag()
        # DeepSpeed averages gradients over ranks; this rank's loss is its share of the global loss
        self.engine.backward(loss * self.world_size)
        if coalescing and boundary:  # the step's one reduction, every parameter in order
            self._coalescing, context = None, self._coalescing
            context.__exit__(None, None, None)

    def step(self, max_grad_norm: float) -> tuple[float, bool]:
        """One optimizer step (clipped by DeepSpeed); skipped when the global gradient norm is not finite."""
        if self._expected is not None and self._backwards != self._expected:
            raise RuntimeError(f"{self._backwards} backward calls but {self._expected} were announced")
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else math.nan
        applied = self.engine.was_step_applied()
        if applied and not math.isfinite(norm):
            raise SetupError("DeepSpeed applied an update with a non-finite gradient norm; this DeepSpeed version "
                             "does not skip such steps (use deepspeed>=0.16 or distributed.bf16=false)")
        if not applied and math.isfinite(norm):
            norm = math.nan  # the cached norm is the previous step's
        if applied:
            self.scheduler.step()
        self._expected, self._backwards = None, 0
        self._reset_zero3_traces()
        return norm, applied

    def _reset_zero3_traces(self) -> None:
        """ZeRO-3 resets its prefetch trace at the start of a root-module forward; the shared-prefix engine
        calls the decoder directly, so the step is where every rank resets it, all at the same point."""
        for engine in (self.engine, self.reference_engine):
            offload = _param_offload(engine)
            if offload is not None:
                offload.get_param_coordinator().reset_step()

    # ---------------------------------------------------------------------------- collectives
    def all_reduce(self, values: dict[str, float]) -> dict[str, float]:
        return self._reduce(values, torch.distributed.ReduceOp.SUM)

    def all_max(self, values: dict[str, float]) -> dict[str, float]:
        return self._reduce(values, torch.distributed.ReduceOp.MAX)

    def _reduce(self, values: dict[str, float], op, group=None, device=None) -> dict[str, float]:
        """One float64 all-reduce of every value (in sorted-name order, the same on every rank); ``group``/``device``:
        another process group than the run's and where its tensors live (`grpo.runtime.thread_view`)."""
        names = sorted(values)
        t = torch.tensor([float(values[k]) for k in names], dtype=torch.float64, device=device or self.device)
        torch.distributed.all_reduce(t, op=op, group=group)
        return dict(zip(names, t.tolist()))

    def any_rank(self, flag: bool) -> bool:
        return self.all_reduce({"flag": float(flag)})["flag"] > 0

    def gather(self, obj) -> list:
        """``obj`` of every rank, on every rank (rank order)."""
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        torch.distributed.barrier()

    def thread_view(self):
        from grpo.runtime.thread_view import ThreadView

        return ThreadView(self, torch.distributed.new_group(backend="gloo", timeout=self.timeout))

    def peer_failure(self, error: Exception) -> Exception | None:
        text = str(error).strip()
        if isinstance(error, GRPOError) or not isinstance(error, RuntimeError):
            return None
        if not (isinstance(error, torch.distributed.DistError) or any(k in text.lower() for k in PEER_LOST)):
            return None
        first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]) if text else type(error).__name__  # [file.cc:78]
        lost = _roll_call(self)
        who = (f"rank {', '.join(map(str, lost))} did not answer within {ROLL_CALL_S:g} s: it failed (its message is "
               "above), was killed, or hangs" if lost else "another rank failed (its message is above) or hangs")
        return PeerLostError(
            f"rank {self.rank} of {self.world_size}: a collective timed out or lost another rank ({first[:160]}); "
            f"{who}, or a step takes longer than distributed.timeout_s={self.timeout.total_seconds():g}")

    def node_local_checkpoints(self, on: bool) -> None:
        """Nodes without a shared filesystem: each node's first rank writes the model states DeepSpeed
        otherwise writes once, on rank 0, and the checkpoint metadata (called before `setup`)."""
        self.node_local = on

    def unwrap(self, model=None):
        model = model if model is not None else self.model
        return getattr(model, "module", model)

    # ---------------------------------------------------------------------------- generation
    def generation_context(self):
        """Around the rollout: yields extra rollout options. ZeRO-3: every rank keeps stepping until
        all are done (synced_gpus), on fully gathered weights when distributed.gather_for_generation."""
        offload = _param_offload(self.engine)  # None but under ZeRO-3
        if offload is None:
            yield {}
            return
        if not self.d.gather_for_generation:
            yield {"synced_gpus": self.any_rank}
            return
        params = list(self.engine.module.parameters())
        with self._ds.zero.GatheredParameters(params):
            for p in params:  # the ZeRO-3 hooks would release the gathered weights after each layer
                p.ds_active_sub_modules.clear()
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield {"synced_gpus": self.any_rank}
            finally:  # (named _register_hooks_recursively before deepspeed 0.16.4)
                register = getattr(offload, "_register_deepspeed_module", None) or offload._register_hooks_recursively
                register(offload.module)

    def full_weights(self, params):
        """ZeRO-3: ``params`` gathered for the block (only these: one layer at a time, never the whole model);
        ZeRO-2: every rank holds every parameter already."""
        if self.stage < 3:
            yield False
            return
        with self._ds.zero.GatheredParameters(list(params), modifier_rank=None):
            yield True

    # context managers by a call, not as decorators: mutmut (`make mutate`) does not mutate a decorated function
    generation_context = contextlib.contextmanager(generation_context)
    full_weights = contextlib.contextmanager(full_weights)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, gathered, as CPU tensors on every rank (for checks; needs the full model in memory)."""
        module = self.engine.module
        params = list(module.parameters())
        ctx = self._ds.zero.GatheredParameters(params) if self.stage == 3 else contextlib.nullcontext()
        with ctx:
            return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}

    # ---------------------------------------------------------------------------- save / load
    def save_model_state(self, tmp: Path) -> None:
        """Weights, optimizer and ZeRO partitions of every rank under ``tmp/deepspeed`` (all ranks call this);
        the trainer state holds no optimizer state (None)."""
        self.barrier()  # rank 0 has created tmp
        # frozen weights (a LoRA run's base model) are not trained: they come back from model.name_or_path
        self.engine.save_checkpoint(str(tmp), tag=TAG, save_latest=False, exclude_frozen_parameters=self._frozen())
        if self.is_main or (self.node_local and self.local_rank == 0):
            (Path(tmp) / TAG / WORLD_FILE).write_text(json.dumps({"world_size": self.world_size,
                                                                  "zero_stage": self.stage}))
        self.barrier()  # every shard is on disk before rank 0 marks the checkpoint complete
        return None

    def load_model_state(self, ckpt: Path, optimizer_state=None) -> None:
        meta = Path(ckpt) / TAG / WORLD_FILE
        if not meta.exists():
            raise SetupError(f"checkpoint {ckpt} was not written by DeepSpeed; resume it with distributed=none, "
                             "or start a new trainer.output_dir")
        saved = json.loads(meta.read_text())
        if saved["world_size"] != self.world_size:
            raise SetupError(f"checkpoint {ckpt} was written by {saved['world_size']} processes but this run has "
                             f"{self.world_size}; resume with {saved['world_size']} processes")
        path, _ = self.engine.load_checkpoint(str(ckpt), tag=TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=False, load_module_strict=not self._frozen())
        if path is None:
            raise SetupError(f"DeepSpeed could not load checkpoint {ckpt}")

    def _frozen(self) -> bool:
        """Whether the model has frozen parameters (LoRA's base): checkpoints leave them out."""
        return any(not p.requires_grad for p in self.engine.module.parameters())

    def _final_state_dict(self, trainable_only: bool = False) -> dict | None:
        """ZeRO-3: the weights consolidated layer by layer onto rank 0 (a collective); ZeRO-2: the module's own."""
        if self.stage < 3:
            return None
        return self.engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=trainable_only)


def _param_offload(engine):
    """DeepSpeed's ZeRO-3 parameter coordinator holder of ``engine``, or None (not ZeRO-3)."""
    if engine is None or not engine.zero_optimization_partition_weights():
        return None
    opt = engine.optimizer
    return getattr(opt, "parameter_offload", opt)


ROLL_CALL_S = 5.0  # how long a rank that lost a collective waits for the others to say they are alive


def _roll_call(rt) -> list[int]:
    """The ranks that do not answer within `ROLL_CALL_S` after ``rt``'s rank found a collective broken: every rank
    that finds one says so in the launcher's store (which outlives any rank under torchrun), so the ranks that never do
    are the lost ones (killed, failed, hung). Asked once per process; [] where the store cannot tell (none, or gone with
    the rank that hosted it)."""
    if getattr(rt, "lost", None) is not None:
        return rt.lost
    store, rt.lost = getattr(rt, "store", None), []
    if store is None:
        return rt.lost
    try:
        store.set_timeout(datetime.timedelta(seconds=ROLL_CALL_S))
        store.set(f"alive/{rt.rank}", "1")
        deadline = time.monotonic() + ROLL_CALL_S
        while True:
            missing = [r for r in range(rt.world_size) if not store.check([f"alive/{r}"])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store went with its host: the message says less
        return rt.lost
    rt.lost = missing
    return missing


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The launcher's key-value store, under a prefix of its own for each restart of the group (torchrun
    --max-restarts): the store outlives a restart and still holds the previous attempt's addresses, which the
    new processes would otherwise try to connect to."""
    store, _, _ = next(torch.distributed.rendezvous("env://", rank, world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return torch.distributed.PrefixStore(f"grpo/attempt_{attempt}", store)


def _destroy_process_group() -> None:
    if torch.distributed.is_initialized():
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()
