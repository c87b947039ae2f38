"""Multi-digit multiplication, ``Compute 347 * 589.``: hard to do in the head for a small model, one call for a
calculator (the calculator-tools recipe: `grpo.rollout.episodes.calculator`)."""
from __future__ import annotations

import random

from grpo.tasks import register_task

CALCULATOR_PROMPT = ("Compute {a} * {b}. You have a calculator: write <calc>expression</calc>, for example "
                     "<calc>12 * 34</calc>, and its result is sent back to you. "
                     "Then give the final answer as a number.")

# rollout.tools=[grpo.rollout.episodes.calculator:calculate] (recipes/calculator-tools.yaml): the call is shown
# with the problem's
# own expression, so what is learnt is to call rather than guess, and to answer with the result
TOOL_PROMPT = ('Compute {a} * {b}. Call the calculator: <tool_call>{{"name": "calculate", "arguments": '
               '{{"expression": "{a} * {b}"}}}}</tool_call> Then give its result as the final answer.')


def multiplication(n: int, seed: int, digits: int = 3, template: str | None = None, tools: bool = False) -> list[dict]:
    """``n`` distinct problems ``a * b`` with two ``digits``-digit numbers, deterministic in ``seed``. ``template``
    gets ``{a}`` and ``{b}``; by default the plain-text calculator's prompt, or with ``tools`` the tool call's."""
    template = template or (TOOL_PROMPT if tools else CALCULATOR_PROMPT)
    if not 1 <= digits <= 9:
        raise ValueError(f"digits must be 1-9, got {digits}")
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    rows, seen = [], set()
    while len(rows) < n:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if (a, b) in seen and len(seen) < (hi - lo + 1) ** 2:
            continue
        seen.add((a, b))
        rows.append({"prompt": template.format(a=a, b=b), "answer": a * b})
    return rows


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register_task("multiplication")(multiplication)
