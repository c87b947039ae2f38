"""Adapters from other projects' reward conventions to the batch signature
``fn(prompts, completions, **columns) -> list[float | None]``."""
from __future__ import annotations

import functools
import inspect
import logging
import math
from typing import Callable

log = logging.getLogger("grpo.rewards")

_VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
_NOT_FOR_VERL = ("prompts", "completions", "completion_ids", "truncated", "answer", "reward_model")


def as_text(value) -> str:
    """The text of a prompt or completion in either of TRL's formats: a string, or a list of
    ``{"role", "content"}`` messages (a completion's text is its assistant turns, a prompt's its contents)."""
    if isinstance(value, str) or value is None:
        return value or ""
    turns = [m for m in value if m.get("role") == "assistant"] or list(value)
    return "\n\n".join(str(m.get("content") or "") for m in turns)


def _value(columns: dict, key: str, i: int, n: int, default=None):
    """Row ``i`` of column ``key``; a value that is not an aligned list is a constant (config)."""
    if key not in columns:
        return default
    v = columns[key]
    return v[i] if isinstance(v, (list, tuple)) and len(v) == n else v


def _ground_truth(columns: dict, i: int, n: int):
    for key in ("ground_truth", "answer"):
        if key in columns:
            return _value(columns, key, i, n)
    row = _value(columns, "reward_model", i, n)
    return row.get("ground_truth") if isinstance(row, dict) else None


def _as_score(value) -> float | None:
    if isinstance(value, dict):
        value = value.get("score")
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _verl_slots(params) -> tuple[list[str], list[str], set[str]]:
    """Which of verl's arguments go to which parameter: positional parameters get them by name, or by
    position when named otherwise; keyword-only parameters by name. Returns (positional argument names,
    keyword-only names, the parameter names they fill)."""
    positional = [p for p in params.values() if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                          inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    slots = []
    for k, p in enumerate(positional):
        if p.name in _VERL_ARGS:
            slots.append(p.name)
        elif k < len(_VERL_ARGS) and p.default is inspect.Parameter.empty:
            slots.append(_VERL_ARGS[k])
        else:
            break
    keyword_only = [a for a in _VERL_ARGS if a in params and a not in slots
                    and params[a].kind is inspect.Parameter.KEYWORD_ONLY]
    return slots, keyword_only, {p.name for p in positional[:len(slots)]} | set(keyword_only)


def from_verl(fn: Callable) -> Callable:
    """Wrap verl's per-sample ``compute_score(data_source, solution_str, ground_truth, extra_info)``
    (returning a float, or a dict whose ``score`` is the reward) into a batch reward function.

    Per sample: ``data_source`` from the ``data_source`` column (else ``"unknown"``),
    ``ground_truth`` from the ``ground_truth``, ``answer`` or ``reward_model.ground_truth``
    column, ``extra_info`` from the ``extra_info`` column (else ``{}``). Scalar keyword arguments
    from the config are passed on (verl's ``reward_kwargs``; `score.check_kwargs` refuses one ``fn`` does not
    name). A sample
    whose call raises, or returns something that is not a finite number, scores None; the first
    such error of a wrapped function is logged with its traceback.
    """
    params = inspect.signature(fn).parameters
    takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    slots, keyword_only, filled = _verl_slots(params)
    reported = []

    def batch(prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        n = len(completions)
        # Aligned lists are dataset columns; anything else came from the config.
        config = {k: v for k, v in columns.items()
                  if k not in _NOT_FOR_VERL and k not in _VERL_ARGS
                  and not (isinstance(v, (list, tuple)) and len(v) == n)}
        extra = {k: v for k, v in config.items()
                 if (takes_var_kw or k in params) and k not in filled}
        out = []
        for i, solution in enumerate(completions):
            values = {
                "data_source": _value(columns, "data_source", i, n, "unknown"),
                "solution_str": as_text(solution),
                "ground_truth": _ground_truth(columns, i, n),
                "extra_info": _value(columns, "extra_info", i, n) or {},
            }
            try:
                res = fn(*(values[a] for a in slots), **{a: values[a] for a in keyword_only}, **extra)
                out.append(_as_score(res))
            except Exception:
                if not reported:
                    reported.append(True)
                    log.warning("verl-style reward %s raised (the sample scores None; logged once)",
                                getattr(fn, "__qualname__", fn), exc_info=True)
                out.append(None)
        return out

    # update_wrapper, not @functools.wraps: mutmut (`make mutate`) does not mutate a decorated function
    functools.update_wrapper(batch, fn)
    batch.__signature__ = inspect.Signature([
        inspect.Parameter("prompts", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("completions", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("columns", inspect.Parameter.VAR_KEYWORD),
    ])
    batch.verl_fn = fn
    return batch
