"""An independent GRPO loss, written from the formulas in docs/algorithms.md, for checking `policy_update`.

Nothing here calls grpo.algorithm.loss, grpo.engine or grpo.update: every completion goes through a plain
Hugging Face forward of its own ``prompt + completion`` row (``model(input_ids).logits``), then
``log_softmax(logits / T)`` and a gather; the ratio, clip, KL estimators and the four aggregations are
spelled out per completion in Python loops.
"""
from __future__ import annotations

import math

import torch


def hf_logprobs(model, prompts: list[list[int]], completions: list[list[int]], temperature: float) -> list:
    """log p(token) of every completion token, one row per completion (``prompts[i]`` goes with
    ``completions[i]``); differentiable when grad is enabled."""
    out = []
    for p, c in zip(prompts, completions):
        ids = torch.tensor([list(p) + list(c)])
        logits = model(input_ids=ids).logits[0].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        out.append(logp[len(p) - 1: len(p) - 1 + len(c)].gather(-1, torch.tensor(c)[:, None])[:, 0])
    return out


def kl_token(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    d = ref - logp  # log pi_ref / pi
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d * d / 2
    assert estimator == "k3", estimator
    return torch.exp(d) - d - 1


def flat(nested: list) -> list:
    return [x for group in nested for x in group]


def oracle_loss(model, batch, acfg, *, temperature: float, max_len: int, mask_truncated: bool,
                old: list | None = None, ref: list | None = None, behaviour: list | None = None,
                is_mode: str = "token_truncate", is_cap: float = 2.0):
    """``(loss, kl_mean)`` of ``batch`` under ``acfg`` (an AlgorithmConfig), from scratch.

    ``old`` / ``ref``: flat lists (one 1-D tensor per completion) of pi_old / pi_ref log-probs; None means
    pi_old = pi (one pass: ratio 1, gradient of log pi) and no reference. ``kl_mean`` is the mean per-token
    KL estimate over the completions that count (None without a reference or with beta = 0). ``behaviour``: flat
    log-probs of the policy that sampled the batch (asynchronous GRPO, vLLM): the policy term of each token is
    weighted by pi_old / pi_behaviour, per token or per completion, truncated at or masked above ``is_cap``
    (decoupled PPO as in AReaL, arXiv:2505.24298, with TIS's cap). A batch with
    ``completion_masks`` (multi-turn episodes): only the tokens marked 1 exist for the loss, as if the others
    (tool output) were context; they still sit in the forward's input."""
    prompts = [p for p, g in zip(batch.prompt_ids, batch.completion_ids) for _ in g]
    comps = flat(batch.completion_ids)
    truncated = flat(batch.truncated)
    adv = [float(a) for a in batch.advantages]
    logps = hf_logprobs(model, prompts, comps, temperature)
    masks = flat(batch.completion_masks) if getattr(batch, "completion_masks", None) is not None else None
    sampled = [[k for k in range(len(c)) if masks is None or masks[i][k]] for i, c in enumerate(comps)]
    logps = [lp[sampled[i]] for i, lp in enumerate(logps)]
    old = None if old is None else [o[sampled[i]] for i, o in enumerate(old)]
    ref = None if ref is None else [r[sampled[i]] for i, r in enumerate(ref)]
    behaviour = None if behaviour is None else [b[sampled[i]] for i, b in enumerate(behaviour)]
    keep = [i for i in range(len(comps)) if not (mask_truncated and truncated[i])]
    n_seqs = len(keep)
    n_tokens = sum(len(sampled[i]) for i in keep)
    eps_low = acfg.epsilon
    eps_high = acfg.epsilon if acfg.epsilon_high is None else acfg.epsilon_high
    beta = 0.0 if acfg.kl_in_reward else acfg.beta
    total = torch.zeros(())
    kl_sum = 0.0
    for i in keep:
        lp = logps[i]
        lp_old = lp.detach() if old is None else old[i]
        if acfg.importance_sampling == "sequence":  # GSPO: exp of the mean log-ratio, one per completion
            rho = torch.exp((lp - lp_old).sum() / len(lp)) * torch.ones_like(lp)
        else:
            rho = torch.exp(lp - lp_old)
        a = adv[i]
        capped = rho if acfg.delta is None else torch.minimum(rho, torch.full_like(rho, acfg.delta))
        surrogate = torch.minimum(capped * a, torch.clamp(rho, 1 - eps_low, 1 + eps_high) * a)
        per_token = -surrogate
        if behaviour is not None:
            per_token = per_token * behaviour_weight(lp_old.detach() - behaviour[i], is_mode, is_cap)
        if ref is not None and beta > 0:
            kl = kl_token(lp, ref[i], acfg.kl_estimator)
            per_token = per_token + beta * kl
            kl_sum += float(kl.detach().sum())
        if acfg.loss_agg == "token_mean":
            term = per_token.sum() / n_tokens
        elif acfg.loss_agg == "seq_mean_token_mean":
            term = per_token.mean() / n_seqs
        elif acfg.loss_agg == "seq_mean_token_sum":
            term = per_token.sum() / n_seqs
        else:
            assert acfg.loss_agg == "dr_grpo", acfg.loss_agg
            term = per_token.sum() / (n_seqs * max_len)
        total = total + term
    kl_mean = kl_sum / n_tokens if (ref is not None and beta > 0) else None
    return total, kl_mean


def behaviour_weight(log_ratio: torch.Tensor, mode: str, cap: float) -> torch.Tensor:
    """One completion's weights from log(pi_old / pi_behaviour) per token."""
    if mode == "none":
        return torch.ones_like(log_ratio)
    rho = torch.exp(log_ratio.sum()) * torch.ones_like(log_ratio) if mode.startswith("sequence") else \
        torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return torch.minimum(rho, torch.full_like(rho, cap))
    return torch.where(rho > cap, torch.zeros_like(rho), rho)


def oracle_grads(model, batch, acfg, **kw) -> tuple[float, dict, float | None]:
    """Loss, every parameter's gradient (the model's .grad is left cleared) and the KL mean."""
    model.zero_grad(set_to_none=True)
    loss, kl = oracle_loss(model, batch, acfg, **kw)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads, kl


def assert_grads_close(got: dict, want: dict, rel: float = 1e-5) -> None:
    """Every gradient within ``rel`` of the oracle's, relative to that tensor's largest entry."""
    assert got.keys() == want.keys()
    for n in want:
        scale = float(want[n].abs().max())
        err = float((got[n] - want[n]).abs().max())
        assert err <= rel * max(scale, 1e-12) or (scale == 0 and err == 0), (n, err, scale)


def close(a: float, b: float, rel: float = 1e-5, abs_: float = 1e-7) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def old_and_reference_logprobs(policy, reference, batch, temperature: float, gen) -> tuple[list, list]:
    """Per completion of ``batch``: pi_old (the policy's log-probs moved by N(0, 0.5), ratios ~0.3 to ~3) and the
    reference's log-probs, by the plain per-sequence forward."""
    rows_p = [p for p, g in zip(batch.prompt_ids, batch.completion_ids) for _ in g]
    with torch.no_grad():
        current = hf_logprobs(policy, rows_p, flat(batch.completion_ids), temperature)
        ref = hf_logprobs(reference, rows_p, flat(batch.completion_ids), temperature)
    return [lp - 0.5 * torch.randn(lp.shape, generator=gen) for lp in current], ref
