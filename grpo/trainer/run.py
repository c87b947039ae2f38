"""What a run is made of: `Run`, the objects built once (`grpo.trainer.build.build_run`), and `LoopState`, the
few values the training loop changes from step to step (and `grpo.trainer.checkpoint` saves and restores).

The built objects keep their own internal state (weights, optimizer moments, the schedule, the sampler's
position), which checkpoints save and restore in place; nothing writes into a `Run` after it is built. Its
``settings`` (`grpo.trainer.settings`) are what every stage reads instead of the config.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from grpo.batch import Batch
from grpo.data import Splits
from grpo.rollout.base import RolloutBackend
from grpo.rollout.episodes.spec import Toolset
from grpo.runtime.base import Runtime
from grpo.sampler import Sampler
from grpo.trainer.settings import RunSettings


@dataclass
class Run:
    runtime: Runtime
    tokenizer: object
    policy: torch.nn.Module               # as loaded; `model` is the one the runtime trains (maybe wrapped)
    reference: torch.nn.Module | None     # None: beta = 0, or LoRA (the policy with its adapter disabled)
    splits: Splits
    sampler: Sampler                      # the backend, rewards, prompt sampler and turn loop (`grpo.sampler`)
    settings: RunSettings                 # what every stage reads (derived from the config once)
    eval_backend: RolloutBackend          # held-out evaluation: greedy, our decode loop on the training model
    owns_output_dir: bool = True          # finalises checkpoints in its output_dir (rank 0; a node's first rank
                                          # when that node's output_dir is not rank 0's, see `build.owns_output_dir`)
    toolset: Toolset | None = None        # multi-turn episodes (rollout.tools / rollout.environment), format chosen
    image_processor: object | None = None  # a vision-language model's (saved with the final model), None: text

    @property
    def model(self) -> torch.nn.Module:
        return self.runtime.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.runtime.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self.runtime.scheduler

    def reference_context(self):
        """Context in which `reference_model()` gives the frozen reference (LoRA: adapter disabled)."""
        if self.reference is None and hasattr(self.model, "disable_adapter"):
            return self.model.disable_adapter()
        return contextlib.nullcontext()

    def reference_model(self) -> torch.nn.Module:
        return self.reference if self.reference is not None else self.model

    def close(self) -> None:
        """Give back what the run holds outside Python's reach: the rollout engine, the tool and reward workers."""
        self.sampler.close()


@dataclass
class LoopState:
    """Changed only by the training loop (and filled by `checkpoint.restore`); saved in every checkpoint."""
    step: int = 0                         # the last step completed
    buffer: Batch | None = None           # rollouts reused across num_iterations optimizer steps
    bad_steps: int = 0                    # non-finite steps in a row
    skipped_steps: int = 0                # steps whose update was skipped, in all
    failed_reward_steps: dict[str, int] = field(default_factory=dict)  # per function: rollouts in a row it failed
    stop_requested: bool = False          # a signal seen on any rank: checkpoint and stop after this step
    in_flight: dict | None = None         # rollout.max_staleness > 0: the batches sampled ahead (grpo.trainer.pipeline)
