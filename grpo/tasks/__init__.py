"""Built-in, seeded, offline prompt generators. Each returns rows ``{"prompt": str, "answer": ..., ...}``;
every key other than ``prompt`` travels to the reward functions as a column. Importing the package
registers every module in it."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

TaskFn = Callable[..., list[dict]]
_TASKS: dict[str, TaskFn] = {}


def register_task(name: str) -> Callable[[TaskFn], TaskFn]:
    """Decorator: ``fn(n: int, seed: int, **kwargs) -> list[dict]`` becomes ``data.source=builtin:<name>``."""

    def deco(fn: TaskFn) -> TaskFn:
        _TASKS[name] = fn
        return fn

    return deco


def available_tasks() -> list[str]:
    return sorted(_TASKS)


def get_task(name: str) -> TaskFn:
    if name not in _TASKS:
        raise KeyError(f"unknown built-in task {name!r}; available: {', '.join(available_tasks())}")
    return _TASKS[name]


for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")
