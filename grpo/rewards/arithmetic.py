"""Exact-answer reward for the built-in arithmetic task."""
from __future__ import annotations

import re

from grpo.rewards.registry import register

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (``"so 3 + 4 = 7."`` -> 7), or None."""
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def bare_integer(text: str) -> int | None:
    """The integer when ``text`` is nothing but one (``" 42."`` -> 42), else None."""
    text = text.strip().rstrip(".").replace(",", "")
    return int(text) if re.fullmatch(r"-?\d+", text) else None


def arithmetic(prompts: list[str], completions: list[str], answer: list, strict: bool = False, **_) -> list[float]:
    """1.0 when the completion's answer equals the row's ``answer``, else 0.0.

    Lenient (default): the last integer written anywhere counts. ``strict=True``: the completion
    must be the number and nothing else, as the built-in prompt asks ("Answer with the number only").
    """
    pick = bare_integer if strict else last_integer
    return [float(pick(c) == int(a)) for c, a in zip(completions, answer)]


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register("arithmetic")(arithmetic)


def number_only(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Format reward for "answer with the number only": 1.0 for a bare integer, otherwise the fraction
    of non-space characters that are digits (a shaped signal that also moves untrained models)."""
    out = []
    for c in completions:
        text = c.strip().rstrip(".")
        if bare_integer(text) is not None:
            out.append(1.0)
            continue
        chars = [ch for ch in text if not ch.isspace()]
        out.append(0.5 * sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return out


register("number_only")(number_only)
