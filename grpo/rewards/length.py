"""Length-shaped rewards, measured in tokens (the ``completion_ids`` column the trainer passes).

When ``completion_ids`` is missing (calling a function by hand), lengths fall back to a count of
whitespace-separated words.
"""
from __future__ import annotations

import math

from grpo.rewards.math_answer import is_correct
from grpo.rewards.registry import register


def _lengths(completions: list[str], completion_ids) -> list[int]:
    if completion_ids is not None:
        return [len(ids) for ids in completion_ids]
    return [len(c.split()) if isinstance(c, str) else 0 for c in completions]


def overlong_penalty(prompts: list[str], completions: list[str], max_len: int | None = None,
                     buffer_len: int | None = None, penalty_factor: float = 1.0,
                     completion_ids: list | None = None, **_) -> list[float]:
    """DAPO's soft overlong punishment, in [-penalty_factor, 0].

    With L the completion's length in tokens, ``max_len`` the generation limit (set it to the
    rollout's max new tokens) and ``buffer_len`` the soft buffer (default max_len // 4):
    0 while L <= max_len - buffer_len, then falling linearly to -penalty_factor at L = max_len,
    and -penalty_factor beyond (a truncated completion).
    """
    if max_len is None or int(max_len) <= 0:
        raise ValueError("overlong_penalty needs max_len > 0 (the rollout's max new tokens)")
    max_len = int(max_len)
    buffer_len = max_len // 4 if buffer_len is None else int(buffer_len)
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong_penalty needs 0 < buffer_len <= max_len, got {buffer_len}")
    start = max_len - buffer_len
    out = []
    for n in _lengths(completions, completion_ids):
        if n <= start:
            out.append(0.0)
        elif n <= max_len:
            out.append((start - n) / buffer_len * penalty_factor)
        else:
            out.append(-float(penalty_factor))
    return out


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register("overlong_penalty")(overlong_penalty)


def _cosine(t: int, t_max: int, at_zero: float, at_max: float) -> float:
    """at_zero at t = 0, easing along half a cosine to at_max at t = t_max."""
    frac = min(max(t, 0), t_max) / t_max
    return at_max + 0.5 * (at_zero - at_max) * (1.0 + math.cos(math.pi * frac))


def cosine_length(prompts: list[str], completions: list[str], answer: list | None = None,
                  max_len: int = 1024, min_value_correct: float = 0.5, max_value_correct: float = 1.0,
                  min_value_wrong: float = -0.5, max_value_wrong: float = 0.0,
                  exceed_penalty: float | None = None, completion_ids: list | None = None,
                  truncated: list | None = None, **_) -> list[float | None]:
    """Correctness scaled by length along a cosine (Yeo et al. 2025, "Demystifying Long CoT").

    Correct (checked like ``math_accuracy`` against the ``answer`` column): from
    ``max_value_correct`` at length 0 down to ``min_value_correct`` at ``max_len`` tokens — short
    correct beats long correct. Wrong: from ``min_value_wrong`` at length 0 up to
    ``max_value_wrong`` at ``max_len`` — a long wrong attempt beats a short guess. Lengths past
    ``max_len`` count as ``max_len``. ``exceed_penalty`` (optional): the score of a completion the
    rollout cut off (``truncated``), whatever its answer. None for rows without a reference.
    """
    if int(max_len) <= 0:
        raise ValueError("cosine_length needs max_len > 0")
    if answer is None:
        return [None] * len(completions)
    lengths = _lengths(completions, completion_ids)
    out = []
    for i, (c, a, n) in enumerate(zip(completions, answer, lengths)):
        if exceed_penalty is not None and truncated is not None and truncated[i]:
            out.append(float(exceed_penalty))
            continue
        ok = is_correct(c, a)
        if ok is None:
            out.append(None)
        elif ok:
            out.append(_cosine(n, int(max_len), max_value_correct, min_value_correct))
        else:
            out.append(_cosine(n, int(max_len), min_value_wrong, max_value_wrong))
    return out


register("cosine_length")(cosine_length)
