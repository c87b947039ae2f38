"""Exact-match reward for short factual answers (the ``retrieval`` task, QA data sets).

Score: 1.0 when the completion's final answer, normalised (lower case, punctuation and the articles
a/an/the removed, whitespace collapsed — SQuAD's rule), equals the normalised reference, else 0.0;
None for rows without a reference. The final answer is the last ``<answer>...</answer>`` block,
else the last ``\\boxed{}``, else what follows the last "answer is" / "Answer:", else the last
non-empty line.
"""
from __future__ import annotations

import re
import string

from grpo.rewards.math_answer import last_boxed
from grpo.rewards.registry import register

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*:?\s*(.+)", re.I)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " if c in "-/" else None for c in string.punctuation})


def normalize(text) -> str:
    """SQuAD-style normal form: ``"The  Answer: 1,024."`` -> ``"answer 1024"``."""
    text = str(text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def final_answer(completion: str) -> str:
    """The completion's final answer (see the module docstring); ``""`` when it is empty."""
    text = completion if isinstance(completion, str) else ""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    said = _ANSWER_IS.findall(text)
    if said:
        return said[-1].strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def matches(prediction: str, reference, mode: str = "exact") -> bool:
    """Whether ``prediction`` matches ``reference`` (a string, or a list of accepted strings).
    ``mode="contains"``: the reference's words appear, in order and adjacent, in the prediction."""
    refs = reference if isinstance(reference, (list, tuple)) else [reference]
    pred = normalize(prediction)
    for ref in refs:
        r = normalize(ref)
        if not r:
            continue
        if mode == "exact" and pred == r:
            return True
        if mode == "contains" and f" {r} " in f" {pred} ":
            return True
    return False


def exact_match(prompts: list[str], completions: list[str], answer: list | None = None,
                mode: str = "exact", **_) -> list[float | None]:
    """1.0 when the final answer equals the ``answer`` column after normalisation, else 0.0.

    ``mode``: ``exact`` (default) or ``contains`` (the reference appears as whole words inside the
    final answer — "The code is 4821." matches 4821, "48213" does not). A list in ``answer``
    means any of its items is accepted.
    """
    if mode not in ("exact", "contains"):
        raise ValueError(f"exact_match mode must be 'exact' or 'contains', got {mode!r}")
    if answer is None:
        return [None] * len(completions)
    return [None if a is None else float(matches(final_answer(c), a, mode))
            for c, a in zip(completions, answer)]


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register("exact_match")(exact_match)
