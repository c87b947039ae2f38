"""Group-relative advantages: A_i = (r_i - mean(group)) / (std + eps), one value per completion.

Pure functions on 1-D tensors. ``group_sizes`` may be ragged (after filtering or resampling).
A group whose rewards are all equal gets advantages of exactly 0, never NaN.
"""
from __future__ import annotations

from typing import Callable

import torch

from grpo.registry import Registry


def group_ids(group_sizes: list[int], device=None) -> torch.Tensor:
    """[0,0,0,1,1,...]: the group index of every completion."""
    sizes = torch.as_tensor(group_sizes, dtype=torch.long, device=device)  # long also when empty
    return torch.repeat_interleave(torch.arange(len(group_sizes), device=device), sizes)


def group_stats(rewards: torch.Tensor, group_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-completion group mean and unbiased group std (0 for groups of one)."""
    gid = group_ids(group_sizes, rewards.device)
    n = torch.as_tensor(group_sizes, device=rewards.device, dtype=rewards.dtype)
    sums = torch.zeros(len(group_sizes), dtype=rewards.dtype, device=rewards.device).index_add_(0, gid, rewards)
    mean = sums / n
    dev2 = torch.zeros_like(sums).index_add_(0, gid, (rewards - mean[gid]) ** 2)
    std = torch.where(n > 1, (dev2 / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(n))
    return mean[gid], std[gid]


def compute_advantages(rewards: torch.Tensor, group_sizes: list[int], scale: str = "group",
                       eps: float = 1e-4, batch_std: float | None = None) -> torch.Tensor:
    """Advantages for ``rewards`` laid out group after group: centred on their group's mean, divided by the
    ``scale`` estimator's std (`ADVANTAGE_SCALES`: ``group`` each group's std (GRPO), ``batch`` the std of all
    rewards (``batch_std`` when given: the std over every process's rewards), ``none`` only centres (Dr. GRPO)).
    An empty batch (every group filtered out) gives an empty tensor.
    """
    if rewards.numel() != sum(group_sizes):
        raise ValueError(f"{rewards.numel()} rewards for groups of total size {sum(group_sizes)}")
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be {', '.join(list(ADVANTAGE_SCALES)[:-1])} or {list(ADVANTAGE_SCALES)[-1]}, "
                         f"got {scale!r}")
    rewards = rewards.float()
    mean, std = group_stats(rewards, group_sizes)
    # a constant group has no signal: exactly 0 (float32 means can be off by an ulp, so test max == min)
    flat = torch.tensor([z for z, g in zip(zero_std_groups(rewards, group_sizes), group_sizes) for _ in range(g)],
                        dtype=torch.bool, device=rewards.device)
    centred = torch.where(flat, torch.zeros_like(rewards), rewards - mean)
    std = ADVANTAGE_SCALES[scale](rewards, std, batch_std)
    if std is None:
        return centred
    adv = centred / (std + eps)
    # exactly zero where there is no spread (also guards eps = 0)
    return torch.where((std > 0) & ~flat, adv, torch.zeros_like(adv))


# The std each estimator divides by (``algorithm.scale_rewards``): ``fn(rewards, group_std, batch_std)`` -> the std
# of every completion ``[N]``, or None (centred only).
ADVANTAGE_SCALES: Registry[Callable] = Registry("advantage estimator")


def group_scale(rewards, group_std, batch_std):
    return group_std


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
ADVANTAGE_SCALES.register("group")(group_scale)


def batch_scale(rewards, group_std, batch_std):
    if batch_std is not None:
        std = torch.as_tensor(float(batch_std), dtype=rewards.dtype, device=rewards.device)
    else:
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
    return std.expand_as(rewards)


ADVANTAGE_SCALES.register("batch")(batch_scale)


def no_scale(rewards, group_std, batch_std):
    return None


ADVANTAGE_SCALES.register("none")(no_scale)


def zero_std_groups(rewards: torch.Tensor, group_sizes: list[int]) -> list[bool]:
    """True for every group whose rewards are all equal (no learning signal)."""
    out, start = [], 0
    for g in group_sizes:
        r = rewards[start:start + g]
        out.append(bool((r == r[0]).all()))
        start += g
    return out
