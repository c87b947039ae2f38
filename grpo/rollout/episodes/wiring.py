"""Multi-turn episodes inside a built run: the turn loop for the run's backend, the reward columns episodes add,
and the environment's ``reward()`` as a reward function (logged as ``reward/<ClassName>``)."""
from __future__ import annotations

from typing import Callable

from grpo import data
from grpo.rewards.score import RewardFunction
from grpo.rollout.episodes import formats
from grpo.rollout.episodes.spec import Toolset
from grpo.rollout.episodes.turns import Episodes, EpisodeSettings, TurnLoop
from grpo.rollout.episodes.worker import ToolWorker


def uses_chat(dcfg, tokenizer) -> bool:
    """Whether turns are rendered by the chat template (``dcfg``: the run's `DataConfig` section)."""
    return bool(dcfg.chat_template and getattr(tokenizer, "chat_template", None))


def turn_loop_maker(settings: EpisodeSettings, tokenizer, toolset: Toolset, worker: ToolWorker, dcfg,
                    runtime) -> Callable[..., TurnLoop]:
    """``make(generate, seed_for=None) -> TurnLoop``: the run's turn loop over ``generate`` (a backend's
    ``generate``). ``dcfg``: the run's `DataConfig` section (how a prompt's turns are rendered)."""
    schemas = formats.of(toolset).template_tools(list(toolset.schemas)) if toolset.protocol == "tools" else None

    def prompt_for(row: dict, text: str):
        prompt = data.render_turns(data.with_extra_text(row["prompt_turns"], text), dcfg, tokenizer, schemas)
        return prompt, tokenizer(prompt, add_special_tokens=False)["input_ids"]

    most = lambda n: int(runtime.all_max({"n": float(n)})["n"])  # noqa: E731

    def make(generate: Callable, seed_for: Callable | None = None) -> TurnLoop:
        return TurnLoop(generate, tokenizer, toolset, worker, settings, most=most,
                        seed_for=seed_for or (lambda turn: None), prompt_for=prompt_for)

    return make


def seen_rows(rows: list[dict], eps: Episodes) -> list[dict]:
    """The rows as the model saw them: with the text reset(row) added to ``prompt``, ``prompt_ids`` and the last user
    turn of ``prompt_messages``, so the rewards' ``prompts`` and samples.jsonl show the prompt that was answered."""
    out = []
    for row, text, prompt, ids in zip(rows, eps.added or [None] * len(rows), eps.prompts, eps.prompt_ids):
        if text:
            row = {**row, "prompt": prompt, "prompt_ids": ids}
            if row.get("prompt_messages"):
                row["prompt_messages"] = data.with_extra_text(row["prompt_messages"], text)
        out.append(row)
    return out


def episode_columns(eps: Episodes) -> dict[str, list]:
    """Per-sample columns the reward functions receive (flat order): the episode's turns and tool counts."""
    flat = [e for g in eps.groups for e in g]
    return {"turns": [e.turns for e in flat], "tool_calls": [e.tool_calls for e in flat],
            "tool_failures": [e.tool_failures for e in flat], "hit_max_turns": [e.hit_max_turns for e in flat],
            "episode": [e.segments for e in flat], "env_reward": [e.env_reward for e in flat]}


def episode_records(eps: Episodes) -> list[list[dict]]:
    """What samples.jsonl shows of each episode, nested like the completions."""
    return [[{"turns": e.segments, "tool_calls": e.tool_calls, "tool_failures": e.tool_failures,
              "hit_max_turns": e.hit_max_turns} for e in g] for g in eps.groups]


def environment_reward(toolset: Toolset) -> RewardFunction:
    """The environment's ``reward()`` as a reward function of weight 1, beside the configured ones."""
    def env_reward(prompts, completions, env_reward=None, **columns):
        return list(env_reward) if env_reward is not None else [None] * len(completions)

    return RewardFunction(toolset.env_name, env_reward, 1.0, spec=f"{toolset.environment}.reward")
