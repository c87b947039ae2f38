"""Scoring a batch with every configured reward function, robustly.

A function that raises on the batch is retried sample by sample; samples that still raise get
``None`` (no score) and are counted in ``errors``. The traceback of a function's first failure is
logged once. The total reward is the weighted sum over the functions that scored the sample.
"""
from __future__ import annotations

import difflib
import inspect
import logging
import math
import os
import sys
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

from grpo.errors import RewardCountError, RewardSpecError, RewardTimeout
from grpo.rewards.registry import is_builtin, resolve

log = logging.getLogger("grpo.rewards")
_HERE = os.path.dirname(os.path.abspath(__file__))

_RESERVED = ("fn", "weight")


@dataclass
class RewardFunction:
    name: str
    fn: Callable
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)
    spec: str = ""                 # the config's fn string (how the worker process finds it)
    timeout_s: float = 0.0         # > 0: run in the worker process, hard-killed after this long
    worker: object = None


def build(functions: dict, timeout_s: float = 0.0) -> list[RewardFunction]:
    """``reward.functions`` (name -> {fn, weight, **kwargs}) to resolved functions. Resolving here
    (also when a worker will run them) makes a bad ``fn`` fail before any model loads."""
    out = []
    for name, spec in functions.items():
        spec = dict(spec)
        fn, kwargs = resolve(spec["fn"]), {k: v for k, v in spec.items() if k not in _RESERVED}
        check_kwargs(name, spec["fn"], fn, kwargs)
        out.append(RewardFunction(name, fn, float(spec.get("weight", 1.0)), kwargs, spec=spec["fn"]))
    return in_worker(out, timeout_s)


def in_worker(rewards: list[RewardFunction], timeout_s: float) -> list[RewardFunction]:
    """The same functions run in one worker process, hard-killed after ``timeout_s`` (0: in this process)."""
    if timeout_s <= 0:
        return rewards
    from grpo.rewards.worker import RewardWorker

    worker = RewardWorker()
    return [replace(r, timeout_s=timeout_s, worker=worker) for r in rewards]


def check_kwargs(name: str, spec: str, fn: Callable, kwargs: dict) -> None:
    """Config arguments against the function: every one must be a parameter the function names, so a misspelled
    one (``wieght``, ``mdoe``, ``target_wrds``) is an error, not silently swallowed by its ``**kwargs`` (which
    receives the dataset columns at each call). A built-in also runs once on an empty batch, so a missing or bad
    argument (``overlong_penalty`` without ``max_len``, ``reward_model`` with a path that does not exist) fails
    now."""
    target = getattr(fn, "verl_fn", fn)
    params = inspect.signature(target).parameters
    named = [p for p in params if params[p].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                         inspect.Parameter.VAR_KEYWORD)]
    open_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    builtin = is_builtin(spec)
    for key in kwargs:
        if key not in named:
            close = difflib.get_close_matches(key, [*named, *_RESERVED], n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            takes = ", ".join(p for p in named if p not in ("prompts", "completions")) or "no arguments"
            opened = "; a config argument must be a parameter it names (its **kwargs gets the dataset columns)" \
                if open_kw and not builtin else ""
            raise RewardSpecError(f"reward.functions.{name}.{key}: {spec!r} has no argument {key!r}{hint}; "
                                  f"it takes {takes} (and fn, weight){opened}")
    if builtin:
        required = {p: [] for p, v in params.items() if v.default is inspect.Parameter.empty
                    and p not in ("prompts", "completions") and p in named and p not in kwargs}
        try:
            fn([], [], **required, **kwargs)
        except Exception as e:  # noqa: BLE001 - whatever the built-in says about its arguments
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise RewardSpecError(f"reward.functions.{name} ({spec}) cannot run with these arguments: {first}") \
                from None


@dataclass
class Scores:
    total: list[float]                      # weighted sum per completion
    per_fn: dict[str, list[float | None]]   # raw scores, None = no score
    errors: dict[str, int]


_reported: set[str] = set()
_first_failure: dict[str, str] = {}  # function name -> one line on its first failure (for the stop message)
# frames of the scoring machinery in this package (the built-ins' text/messages wrapper included): not the user's
_MACHINERY = ("score.py", "worker.py", "adapters.py", "registry.py")


def _call(rf: RewardFunction, prompts, completions, columns) -> list:
    if rf.worker is not None:
        out = rf.worker.call(rf.spec, rf.kwargs, prompts, completions, columns, rf.timeout_s)
    else:
        out = list(rf.fn(prompts, completions, **columns, **rf.kwargs))
    if len(out) != len(completions):
        raise RewardCountError(f"reward.functions.{rf.name} ({rf.spec}) returned {len(out)} scores for "
                               f"{len(completions)} completions; return one score (or None) per completion")
    return [None if v is None else float(v) for v in out]


def score_one(rf: RewardFunction, prompts, completions, columns) -> tuple[list, int]:
    """Scores of one function and its error count. When the batch call raises, each sample is retried alone
    (one bad sample costs only its own score); a timeout is not retried (every sample would wait again)."""
    try:
        vals, errors = _call(rf, prompts, completions, columns), 0
    except RewardCountError:
        raise
    except RewardTimeout:
        _report(rf.name, f"timed out after {rf.timeout_s:g} s (reward.timeout_s) and was killed")
        vals, errors = [None] * len(completions), len(completions)
    except Exception:
        _report(rf.name)
        vals, errors = [], 0
        for i in range(len(completions)):
            cols = {k: v[i:i + 1] for k, v in columns.items()}
            try:
                vals.extend(_call(rf, prompts[i:i + 1], completions[i:i + 1], cols))
            except RewardCountError:
                raise
            except Exception:
                vals.append(None)
                errors += 1
    bad = [v is not None and not math.isfinite(v) for v in vals]
    if any(bad):
        _report(rf.name, f"returned {next(v for v, b in zip(vals, bad) if b)}")
    return [None if b else v for v, b in zip(vals, bad)], errors + sum(bad)


def first_failure(name: str) -> str | None:
    """One line on the first failure of the function ``name`` in this process (None: it never failed here)."""
    return _first_failure.get(name)


def _report(name: str, what: str = "") -> None:
    """The first failure of a function, once: what happened (``what``; empty: the exception being handled, with
    the user's own frames, not the scoring machinery's). Kept for the stop message (`first_failure`)."""
    if name in _reported:
        return
    _reported.add(name)
    text = ""
    if not what:
        etype, err, tb = sys.exc_info()
        frames = [f for f in traceback.extract_tb(tb) if os.path.basename(f.filename) not in _MACHINERY
                  or os.path.dirname(f.filename) != _HERE]
        last = traceback.format_exception_only(etype, err)
        text = ":\n" + ("".join(traceback.format_list(frames)) + "".join(last)).rstrip()
        what = "raised " + ("".join(last).strip().splitlines() or [etype.__name__])[-1]
    _first_failure[name] = what[:300]
    log.warning("reward function %r %s (the samples it cannot score get no score; shown once)%s", name, what, text)


def reward_inputs(rows: list[dict], texts: list[str], group_size: int, completion_format: str) -> tuple[list, list]:
    """(prompts, completions) as reward functions receive them, by TRL's rule: a conversational dataset (rows
    with ``prompt_messages``) gives message lists and ``[{"role": "assistant", "content": text}]``, a text
    dataset strings; ``completion_format`` text or messages forces one."""
    conversational = any("prompt_messages" in r for r in rows)
    if completion_format == "text" or (completion_format == "auto" and not conversational):
        return [r["prompt"] for r in rows for _ in range(group_size)], texts
    prompts = [r.get("prompt_messages") or [{"role": "user", "content": r["prompt"]}]
               for r in rows for _ in range(group_size)]
    return prompts, [[{"role": "assistant", "content": t}] for t in texts]


def score(functions: list[RewardFunction], prompts: list[str], completions: list[str], columns: dict) -> Scores:
    per_fn, errors = {}, {}
    for rf in functions:
        per_fn[rf.name], errors[rf.name] = score_one(rf, prompts, completions, columns)
    total = []
    for i in range(len(completions)):
        total.append(sum(rf.weight * per_fn[rf.name][i] for rf in functions if per_fn[rf.name][i] is not None))
    return Scores(total, per_fn, errors)
