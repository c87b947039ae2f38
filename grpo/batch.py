"""`Batch`: one step's experience, what `experience.collect` produces and `update.policy_update` trains on.

Groups are laid out group after group; ``flat`` indices run over every completion in that order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    rows: list[dict]                          # one dataset row per group
    prompt_ids: list[list[int]]
    completion_ids: list[list[list[int]]]     # [group][completion] -> token ids
    truncated: list[list[bool]]
    rewards: torch.Tensor                     # [N] total reward per completion
    advantages: torch.Tensor                  # [N]
    old_logps: list | None = None             # nested like completion_ids, or None (mu = 1)
    ref_logps: list | None = None             # nested like completion_ids, or None (beta = 0)
    stats: dict = field(default_factory=dict)  # rollout/reward metrics of this batch
    sampling_logps: list | None = None        # the rollout backend's own log-probs (vLLM), nested; None: hf

    @property
    def group_sizes(self) -> list[int]:
        return [len(g) for g in self.completion_ids]

    def flat_index(self, group: int, completion: int) -> int:
        return sum(self.group_sizes[:group]) + completion
