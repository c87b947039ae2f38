"""The one way to find the model inside its wrappers (DDP, DataParallel, a DeepSpeed engine, a peft model).

Used by the engine (log-probs, the attention switch, memory sizing) and by the rollout (grpo/rollout/hf.py).
"""

from __future__ import annotations

_PARALLEL_WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine")


def _is_parallel_wrapper(m) -> bool:
    return hasattr(m, "module") and any(c.__name__ in _PARALLEL_WRAPPERS for c in type(m).__mro__)


def _is_peft_wrapper(m) -> bool:
    return hasattr(m, "peft_config") and hasattr(m, "get_base_model")


def unwrap_chain(model, *, peft: bool = True) -> list:
    """``[model, the model it wraps, ..., the innermost model]``: through DDP, DataParallel and DeepSpeed engines,
    and with ``peft`` through peft models too (their adapter layers stay injected in the base model). Raises
    NotImplementedError for a prompt-learning peft adapter (prefix/prompt tuning), which the base model cannot
    carry."""
    chain = [model]
    for _ in range(8):
        m = chain[-1]
        if peft and _is_peft_wrapper(m):
            cfg = getattr(m, "active_peft_config", None)
            if cfg is not None and getattr(cfg, "is_prompt_learning", False):  # pragma: no mutate
                raise NotImplementedError("prompt-learning PEFT adapters (prefix/prompt tuning) are not supported")
            chain.append(m.get_base_model())
        elif _is_parallel_wrapper(m):
            chain.append(m.module)
        else:
            break
    return chain


def unwrap_model(model, *, peft: bool = True):
    """The model inside DDP / DataParallel / DeepSpeed wrappers, and with ``peft`` (the default) inside a peft
    model too; see :func:`unwrap_chain`."""
    return unwrap_chain(model, peft=peft)[-1]
