"""What you compose is what runs: Hydra's composition plus the precedence a user expects.

Hydra merges a recipe (``@package _global_``) after the config groups, so its values would beat a
group the user names on the command line, and it merges dicts key by key, so a reward set or a task's
arguments would keep leftovers of the layer below. The rules here apply to every run, ``--cfg job``
and the tests alike:

1. Defaults < the chosen group options < the recipe < what the command line names.
2. A group named on the command line (``reward=math``) replaces its whole section, the recipe's
   values for it included; key overrides on the command line then apply on top.
3. A free-form dict (``reward.functions``, ``data.task_kwargs``, ``model.tiny``, ...) comes whole from
   the last layer that sets it (a recipe's reward set replaces its group's), then the command line's
   overrides of it. ``data.task_kwargs`` belong to the source they were written for: a recipe or a
   command line that switches ``data.source`` does not inherit the earlier layer's task arguments.
4. ``key={...}`` on the command line replaces a free-form dict (Hydra would merge into it);
   ``+``/``++`` still add and merge, ``~`` deletes.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from grpo.config.schema import open_dict_keys
from grpo.errors import ConfigError

TASK_KWARGS = "data.task_kwargs"


# The configs ship inside the package: an installed wheel has grpo/_data/configs (setup.py copies the checkout's
# configs/ there, its recipe/ group included); a checkout (editable install) reads configs/ itself, whose recipe/
# is the symlink to recipes/. One source of truth: the checkout's configs/ and recipes/.
_PACKAGED = Path(__file__).resolve().parents[1] / "_data" / "configs"  # grpo/_data/configs
CONFIG_DIR = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[2] / "configs"
RECIPE_DIR = CONFIG_DIR / "recipe"
RECIPE_PATH_ENV = "GRPO_RECIPE_PATH"  # your recipe folders, searched before the built-ins (os.pathsep-separated)


def groups() -> dict[str, list[str]]:
    """Config groups and their options (``distributed: [none, zero2, zero3]``); ``recipe``: the built-ins."""
    out = {"recipe": sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))}
    for d in CONFIG_DIR.iterdir():
        if d.is_dir() and d.name not in out:  # recipe/: the symlink to recipes/ (a copy in a wheel)
            out[d.name] = sorted(p.stem for p in d.glob("*.yaml"))
    return out


def _parse(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(f"cannot parse the command line: {str(e).splitlines()[0]}") from None


def normalize(overrides: list[str]) -> list[str]:
    """Rule 4: ``reward.functions={a: {...}}`` becomes ``~reward.functions`` + ``+reward.functions={...}``; and
    ``recipe=NAME|PATH`` becomes the option Hydra loads (`serve_recipes`)."""
    dicts, out = open_dict_keys(), []
    for line, o in zip(overrides, _parse(overrides)):
        plain = not (o.is_delete() or o.is_add() or o.is_force_add() or o.is_sweep_override())
        if plain and o.key_or_group in dicts and isinstance(o.value(), dict):
            out += [f"~{o.key_or_group}", "+" + line]
        else:
            out.append(line)
    return serve_recipes(out)


def _is_group(key: str) -> bool:
    return key in groups()  # a dotted key never is


def _yaml(path) -> DictConfig:
    return OmegaConf.load(path) if path.exists() else OmegaConf.create({})


def apply_precedence(raw: DictConfig, overrides: list[str], choices: dict, compose_fn) -> DictConfig:
    """Rules 2 and 3 on Hydra's composed ``raw``. ``choices`` maps each group to the option Hydra chose;
    ``compose_fn(overrides)`` composes again (the recipe-less pass for the groups the user named)."""
    parsed = _parse(overrides)
    named = {o.key_or_group for o in parsed if _is_group(o.key_or_group) and o.key_or_group != "recipe"
             and not o.is_delete()}
    recipe = choices.get("recipe")
    out = OmegaConf.create(OmegaConf.to_container(raw))  # unresolved
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
    rec = _recipe_values(recipe)
    for key in sorted(open_dict_keys()):
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(out, parent)
        if not isinstance(node, DictConfig):
            continue
        base = _dict_base(key, parsed, choices, None if key.partition(".")[0] in named else rec)
        if base is not None:
            node[leaf] = _apply_overrides(base, key, parsed)  # the whole dict: no key-by-key merge
    return out


def _recipe_values(recipe: str | None) -> DictConfig | None:
    """The recipe file's own values (None: no recipe)."""
    if not recipe:
        return None
    return _yaml(recipe_file(recipe))


def _group_source(option: str | None) -> str | None:
    """``data.source`` of the data group's option (None: no option, or one that sets no source)."""
    if not option:
        return None
    return _yaml(CONFIG_DIR / "data" / f"{option}.yaml").get("source")


def _dict_base(key: str, parsed, choices: dict, rec: DictConfig | None):
    """Rule 3: the value of free-form dict ``key`` before the command line's overrides of it, when it is not
    Hydra's key-by-key merge (None: keep that). ``rec`` is the recipe (None when its section is dropped)."""
    own = OmegaConf.select(rec, key) if rec is not None else None  # None where the recipe does not set it
    if key == TASK_KWARGS:
        group_source = _group_source(choices.get("data"))
        recipe_source = OmegaConf.select(rec, "data.source") if rec is not None else None
        before = recipe_source if recipe_source is not None else group_source
        cli = [o for o in parsed if o.key_or_group == "data.source" and not o.is_delete()]
        if cli and str(cli[-1].value()) != str(before):
            return {}  # the command line switched the task: only its own task arguments
        if own is None and recipe_source is not None and recipe_source != group_source:
            return {}  # the recipe switched the task without arguments: the task's defaults
    return OmegaConf.to_container(own) if own is not None else None


def _apply_overrides(base: dict, key: str, parsed) -> DictConfig:
    """The command line's overrides of ``key`` and its sub-keys, in order, applied to ``base``."""
    value = OmegaConf.create(base)
    for o in parsed:
        if o.is_sweep_override():
            continue
        if o.key_or_group == key:
            value = OmegaConf.create({} if o.is_delete() else dict(o.value() or {}))
        elif o.key_or_group.startswith(key + "."):
            sub = o.key_or_group[len(key) + 1:]
            if o.is_delete():
                parent, _, leaf = sub.rpartition(".")
                node = OmegaConf.select(value, parent)  # "" selects the dict itself
                if isinstance(node, DictConfig):
                    node.pop(leaf, None)
            else:
                OmegaConf.update(value, sub, o.value(), merge=o.is_add() or o.is_force_add())  # not struct: adds
    return value


def compose(overrides: list[str]) -> DictConfig:
    """The config a run with these command-line overrides trains with (no sweeps), Hydra's ``hydra``
    section included. Raises ConfigError with one line when Hydra cannot compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    overrides = normalize(overrides)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        try:
            raw = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
        except Exception as e:  # noqa: BLE001 - Hydra's composition errors, as one line
            typo = _reward_typo(overrides, lambda ov: hydra_compose(config_name="config", overrides=ov))
            raise ConfigError(typo or hydra_error_line(e)) from None
        choices = OmegaConf.to_container(raw.hydra.runtime.choices)
        out = apply_precedence(raw, overrides, choices,
                               lambda ov: hydra_compose(config_name="config", overrides=ov))
    return out


def _reward_typo(overrides: list[str], compose_fn) -> str | None:
    """A reward the command line changes or deletes (``reward.functions.NAME...``, ``~reward.functions.NAME``)
    that the composed config does not have: a "did you mean" (Hydra would suggest ``+`` and add it)."""
    import difflib

    key = "reward.functions."
    named = [(line, o.key_or_group[len(key):].split(".")[0]) for line, o in zip(overrides, _parse(overrides))
             if o.key_or_group.startswith(key) and not (o.is_add() or o.is_force_add())]
    if not named:
        return None
    try:
        have = set(compose_fn([line for line in overrides if line not in {n[0] for n in named}]).reward.functions)
    except Exception:  # noqa: BLE001 - another mistake: Hydra's own line says it
        return None
    for _, name in named:
        if name not in have:
            close = difflib.get_close_matches(name, sorted(have))  # the best match first
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            return (f"reward.functions has no '{name}'{hint}; this run's rewards: {', '.join(sorted(have))}; "
                    f"add a new one with '+reward.functions.{name}={{fn: ..., weight: ...}}'")
    return None


def hydra_error_line(e: Exception) -> str:
    """Hydra's override errors span several lines; the user needs the first that says what failed."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    details = [line for line in lines[1:] if not line.startswith(("full_key", "object_type", "To append"))]
    hints = [line for line in lines[1:] if line.startswith("To append")]
    return " ".join([lines[0], *details[:1], *hints[:1]])


# ------------------------------------------------------------------------------------------ recipes from anywhere
# ``recipe=`` takes a path (``./my.yaml``, ``/abs/my.yaml``, ``recipes/x.yaml``: anything with a slash or a .yaml
# suffix, relative to the working directory) or a name, looked up in $GRPO_RECIPE_PATH's folders in order, then the
# built-ins: the first NAME.yaml found wins. Hydra loads group options from its config search path only, so a recipe
# outside the built-in folder (or one whose first line is not ``# @package _global_``: a recipe is always global) is
# served from a folder of this process's own, as ``recipe=NAME`` (``recipe=user/NAME`` when a built-in has that name)
# with that folder on ``hydra.searchpath``.
_GLOBAL = "# @package _global_\n"
_served: dict[Path, str] = {}  # recipe file -> the option that serves it
_overlay: list[Path] = []


def recipe_folders() -> list[Path]:
    """Where ``recipe=NAME`` is looked up, in order."""
    env = [Path(p).expanduser().resolve() for p in os.environ.get(RECIPE_PATH_ENV, "").split(os.pathsep) if p]
    return [*env, RECIPE_DIR]


def _is_path(value: str) -> bool:
    separators = {os.sep, os.altsep}  # "/" on POSIX; "\\" and "/" on Windows
    return bool(separators & set(value)) or value.endswith((".yaml", ".yml")) or value.startswith("~")


def find_recipe(value: str) -> Path:
    """The file ``recipe=value`` names. Raises ConfigError (one line) naming every folder searched."""
    if "/" in value and _served_file(value):  # user/NAME: an option this process serves (a name is looked up anew)
        return _served_file(value)
    if _is_path(value):
        path = Path(value).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"recipe={value!r}: no such file {path}")
        return path
    folders = recipe_folders()
    for d in folders:
        if (d / f"{value}.yaml").is_file():
            return d / f"{value}.yaml"
    names = sorted({p.stem for d in folders for p in d.glob("*.yaml")})
    unset = "" if os.environ.get(RECIPE_PATH_ENV) else f" (${RECIPE_PATH_ENV} is not set)"
    raise ConfigError(f"recipe={value!r} does not exist in {', '.join(str(d.resolve()) for d in folders)}{unset}; "
                      f"available: {', '.join(names)}; or give a path: recipe=./{value}.yaml")


def recipe_file(option: str) -> Path:
    """The file behind the recipe option Hydra chose."""
    return _served_file(option) or RECIPE_DIR / f"{option}.yaml"


def _served_file(option: str) -> Path | None:
    return next((p for p, o in _served.items() if o == option), None)


def _is_global(text: str) -> bool:
    """Whether Hydra reads ``text`` as global: its header is the leading ``# @key value`` lines (blank lines
    skipped; any other line ends it, a plain comment too) and the last ``@package`` there says ``_global_``."""
    is_global = False
    for line in (line.strip() for line in text.splitlines()):
        if not line:
            continue
        header = re.match(r"#\s*(@\S*) *(.*)", line)
        if not header:
            break
        if header[1] == "@package":
            is_global = header[2] == "_global_"
    return is_global


def _option(path: Path) -> str:
    """The Hydra option for recipe file ``path``: its name when it is a built-in Hydra reads as global, else a copy
    with the package line first in this process's overlay folder."""
    if path.parent.resolve() == RECIPE_DIR.resolve() and _is_global(path.read_text()):
        return path.stem
    if path not in _served:
        if not _overlay:
            _overlay.append(Path(tempfile.mkdtemp(prefix="grpo-recipes-")))
            atexit.register(shutil.rmtree, _overlay[0], True)
        # its own name when no built-in has it (job names and reports say recipe=NAME); else, or for a second file
        # of one name (a sweep over folders): user/NAME, user2/NAME, in that order, so the names taken before this
        # one are the files of its name served already and a built-in of its name
        taken = sum(p.stem == path.stem for p in _served) + (RECIPE_DIR / f"{path.stem}.yaml").is_file()
        option = f"user{taken if taken > 1 else ''}/{path.stem}" if taken else path.stem
        target = _overlay[0] / "recipe" / f"{option}.yaml"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_GLOBAL + path.read_text())
        _served[path] = option
    return _served[path]


def serve_recipes(overrides: list[str]) -> list[str]:
    """``recipe=`` values (a sweep's too) rewritten to the options Hydra loads, with the overlay folder on
    ``hydra.searchpath`` when one is used."""
    out = []
    for line, o in zip(overrides, _parse(overrides)):
        if o.key_or_group != "recipe" or o.is_delete():
            out.append(line)
            continue
        values = [str(v) for v in o.value().list] if o.is_sweep_override() else [str(o.value())]
        prefix = line.partition("recipe=")[0]
        out.append(f"{prefix}recipe=" + ",".join(_option(find_recipe(v)) for v in values))
    if _served:  # served by _option, which made the overlay folder first
        entry = f"file://{_overlay[0]}"
        given = [i for i, line in enumerate(out) if line.startswith("hydra.searchpath=")]
        if not given:
            out.append(f"hydra.searchpath=[{entry}]")
        elif entry not in out[given[-1]]:
            head = out[given[-1]].rstrip("]")
            out[given[-1]] = head + ("," if head[-1] != "[" else "") + entry + "]"
    return out
