"""Exact-answer reward for the built-in arithmetic task."""
from __future__ import annotations

import re

from grpo.rewards.registry import register

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (``"so 3 + 4 = 7."`` -> 7), or None."""
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


@register("arithmetic")
def arithmetic(prompts: list[str], completions: list[str], answer: list, **_) -> list[float]:
    """1.0 when the last integer in the completion equals the row's ``answer``, else 0.0."""
    return [float(last_integer(c) == int(a)) for c, a in zip(completions, answer)]


@register("number_only")
def number_only(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Format reward for "answer with the number only": 1.0 for a bare integer, otherwise the fraction
    of non-space characters that are digits (a shaped signal that also moves untrained models)."""
    out = []
    for c in completions:
        text = c.strip().rstrip(".")
        if re.fullmatch(r"-?\d+", text.replace(",", "")):
            out.append(1.0)
            continue
        chars = [ch for ch in text if not ch.isspace()]
        out.append(0.5 * sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return out
