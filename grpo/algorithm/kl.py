"""Per-token estimators of KL(pi || pi_ref) from samples of pi: Schulman's k1, k2 and k3 ("Approximating KL
Divergence", http://joschu.net/blog/kl-approx.html, 2020). With r = pi_ref / pi on a token sampled from pi:
k1 = -log r (unbiased, high variance, can be negative); k2 = (log r)^2 / 2 (biased, low variance); k3 = (r - 1) - log r
(unbiased, low variance, >= 0; GRPO's, arXiv:2402.03300 eq. 4)."""
from __future__ import annotations

import torch


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref); ``logp``, ``ref_logp``: ``[B, T]`` (or any shape, the same)."""
    log_ratio = ref_logp - logp  # log r = log pi_ref / pi
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1
    raise ValueError(f"kl_estimator must be k1, k2 or k3, got {estimator!r}")
