"""The samplers of asynchronous GRPO (``rollout.max_staleness`` > 0), built by the run's one factory
(`grpo.sampler.build_sampler`, ``ahead=True``) for the two ways a backend samples ahead (its capabilities'
``ahead``, `grpo.rollout.registry`):

- ``process``: a generator process per rank (`grpo.rollout.generator_process.GeneratorProcess`) with its own copy of the
  policy and one thread. `ProcessSide` is what runs inside it: it loads the weights published to it and samples
  exactly what `grpo.experience.sample` samples in the trainer, then takes the behaviour log-probs of what it
  sampled with the trainer's own engine (`grpo.engine.batch_logprobs.nested_logprobs`, the same micro-batches):
  when its weights equal the trainer's, they equal the trainer's log-probs bit for bit and the correction's ratio
  is 1. With many training processes (ZeRO-2/3) each rank's generator samples that rank's share of each step's
  prompts with that rank's seeds (a `LocalRuntime` of that rank, its collectives over itself) and keeps the sums
  its statistics come from, which the trainers reduce (`grpo.experience.finish`).
- ``thread``: the rollout servers (`grpo.rollout.server.generator_thread.ServerGenerator`): `server_generator`'s sampler
  lives in the trainer's process and runs on the worker thread, the weights it samples with are the worker's
  pushes; the behaviour log-probs are the servers' own, as in the synchronous server run. With many training
  processes each rank's worker samples the rank's share from the servers with the rank's seeds, rank 0 pushes,
  and the workers agree (on the push, the sync check, refill rounds) through a group of their own
  (`grpo.runtime.base.Runtime.thread_view`).

Either way the sampler is its own: a prompt sampler started from the trainer's state (so the prompts come in the
synchronous run's order, each round seeded by `grpo.rollout.backends.step_seed` of its position, so that a resume
samples the same), its reward functions (and their worker), and for multi-turn episodes a tool worker.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from grpo import experience
from grpo.config.schema import ModelConfig
from grpo.engine.batch_logprobs import nested_logprobs
from grpo.models import load_model, load_tokenizer
from grpo.rollout.episodes.spec import Toolset
from grpo.rollout.generator_process import Generated, GeneratorProcess
from grpo.rollout.server.generator_thread import ServerGenerator
from grpo.runtime.local import LocalRuntime
from grpo.sampler import Sampler, build_sampler
from grpo.trainer.run import Run
from grpo.trainer.settings import RunSettings


@dataclass(frozen=True)
class ProcessSpec:
    """Everything the generator process is built from (it must pickle)."""
    settings: RunSettings      # the trainer's, derived once (the micro-batch budget it sized, the sampler's)
    model: ModelConfig         # the model section: the policy's copy is loaded as the trainer's was
    toolset: Toolset | None    # the trainer's, its tool format chosen
    train_rows: list[dict]     # the training split as the trainer built it
    sampler: dict              # the prompt sampler's state to start from (a resume: after the stored batches)
    threads: int = 1           # torch threads of the generator
    rank: int = 0              # the trainer's rank: the generator samples its share of each step's prompts
    world_size: int = 1
    device: str = "cpu"        # the trainer's device (one GPU per rank)


class ProcessSide:
    """``load(version, weights)`` and ``sample(step, version)``: what `grpo.rollout.generator_process` calls."""

    def __init__(self, sampler: Sampler, policy: torch.nn.Module, settings: RunSettings):
        self.sampler, self.policy, self.settings, self.version = sampler, policy, settings, None
        self.params = dict(policy.named_parameters())

    def load(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in weights.items():
                self.params[name].copy_(value)
        self.version = version

    def sample(self, step: int, version: int) -> Generated:
        if version != self.version:
            raise RuntimeError(f"step {step} wants the weights of version {version}, the generator holds "
                               f"{self.version}: published out of order")
        s = self.settings.collect
        batch = experience.sample(self.sampler, s)
        batch.sampling_logps = nested_logprobs(self.sampler.runtime, self.policy, batch, s.engine,
                                               s.sampling.temperature)
        batch.versions = [version] * len(batch.completion_ids)
        return Generated(step, version, batch, self.sampler.prompts.state_dict())


def build_process_side(spec: ProcessSpec) -> ProcessSide:
    """Inside the generator process: its tokenizer, its copy of the policy, its sampler."""
    torch.set_num_threads(spec.threads)
    tokenizer = load_tokenizer(spec.model.name_or_path)
    runtime = LocalRuntime(spec.device, spec.rank, spec.world_size)
    policy = runtime.setup(load_model(spec.model, len(tokenizer), seed=spec.settings.seed), None, None)
    policy.train()  # as the trainer's: the behaviour log-probs are taken in the same mode
    sampler = build_sampler(spec.settings.sampler, runtime, tokenizer, spec.train_rows, spec.toolset,
                            prompts_state=spec.sampler, ahead=True)
    return ProcessSide(sampler, policy, spec.settings)


def process_generator(run: Run, model: ModelConfig) -> GeneratorProcess:
    """This rank's generator process (``model``: the run's model section)."""
    rt = run.runtime
    spec = ProcessSpec(run.settings, model, run.toolset, run.splits.train, run.sampler.prompts.state_dict(),
                       torch.get_num_threads(), rt.rank, rt.world_size, str(rt.device))
    return GeneratorProcess(build_process_side, spec, name=f"grpo-generator-{rt.rank}")


def server_generator(run: Run) -> ServerGenerator:
    """Connect to the servers (rollout.server) and build the generator of this run (its weights: the first
    ``publish``)."""
    s = run.settings.collect
    # the worker thread's collectives (the push's barrier, the sync check, refill rounds) over a group of their own
    view = run.runtime.thread_view()
    sampler = build_sampler(run.settings.sampler, view, copy.deepcopy(run.tokenizer), run.splits.train,
                            run.toolset, prompts_state=run.sampler.prompts.state_dict(), ahead=True)
    backend = sampler.backend.ready()

    def sample(step: int, version: int) -> Generated:
        sampler.versions.clear()
        batch = experience.sample(sampler, s)
        if sampler.versions != {version}:
            raise RuntimeError(f"the batch of step {step} was sampled with weight versions {sorted(sampler.versions)}, "
                               f"not {version}: a push came between its requests")
        batch.versions = [version] * len(batch.completion_ids)
        batch.stats["server/version_lag"] = float(step - 1 - version)  # the trainer's weights when it trains
        return Generated(step, version, batch, sampler.prompts.state_dict())

    return ServerGenerator(backend, run.runtime.model, sample, full_weights=run.runtime.full_weights,
                           closers=[sampler.close])
