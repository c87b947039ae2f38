"""grpo: Group Relative Policy Optimization with a shared-prefix forward engine."""
from __future__ import annotations

__all__ = ["token_logprobs", "plan_micro_batches"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # imported on first use: a worker process that only needs grpo.rollout.episodes or grpo.rewards
    # (spawned for tool and reward calls) then starts without importing torch
    if name in __all__:
        from grpo import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
