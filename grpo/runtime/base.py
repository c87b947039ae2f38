"""The runtime interface: everything the loop asks of "the processes this run is made of".

`Runtime` declares every method the loop, the stages and checkpointing call, with the one-process
behaviour as default: a collective over one process returns its input, a barrier does nothing. A
multi-process runtime overrides what differs. Rules every runtime keeps:

- Collectives (`all_reduce`, `all_max`, `any_rank`, `gather`, `barrier`) are called by every rank at the same
  point, with the same keys; nothing outside ``grpo/runtime/`` talks to the process group.
- `backward` receives this rank's share of the batch-wide loss; after the announced number of
  backwards (`expect_backwards`), `step` applies one optimizer step whose gradient is the global one.
- The runtime never holds the run or its loop state: the loop asks, the runtime answers.
"""
from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.errors import SetupError


@dataclass(frozen=True)
class RunShape:
    """What a multi-process runtime needs of the run beyond its own section (`DistributedConfig`)."""
    prompts_per_step: int      # rollout.prompts_per_step, over every rank
    group_size: int            # algorithm.group_size
    max_grad_norm: float       # trainer.max_grad_norm (DeepSpeed clips)
    dtype: str                 # model.dtype (bfloat16: DeepSpeed's bf16 mode)


def check_world_size(prompts_per_step: int, world_size: int) -> None:
    """Settings that need a particular number of processes. A multi-process runtime calls it before its first
    collective, so that every rank raises the same one-line SetupError and none is left waiting."""
    if prompts_per_step % world_size:
        raise SetupError(f"rollout.prompts_per_step={prompts_per_step} must be divisible by the "
                         f"number of processes ({world_size}) so that every group stays on one rank")


class Runtime:
    """One process; subclasses override what differs. ``model`` is the trained model as the runtime wraps it
    (set by `setup`), ``device`` where its inputs go."""

    rank: int = 0
    local_rank: int = 0        # rank inside this node
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    model = optimizer = scheduler = None
    # whether this process holds a torch.distributed process group of the runtime's: a library that would set up
    # or tear down its own (vLLM) must use this one and leave it alone
    process_group: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, prints and writes the run's files."""
        return self.rank == 0

    # ------------------------------------------------------------------------------- building
    def setup(self, model: torch.nn.Module, optimizer, scheduler):
        """Take over the policy, its optimizer and schedule (placed, wrapped); returns the model to train."""
        self.model, self.optimizer, self.scheduler = model.to(self.device), optimizer, scheduler
        return self.model

    def prepare_reference(self, reference: torch.nn.Module) -> torch.nn.Module:
        """The frozen reference, placed (partitioned, for runtimes that partition weights)."""
        return reference.to(self.device)

    def node_local_checkpoints(self, on: bool) -> None:
        """Told before `setup` whether this node's output_dir is its own (no filesystem shared with rank 0)."""

    def unwrap(self, model=None) -> torch.nn.Module:
        """The plain model under the runtime's wrapper (``model``, or the trained one)."""
        return model if model is not None else self.model

    # ------------------------------------------------------------------------------- training
    def expect_backwards(self, n: int) -> None:
        """The next ``n`` backward calls (the same number on every rank) make one optimizer step."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, max_grad_norm: float) -> tuple[float, bool]:
        """Clip (``max_grad_norm`` <= 0: no clipping), then one optimizer and scheduler step unless the global
        gradient norm is not finite; gradients are cleared. Returns (grad_norm, stepped)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def generation_context(self):
        """Around a rollout: prepares the model and yields options for `grpo.rollout.hf.generate` (``synced_gpus``:
        a callable ``any_rank``, when every rank must run every decoding step until all are done)."""
        yield {}

    # ----------------------------------------------------------------------------- collectives
    def all_reduce(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over every rank, by name (every rank passes the same names)."""
        return dict(values)

    def all_max(self, values: dict[str, float]) -> dict[str, float]:
        """Each value's maximum over every rank, by name (every rank passes the same names)."""
        return dict(values)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (stop requests, "not done yet")."""
        return bool(flag)

    def gather(self, obj) -> list:
        """``obj`` of every rank, on every rank, in rank order."""
        return [obj]

    def barrier(self) -> None:
        """Wait until every rank gets here."""

    def thread_view(self) -> "Runtime":
        """This runtime for a thread that runs beside the trainer's and takes part in collectives of its own (the
        server generator's worker): the same rank, model and weights, its collectives never mixed with the trainer's
        (`grpo.runtime.thread_view`). Every rank calls it at the same point. One process: this runtime."""
        return self

    def peer_failure(self, error: Exception) -> Exception | None:
        """``error`` as a one-line `PeerLostError` when it is a collective that timed out or lost another rank
        (that rank failed or hangs), else None. One process has no other rank: None."""
        return None

    def peer_failures_as_errors(self):
        """Inside it, an error that `peer_failure` recognises is raised as its one-line `PeerLostError`."""
        try:
            yield
        except Exception as e:
            lost = self.peer_failure(e)
            if lost is None:
                raise
            raise lost from e

    # a context manager by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
    peer_failures_as_errors = contextlib.contextmanager(peer_failures_as_errors)

    @contextlib.contextmanager
    def full_weights(self, params: list[torch.nn.Parameter]):
        """Inside it, ``params`` (parameters of the trained model) hold their full values on this rank, to read.
        Yields True when those values are temporary (gathered for the block: copy what must outlive it). Every rank
        calls it with the same parameters in the same order. One process: the parameters as they are."""
        yield False

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter as a CPU float copy, on every rank (gathered when partitioned; for checks)."""
        return {n: p.detach().float().cpu().clone() for n, p in self.unwrap().named_parameters()}

    # ---------------------------------------------------------------------------- save / load
    def save_model_state(self, ckpt: Path):
        """Write the model's trained weights (and whatever optimizer state the runtime keeps in its own files)
        into the checkpoint directory ``ckpt``; every rank calls it. Returns the optimizer state to store in
        the loop's trainer state, or None when it went into the runtime's own files."""
        raise NotImplementedError

    def load_model_state(self, ckpt: Path, optimizer_state) -> None:
        """Load what `save_model_state` wrote (``optimizer_state``: what it returned, read back)."""
        raise NotImplementedError

    def save_final(self, tmp: Path, tokenizer, merge_lora: bool) -> None:
        """An ordinary Hugging Face directory in ``tmp`` written by rank 0 (every rank calls it): the model,
        with its LoRA adapter merged when ``merge_lora`` (else the adapter alone), and the tokenizer."""
        # merging needs the base weights too; the adapter alone is only the trainable parameters
        state = self._final_state_dict(trainable_only=_is_peft(self.unwrap()) and not merge_lora)
        if self.is_main:
            if Path(tmp).exists():
                shutil.rmtree(tmp)
            model = self.unwrap()
            if merge_lora and state is not None:  # partitioned weights: merge into a CPU copy holding them whole
                model, state = holding(model, state), None
            if merge_lora:
                model = model.merge_and_unload()
            model.save_pretrained(tmp, **({} if state is None else {"state_dict": state}))
            tokenizer.save_pretrained(tmp)
        self.barrier()

    def _final_state_dict(self, trainable_only: bool = False) -> dict | None:
        """The weights for `save_final` on rank 0 when the model does not hold them whole (a collective: every rank
        calls it), only the trainable ones with ``trainable_only``; None: the model's own."""
        return None


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def holding(model: torch.nn.Module, state: dict) -> torch.nn.Module:
    """A copy of ``model`` (a transformers causal LM, or a peft model around one) whose parameters are the
    tensors of ``state`` (its full state dict, on the CPU): built on the meta device, so no weight is allocated
    twice. For a model whose own parameters are partitioned (ZeRO-3), so that peft can merge the adapter."""
    from transformers import AutoModelForCausalLM

    peft = _is_peft(model)
    base = model.get_base_model() if peft else model
    with torch.device("meta"):
        copy = AutoModelForCausalLM.from_config(base.config)
        if peft:
            from peft import get_peft_model

            copy = get_peft_model(copy, model.peft_config[model.active_adapter], adapter_name=model.active_adapter)
    copy.generation_config = base.generation_config
    result = copy.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if k in dict(copy.named_parameters())]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"the gathered weights do not match the model (missing {missing[:3]}, unexpected "
                           f"{result.unexpected_keys[:3]})")
    copy.tie_weights()
    return copy.eval()
