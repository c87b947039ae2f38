"""Built-in, seeded, offline prompt generators. Each returns rows ``{"prompt": str, "answer": ..., ...}``;
every key other than ``prompt`` travels to the reward functions as a column. Importing the package
registers every module in it."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

from grpo.registry import Registry

TaskFn = Callable[..., list[dict]]
TASKS: Registry[TaskFn] = Registry("task")


def register_task(name: str) -> Callable[[TaskFn], TaskFn]:
    """Decorator: ``fn(n: int, seed: int, **kwargs) -> list[dict]`` becomes ``data.source=builtin:<name>``."""
    return TASKS.register(name)


def available_tasks() -> list[str]:
    return TASKS.names()


def get_task(name: str) -> TaskFn:
    if name not in TASKS:
        raise KeyError(f"unknown built-in task {name!r}; available: {', '.join(available_tasks())}")
    return TASKS[name]


for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")
