"""Collecting one step's experience: rollout -> rewards -> advantages -> old/ref log-probs."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from grpo.algorithm.advantages import compute_advantages, zero_std_groups
from grpo.algorithm.kl import kl_estimate
from grpo.batch import Batch
from grpo.config.schema import AlgorithmConfig, EngineConfig
from grpo.engine.batch_logprobs import nested_logprobs
from grpo.rewards.score import reward_inputs, score
from grpo.rollout.backends import Sampling, step_seed
from grpo.rollout.episodes.runs import episode_columns, episode_records, seen_rows
from grpo.rollout.episodes.turns import episode_metrics
from grpo.runtime.base import Runtime

# ``run`` below is a built `grpo.trainer.run.Run` (not imported: the trainer is the stage after this one)
Run = object


@dataclass(frozen=True)
class CollectSettings:
    """What `collect` needs, derived once per run (`grpo.trainer.settings.derive`)."""
    prompts_per_step: int      # over every rank; each samples its share
    group_size: int            # G completions per prompt
    sampling: Sampling         # rollout.max_new_tokens, temperature, top_p, top_k
    seed: int                  # trainer.seed: a backend with its own generator (vLLM) is seeded per step from it
    algorithm: AlgorithmConfig  # zero-std filtering and resampling, beta and the KL, the advantages' scaling
    engine: EngineConfig       # the old/reference log-prob passes (its micro-batch budget an int in a built run)


def collect(run: Run) -> Batch:
    """One step's experience (``run.settings.collect``): `sample` (steps 1-2), then `finish` (steps 3-5), in order:

    1. rollout: G completions per prompt from the run's backend, scored by every reward function;
    2. zero-std filtering: with ``algorithm.filter_zero_std_groups`` groups whose task rewards are all equal are
       dropped, and with ``algorithm.resample_zero_std=N`` up to N more rollout rounds refill the batch with groups
       that have signal (DAPO dynamic sampling, arXiv:2503.14476 section 3.2). Every rank runs the same number of
       rounds (ZeRO-3 generates in lockstep, and the prompt sampler must stay in step). The batch may end up
       empty; `policy_update` then skips;
    3. the reference's and the old policy's log-probs of the groups kept;
    4. the KL to the reference (a metric, or with ``kl_in_reward`` a penalty in the reward);
    5. advantages (group-normalised, `grpo.algorithm.advantages`).

    With ``rollout.max_staleness`` > 0 the generator process runs `sample` (`grpo.trainer.generator_side`) and the
    trainer `finish`es the batch when its step comes (`grpo.trainer.pipeline`).
    """
    return finish(run, sample(run))


def sample(run: Run) -> Batch:
    """Steps 1-2 of `collect`: the rollout, scored, with zero-std groups filtered out and refilled."""
    s = run.settings.collect
    rt, a = run.runtime, s.algorithm
    batch = _rollout(run)                                                               # 1.
    zero = zero_std_groups(batch.rewards, batch.group_sizes)                            # 2.
    batch.sums["zero_std"] = {"zero_std": float(sum(zero)), "groups": float(len(zero))}
    batch.stats.update(_zero_std_stats(rt.all_reduce(batch.sums["zero_std"])))
    if a.filter_zero_std_groups:  # before any log-prob forward: dropped groups cost nothing more
        batch = _filter_and_refill(run, batch, zero)
    return batch


def finish(run: Run, batch: Batch) -> Batch:
    """Steps 3-5 of `collect` on a sampled batch: reference and old log-probs, the KL, advantages."""
    s = run.settings.collect
    rt, a, T = run.runtime, s.algorithm, s.sampling.temperature
    stats = batch.stats
    if a.beta > 0:                                                                      # 3.
        with run.reference_context():
            batch.ref_logps = nested_logprobs(rt, run.reference_model(), batch, s.engine, T)
    if a.num_iterations > 1 or (a.beta > 0 and a.kl_in_reward):
        batch.old_logps = nested_logprobs(rt, rt.model, batch, s.engine, T)
    # 4. KL of the batch to the reference. With the KL in the loss and mu = 1 the update measures it itself
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
    batch_std = _batch_std(rt, batch.rewards) if a.scale_rewards == "batch" else None  # 5.
    batch.advantages = compute_advantages(batch.rewards, batch.group_sizes, a.scale_rewards, a.adv_eps,
                                          batch_std=batch_std)
    return batch


def _rollout(run: Run) -> Batch:
    """Sample the next prompts (the same on every rank; each takes its share), generate G completions
    each, and score them. Advantages are left at zero."""
    s, rt = run.settings.collect, run.runtime
    # 1. the prompts: the same order on every rank, each takes its share
    indices = run.sampler.next(s.prompts_per_step)
    per_rank = s.prompts_per_step // rt.world_size
    rows = [run.splits.train[i] for i in indices[rt.rank * per_rank:(rt.rank + 1) * per_rank]]
    prompt_ids = [row["prompt_ids"] for row in rows]
    t0 = time.time()
    # 2. the backend, with the policy's current weights (vLLM: synced if the optimizer stepped since its last sync)
    backend = run.rollout.ready()
    seed_for = (lambda turn: None) if backend.name == "hf" and not getattr(backend, "seeded", False) else \
        (lambda turn: step_seed(s.seed, rt.rank, run.sampler.epoch, run.sampler.position,
                                *((turn,) if turn > 1 else ())))
    # 3. G completions per prompt: one call, or one per turn for multi-turn episodes (grpo.rollout.episodes)
    masks = episodes = extra = None
    if run.turn_loop is None:
        out = backend.generate(prompt_ids, s.group_size, s.sampling, seed=seed_for(1))
        completion_ids, truncated, sampling_logps = out.ids, out.truncated, out.logprobs
    else:
        eps = run.turn_loop(backend.generate, seed_for).run(rows, prompt_ids, s.group_size, s.sampling)
        rows = seen_rows(rows, eps)  # with the text reset(row) added: what rewards and samples.jsonl show
        prompt_ids, completion_ids, truncated = eps.prompt_ids, eps.completion_ids, eps.truncated
        sampling_logps, masks, episodes = eps.sampling_logps, eps.masks, episode_records(eps)
        extra = episode_columns(eps)
    backend.sleep()  # vLLM on CUDA with rollout.vllm.sleep: its memory is the update's until the next rollout
    t1 = time.time()
    # 4. every reward function on every completion
    scores: list[dict] = []
    sums: dict[str, dict] = {}
    rewards, stats = score_groups(run, rows, completion_ids, truncated, extra, scores_out=scores, sums_out=sums)
    if run.turn_loop is not None:
        sums["episode"] = eps.sums()
        stats.update(episode_metrics(rt.all_reduce(sums["episode"])))
    stats["time/rollout_s"], stats["time/reward_s"] = t1 - t0, time.time() - t1
    stats.update(run.rollout.stats())  # rollout.backend=server: the sync check's gap, the push's time
    return Batch(rows, prompt_ids, completion_ids, truncated, rewards, torch.zeros_like(rewards), stats=stats,
                 sampling_logps=sampling_logps, completion_masks=masks, episodes=episodes,
                 scores=_nest(scores, completion_ids), sums=sums)


def _nest(flat: list, like: list[list]) -> list[list]:
    it = iter(flat)
    return [[next(it) for _ in g] for g in like]


def _filter_and_refill(run: Run, batch: Batch, zero: list[bool]) -> Batch:
    """Drop zero-std groups; then at most ``resample_zero_std`` extra rounds while any rank is short of
    its groups. Surplus groups of the last round are discarded. The reward metrics stay those of the
    first round (the policy's on-policy sample); extra rounds do not count towards reward.max_failed_steps."""
    rt, a = run.runtime, run.settings.collect.algorithm
    target = len(batch.completion_ids)
    kept = batch.select([not z for z in zero])
    dropped, rounds = sum(zero), 0
    while rounds < a.resample_zero_std and rt.any_rank(len(kept.completion_ids) < target):
        rounds += 1
        extra = _rollout(run)
        z = zero_std_groups(extra.rewards, extra.group_sizes)
        dropped += sum(z)
        kept = _concat(kept, extra.select([not x for x in z]), target)
        for k in ("time/rollout_s", "time/reward_s"):
            batch.stats[k] += extra.stats[k]
    kept.sums["refill"] = {"dropped": float(dropped), "groups": float(len(kept.completion_ids))}
    kept.stats = {**batch.stats, **_refill_stats(rt.all_reduce(kept.sums["refill"])), "resample_rounds": rounds}
    return kept


def reduce_stats(run: Run, batch: Batch) -> None:
    """The batch's sampling statistics (the first round's rewards, episodes, the zero-std share, refill rounds) made
    again from the local sums it kept, summed over every rank now: for a batch sampled apart from the trainer's
    collectives (asynchronous GRPO's generator of one rank among several). A collective: every rank calls it at the
    same step. One process: the statistics the batch already has, the same numbers."""
    rt, sums, stats = run.runtime, batch.sums, batch.stats
    if not sums:
        return
    stats.update(_score_stats(rt.all_reduce(sums["score"]), [rf.name for rf in run.rewards]))
    if "episode" in sums:
        stats.update(episode_metrics(rt.all_reduce(sums["episode"])))
    stats.update(_zero_std_stats(rt.all_reduce(sums["zero_std"])))
    if "refill" in sums:
        stats.update(_refill_stats(rt.all_reduce(sums["refill"])))


def _zero_std_stats(z: dict) -> dict:
    return {"zero_std_frac": z["zero_std"] / max(z["groups"], 1)}


def _refill_stats(n: dict) -> dict:
    return {"dropped_groups": int(n["dropped"]), "num_groups": int(n["groups"])}


def score_groups(run: Run, rows, completion_ids, truncated, extra: dict | None = None, scores_out: list | None = None,
                 sums_out: dict | None = None):
    """Decode, score with every reward function, and summarise (all-reduced across ranks). ``reward/<name>_errors``
    counts the samples a function failed on (the loop's reward.max_failed_steps check reads it). ``extra``: more
    per-sample columns for the reward functions (multi-turn episodes: turns, tool counts, the episode's turns).
    ``scores_out`` receives each completion's ``{function name: score or None}`` (the completions table),
    ``sums_out["score"]`` this rank's sums the summary is made of (`reduce_stats`)."""
    rt, tok = run.runtime, run.tokenizer
    G = len(completion_ids[0]) if completion_ids else 0
    texts = [tok.decode(c, skip_special_tokens=True) for g in completion_ids for c in g]
    prompts, completions = reward_inputs(rows, texts, G, run.completion_format)
    skip = {"prompt", "prompt_ids", "prompt_messages", "prompt_turns"}
    columns = {k: [r.get(k) for r in rows for _ in range(G)] for k in rows[0] if k not in skip}
    columns["completion_ids"] = [c for g in completion_ids for c in g]
    columns["truncated"] = [t for g in truncated for t in g]
    columns.update(extra or {})
    s = score(run.rewards, prompts, completions, columns)
    rewards = torch.tensor(s.total, dtype=torch.float32)
    if scores_out is not None:
        scores_out.extend({name: vals[i] for name, vals in s.per_fn.items()} for i in range(len(texts)))
    n = len(texts)
    lens = [len(c) for c in columns["completion_ids"]]
    sums = {"reward": float(rewards.sum()), "reward2": float((rewards ** 2).sum()), "n": float(n),
            "len": float(sum(lens)), "truncated": float(sum(columns["truncated"]))}
    for rf in run.rewards:
        vals = [v for v in s.per_fn[rf.name] if v is not None]
        sums.update({f"fn/{rf.name}/sum": sum(vals), f"fn/{rf.name}/sum2": sum(v * v for v in vals),
                     f"fn/{rf.name}/count": float(len(vals)), f"fn/{rf.name}/errors": float(s.errors[rf.name])})
    if sums_out is not None:
        sums_out["score"] = dict(sums)
    return rewards, _score_stats(rt.all_reduce(sums), [rf.name for rf in run.rewards])


def _score_stats(sums: dict, names: list[str]) -> dict:
    """`score_groups`' metrics from its sums over every rank."""
    n_all = sums["n"]
    stats = {"reward_mean": sums["reward"] / n_all, "reward_std": _std(sums["reward"], sums["reward2"], n_all),
             "completion_len_mean": sums["len"] / n_all, "truncated_frac": sums["truncated"] / n_all}
    for name in names:
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


def sample_rows(run: Run, batch: Batch, n: int) -> list[dict]:
    """``n`` completions with their rewards, for the console and samples.jsonl: the first of each group, then
    the second of each, ... (a rank holding one group still shows ``n``)."""
    tok, out = run.tokenizer, []
    order = sorted(((j, g) for g, comps in enumerate(batch.completion_ids) for j in range(len(comps))))
    for j, g in order[:n]:
        row = batch.rows[g]
        out.append({"prompt": row["prompt"][-200:],
                    "completion": tok.decode(batch.completion_ids[g][j], skip_special_tokens=True),
                    "reward": float(batch.rewards[batch.flat_index(g, j)]), "answer": row.get("answer")})
        if batch.episodes is not None:  # the whole episode, turn by turn, tool/environment turns marked by role
            out[-1]["episode"] = batch.episodes[g][j]
    return out


def completion_rows(run: Run, batch: Batch) -> list[dict]:
    """Every completion of the batch (this rank's) for the completions table: prompt, completion, each reward
    function's score, the total reward and the advantage."""
    tok, out = run.tokenizer, []
    names = [rf.name for rf in run.rewards]
    for g, comps in enumerate(batch.completion_ids):
        for j, ids in enumerate(comps):
            k = batch.flat_index(g, j)
            scores = batch.scores[g][j] if batch.scores is not None else {}
            out.append({"prompt": str(batch.rows[g]["prompt"]),  # a conversation: its messages as text
                        "completion": tok.decode(ids, skip_special_tokens=True),
                        **{f"reward/{n}": scores.get(n) for n in names}, "reward": float(batch.rewards[k]),
                        "advantage": float(batch.advantages[k])})
    return out
