"""Policy losses: the per-token policy term of the objective, one registered function each.

A policy loss has one fixed signature::

    @register_policy_loss("name")
    def name(logp, old_logp, advantages, mask, algorithm) -> tuple[per_token, stats]

``logp`` (with grad), ``old_logp`` and ``mask``: ``[B, T]``; ``advantages``: ``[B]``; ``algorithm``: the run's
`AlgorithmConfig` (its hyperparameters). It returns the per-token loss ``[B, T]`` (to be minimised; the rollout
correction, the KL penalty and the aggregation are applied around it by `grpo.algorithm.loss.grpo_loss`) and
token-summed statistics over ``mask`` (``ratio``, ``clip_low``, ``clip_high``: the update logs each one a loss
returns, and None for the others). ``algorithm.policy_loss`` names the one a run uses (a registered name, or
``package.module:function`` for one outside grpo).
"""
from __future__ import annotations

from typing import Callable

import torch

from grpo.errors import ConfigError
from grpo.objects import load_object
from grpo.registry import Registry

PolicyLoss = Callable[..., tuple[torch.Tensor, dict]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


def get_policy_loss(spec: str) -> PolicyLoss:
    """The loss ``algorithm.policy_loss`` names; a one-line ConfigError listing the registered ones."""
    if spec in POLICY_LOSSES:
        return POLICY_LOSSES[spec]
    if ":" not in spec:
        raise ConfigError(f"algorithm.policy_loss={spec!r} is not a registered policy loss; one of "
                          f"{', '.join(POLICY_LOSSES.names())}, or 'package.module:function' (docs/architecture.md)")
    fn = load_object(spec, "algorithm.policy_loss")
    if not callable(fn):
        raise ConfigError(f"algorithm.policy_loss={spec!r} is not a function")
    return fn


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                     level: str = "token") -> torch.Tensor:
    """rho = pi / pi_old per token ``[B, T]``, or GSPO's length-normalised sequence ratio
    (pi(y|x) / pi_old(y|x))^(1/|y|) broadcast to the tokens (arXiv:2507.18071)."""
    log_ratio = logp - old_logp                                                          # [B, T]
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        return torch.exp(seq).expand_as(logp)
    raise ValueError(f"importance_sampling must be token or sequence, got {level!r}")


def ppo_clip(logp, old_logp, advantages, mask, algorithm):
    """GRPO's clipped surrogate, -min(rho A, clip(rho, 1 - eps, 1 + eps_high) A) per token (arXiv:2402.03300
    eq. 3), with DAPO's clip-higher ``epsilon_high`` (arXiv:2503.14476 sec. 3.1), an optional cap ``delta`` on the
    unclipped ratio (two-sided clipping for negative advantages) and GSPO's sequence-level ratio with
    ``importance_sampling=sequence`` (arXiv:2507.18071)."""
    eps, delta = algorithm.epsilon, algorithm.delta
    eps_high = eps if algorithm.epsilon_high is None else algorithm.epsilon_high
    adv = advantages.unsqueeze(-1)                                                       # [B, 1]
    ratio = importance_ratio(logp, old_logp, mask, algorithm.importance_sampling)        # [B, T]
    capped = torch.clamp(ratio, max=delta) if delta is not None else ratio
    per_token = -torch.min(capped * adv, torch.clamp(ratio, 1 - eps, 1 + eps_high) * adv)
    with torch.no_grad():
        low = (ratio < 1 - eps) & (adv < 0)
        high = (ratio > 1 + eps_high) & (adv > 0)
        stats = {"clip_low": (low.float() * mask).sum(), "clip_high": (high.float() * mask).sum(),
                 "ratio": (ratio.detach() * mask).sum()}
    return per_token, stats


# registered by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
register_policy_loss("ppo_clip")(ppo_clip)
