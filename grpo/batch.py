"""`Batch`: one step's experience, what `experience.collect` produces and `update.policy_update` trains on.

Groups are laid out group after group; ``flat`` indices run over every completion in that order.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

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
    # multi-turn episodes (grpo.rollout.episodes): nested like completion_ids, 1 = a token the policy sampled,
    # 0 = one a tool or the environment wrote (no loss, KL or entropy, not counted); None: every token was sampled
    completion_masks: list | None = None
    episodes: list | None = None              # nested: each episode's turns and tool counts (samples.jsonl)
    scores: list | None = None                # nested: each completion's {reward function: score or None}
    versions: list | None = None              # per group: the policy version that sampled it (asynchronous GRPO)
    # this rank's sums the sampling statistics are made of, by kind (`grpo.experience.finish` reduces them over
    # every rank once, for a batch sampled in the loop or apart from the trainer's collectives)
    sums: dict | None = None

    # how `select` and `concat` treat each field: nested per group (the default), per completion (a flat tensor
    # over every completion), or kept from the first batch
    _FLAT = ("rewards", "advantages")
    _KEPT = ("stats", "sums")

    def select(self, keep: list[bool]) -> Batch:
        """The groups whose ``keep`` is true, every per-group and per-completion field cut alike."""
        flat_keep = [k for k, g in zip(keep, self.group_sizes) for _ in range(g)]
        idx = torch.tensor([i for i, k in enumerate(flat_keep) if k], dtype=torch.long)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self._KEPT:
                out[f.name] = None if value is None else dict(value)
            elif f.name in self._FLAT:
                out[f.name] = value[idx]
            else:
                out[f.name] = None if value is None else [x for x, k in zip(value, keep) if k]
        return Batch(**out)

    def concat(self, other: Batch) -> Batch:
        """This batch's groups followed by ``other``'s (a per-group field either lacks is None in the result; the
        stats are this batch's)."""
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in self._KEPT:
                out[f.name] = a
            elif f.name in self._FLAT:
                out[f.name] = torch.cat([a, b])
            else:
                out[f.name] = None if a is None or b is None else a + b
        return Batch(**out)

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
