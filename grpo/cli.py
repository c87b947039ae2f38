"""Command-line checks that run before Hydra, so that a typo costs one clear line, not a traceback."""
from __future__ import annotations

from pathlib import Path

from grpo.config import ConfigError, open_dict_keys, schema_keys, suggest

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / "configs"
RECIPE_DIR = ROOT / "recipes"


def groups() -> dict[str, list[str]]:
    """Config groups and their options (``distributed: [none, zero2, zero3]``)."""
    out = {"recipe": sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))}
    for d in CONFIG_DIR.iterdir():
        if d.is_dir() and not d.is_symlink():
            out[d.name] = sorted(p.stem for p in d.glob("*.yaml"))
    return out


def check_argv(argv: list[str]) -> None:
    """Reject unknown keys and unknown group options in ``key=value`` overrides."""
    leaves, open_dicts = set(schema_keys()), open_dict_keys()
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
