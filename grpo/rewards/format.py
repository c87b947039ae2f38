"""Format rewards for the ``<think>...</think><answer>...</answer>`` layout of DeepSeek-R1.

Both take ``think_in_prompt: bool = False``: set it when the chat template already ends the prompt
with ``<think>\\n`` (DeepSeek-R1 distills, Qwen3 thinking mode), so completions start inside the
think block; ``<think>\\n`` is then put back in front of each completion before checking.
"""
from __future__ import annotations

import re

from grpo.rewards.registry import register

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_NO_TAG = r"(?:(?!</?think>|</?answer>).)*?"
_STRICT = re.compile(
    rf"\A<think>\n{_NO_TAG}\n</think>\n<answer>\n{_NO_TAG}\n</answer>\n?\Z", re.S)
_LENIENT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.S)


def _text(completion, think_in_prompt: bool) -> str:
    text = completion if isinstance(completion, str) else ""
    return "<think>\n" + text if think_in_prompt else text


def format_reward(prompts: list[str], completions: list[str], strict: bool = False,
                  think_in_prompt: bool = False, **_) -> list[float]:
    """1.0 when the completion has the think/answer structure, else 0.0.

    ``strict=True``: the whole completion is exactly ``<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>``
    (one optional final newline, no other tags inside the blocks, nothing before or after).
    ``strict=False`` (default): a ``<think>...</think>`` block followed by an ``<answer>...</answer>``
    block anywhere in the completion.
    """
    pattern = _STRICT.match if strict else _LENIENT.search
    return [1.0 if pattern(_text(c, think_in_prompt)) else 0.0 for c in completions]


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register("format")(format_reward)


def tag_score(text: str) -> float:
    """0.25 for each of ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` that appears exactly
    once and after every earlier tag of that sequence that appears exactly once."""
    score, prev_pos = 0.0, -1
    for tag in _TAGS:
        n = text.count(tag)
        pos = text.find(tag) if n == 1 else None
        if pos is not None and pos > prev_pos:
            score += 0.25
        if pos is not None:
            prev_pos = max(prev_pos, pos)
    return score


def tag_count(prompts: list[str], completions: list[str], think_in_prompt: bool = False,
              **_) -> list[float]:
    """Partial format credit in [0, 1]: 0.25 per correctly used tag (see :func:`tag_score`).
    A dense signal that helps a model discover the format before ``format`` pays anything."""
    return [tag_score(_text(c, think_in_prompt)) for c in completions]


register("tag_count")(tag_count)
