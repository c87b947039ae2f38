"""What runs inside the generator process of asynchronous GRPO (`grpo.rollout.generator`): the sampling half of a
run, rebuilt there from the config, with its own copy of the policy and one thread.

It samples exactly what `grpo.experience.sample` samples in the trainer (the rollout, every reward function, the
zero-std filter and its refill rounds), from its own prompt sampler (started from the trainer's state, so the
prompts come in the synchronous run's order) and with a seed per rollout round (`grpo.rollout.backends.step_seed`
of the sampler's position, so that a resume samples the same). Then it computes the behaviour log-probs of what it
sampled with the trainer's own engine (`grpo.engine.batch_logprobs.nested_logprobs`, the same micro-batches): when
its weights equal the trainer's, they equal the trainer's log-probs bit for bit and the correction's ratio is 1.

With many training processes (ZeRO-2/3) every rank has a generator of its own: it samples that rank's share of each
step's prompts with that rank's seeds, as the rank's trainer would (a `LocalRuntime` of that rank, its collectives
over itself), and keeps the sums its statistics come from, which the trainers reduce (`grpo.experience.reduce_stats`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo import experience
from grpo.config.schema import Config
from grpo.data import PromptSampler, Splits
from grpo.engine.batch_logprobs import nested_logprobs
from grpo.models import load_model, load_tokenizer
from grpo.rewards.score import build as build_rewards
from grpo.rewards.score import in_worker
from grpo.rollout.backends import HFBackend, SyncedBackend
from grpo.rollout.episodes.runs import environment_reward, turn_loop_maker
from grpo.rollout.episodes.spec import build_toolset, choose_format, multi_turn
from grpo.rollout.episodes.worker import ToolWorker
from grpo.rollout.generator import Generated
from grpo.runtime.local import LocalRuntime
from grpo.trainer.run import Run
from grpo.trainer.settings import RunSettings


@dataclass(frozen=True)
class GeneratorSpec:
    """Everything the generator process is built from (it must pickle)."""
    cfg: Config
    settings: RunSettings      # the trainer's, derived once (the micro-batch budget it sized)
    train_rows: list[dict]     # the training split as the trainer built it
    sampler: dict              # the prompt sampler's state to start from (a resume: after the stored batches)
    threads: int = 1           # torch threads of the generator
    rank: int = 0              # the trainer's rank: the generator samples its share of each step's prompts
    world_size: int = 1
    device: str = "cpu"        # the trainer's device (one GPU per rank)


class GeneratorSide:
    """``load(version, weights)`` and ``sample(step, version)``: what `grpo.rollout.generator` calls."""

    def __init__(self, run: Run):
        self.run, self.version = run, None
        self.params = dict(run.policy.named_parameters())

    def load(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in weights.items():
                self.params[name].copy_(value)
        self.version = version

    def sample(self, step: int, version: int) -> Generated:
        if version != self.version:
            raise RuntimeError(f"step {step} wants the weights of version {version}, the generator holds "
                               f"{self.version}: published out of order")
        run, s = self.run, self.run.settings.collect
        batch = experience.sample(run)
        batch.sampling_logps = nested_logprobs(run.runtime, run.policy, batch, s.engine, s.sampling.temperature)
        batch.versions = [version] * len(batch.completion_ids)
        return Generated(step, version, batch, run.sampler.state_dict())


def own_sampling_parts(cfg: Config, settings: RunSettings, tokenizer, toolset, runtime, train_size: int,
                       sampler_state: dict):
    """What a generator samples with of its own, never shared with the trainer: the reward functions (and their
    worker; with episodes, the environment's reward), a prompt sampler started from ``sampler_state``, and for
    multi-turn episodes a tool worker and the turn loop. Returns ``(rewards, sampler, tool_worker, turn_loop)``."""
    rewards = in_worker(build_rewards(cfg.reward.functions), cfg.reward.timeout_s)
    sampler = PromptSampler(train_size, seed=cfg.trainer.seed)
    sampler.load_state_dict(sampler_state)
    worker = turn_loop = None
    if toolset is not None:  # multi-turn episodes: the tools run in a worker of the generator's own
        if toolset.env_reward:
            rewards.append(environment_reward(toolset))
        worker = ToolWorker(toolset.environment, cfg.rollout.tool_timeout_s)
        turn_loop = turn_loop_maker(settings.episodes, tokenizer, toolset, worker, cfg.data, runtime)
    return rewards, sampler, worker, turn_loop


def build(spec: GeneratorSpec) -> GeneratorSide:
    """The generator's run: tokenizer, policy copy, rewards (and their worker), tools, sampler, seeded backend."""
    torch.set_num_threads(spec.threads)
    cfg = spec.cfg
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    runtime = LocalRuntime(spec.device, spec.rank, spec.world_size)
    policy = runtime.setup(load_model(cfg.model, len(tokenizer), seed=cfg.trainer.seed), None, None)
    policy.train()  # as the trainer's: the behaviour log-probs are taken in the same mode
    backend = HFBackend(policy, tokenizer, batch_size=cfg.rollout.batch_size, share_prompt=cfg.rollout.share_prompt,
                        context=runtime.generation_context, seeded=True, keep_turns=multi_turn(cfg.rollout))
    toolset = build_toolset(cfg.rollout.tools, cfg.rollout.environment)
    if toolset is not None:
        toolset, _ = choose_format(toolset, cfg.rollout.tool_format, tokenizer, cfg.data.chat_template)
    rewards, sampler, worker, turn_loop = own_sampling_parts(cfg, spec.settings, tokenizer, toolset, runtime,
                                                             len(spec.train_rows), spec.sampler)
    run = Run(runtime, tokenizer, policy, None, Splits(spec.train_rows, []), rewards, sampler, spec.settings,
              SyncedBackend(lambda: backend, runtime), backend, completion_format=cfg.reward.completion_format,
              toolset=toolset, tool_worker=worker, turn_loop=turn_loop)
    return GeneratorSide(run)
