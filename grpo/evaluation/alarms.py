"""Alarms: rules over one step's logged metrics that name a silent failure and what to change.

A rule looks at a step's metrics and returns what it sees, per subject (a reward function, or the run itself), when
its condition holds. `Alarms` counts the steps in a row a condition holds; at ``patience`` steps the alarm fires (one
line), and while it holds nothing more is printed; the step it stops holding, one line says it cleared. The metric
``alarm/<name>`` is 1 while an alarm is firing, else 0. Pure: the trainer prints the lines, logs the metrics, sends
wandb alerts and stops the run when ``trainer.stop_on_alarm`` asks (`grpo.trainer.alarms`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

Seen = dict[str, str]  # subject -> what the rule sees ("" is the run itself)


@dataclass(frozen=True)
class Context:
    """What the messages quote: the settings the advice names."""
    max_new_tokens: int
    group_size: int
    temperature: float


def _truncation(m: dict, th: float, ctx: Context) -> Seen:
    v = m.get("truncated_frac")
    return {"": f"{v:.0%} of completions hit rollout.max_new_tokens={ctx.max_new_tokens}"} \
        if v is not None and v >= th else {}


def _zero_std(m: dict, th: float, ctx: Context) -> Seen:
    v = m.get("zero_std_frac")
    return {"": f"{v:.0%} of groups of G={ctx.group_size} had all-equal rewards"} if v is not None and v >= th else {}


def _entropy(m: dict, th: float, ctx: Context) -> Seen:
    v = m.get("entropy")
    return {"": f"the policy's entropy is {v:.3g} nats/token (at or below {th:g})"} \
        if v is not None and math.isfinite(v) and v <= th else {}


def _logprob_gap(m: dict, th: float, ctx: Context) -> Seen:
    seen = {}
    for key in ("rollout_is/logp_diff_abs_mean", "server/sync_logprob_gap"):
        v = m.get(key)
        if v is not None and v >= th:
            seen[key] = f"{key}={v:.3g}: the sampler's log-probs are that far from the trainer's"
    return seen


def _constant_reward(m: dict, th: float, ctx: Context) -> Seen:
    """A function whose scores vary by at most ``th`` (their std) over the whole batch."""
    seen = {}
    for key, std in m.items():
        if key.startswith("reward/") and key.endswith("_std") and std is not None and std <= th:
            name = key[len("reward/"):-len("_std")]
            mean = m.get(f"reward/{name}")
            if mean is not None:
                seen[name] = f"reward.functions.{name} gave every sample the same score ({mean:.3g})"
    return seen


def _non_finite(m: dict, th: float, ctx: Context) -> Seen:
    """An empty batch (`grpo.update.EMPTY`: loss None, grad_norm 0.0) is skipped, not broken: nothing to see."""
    bad = [k for k in ("loss", "grad_norm") if isinstance(m.get(k), float) and not math.isfinite(m[k])]
    verb = "were" if len(bad) > 1 else "was"
    return {"": f"the {' and the '.join(bad)} {verb} not finite (the update was skipped)"} if bad else {}


@dataclass(frozen=True)
class Rule:
    check: Callable[[dict, float, Context], Seen]
    advice: str  # what to change


RULES: dict[str, Rule] = {
    "truncation": Rule(_truncation, "rewards are computed on cut answers; raise rollout.max_new_tokens"),
    "zero_std": Rule(_zero_std, "their advantages are 0 and nothing is learned from them; make the prompts match "
                                "the model (easier or harder), raise algorithm.group_size or rollout.temperature"),
    "entropy": Rule(_entropy, "the policy has collapsed onto one answer per prompt; lower trainer.lr, raise "
                              "rollout.temperature or algorithm.beta"),
    "logprob_gap": Rule(_logprob_gap, "the sampler's weights may be stale or its numerics differ; check the weight "
                                      "sync of rollout.backend, or correct it with algorithm.rollout_is"),
    "constant_reward": Rule(_constant_reward, "a reward with no variance teaches nothing; check that it reads "
                                              "these completions (its columns, its answer parsing)"),
    "non_finite": Rule(_non_finite, "lower trainer.lr or check the rewards for inf/NaN; the run stops after "
                                    "trainer.max_bad_steps such steps in a row"),
}


@dataclass(frozen=True)
class Event:
    name: str
    subject: str
    fired: bool          # True: it fires now; False: it cleared
    line: str


@dataclass
class Alarms:
    """``specs``: name -> ``enabled``, ``threshold``, ``patience`` (`grpo.config.evaluation.AlarmRule`)."""
    specs: dict
    context: Context
    streaks: dict[tuple[str, str], int] = field(default_factory=dict)
    active: set[tuple[str, str]] = field(default_factory=set)

    def update(self, step: int, metrics: dict) -> list[Event]:
        """The events of this step (fired, cleared) in rule order."""
        events = []
        for name, rule in RULES.items():
            spec = self.specs[name]
            if not spec.enabled:
                continue
            seen = rule.check(metrics, spec.threshold, self.context)
            subjects = {s for (n, s) in self.streaks if n == name} | set(seen)
            for subject in sorted(subjects):
                key = (name, subject)
                if subject in seen:
                    self.streaks[key] = self.streaks.get(key, 0) + 1
                    if self.streaks[key] >= spec.patience and key not in self.active:
                        self.active.add(key)
                        events.append(Event(name, subject, True, f"alarm {name}: {seen[subject]} for "
                                            f"{self.streaks[key]} step{'s' * (self.streaks[key] > 1)}: {rule.advice}"))
                    continue
                self.streaks.pop(key, None)
                if key in self.active:
                    self.active.discard(key)
                    what = f" ({subject})" if subject else ""
                    events.append(Event(name, subject, False, f"alarm {name}{what} cleared at step {step}"))
        return events

    def metrics(self) -> dict[str, int]:
        """``alarm/<name>``: 1 while any of its subjects is firing, for every enabled alarm."""
        return {f"alarm/{n}": int(any(k[0] == n for k in self.active)) for n in RULES if self.specs[n].enabled}
