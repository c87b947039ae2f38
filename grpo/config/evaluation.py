"""The config sections of evaluation and alarms (`evaluation.*`, `alarms.*`; part of `grpo.config.schema.Config`),
their ranges and the checks that span their keys (docs/evaluation.md)."""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field, fields
from typing import Optional

from grpo.errors import ConfigError


@dataclass
class EvalConfig:
    n: int = 1                       # samples per prompt; 1 at temperature 0 is greedy decoding (the default)
    temperature: float = 0.0         # 0 = greedy (then n must be 1); > 0: n samples at this temperature, seeded
    top_p: float = 1.0               # nucleus sampling of the sampled evaluation; 1 = off
    top_k: int = 0                   # sample from the k most likely tokens; 0 = off
    k: list = field(default_factory=list)  # pass@k and maj@k for these k (each <= n); [] = 1 and n
    seed: int = 0                    # the sampling seed: every model compared sees the same prompts and seeds
    correct_reward: Optional[str] = None  # the reward deciding pass@k / maj@k (null: `accuracy`, else the first)
    threshold: float = 1.0           # a sample is correct when that reward's score is at least this
    # named sets, each [{name, source, num, split, prompt_column, answer_column, task_kwargs, load_kwargs, seed, ...}]:
    # metrics under eval/<name>/...; data.* keys a set does not give (template, system prompt) are the data's
    sets: list = field(default_factory=list)


@dataclass
class AlarmRule:
    enabled: bool = True             # watch for it
    threshold: float = 0.0           # the value at which the condition holds (see docs/evaluation.md#alarms)
    patience: int = 1                # steps in a row it must hold before the alarm fires


def _rule(threshold: float, patience: int):
    return field(default_factory=lambda: AlarmRule(True, threshold, patience))


@dataclass
class AlarmsConfig:
    truncation: AlarmRule = _rule(0.9, 5)      # truncated_frac >= threshold: completions cut at max_new_tokens
    zero_std: AlarmRule = _rule(0.95, 10)      # zero_std_frac >= threshold: groups whose rewards are all equal
    entropy: AlarmRule = _rule(0.01, 10)       # entropy <= threshold (nats/token): collapse onto one completion
    logprob_gap: AlarmRule = _rule(0.5, 3)     # mean |log p sampler - log p trainer| >= threshold: stale weights
    constant_reward: AlarmRule = _rule(0.0, 10)  # a reward's std over the whole batch <= threshold
    non_finite: AlarmRule = _rule(0.0, 1)      # the loss or gradient norm is NaN/inf (threshold unused)


RANGES = {
    "evaluation.n": (lambda v: v >= 1, ">= 1 (samples per prompt)"),
    "evaluation.temperature": (lambda v: v >= 0 and math.isfinite(v), ">= 0 (0 = greedy)"),
    "evaluation.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "evaluation.top_k": (lambda v: v >= 0, ">= 0 (0 = off)"),
    **{f"alarms.{f.name}.patience": (lambda v: v >= 1, ">= 1 (steps in a row)") for f in fields(AlarmsConfig)},
}
# what a named set may give: its source and the data.* keys that describe a source; ``num``: how many prompts
SET_KEYS = ("name", "source", "num", "split", "load_kwargs", "task_kwargs", "prompt_column", "answer_column", "seed",
            "system_prompt", "prompt_template", "chat_template", "max_prompt_tokens")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def check_evaluation(cfg) -> None:
    """``cfg``: the root Config. The sampled evaluation's keys together, then every named set."""
    e = cfg.evaluation
    if e.temperature == 0 and e.n > 1:
        raise ConfigError(f"evaluation.n={e.n} at evaluation.temperature=0 (greedy) gives {e.n} identical samples; "
                          "set evaluation.temperature > 0 (e.g. 0.6) or evaluation.n=1")
    ks = list(e.k)
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= e.n:
            raise ConfigError(f"evaluation.k={ks}: each k must be an integer in 1..evaluation.n={e.n} "
                              "(pass@k and maj@k choose k of the n samples)")
    if e.correct_reward is not None and e.correct_reward not in cfg.reward.functions:
        raise ConfigError(f"evaluation.correct_reward={e.correct_reward!r} is not a reward; choose one of: "
                          f"{', '.join(cfg.reward.functions)}")
    seen: set[str] = set()
    for i, spec in enumerate(e.sets):
        name = _check_set(i, spec)
        if name in seen:
            raise ConfigError(f"evaluation.sets: the name {name!r} is given twice; give each set its own name")
        seen.add(name)


def _check_set(i: int, spec) -> str:
    where = f"evaluation.sets[{i}]"
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} must be a mapping such as {{name: gsm8k, source: openai/gsm8k, split: test}}")
    for key in spec:
        if key not in SET_KEYS:
            close = difflib.get_close_matches(str(key), SET_KEYS, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}.{key} is not a key of an evaluation set{hint}; allowed: {', '.join(SET_KEYS)}")
    name, source = spec.get("name"), spec.get("source")
    if not isinstance(name, str) or not _NAME.match(name) or name == "held-out":
        raise ConfigError(f"{where}.name={name!r}: give each set a name of letters, digits, '_', '.' or '-' (held-out "
                          "is the data's held-out split)")
    if not isinstance(source, str) or not source:
        raise ConfigError(f"{where} ({name}) needs a source: builtin:<task>, a .jsonl/.parquet/.csv file or a hub "
                          "dataset name")
    num = spec.get("num")
    if num is not None and (isinstance(num, bool) or not isinstance(num, int) or num < 1):
        raise ConfigError(f"{where}.num={num!r} ({name}) must be an integer >= 1 or null (a file's every row)")
    return name
