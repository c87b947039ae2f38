"""Rollout importance sampling: correcting for a sampler whose log-probs differ from the trainer's.

A rollout engine other than our own decode loop (vLLM) samples from its own kernels and precision, so the
distribution it sampled from, pi_sampler, is not exactly the trainer's pi_old. Truncated importance sampling
(TIS) re-weights each token's policy-gradient term by rho = pi_old / pi_sampler, computed from the log-probs
both sides report for the same tokens:

- ``token_truncate``:    w_t = min(rho_t, C)                     (per token, capped)
- ``token_mask``:        w_t = rho_t if rho_t <= C else 0        (per token, tokens beyond the cap dropped)
- ``sequence_truncate``: w_t = min(prod_t rho_t, C)              (one weight per completion)
- ``sequence_mask``:     w_t = prod_t rho_t if <= C else 0       (a completion beyond the cap dropped)
- ``none``:              w_t = 1 (the mismatch is still measured)

The weights are constants (no gradient); they multiply the clipped policy-gradient term of every token, not the
KL penalty (as TRL does). Everything here is pure: ``[B, T]`` right-padded tensors with a 0/1 ``mask``.
"""
from __future__ import annotations

import torch

from grpo.config.schema import ROLLOUT_IS_MODES as MODES
from grpo.runtime.base import Runtime


def rollout_is(logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor, mode: str,
               cap: float) -> tuple[torch.Tensor, dict]:
    """``(weights, stats)`` for ``mode`` with cap ``C``, from one ratio rho = pi_old / pi_sampler: per token, or for
    sequence modes the product over each completion's tokens broadcast to its tokens (padding gives 1 and does not
    enter the product).

    ``weights`` ``[B, T]``: no gradient, zero on padding. ``stats``: sums over this (micro-)batch's tokens, to add
    up across micro-batches and processes, plus two maxima: ``abs_diff`` sum of |log pi_old - log pi_sampler|;
    ``tokens`` masked tokens; ``capped`` tokens whose weight the cap changed (sequence modes: every token of a capped
    completion); ``ratio_max`` the largest rho (the token ratio for ``none`` and token modes, the completion ratio
    for sequence modes); ``abs_diff_max`` the largest |delta log p|."""
    if mode not in MODES:
        raise ValueError(f"rollout_is must be one of {', '.join(MODES)}, got {mode!r}")
    mask = mask.float()
    diff = (logp.detach().float() - sampling_logp.float()) * mask
    ratio = torch.exp(diff.sum(-1, keepdim=True)).expand_as(diff) if mode.startswith("sequence") else torch.exp(diff)
    on = mask > 0
    if mode == "none":
        weights = mask.clone()
    elif mode.endswith("_truncate"):
        weights = ratio.clamp(max=cap) * mask
    else:
        weights = ratio.masked_fill(ratio > cap, 0.0) * mask
    stats = {"abs_diff": float(diff.abs().sum()), "tokens": float(mask.sum()),
             "capped": float(((ratio > cap) & on).sum()) if mode != "none" else 0.0,
             "ratio_max": float(ratio[on].max()) if bool(on.any()) else 0.0,
             "abs_diff_max": float(diff.abs().max()) if diff.numel() else 0.0}
    return weights, stats


def summarize(totals: dict, prefix: str = "rollout_is/") -> dict:
    """The logged metrics from summed `rollout_is` stats (``ratio_max``/``abs_diff_max`` already reduced by max)."""
    tokens = max(totals.get("tokens", 0.0), 1.0)
    return {f"{prefix}logp_diff_abs_mean": totals.get("abs_diff", 0.0) / tokens,
            f"{prefix}logp_diff_abs_max": totals.get("abs_diff_max", 0.0),
            f"{prefix}ratio_max": totals.get("ratio_max", 0.0),
            f"{prefix}capped_frac": totals.get("capped", 0.0) / tokens}


class MismatchMeter:
    """The correction over one policy update: ``weights`` per micro-batch (recording the mismatch), then
    ``metrics`` once. Its ``sums`` go into the update's own all-reduced totals (no collective of their own); the
    maxima take one ``all_max``."""

    def __init__(self, mode: str, cap: float):
        self.mode, self.cap = mode, cap
        self.sums = {"is_abs_diff": 0.0, "is_tokens": 0.0, "is_capped": 0.0}
        self.maxes = {"ratio_max": 0.0, "abs_diff_max": 0.0}

    def weights(self, logp: torch.Tensor, sampling_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The weights for this micro-batch (None for mode ``none``: nothing to multiply)."""
        w, s = rollout_is(logp, sampling_logp, mask, self.mode, self.cap)
        for k in self.sums:
            self.sums[k] += s[k.removeprefix("is_")]
        for k in self.maxes:
            self.maxes[k] = max(self.maxes[k], s[k])
        return None if self.mode == "none" else w.to(logp.dtype)

    def metrics(self, runtime: Runtime, reduced: dict) -> dict:
        """Collective: every rank calls it once per update. ``reduced``: the update's totals, summed over every rank,
        with ``sums`` among them."""
        return summarize({**{k.removeprefix("is_"): reduced[k] for k in self.sums}, **runtime.all_max(self.maxes)})
