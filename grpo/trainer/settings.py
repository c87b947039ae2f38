"""The settings every stage below the trainer takes, derived from the checked config once, when the run is built
(`derive`). They are frozen: nothing writes into the config after it is checked, and nothing below the trainer
reads it (a stage gets its settings, a runtime or the engine its own config section)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from grpo.config.schema import Config
from grpo.engine.memory import parse_budget
from grpo.experience import CollectSettings
from grpo.rollout.base import Sampling
from grpo.rollout.episodes.spec import max_sampled_tokens, multi_turn
from grpo.rollout.episodes.turns import EpisodeSettings
from grpo.update import UpdateSettings


@dataclass(frozen=True)
class EvalSettings:
    """Held-out evaluation (`grpo.trainer.evaluate`): greedy, or n samples per prompt at a temperature."""
    max_new_tokens: int        # trainer.eval_max_new_tokens, or rollout.max_new_tokens
    batch_size: int            # prompts decoded together: rollout.batch_size x G
    n: int = 1                 # evaluation.n: samples per prompt
    sampling: Sampling | None = None  # None: greedy; else evaluation.temperature / top_p / top_k
    ks: tuple[int, ...] = (1,)  # pass@k / maj@k (evaluation.k, or 1 and n)
    seed: int = 0              # evaluation.seed
    correct_reward: str | None = None  # the reward deciding pass@k / maj@k (None: accuracy, else the first)
    threshold: float = 1.0     # evaluation.threshold


def eval_settings(cfg: Config) -> EvalSettings:
    """The evaluation's settings from the checked config (the run's, and grpo-eval's)."""
    e, r = cfg.evaluation, cfg.rollout
    max_new = cfg.trainer.eval_max_new_tokens or r.max_new_tokens
    sampling = Sampling(max_new, e.temperature, e.top_p, e.top_k) if e.temperature > 0 else None
    ks = tuple(sorted(set(e.k))) if e.k else tuple(sorted({1, e.n}))
    return EvalSettings(max_new, max(r.batch_size * cfg.algorithm.group_size, 1), e.n, sampling, ks, e.seed,
                        e.correct_reward, e.threshold)


@dataclass(frozen=True)
class RunSettings:
    collect: CollectSettings
    update: UpdateSettings
    evaluation: EvalSettings
    episodes: EpisodeSettings | None  # multi-turn runs (rollout.tools / rollout.environment) only
    seed: int                          # trainer.seed


def derive(cfg: Config, max_tokens: int | None = None, chat: bool = False) -> RunSettings:
    """Every stage's settings. ``max_tokens``: the micro-batch token budget the run was sized for
    (`grpo.trainer.budget.plan`); None keeps ``engine.max_tokens_per_micro_batch`` as configured (``auto`` is then
    sized for the model where it is used). ``chat``: multi-turn turns are rendered by the chat template."""
    a, r = cfg.algorithm, cfg.rollout
    engine = cfg.engine if max_tokens is None else \
        dataclasses.replace(cfg.engine, max_tokens_per_micro_batch=max_tokens)  # a copy: cfg stays as checked
    sampling = Sampling(r.max_new_tokens, r.temperature, r.top_p, r.top_k)
    collect = CollectSettings(r.prompts_per_step, a.group_size, sampling, cfg.trainer.seed, a, engine)
    update = UpdateSettings(a, engine, r.temperature, max_sampled_tokens(r), a.mask_truncated,
                            cfg.trainer.max_grad_norm, a.rollout_is, a.rollout_is_cap)
    evaluation = eval_settings(cfg)
    episodes = None
    if multi_turn(r):
        budget = max_tokens if max_tokens is not None else parse_budget(cfg.engine.max_tokens_per_micro_batch)
        episodes = EpisodeSettings(r.max_turns, r.max_tool_tokens, chat, r.max_new_tokens, max_tokens=budget or 0)
    return RunSettings(collect, update, evaluation, episodes, cfg.trainer.seed)
