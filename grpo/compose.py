"""What you compose is what runs: Hydra's composition plus the precedence a user expects.

Hydra merges a recipe (``@package _global_``) after the config groups, so its values would beat a
group the user names on the command line. The rules here, applied to every run, ``--cfg job`` and
the tests alike:

1. Defaults < the chosen group options < the recipe < what the command line names.
2. A group named on the command line (``reward=math``) replaces its whole section, the recipe's
   values for it included; key overrides on the command line then apply on top.
3. ``data.source=...`` on the command line that switches to another source starts ``data.task_kwargs``
   afresh: only the ``data.task_kwargs.*`` given on the command line (a task's arguments never leak
   into another task).
4. ``key={...}`` on a free-form dict (``reward.functions``, ``data.task_kwargs``, ...) replaces it;
   Hydra would merge (``+``/``++`` still add and merge).
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from grpo.cli import CONFIG_DIR, RECIPE_DIR, groups
from grpo.config import ConfigError, open_dict_keys


def _parse(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(f"cannot parse the command line: {str(e).splitlines()[0]}") from None


def normalize(overrides: list[str]) -> list[str]:
    """Rule 4: ``reward.functions={a: {...}}`` becomes ``~reward.functions`` + ``+reward.functions={...}``."""
    dicts, out = open_dict_keys(), []
    for line, o in zip(overrides, _parse(overrides)):
        plain = not (o.is_delete() or o.is_add() or o.is_force_add() or o.is_sweep_override())
        if plain and o.key_or_group in dicts and isinstance(o.value(), dict):
            out += [f"~{o.key_or_group}", "+" + line]
        else:
            out.append(line)
    return out


def _is_group(key: str) -> bool:
    return "." not in key and key in groups()


def apply_precedence(raw: DictConfig, overrides: list[str], choices: dict, compose_fn) -> DictConfig:
    """Rules 2 and 3 on Hydra's composed ``raw``. ``choices`` maps each group to the option Hydra chose;
    ``compose_fn(overrides)`` composes again (the recipe-less pass for the groups the user named)."""
    parsed = _parse(overrides)
    named = {o.key_or_group for o in parsed if _is_group(o.key_or_group) and o.key_or_group != "recipe"
             and not o.is_delete()}
    recipe = choices.get("recipe")
    out = OmegaConf.create(OmegaConf.to_container(raw, resolve=False))
    if named and recipe:
        pinned = [f"{g}={c}" for g, c in choices.items() if _is_group(g) and g != "recipe" and c is not None]
        own = [line for line, o in zip(overrides, parsed) if o.key_or_group.split(".")[0] in named
               and not _is_group(o.key_or_group)]
        try:
            plain = compose_fn(["~recipe", *pinned, *own])
        except Exception as e:  # noqa: BLE001 - Hydra's own message, as one line
            raise ConfigError(f"cannot compose {' '.join(own) or 'the overrides'} without the recipe's values: "
                              f"{str(e).splitlines()[0]}") from None
        for g in named:
            if g in plain:
                out[g] = plain[g]
    sources = [o for o in parsed if o.key_or_group == "data.source" and not o.is_delete()]
    if sources and out.get("data") is not None:
        base = _base_source(choices, recipe)
        if base is not None and str(sources[-1].value()) != base:
            out.data.task_kwargs = _cli_task_kwargs(parsed)
    return out


def _base_source(choices: dict, recipe: str | None) -> str | None:
    """The data source before the command line: the recipe's, else the data group option's."""
    if recipe and (RECIPE_DIR / f"{recipe}.yaml").exists():
        src = OmegaConf.select(OmegaConf.load(RECIPE_DIR / f"{recipe}.yaml"), "data.source")
        if src is not None:
            return str(src)
    option = choices.get("data")
    path = CONFIG_DIR / "data" / f"{option}.yaml"
    return str(OmegaConf.load(path).get("source")) if option and path.exists() else None


def _cli_task_kwargs(parsed) -> dict:
    kwargs = OmegaConf.create({})
    for o in parsed:
        key = o.key_or_group
        if key == "data.task_kwargs":
            kwargs = OmegaConf.create({} if o.is_delete() else dict(o.value() or {}))
        elif key.startswith("data.task_kwargs."):
            sub = key[len("data.task_kwargs."):]
            if o.is_delete():
                kwargs.pop(sub, None)
            else:
                OmegaConf.update(kwargs, sub, o.value(), force_add=True)
    return kwargs


def compose(overrides: list[str]) -> DictConfig:
    """The config a run with these command-line overrides trains with (no sweeps), Hydra's ``hydra``
    section included. Raises ConfigError with one line when Hydra cannot compose it."""
    from hydra import compose as hydra_compose, initialize_config_dir

    overrides = normalize(overrides)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        try:
            raw = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
        except Exception as e:  # noqa: BLE001 - Hydra's composition errors, as one line
            raise ConfigError(hydra_error_line(e)) from None
        choices = OmegaConf.to_container(raw.hydra.runtime.choices)
        out = apply_precedence(raw, overrides, choices,
                               lambda ov: hydra_compose(config_name="config", overrides=ov))
    return out


def hydra_error_line(e: Exception) -> str:
    """Hydra's override errors span several lines; the user needs the first that says what failed."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    first = lines[0]
    detail = next((line for line in lines[1:] if not line.startswith(("full_key", "object_type", "To append"))), "")
    hint = next((line for line in lines[1:] if line.startswith("To append")), "")
    return " ".join(part for part in (first, detail, hint) if part)
