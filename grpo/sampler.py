"""`Sampler`: what a run samples with, built in one place (`build_sampler`) for all three places that sample: the
synchronous loop (`grpo.trainer.build`), the generator process of asynchronous GRPO (`grpo.trainer.generators`)
and the rollout servers' worker thread (`grpo.trainer.generators`).

A sampler is the rollout backend (`grpo.rollout.registry`: made at the first rollout, its weights kept in step with
the policy), the reward functions, the prompt sampler over the training rows, and for multi-turn episodes the tool
worker and the turn loop. `grpo.experience.sample` draws one step's groups from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from grpo.config.schema import DataConfig, RewardConfig, RolloutConfig
from grpo.data import PromptSampler
from grpo.rewards.score import RewardFunction, in_worker
from grpo.rewards.score import build as build_rewards
from grpo.rollout import registry
from grpo.rollout.backends import SyncedBackend, step_seed
from grpo.rollout.base import Completions, Sampling
from grpo.rollout.episodes.spec import Toolset, multi_turn
from grpo.rollout.episodes.turns import EpisodeSettings
from grpo.rollout.episodes.wiring import environment_reward, turn_loop_maker
from grpo.rollout.episodes.worker import ToolWorker

SYNC_CHECK_TOKENS = 32  # the first train prompt's first tokens: what a server and the trainer both score


@dataclass(frozen=True)
class SamplerSettings:
    """What `build_sampler` needs, derived once per run (`grpo.trainer.settings.derive`)."""
    backend: str               # rollout.backend resolved for the trainer's device (`grpo.rollout.registry.resolve`)
    rollout: RolloutConfig     # the rollout section (batch size, the vllm and server sections, tool timeout)
    reward: RewardConfig       # the reward functions, their timeout, the completion format they receive
    data: DataConfig           # how a multi-turn prompt's turns are rendered
    model_name: str            # model.name_or_path
    seed: int                  # trainer.seed: the prompt order and every rollout's seed
    longest_prompt: int        # the data's longest prompt in tokens (a vLLM engine's or a server's max length)
    episodes: EpisodeSettings | None = None  # multi-turn runs only


class Sampler:
    """``backend``: the run's `SyncedBackend`; ``prompts``: the `PromptSampler` over ``rows``; ``turn_loop``:
    ``make(generate, seed_for=None) -> TurnLoop`` (multi-turn episodes), else None. ``seeded``: every rollout gets a
    seed from the run's seed, the rank and the prompt sampler's position (`step_seed`), else the backend draws from
    the process's torch generator (which a checkpoint holds)."""

    def __init__(self, runtime, tokenizer, rows: list[dict], prompts: PromptSampler, backend: SyncedBackend,
                 rewards: list[RewardFunction], *, completion_format: str = "auto", seeded: bool = True,
                 seed: int = 0, turn_loop: Callable | None = None, tool_worker: ToolWorker | None = None):
        self.runtime, self.tokenizer, self.rows, self.prompts = runtime, tokenizer, rows, prompts
        self.backend, self.rewards, self.completion_format = backend, rewards, completion_format
        self.seeded, self.seed, self.turn_loop, self.tool_worker = seeded, seed, turn_loop, tool_worker
        self.versions: set[int] = set()  # the weight versions that answered since `versions` was last cleared

    @property
    def reward_names(self) -> list[str]:
        return [rf.name for rf in self.rewards]

    def generate(self, prompt_ids, group_size: int, sampling: Sampling, seed=None, suffixes=None) -> Completions:
        """The backend's `generate`, with the versions of the weights that answered recorded."""
        out = self.backend.ready().generate(prompt_ids, group_size, sampling, seed=seed, suffixes=suffixes)
        self.versions.update(v for v in out.versions or [] if v is not None)
        return out

    def seed_for(self, turn: int) -> int | None:
        """The seed of this round's ``turn`` (None: not seeded), from the prompt sampler's position."""
        if not self.seeded:
            return None
        p = self.prompts
        return step_seed(self.seed, self.runtime.rank, p.epoch, p.position, *((turn,) if turn > 1 else ()))

    def close(self) -> None:
        """Give back what it holds outside Python's reach: the backend, the tool and reward workers."""
        self.backend.close()
        if self.tool_worker is not None:
            self.tool_worker.kill()
        for worker in {id(rf.worker): rf.worker for rf in self.rewards if rf.worker is not None}.values():
            worker.kill()


def build_sampler(settings: SamplerSettings, runtime, tokenizer, rows: list[dict], toolset: Toolset | None, *,
                  rewards: list[RewardFunction] | None = None, prompts_state: dict | None = None,
                  ahead: bool = False, progress: bool = False) -> Sampler:
    """The sampler of this process. ``runtime``: its runtime (the generator process's holds the policy's copy);
    ``rows``: the training split; ``toolset``: `build_toolset`'s, its format chosen; ``rewards``: resolved already
    (else built from ``settings.reward``), in a worker when reward.timeout_s > 0; ``prompts_state``: the prompt
    sampler's state to start from. ``ahead``: it samples ahead of the trainer (rollout.max_staleness > 0): the
    weights are the ones published to it, never synced from the live model, and every rollout is seeded."""
    r = settings.rollout
    if rewards is None:
        rewards = build_rewards(settings.reward.functions)
    rewards = in_worker(list(rewards), settings.reward.timeout_s)
    prompts = PromptSampler(len(rows), seed=settings.seed)
    if prompts_state is not None:
        prompts.load_state_dict(prompts_state)
    worker = turn_loop = None
    if toolset is not None:  # multi-turn episodes: the tools run in a worker of this sampler's own
        if toolset.env_reward:
            rewards.append(environment_reward(toolset))
        worker = ToolWorker(toolset.environment, r.tool_timeout_s)
        turn_loop = turn_loop_maker(settings.episodes, tokenizer, toolset, worker, settings.data, runtime)
    ctx = registry.BackendContext(runtime, tokenizer, r, settings.model_name, settings.seed, settings.longest_prompt,
                                  list(rows[0]["prompt_ids"][:SYNC_CHECK_TOKENS]) if rows else [],
                                  progress=progress, multi_turn=multi_turn(r))
    caps = registry.capabilities(settings.backend)
    backend = SyncedBackend(lambda: registry.make(settings.backend, ctx), runtime, caps, follow=not ahead)
    return Sampler(runtime, tokenizer, rows, prompts, backend, rewards,
                   completion_format=settings.reward.completion_format, seeded=caps.seeded or ahead, seed=settings.seed,
                   turn_loop=turn_loop, tool_worker=worker)
