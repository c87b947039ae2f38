"""Rewards: a registry of built-ins plus any importable function. Importing this package loads
every module in it, so a new built-in only needs a file with ``@register("name")``."""
import importlib
import pkgutil

from grpo.errors import RewardSpecError
from grpo.rewards.registry import available, register, resolve

for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("registry",):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["RewardSpecError", "available", "register", "resolve"]
