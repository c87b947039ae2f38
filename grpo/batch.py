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
    # multi-turn episodes (grpo.tools): nested like completion_ids, 1 = a token the policy sampled, 0 = one a tool
    # or the environment wrote (no loss, KL or entropy, not counted); None: every token was sampled
    completion_masks: list | None = None
    episodes: list | None = None              # nested: each episode's turns and tool counts (samples.jsonl)
    scores: list | None = None                # nested: each completion's {reward function: score or None}

    @property
    def group_sizes(self) -> list[int]:
        return [len(g) for g in self.completion_ids]

    def flat_index(self, group: int, completion: int) -> int:
        return sum(self.group_sizes[:group]) + completion

    def sampled_count(self, group: int, completion: int) -> int:
        """Tokens of a completion the policy sampled (all of them, unless tools wrote some)."""
        if self.completion_masks is None:
            return len(self.completion_ids[group][completion])
        return sum(self.completion_masks[group][completion])

    def token_mask(self, group: int, completion: int) -> torch.Tensor:
        """1.0 for each token the policy sampled, 0.0 for tool/environment tokens."""
        if self.completion_masks is None:
            return torch.ones(len(self.completion_ids[group][completion]))
        return torch.tensor(self.completion_masks[group][completion], dtype=torch.float32)
