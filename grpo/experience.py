"""Collecting one step's experience: rollout -> rewards -> advantages -> old/ref log-probs."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo.algorithm.advantages import compute_advantages, zero_std_groups
from grpo.algorithm.kl import kl_estimate
from grpo.batch import Batch
from grpo.config.schema import AlgorithmConfig, EngineConfig
from grpo.engine.batch_logprobs import nested_logprobs
from grpo.rewards.score import reward_inputs, score
from grpo.rollout.base import Sampling
from grpo.rollout.episodes.turns import episode_metrics
from grpo.rollout.episodes.wiring import episode_columns, episode_records, seen_rows
from grpo.runtime.base import Runtime
from grpo.sampler import Sampler


@dataclass(frozen=True)
class CollectSettings:
    """What `collect` needs, derived once per run (`grpo.trainer.settings.derive`)."""
    prompts_per_step: int      # over every rank; each samples its share
    group_size: int            # G completions per prompt
    sampling: Sampling         # rollout.max_new_tokens, temperature, top_p, top_k
    seed: int                  # trainer.seed
    algorithm: AlgorithmConfig  # zero-std filtering and resampling, beta and the KL, the advantages' scaling
    engine: EngineConfig       # the old/reference log-prob passes (its micro-batch budget an int in a built run)


class Reference(Protocol):
    """Where the frozen reference's log-probs come from (a built run): ``with reference_context():`` the model
    ``reference_model()`` gives is the reference (LoRA: the policy with its adapter disabled)."""

    def reference_context(self): ...

    def reference_model(self) -> torch.nn.Module: ...


def collect(sampler: Sampler, runtime: Runtime, s: CollectSettings, reference: Reference) -> Batch:
    """One step's experience: `sample` (steps 1-2) from ``sampler``, then `finish` (steps 3-6) with the training
    ``runtime`` (its model: the old log-probs) and the ``reference``, in order:

    1. rollout: G completions per prompt from the sampler's backend, scored by every reward function;
    2. zero-std filtering: with ``algorithm.filter_zero_std_groups`` groups whose task rewards are all equal are
       dropped, and with ``algorithm.resample_zero_std=N`` up to N more rollout rounds refill the batch with groups
       that have signal (DAPO dynamic sampling, arXiv:2503.14476 section 3.2). Every rank runs the same number of
       rounds (ZeRO-3 generates in lockstep, and the prompt sampler must stay in step). The batch may end up
       empty; `policy_update` then skips;
    3. the sampling statistics, from the sums steps 1-2 kept, over every rank (once);
    4. the reference's and the old policy's log-probs of the groups kept;
    5. the KL to the reference (a metric, or with ``kl_in_reward`` a penalty in the reward);
    6. advantages (group-normalised, `grpo.algorithm.advantages`).

    With ``rollout.max_staleness`` > 0 a sampler of its own runs `sample` ahead (`grpo.trainer.generators`) and
    the trainer `finish`es the batch when its step comes (`grpo.trainer.pipeline`).
    """
    return finish(sample(sampler, s), runtime, s, reference)


def sample(sampler: Sampler, s: CollectSettings) -> Batch:
    """Steps 1-2 of `collect`: the rollout, scored, with zero-std groups filtered out and refilled. The batch keeps
    this rank's sums of its statistics (``sums``), which `finish` reduces over every rank."""
    batch = _rollout(sampler, s)                                                        # 1.
    zero = zero_std_groups(batch.rewards, batch.group_sizes)                            # 2.
    batch.sums["zero_std"] = {"zero_std": float(sum(zero)), "groups": float(len(zero))}
    if s.algorithm.filter_zero_std_groups:  # before any log-prob forward: dropped groups cost nothing more
        batch = _filter_and_refill(sampler, s, batch, zero)
    return batch


def finish(batch: Batch, runtime: Runtime, s: CollectSettings, reference: Reference) -> Batch:
    """Steps 3-6 of `collect` on a sampled batch: its statistics, reference and old log-probs, the KL, advantages.
    A collective: every rank calls it at the same step."""
    rt, a, T = runtime, s.algorithm, s.sampling.temperature
    batch.stats = {**sampling_stats(rt, batch.sums or {}), **batch.stats}              # 3.
    stats = batch.stats
    if a.beta > 0:                                                                      # 4.
        with reference.reference_context():
            batch.ref_logps = nested_logprobs(rt, reference.reference_model(), batch, s.engine, T)
    if a.num_iterations > 1 or (a.beta > 0 and a.kl_in_reward):
        batch.old_logps = nested_logprobs(rt, rt.model, batch, s.engine, T)
    # 5. KL of the batch to the reference. With the KL in the loss and mu = 1 the update measures it itself
    # (no extra forward here); with mu > 1 or the KL in the reward the old log-probs are at hand.
    if batch.ref_logps is not None and batch.old_logps is not None:
        # only tokens the policy sampled: tool/environment tokens carry no KL
        seq_kl = torch.tensor([float((kl_estimate(lp, ref, a.kl_estimator) * batch.token_mask(g, j)).sum())
                               for g, (gl, gr) in enumerate(zip(batch.old_logps, batch.ref_logps))
                               for j, (lp, ref) in enumerate(zip(gl, gr))])            # [N]
        tokens = sum(batch.sampled_count(g, j) for g, c in enumerate(batch.completion_ids) for j in range(len(c)))
        kl = rt.all_reduce({"kl": float(seq_kl.sum()), "tokens": float(tokens)})
        stats["kl"] = kl["kl"] / max(kl["tokens"], 1)
        if a.kl_in_reward:  # r_i - beta * sum_t KL_t, before the group normalisation
            batch.rewards = batch.rewards - a.beta * seq_kl
    if a.num_iterations == 1:
        batch.old_logps = None  # ratio is 1 with one pass: old = logp.detach()
    batch_std = _batch_std(rt, batch.rewards) if a.scale_rewards == "batch" else None  # 6.
    batch.advantages = compute_advantages(batch.rewards, batch.group_sizes, a.scale_rewards, a.adv_eps,
                                          batch_std=batch_std)
    return batch


def _rollout(sampler: Sampler, s: CollectSettings) -> Batch:
    """Sample the next prompts (the same on every rank; each takes its share), generate G completions
    each, and score them. Advantages are left at zero."""
    rt = sampler.runtime
    # 1. the prompts: the same order on every rank, each takes its share
    indices = sampler.prompts.next(s.prompts_per_step)
    per_rank = s.prompts_per_step // rt.world_size
    rows = [sampler.rows[i] for i in indices[rt.rank * per_rank:(rt.rank + 1) * per_rank]]
    prompt_ids = [row["prompt_ids"] for row in rows]
    t0 = time.time()
    # 2. G completions per prompt from the backend, with the policy's current weights (synced at its first call if
    # the optimizer stepped since its last sync): one call, or one per turn for multi-turn episodes
    masks = episodes = extra = None
    if sampler.turn_loop is None:
        out = sampler.generate(prompt_ids, s.group_size, s.sampling, seed=sampler.seed_for(1))
        completion_ids, truncated, sampling_logps = out.ids, out.truncated, out.logprobs
    else:
        eps = sampler.turn_loop(sampler.generate, sampler.seed_for).run(rows, prompt_ids, s.group_size, s.sampling)
        rows = seen_rows(rows, eps)  # with the text reset(row) added: what rewards and samples.jsonl show
        prompt_ids, completion_ids, truncated = eps.prompt_ids, eps.completion_ids, eps.truncated
        sampling_logps, masks, episodes = eps.sampling_logps, eps.masks, episode_records(eps)
        extra = episode_columns(eps)
    sampler.backend.sleep()  # vLLM on CUDA with rollout.vllm.sleep: its memory is the update's until the next rollout
    t1 = time.time()
    # 3. every reward function on every completion
    rewards, scores, sums = score_groups(sampler, rows, completion_ids, truncated, extra)
    sums = {"score": sums}
    if sampler.turn_loop is not None:
        sums["episode"] = eps.sums()
    stats = {"time/rollout_s": t1 - t0, "time/reward_s": time.time() - t1,
             **sampler.backend.stats()}  # rollout.backend=server: the sync check's gap, the push's time
    return Batch(rows, prompt_ids, completion_ids, truncated, rewards, torch.zeros_like(rewards), stats=stats,
                 sampling_logps=sampling_logps, completion_masks=masks, episodes=episodes,
                 scores=_nest(scores, completion_ids), sums=sums)


def _nest(flat: list, like: list[list]) -> list[list]:
    it = iter(flat)
    return [[next(it) for _ in g] for g in like]


def _filter_and_refill(sampler: Sampler, s: CollectSettings, batch: Batch, zero: list[bool]) -> Batch:
    """Drop zero-std groups; then at most ``resample_zero_std`` extra rounds while any rank is short of
    its groups. Surplus groups of the last round are discarded. The reward metrics stay those of the
    first round (the policy's on-policy sample); extra rounds do not count towards reward.max_failed_steps."""
    rt, a = sampler.runtime, s.algorithm
    target = len(batch.completion_ids)
    kept = batch.select([not z for z in zero])
    dropped, rounds = sum(zero), 0
    while rounds < a.resample_zero_std and rt.any_rank(len(kept.completion_ids) < target):
        rounds += 1
        extra = _rollout(sampler, s)
        z = zero_std_groups(extra.rewards, extra.group_sizes)
        dropped += sum(z)
        kept = _concat(kept, extra.select([not x for x in z]), target)
        for k in ("time/rollout_s", "time/reward_s"):
            batch.stats[k] += extra.stats[k]
    kept.sums["refill"] = {"dropped": float(dropped), "groups": float(len(kept.completion_ids))}
    kept.stats = {**batch.stats, "resample_rounds": rounds}
    return kept


def sampling_stats(runtime: Runtime, sums: dict[str, dict]) -> dict:
    """The sampling statistics (the first round's rewards and episodes, the zero-std share, the refill) from each
    rank's sums (`sample` keeps them in ``Batch.sums``, by kind), summed over every rank in one collective."""
    flat = {f"{kind}:{k}": v for kind, part in sums.items() for k, v in part.items()}
    total = runtime.all_reduce(flat) if flat else {}
    got = {kind: {k: total[f"{kind}:{k}"] for k in part} for kind, part in sums.items()}
    out = {}
    if "score" in got:
        out.update(score_stats(got["score"]))
    if "episode" in got:
        out.update(episode_metrics(got["episode"]))
    if "zero_std" in got:
        out["zero_std_frac"] = got["zero_std"]["zero_std"] / max(got["zero_std"]["groups"], 1)
    if "refill" in got:
        out.update({"dropped_groups": int(got["refill"]["dropped"]), "num_groups": int(got["refill"]["groups"])})
    return out


def score_groups(sampler: Sampler, rows, completion_ids, truncated, extra: dict | None = None):
    """Decode and score with every reward function of ``sampler``. ``extra``: more per-sample columns for the reward
    functions (multi-turn episodes: turns, tool counts, the episode's turns). Returns ``(rewards, scores, sums)``:
    the total reward of each completion ``[N]``, each completion's ``{function name: score or None}`` (the
    completions table), and this rank's sums the statistics are made of (`score_stats`, over every rank;
    ``reward/<name>_errors`` counts the samples a function failed on: the loop's reward.max_failed_steps reads it)."""
    tok = sampler.tokenizer
    G = len(completion_ids[0]) if completion_ids else 0
    texts = [tok.decode(c, skip_special_tokens=True) for g in completion_ids for c in g]
    prompts, completions = reward_inputs(rows, texts, G, sampler.completion_format)
    skip = {"prompt", "prompt_ids", "prompt_messages", "prompt_turns"}
    columns = {k: [r.get(k) for r in rows for _ in range(G)] for k in rows[0] if k not in skip}
    columns["completion_ids"] = [c for g in completion_ids for c in g]
    columns["truncated"] = [t for g in truncated for t in g]
    columns.update(extra or {})
    s = score(sampler.rewards, prompts, completions, columns)
    rewards = torch.tensor(s.total, dtype=torch.float32)
    scores = [{name: vals[i] for name, vals in s.per_fn.items()} for i in range(len(texts))]
    lens = [len(c) for c in columns["completion_ids"]]
    sums = {"reward": float(rewards.sum()), "reward2": float((rewards ** 2).sum()), "n": float(len(texts)),
            "len": float(sum(lens)), "truncated": float(sum(columns["truncated"]))}
    for rf in sampler.rewards:
        vals = [v for v in s.per_fn[rf.name] if v is not None]
        sums.update({f"fn/{rf.name}/sum": sum(vals), f"fn/{rf.name}/sum2": sum(v * v for v in vals),
                     f"fn/{rf.name}/count": float(len(vals)), f"fn/{rf.name}/errors": float(s.errors[rf.name])})
    return rewards, scores, sums


def score_stats(sums: dict) -> dict:
    """`score_groups`' metrics from its sums over every rank (each reward function's, in the order scored)."""
    n_all = sums["n"]
    stats = {"reward_mean": sums["reward"] / n_all, "reward_std": _std(sums["reward"], sums["reward2"], n_all),
             "completion_len_mean": sums["len"] / n_all, "truncated_frac": sums["truncated"] / n_all}
    for name in [k[3:-4] for k in sums if k.startswith("fn/") and k.endswith("/sum")]:
        v, v2, cnt = (sums[f"fn/{name}/{k}"] for k in ("sum", "sum2", "count"))
        stats[f"reward/{name}"] = v / cnt if cnt else None
        stats[f"reward/{name}_std"] = _std(v, v2, cnt) if cnt else None
        stats[f"reward/{name}_errors"] = int(sums[f"fn/{name}/errors"])
    return stats


def _batch_std(rt: Runtime, rewards: torch.Tensor) -> float:
    """Unbiased std of every rank's rewards, two-pass in float64: the same formula for 1 and N processes."""
    r = rewards.double()
    t = rt.all_reduce({"sum": float(r.sum()), "n": float(r.numel())})
    s, n = t["sum"], t["n"]
    dev2 = rt.all_reduce({"dev2": float(((r - s / max(n, 1)) ** 2).sum())})["dev2"]
    return (dev2 / (n - 1)) ** 0.5 if n > 1 else 0.0


def _std(s: float, s2: float, n: float) -> float:
    if n < 2:
        return 0.0
    return max((s2 - s * s / n) / (n - 1), 0.0) ** 0.5


def _concat(a: Batch, b: Batch, limit: int) -> Batch:
    """``a`` followed by as many groups of ``b`` as fit in ``limit`` groups (before any log-probs)."""
    room = max(limit - len(a.completion_ids), 0)
    return a.concat(b.select([i < room for i in range(len(b.completion_ids))]))


def sample_rows(sampler: Sampler, batch: Batch, n: int) -> list[dict]:
    """``n`` completions with their rewards, for the console and samples.jsonl: the first of each group, then
    the second of each, ... (a rank holding one group still shows ``n``)."""
    tok, out = sampler.tokenizer, []
    order = sorted(((j, g) for g, comps in enumerate(batch.completion_ids) for j in range(len(comps))))
    for j, g in order[:n]:
        row = batch.rows[g]
        out.append({"prompt": row["prompt"][-200:],
                    "completion": tok.decode(batch.completion_ids[g][j], skip_special_tokens=True),
                    "reward": float(batch.rewards[batch.flat_index(g, j)]), "answer": row.get("answer")})
        if batch.episodes is not None:  # the whole episode, turn by turn, tool/environment turns marked by role
            out[-1]["episode"] = batch.episodes[g][j]
    return out


def completion_rows(sampler: Sampler, batch: Batch) -> list[dict]:
    """Every completion of the batch (this rank's) for the completions table: prompt, completion, each reward
    function's score, the total reward and the advantage."""
    tok, out = sampler.tokenizer, []
    names = sampler.reward_names
    for g, comps in enumerate(batch.completion_ids):
        for j, ids in enumerate(comps):
            k = batch.flat_index(g, j)
            scores = batch.scores[g][j] if batch.scores is not None else {}
            out.append({"prompt": str(batch.rows[g]["prompt"]),  # a conversation: its messages as text
                        "completion": tok.decode(ids, skip_special_tokens=True),
                        **{f"reward/{n}": scores.get(n) for n in names}, "reward": float(batch.rewards[k]),
                        "advantage": float(batch.advantages[k])})
    return out
