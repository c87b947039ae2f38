"""The trainer's state on disk without pickle: ``<name>.safetensors`` holds every tensor, ``<name>.json`` the rest
as plain data with each tensor's place (`save`, `load`); reading either runs no code.

The JSON is the state's own tree, with tags where JSON has no type of its own: ``{"__tensor__": key}`` (a tensor of
the safetensors file), ``{"__tuple__": [...]}``, ``{"__items__": [[key, value], ...]}`` (a dict whose keys are not
all strings, e.g. an optimizer's state by parameter index), ``{"__ndarray__": [...], "dtype": ...}`` (the small
arrays of numpy's RNG state), ``{"__np__": value, "dtype": ...}`` (a numpy scalar) and ``{"__record__": name,
"fields": {...}}`` for the few dataclasses a checkpoint holds (`RECORDS`, looked up by name, never imported).

Checkpoints written before this format (``trainer_state.pt``, ``rank_<r>.pt``) are read by `load_legacy`:
torch's restricted unpickler with only the classes those files hold allowed; a pickle that names anything else (a
function that would run) is refused.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

from grpo.batch import Batch
from grpo.errors import SetupError
from grpo.rollout.generator import Generated

RECORDS = {"Batch": Batch, "Generated": Generated}
_TAGS = ("__tensor__", "__tuple__", "__items__", "__ndarray__", "__np__", "__record__")


def paths(directory: Path, name: str) -> tuple[Path, Path]:
    """``(<name>.json, <name>.safetensors)`` in ``directory``."""
    return directory / f"{name}.json", directory / f"{name}.safetensors"


def save(directory: Path, name: str, state) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = encode(state, tensors, {})
    tree_path, tensor_path = paths(directory, name)
    save_file(tensors, str(tensor_path))
    tree_path.write_text(json.dumps(tree))


def load(directory: Path, name: str):
    from safetensors.torch import load_file

    tree_path, tensor_path = paths(directory, name)
    return decode(json.loads(tree_path.read_text()), load_file(str(tensor_path)))


_noted: set[str] = set()


def load_state(ckpt: Path, name: str, say: bool = True):
    """``<name>.json`` + ``.safetensors``, or the ``<name>.pt`` pickle of a checkpoint written before (`load_legacy`,
    with a one-time note when ``say``)."""
    if paths(ckpt, name)[0].exists():
        try:
            return load(ckpt, name)
        except (ValueError, KeyError, OSError) as e:  # a copy nobody verified (a rank that does not own it)
            raise SetupError(f"checkpoint {ckpt}: {name} cannot be read ({str(e)[:120]}); resume from another "
                             "checkpoint") from None
    if say and str(ckpt) not in _noted:
        _noted.add(str(ckpt))
        print(f"[grpo] {ckpt} was written before checkpoints carried a manifest and plain-data state: it is not "
              "verified, and its pickle is read without running code; the next checkpoints use the new format",
              file=sys.stderr, flush=True)
    return load_legacy(ckpt / f"{name}.pt")


def encode(obj, tensors: dict, seen: dict):
    """``obj`` as JSON-able data; its tensors go into ``tensors`` (one key per distinct tensor: ``seen`` maps
    ``id(tensor)`` to its key, so a tensor held twice is stored once and loads as one)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen[id(obj)] = key = str(len(tensors))
            tensors[key] = _own(obj.detach().cpu(), seen)
        return {"__tensor__": seen[id(obj)]}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": obj.dtype.str}
    if isinstance(obj, np.generic):
        return {"__np__": obj.item(), "dtype": obj.dtype.str}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors, seen) for v in obj]}
    if isinstance(obj, list):
        return [encode(v, tensors, seen) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in obj):
            return {k: encode(v, tensors, seen) for k, v in obj.items()}
        return {"__items__": [[encode(k, tensors, seen), encode(v, tensors, seen)] for k, v in obj.items()]}
    name = type(obj).__name__
    if RECORDS.get(name) is type(obj):
        return {"__record__": name, "fields": {f.name: encode(getattr(obj, f.name), tensors, seen)
                                              for f in dataclasses.fields(obj)}}
    raise TypeError(f"a checkpoint cannot hold a {type(obj).__qualname__} (add it to state_files.RECORDS if it is "
                    "a dataclass of plain fields)")


def _own(t: torch.Tensor, seen: dict) -> torch.Tensor:
    """``t`` itself when it is the whole of a memory no other stored tensor uses (safetensors stores no two views of
    one memory), else a copy of it: no copy of the optimizer's moments."""
    storage = ("storage", t.untyped_storage().data_ptr())
    if not t.is_contiguous() or t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size() \
            or storage in seen or not t.numel():
        return t.clone(memory_format=torch.contiguous_format)
    seen[storage] = True
    return t


def decode(tree, tensors: dict):
    """What `encode` gave, back (``tensors``: the safetensors file's)."""
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__tensor__" in tree:
        return tensors[tree["__tensor__"]]
    if "__tuple__" in tree:
        return tuple(decode(v, tensors) for v in tree["__tuple__"])
    if "__items__" in tree:
        return {decode(k, tensors): decode(v, tensors) for k, v in tree["__items__"]}
    if "__ndarray__" in tree:
        return np.array(tree["__ndarray__"], dtype=np.dtype(tree["dtype"]))
    if "__np__" in tree:
        return np.dtype(tree["dtype"]).type(tree["__np__"])
    if "__record__" in tree:
        return RECORDS[tree["__record__"]](**{k: decode(v, tensors) for k, v in tree["fields"].items()})
    return {k: decode(v, tensors) for k, v in tree.items()}


# ---------------------------------------------------------------------------------- before this format
def _allowed() -> list:
    """What a pickle of the earlier checkpoints holds besides tensors and builtins: the step's batch, an in-flight
    batch, numpy's RNG state (arrays and their dtypes) and numpy scalars."""
    dtypes = {type(np.dtype(c)) for c in "?bhilqBHILQefdgFDGUS"}
    return [Batch, Generated, np.ndarray, np.dtype, *dtypes, np._core.multiarray._reconstruct,
            np._core.multiarray.scalar]


def load_legacy(path: Path):
    """A ``torch.save`` pickle of an earlier checkpoint, read by torch's restricted unpickler (`_allowed` only);
    SetupError naming the file and what it would run when it names anything else, or when it is damaged."""
    try:
        with torch.serialization.safe_globals(_allowed()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ... for these
        found = re.search(r"GLOBAL (\S+)", str(e))
        named = found.group(1) if found else _global_in(path)
        lines = [line.strip() for line in str(e).splitlines() if line.strip() and not line.startswith(_BOILERPLATE)]
        why = f"its pickle names {named}, which would run code" if named else \
            (lines[0] if lines else type(e).__name__)[:200]
        raise SetupError(f"refusing {path}: {why} (a checkpoint is read without running code from it); resume from "
                         "another checkpoint or start a new trainer.output_dir") from None


_BOILERPLATE = ("Weights only load failed", "Check the documentation", "Please file an issue")


def _global_in(path: Path) -> str | None:
    """The first global a plain pickle of protocol 4 or 5 names (STACK_GLOBAL, which torch's restricted unpickler
    refuses without naming it; it names the GLOBAL of earlier protocols itself), read without unpickling."""
    import pickletools

    strings: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(path.read_bytes()):
            if op.name == "STACK_GLOBAL" and len(strings) >= 2:
                return f"{strings[-2]}.{strings[-1]}"
            if isinstance(arg, str):
                strings.append(arg)
    except Exception:  # noqa: BLE001 - not a pickle, or a damaged one: nothing to name
        return None
    return None
