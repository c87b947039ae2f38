"""The sampling half of an asynchronous run on the server backend (``rollout.backend=server``,
``rollout.max_staleness`` > 0): what `grpo.rollout.server.generator.ServerGenerator`'s worker thread calls.

It samples exactly what `grpo.experience.sample` samples in the synchronous server run (the rollout from the
servers, every reward function, the zero-std filter and its refill rounds), with parts of its own so that nothing
is shared with the trainer's thread: a copy of the prompt sampler (started from the trainer's state, so the
prompts come in the synchronous run's order, each round seeded by `grpo.rollout.backends.step_seed` of the
sampler's position), the reward functions (and their worker), a tokenizer, and for multi-turn episodes a tool
worker. The behaviour log-probs (`Batch.sampling_logps`) are the servers' own sampling log-probs, as in the
synchronous server run; `server/sync_logprob_gap` bounds how far they are from the trainer's on the pushed weights.
"""
from __future__ import annotations

import copy
import dataclasses

from grpo import experience
from grpo.config.schema import Config
from grpo.rollout.generator import Generated
from grpo.rollout.server.generator import ServerGenerator
from grpo.trainer.generator_side import own_sampling_parts
from grpo.trainer.run import Run


class _Held:
    """The generator's view of the backend: the weights are the worker's pushes, never the trainer's live ones
    (no sync at ``ready``); the versions every request was answered with are recorded."""

    def __init__(self, backend):
        self.backend, self.versions = backend, set()

    def ready(self):
        return self

    def generate(self, *args, **kw):
        out = self.backend.generate(*args, **kw)
        self.versions.update(out.versions or [])
        return out

    def stats(self) -> dict:
        return {"server/sync_logprob_gap": self.backend.stats.get("server/sync_logprob_gap")}

    def __getattr__(self, name):  # name, sleep, ...: the backend's
        return getattr(self.backend, name)


def server_generator(run: Run, cfg: Config) -> ServerGenerator:
    """Connect to the servers (rollout.server) and build the generator of this run (its weights: the first
    ``publish``)."""
    backend = run.rollout.make()
    rewards, sampler, worker, turn_loop = own_sampling_parts(cfg, run.settings, run.tokenizer, run.toolset,
                                                             run.runtime, len(run.splits.train),
                                                             run.sampler.state_dict())
    held = _Held(backend)
    mine = dataclasses.replace(run, tokenizer=copy.deepcopy(run.tokenizer), rewards=rewards, sampler=sampler,
                               rollout=held, tool_worker=worker, turn_loop=turn_loop)

    def sample(step: int, version: int) -> Generated:
        held.versions.clear()
        batch = experience.sample(mine)
        if held.versions != {version}:
            raise RuntimeError(f"the batch of step {step} was sampled with weight versions {sorted(held.versions)}, "
                               f"not {version}: a push came between its requests")
        batch.versions = [version] * len(batch.completion_ids)
        batch.stats["server/version_lag"] = float(step - 1 - version)  # the trainer's weights when it trains
        return Generated(step, version, batch, sampler.state_dict())

    return ServerGenerator(backend, run.runtime.model, sample, full_weights=run.runtime.full_weights,
                           closers=[mine.close])
