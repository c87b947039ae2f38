"""The DeepSpeed side of a config: the launcher's environment, the settings that cannot work with a world size,
and the DeepSpeed config derived from the recipe (`ds_config`). Used by `grpo.runtime.deepspeed`."""
from __future__ import annotations

import copy
import os

import torch

from grpo.errors import SetupError
from grpo.runtime.base import RunShape, check_world_size

LAUNCH_HINT = ("torchrun --nproc_per_node N -m grpo.train ... or deepspeed --num_gpus N --module grpo.train ... "
               "(see docs/distributed.md)")
TAG = "deepspeed"                 # sub-directory of a checkpoint holding DeepSpeed's own files
WORLD_FILE = "grpo_world.json"    # how many processes wrote a checkpoint
# DeepSpeed settings the runtime derives itself; distributed.ds_config may not override them.
OWNED_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
              "scheduler", "gradient_clipping", "bf16", "fp16", "zero_optimization.stage",
              "zero_optimization.offload_optimizer", "zero_optimization.offload_param"}


# ------------------------------------------------------------------------------------ checks
def launcher_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher's environment; SetupError when it is not there."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise SetupError(f"distributed.backend=deepspeed needs a launcher ({', '.join(missing)} not set); run "
                         + LAUNCH_HINT)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise SetupError("RANK, WORLD_SIZE and LOCAL_RANK must be integers; start the run with "
                         + LAUNCH_HINT) from None
    if not (0 <= rank < world):
        raise SetupError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    return rank, world, local


def check(d, shape: RunShape, world_size: int) -> None:
    """Settings that cannot work with ``world_size`` processes (``d``: the run's `DistributedConfig`); identical on
    every rank, so every rank raises the same one-line SetupError before any collective call (none is left
    waiting)."""
    check_world_size(shape.prompts_per_step, world_size)
    for key in _flat_keys(d.ds_config):
        if key in OWNED_KEYS or any(key.startswith(k + ".") for k in OWNED_KEYS):
            raise SetupError(f"distributed.ds_config.{key} is derived from the recipe and cannot be overridden "
                             "(see docs/distributed.md, 'What grpo sets')")


def _flat_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        out.append(key)
        if isinstance(v, dict):
            out.extend(_flat_keys(v, key + "."))
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in (extra or {}).items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def ds_config(d, shape: RunShape, world_size: int, *, train: bool = True) -> dict:
    """The DeepSpeed config for the run's `DistributedConfig` ``d``. The batch-size fields only feed DeepSpeed's
    counters: the loop decides the micro-batches (engine.max_tokens_per_micro_batch) and marks the step boundary
    itself."""
    per_rank = shape.prompts_per_step // world_size * shape.group_size
    zero: dict = {"stage": d.zero_stage if train else (3 if d.zero_stage == 3 else 0)}
    if train and d.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if d.offload_params and zero["stage"] == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if zero["stage"] == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    out = {
        "train_micro_batch_size_per_gpu": max(per_rank, 1),
        "gradient_accumulation_steps": 1,
        "train_batch_size": max(per_rank, 1) * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": uses_bf16(d, shape)},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if train:
        out["gradient_clipping"] = float(shape.max_grad_norm)
        out["zero_allow_untested_optimizer"] = True   # the loop's own torch AdamW
    return _merge(out, d.ds_config)


def uses_bf16(d, shape: RunShape) -> bool:
    return bool(d.bf16 or shape.dtype == "bfloat16")
