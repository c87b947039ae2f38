"""The answer a built-in reward reads from a completion, as a key to vote on (maj@k, `grpo.evaluation.metrics`):
two completions with the same key give the same answer after the task's own normalisation. Only rewards whose task
has one answer to compare define it: ``arithmetic`` (the integer it reads), ``math_accuracy`` (the final answer, a
plain number as an exact fraction, else its normalised text) and ``exact_match`` in its ``exact`` mode (the final
answer's SQuAD-style normal form). Others (countdown's equations, format rewards, user functions) have none."""
from __future__ import annotations

import inspect
from collections.abc import Hashable
from typing import Callable

from grpo.rewards import arithmetic, exact_match, math_answer


def _math_key(text: str) -> Hashable | None:
    cand = math_answer.extract_answer(text)
    if cand is None:
        return None
    number = math_answer.as_number(cand)  # a Fraction, never equal to a text key
    return number if number is not None else math_answer._norm_text(cand)


def _exact_key(text: str) -> Hashable | None:
    return exact_match.normalize(exact_match.final_answer(text)) or None


def vote_key(spec: str, kwargs: dict) -> Callable[[str], Hashable | None] | None:
    """``text -> key`` (None: no answer) for the reward ``spec`` (a config's ``fn``) with its config ``kwargs``; None
    when that reward defines no answer to vote on."""
    if spec == "arithmetic":
        return arithmetic.bare_integer if kwargs.get("strict") else arithmetic.last_integer
    if spec == "math_accuracy":
        return _math_key
    if spec == "exact_match" and kwargs.get("mode", "exact") == "exact":
        return _exact_key
    return None


def needs_answer(fn: Callable) -> bool:
    """Whether a reward function reads the reference answer: it names an ``answer`` argument (a verl function
    always reads ``ground_truth``, which the ``answer`` column fills)."""
    if hasattr(fn, "verl_fn"):
        return True
    try:
        return "answer" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
