"""The answer of an episode's last model turn (multi-turn rollouts: tool results and observations must not count as
the model's answer)."""
from __future__ import annotations

from grpo.rewards.arithmetic import last_integer
from grpo.rewards.registry import register


def final_turn(completion, episode=None) -> str:
    """The text of the last assistant turn of an episode; the whole completion for a single-turn one."""
    if episode:
        turns = [t["text"] for t in episode if t["role"] == "assistant"]
        if turns:
            return turns[-1]
    return completion if isinstance(completion, str) else completion[-1]["content"]


@register("final_answer")
def final_answer(prompts: list, completions: list, answer: list, episode: list | None = None, **_) -> list[float]:
    """1.0 when the last integer of the episode's final model turn equals ``answer``, else 0.0."""
    episode = episode or [None] * len(completions)
    return [float(last_integer(final_turn(c, e)) == int(a)) for c, e, a in zip(completions, episode, answer)]
