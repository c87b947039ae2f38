"""Command-line checks that run before Hydra, so that a typo costs one clear line, not a traceback."""
from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path

from grpo.config import Config, ConfigError, suggest

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / "configs"
RECIPE_DIR = ROOT / "recipes"


def _dict_fields(cls=Config, prefix: str = "") -> tuple[set[str], set[str]]:
    """(leaf keys, keys of free-form dict fields whose sub-keys are open)."""
    leaves, open_dicts = set(), set()
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            sub_leaves, sub_open = _dict_fields(type(default), key + ".")
            leaves |= sub_leaves
            open_dicts |= sub_open
        else:
            leaves.add(key)
            if isinstance(default, dict):
                open_dicts.add(key)
    return leaves, open_dicts


def groups() -> dict[str, list[str]]:
    """Config groups and their options (``distributed: [none, zero2, zero3]``)."""
    out = {"recipe": sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))}
    for d in CONFIG_DIR.iterdir():
        if d.is_dir() and not d.is_symlink():
            out[d.name] = sorted(p.stem for p in d.glob("*.yaml"))
    return out


def check_argv(argv: list[str]) -> None:
    """Reject unknown keys and unknown group options in ``key=value`` overrides."""
    leaves, open_dicts = _dict_fields()
    options = groups()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key.startswith("hydra") or key.startswith("reward.functions"):
            continue
        if key in options:
            for v in value.split(","):
                if v not in options[key]:
                    raise ConfigError(f"{key}={v!r} does not exist; available: {', '.join(options[key])}")
            continue
        if key in leaves or any(key.startswith(d + ".") for d in open_dicts):
            continue
        raise ConfigError(f"unknown config key '{key}'{suggest(key)}")
