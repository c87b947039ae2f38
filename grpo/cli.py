"""The command line before Hydra sees it: a typo costs one clear line, not a traceback, and a single run is
composed and checked (grpo/config/compose.py, `build.preflight`) before any run directory exists."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from grpo.config.compose import compose, find_recipe, groups, normalize
from grpo.config.schema import open_dict_keys, schema_keys, suggest
from grpo.errors import ConfigError


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
        if key == "recipe" and not arg.startswith("~"):
            for v in value.split(","):
                find_recipe(v.strip("\"'"))  # a path, $GRPO_RECIPE_PATH, the built-ins: one line if none has it
            continue
        if key in options:
            for v in value.split(","):
                if v not in options[key]:
                    raise ConfigError(f"{key}={v!r} does not exist; available: {', '.join(options[key])}")
            continue
        if key in leaves or any(key.startswith(d + ".") for d in open_dicts):
            continue
        raise ConfigError(f"unknown config key '{key}'{suggest(key)}")


def prepare_argv(argv: list[str]) -> list[str]:
    """``sys.argv`` as Hydra should see it, after every check that can run before Hydra. Raises the one-line
    errors (ConfigError, SetupError, ...)."""
    argv = _drop_local_rank(argv)
    flags, overrides = _split_argv(argv[1:])
    if {"-h", "--help"} & set(flags):
        print(usage("grpo-train"))
        sys.exit(0)
    if {"-m", "--multirun"} & set(flags) and {"--cfg", "-c", "--info", "-i"} & set(flags):
        raise ConfigError("--cfg and --info show one run: drop -m and give each swept key one value "
                          "(e.g. algorithm.group_size=4)")
    overrides = _quote_home(overrides)
    check_argv(overrides)
    overrides = normalize(overrides)
    single = not ({"-m", "--multirun", "--info", "-i"} & set(flags))  # (--help has exited above)
    if {"-m", "--multirun"} & set(flags):
        overrides = _sweep_dir(overrides)
    if single and _flag_value(flags, "--cfg", "-c") in (None, "job"):
        overrides = _preflight(flags, overrides)
    return [argv[0], *flags, *overrides]


# Hydra's flags that take a value; everything else that is not a flag is an override.
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
                "-cd", "--info", "-i", "--experimental-rerun"}


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(Hydra flags with their values, overrides)."""
    flags, overrides, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a in _VALUE_FLAGS and i + 1 < len(argv) and "=" not in argv[i + 1]:
            flags += [a, argv[i + 1]]
            i += 2
            continue
        (flags if a.startswith("-") else overrides).append(a)
        i += 1
    return flags, overrides


def _preflight(flags: list[str], overrides: list[str]) -> list[str]:
    """Compose and check a single run before Hydra creates its directory (a mistake leaves nothing behind);
    answer ``--cfg job`` with the config that would run, after the same checks. Returns the overrides to hand to
    Hydra: the run directory is ``trainer.output_dir`` when one is given (``.hydra/`` and ``train.log`` land
    beside the metrics, nothing in ./outputs)."""
    from omegaconf import OmegaConf

    from grpo.config.schema import load

    raw = compose(overrides)
    job = {k: v for k, v in OmegaConf.to_container(raw, resolve=False).items() if k != "hydra"}
    out = expand_paths(job["trainer"])
    printed = OmegaConf.to_yaml(job, resolve=False)
    job["trainer"]["output_dir"] = out or "outputs"  # without one, Hydra's outputs/<date>/<time>
    cfg = load(OmegaConf.to_container(OmegaConf.create(job), resolve=True))  # the schema's checks: no torch yet
    if _flag_value(flags, "--cfg", "-c") == "job":
        _check_inputs(cfg)
        print(printed, end="")
        sys.exit(0)
    from grpo.trainer.build import preflight  # the checks that import torch and the user's reward, tool and data code

    preflight(cfg)
    if out and not any(o.startswith("hydra.run.dir=") for o in overrides):
        overrides = [*overrides, f"hydra.run.dir={_quote(os.path.abspath(out))}"]
    return overrides


def _check_inputs(cfg) -> None:
    """What `grpo.trainer.build.preflight` checks of the user's own input without torch (``--cfg job`` stays quick): the
    reward functions and their arguments, tools and environment, the task's arguments or the data file."""
    from grpo import data
    from grpo.rewards.score import build as build_rewards
    from grpo.rollout.episodes.spec import build_toolset

    build_rewards(cfg.reward.functions)
    build_toolset(cfg.rollout.tools, cfg.rollout.environment)
    data.check_source(cfg.data)


def _quote_home(overrides: list[str]) -> list[str]:
    """``key=~/x`` is not a value Hydra's parser takes: quoted, as ``key='~/x'`` (expanded by `expand_paths`)."""
    return [f"{o.split('=', 1)[0]}={_quote(o.split('=', 1)[1])}" if "=" in o and o.split("=", 1)[1][:1] == "~"
            and not o.startswith(("~", "+~")) else o for o in overrides]


def expand_paths(trainer: dict) -> str | None:
    """``~`` in trainer.output_dir and trainer.resume is the home directory (as in a shell); returns output_dir."""
    for key in ("output_dir", "resume"):
        if isinstance(trainer.get(key), str):
            trainer[key] = os.path.expanduser(trainer[key])
    return trainer.get("output_dir")


def _sweep_dir(overrides: list[str]) -> list[str]:
    """A sweep with one ``trainer.output_dir=DIR``: DIR is the sweep's directory and each job trains in its own
    subdirectory of it (``DIR/<job number>_<its overrides>``: metrics, checkpoints, ``.hydra/``, ``train.log``),
    so that no two jobs share one run directory."""
    given = [o for o in overrides if o.startswith("trainer.output_dir=")]
    if len(given) != 1 or "," in given[0] or any(o.startswith("hydra.sweep.dir=") for o in overrides):
        return overrides
    out = os.path.abspath(os.path.expanduser(given[0].split("=", 1)[1].strip("'\"")))
    return [o for o in overrides if o != given[0]] + [f"hydra.sweep.dir={_quote(out)}"]


_USAGE = {
    "grpo-train": """usage: grpo-train recipe=NAME [key=value ...]           one run
       grpo-train -m recipe=NAME key=A,B [key=value ...]  a sweep: one run per value (Hydra multirun)
       grpo-train recipe=NAME [key=value ...] --cfg job   print the config that would run, after its checks

  grpo-train recipe=quickstart algorithm.group_size=4 trainer.output_dir=runs/a
  grpo-train recipe=quickstart trainer.output_dir=runs/a trainer.resume=auto   # continue where it stopped
  grpo-train recipe=./my-recipe.yaml                    # a recipe file of your own
  (Hydra's own help: --hydra-help)""",
    "grpo-serve": """usage: grpo-serve recipe=NAME [key=value ...] [--print] [-- VLLM_FLAGS]

vLLM's OpenAI-compatible server for the run's model (the recipe and overrides grpo-train takes, plus
rollout.server.host/port); then train with rollout.backend=server. --print: print the command instead.
  grpo-serve recipe=quickstart rollout.server.port=8000""",
}


def usage(command: str) -> str:
    """``--help``: how to run a recipe, the recipes found (built-in and ``$GRPO_RECIPE_PATH``'s), where the docs are."""
    from grpo.config.compose import RECIPE_PATH_ENV, recipe_folders

    found: dict[str, Path] = {}
    for d in recipe_folders():
        for p in sorted(d.glob("*.yaml")):
            found.setdefault(p.stem, p)
    width = max(map(len, found), default=0)
    lines = [_USAGE[command], "", f"recipes (recipe=NAME; your own folders first with {RECIPE_PATH_ENV}):"]
    for name, path in found.items():
        first = next((x.lstrip("# ").strip() for x in path.read_text().splitlines()
                      if x.startswith("#") and "@package" not in x), "")
        first = first.split(". ")[0]
        lines.append(f"  {name:<{width}}  {first if len(first) <= 76 else first[:75] + '…'}")
    docs = "docs/getting-started.md, docs/recipes.md, docs/config-reference.md"
    docs += ", docs/rollout.md#the-server-backend" if command == "grpo-serve" else ""
    lines += ["", "every key: grpo-train recipe=NAME --cfg job; docs (in the grpo repository):", docs]
    return "\n".join(lines)


def _flag_value(flags: list[str], *names: str) -> str | None:
    for i, f in enumerate(flags[:-1]):
        if f in names:
            return flags[i + 1]
    return None


def _quote(path: str) -> str:
    """A path as a quoted Hydra override value."""
    return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _drop_local_rank(argv: list[str]) -> list[str]:
    """The deepspeed launcher appends ``--local_rank=N`` (LOCAL_RANK is in the environment as well)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--local_rank":
            skip = True
        elif not a.startswith("--local_rank="):
            out.append(a)
    return out
