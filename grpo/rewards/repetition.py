"""N-gram repetition penalty (as in Yeo et al. 2025 "Demystifying Long CoT" and Open-R1)."""
from __future__ import annotations

from grpo.rewards.registry import register


def repeated_fraction(units: list, n: int) -> float:
    """Share of the n-grams of ``units`` that repeat an earlier one: 0 for no repetition, close to 1
    for a completion stuck in a loop; 0 when there are fewer than ``n`` units."""
    if len(units) < n:
        return 0.0
    grams = [tuple(units[i:i + n]) for i in range(len(units) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


def repetition_penalty(prompts: list[str], completions: list[str], ngram_size: int = 3,
                       max_penalty: float = -1.0, unit: str = "tokens",
                       completion_ids: list | None = None, **_) -> list[float]:
    """A score in [max_penalty, 0]: ``max_penalty`` times the share of repeated n-grams.

    ``unit``: ``tokens`` (default; n-grams of the completion's token ids, which also catches a
    collapse into one repeated character), ``words`` (lower-cased whitespace-separated words) or
    ``chars``. Without a ``completion_ids`` column ``tokens`` falls back to ``words``.
    """
    if max_penalty > 0:
        raise ValueError(f"repetition_penalty needs max_penalty <= 0, got {max_penalty}")
    n = int(ngram_size)
    if n < 1:
        raise ValueError(f"repetition_penalty needs ngram_size >= 1, got {ngram_size}")
    if unit not in ("tokens", "words", "chars"):
        raise ValueError(f"repetition_penalty unit must be tokens, words or chars, got {unit!r}")
    out = []
    for i, c in enumerate(completions):
        c = c if isinstance(c, str) else ""
        if unit == "tokens" and completion_ids is not None:
            units = list(completion_ids[i])
        elif unit == "chars":
            units = list(c)
        else:
            units = c.lower().split()
        frac = repeated_fraction(units, n)
        out.append(frac * max_penalty if frac else 0.0)
    return out


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register("repetition_penalty")(repetition_penalty)
