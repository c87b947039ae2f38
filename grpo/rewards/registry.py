"""The reward registry: built-in rewards by name, any importable function by dotted path.

A reward function takes the whole batch and returns one score per completion (TRL's signature)::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

`columns` holds every dataset column (``answer``, ``tests``, ...) as a list aligned with
``completions``, plus any keyword arguments given in the config. ``None`` means "no score for this
sample" and is excluded from that function's statistics and from the weighted sum.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

from grpo.errors import RewardSpecError
from grpo.objects import import_attr
from grpo.registry import Registry
from grpo.rewards.adapters import as_text, from_verl

RewardFn = Callable[..., list]

REWARDS: Registry[RewardFn] = Registry("reward")


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make ``fn`` available as ``reward.functions.<key>.fn=<name>``. Built-ins are written for
    text; the registered function also accepts conversational prompts and completions (TRL's message lists)."""

    def deco(fn: RewardFn) -> RewardFn:
        def text_or_messages(prompts, completions, **columns):
            return fn([as_text(p) for p in prompts], [as_text(c) for c in completions], **columns)

        # update_wrapper, not @functools.wraps: mutmut (`make mutate`) does not mutate a decorated function
        functools.update_wrapper(text_or_messages, fn)
        REWARDS.add(name, text_or_messages)  # a conflicting second registration: one line
        return fn

    return deco


def available() -> list[str]:
    """Names of the built-in rewards."""
    _load_builtins()
    return REWARDS.names()


def is_builtin(spec: str) -> bool:
    _load_builtins()
    return spec in REWARDS


def _load_builtins() -> None:
    import grpo.rewards  # noqa: F401  (importing the package registers every built-in module)


def resolve(spec: str) -> RewardFn:
    """Turn a config's ``fn`` string into a batch reward function.

    ``spec`` is a built-in name (``arithmetic``) or ``package.module:function``
    (``package.module.function`` is accepted too). Functions with verl's per-sample signature
    ``compute_score(data_source, solution_str, ground_truth, extra_info)`` are adapted to the
    batch signature automatically (see :mod:`grpo.rewards.adapters`).
    """
    _load_builtins()
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    elif "." in spec:
        module_name, _, attr = spec.rpartition(".")
    else:
        raise RewardSpecError(
            f"unknown reward {spec!r}; built-ins are {', '.join(available())}, "
            "or give an importable 'package.module:function'"
        )
    try:
        fn = import_attr(module_name, attr)
    except Exception as e:  # ImportError, or the module itself failing on import
        raise RewardSpecError(f"cannot import module {module_name!r} for reward {spec!r}: {e}") from None
    if fn is None or not callable(fn):
        raise RewardSpecError(f"module {module_name!r} has no function {attr!r} (reward {spec!r})")
    return adapt(fn, spec)


def adapt(fn: Callable, spec: str) -> RewardFn:
    """Accept TRL-style batch functions as they are and wrap verl-style per-sample ones."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    names = list(params)
    if "solution_str" in names:  # verl's solution_str, wherever it stands
        return from_verl(fn)
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    positional = [
        p for p in params.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if not (("completions" in names and has_var_kw) or len(positional) >= 2):
        raise RewardSpecError(
            f"reward {spec!r} has signature {inspect.signature(fn)}; expected "
            "fn(prompts, completions, **columns) -> list[float | None] or verl's "
            "compute_score(data_source, solution_str, ground_truth, extra_info)"
        )
    if "completions" in names and [p.name for p in positional[:2]] != ["prompts", "completions"]:
        # TRL calls reward functions by keyword, so `def f(completions, **kwargs)` is a valid TRL
        # reward; it would break when called positionally as fn(prompts, completions, ...).
        def by_keyword(prompts, completions, **columns):
            return fn(prompts=prompts, completions=completions, **columns)

        return functools.update_wrapper(by_keyword, fn)
    return fn
