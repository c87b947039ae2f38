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


def final_answer(prompts: list, completions: list, answer: list, episode: list | None = None, **_) -> list[float]:
    """1.0 when the last integer of the episode's final model turn equals ``answer``, else 0.0."""
    episode = episode or [None] * len(completions)
    return [float(last_integer(final_turn(c, e)) == int(a)) for c, e, a in zip(completions, episode, answer)]


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register("final_answer")(final_answer)


def tool_call(prompts: list, completions: list, tool_calls: list | None = None, tool_failures: list | None = None,
              **_) -> list[float]:
    """1.0 when the episode called a tool and every call ran (valid JSON in the run's tool format, a known tool, no
    exception or timeout), else 0.0; single-turn completions (no ``tool_calls`` column) score 0."""
    if tool_calls is None:
        return [0.0] * len(completions)
    failures = tool_failures or [0] * len(completions)
    return [float(n > 0 and f == 0) for n, f in zip(tool_calls, failures)]


register("tool_call")(tool_call)
