"""Runtimes: who this process is, where tensors live, how backward, the optimizer step, collectives and
model checkpoints run. `Runtime` (base.py) is the one interface the loop uses; `LocalRuntime` (local.py)
is one process, `DeepSpeedRuntime` (deepspeed.py) many processes through DeepSpeed ZeRO-2/3."""
from grpo.runtime.base import Runtime, check_world_size

__all__ = ["Runtime", "check_world_size"]
