"""Cutting a batch of groups into micro-batches of at most a given number of real tokens (``plan_micro_batches``),
and putting a micro-batch's results back in place (``scatter``).

The budget itself (``engine.max_tokens_per_micro_batch``, ``auto`` sized from memory) is grpo/engine/memory.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MicroBatch = list[tuple[int, slice]]  # (group index, slice of its completions), in order


def plan_micro_batches(
    prompt_lens: list[int],
    completion_lens: list[list[int]],
    max_tokens: int | None,
    *,
    shared_prefix: bool = True,
) -> list[MicroBatch]:
    """Split groups into micro-batches of at most ``max_tokens`` real tokens, keeping each group whole.

    The token count of a micro-batch is the layout's real count: ``P + sum(S_i)`` per group for the shared
    layout, ``sum(P + S_i)`` for the standard one. A group larger than the budget is split by completions
    (each part keeps its prompt). A single prompt + completion larger than the budget raises ValueError.
    Returns a list of micro-batches, each a list of ``(group_index, slice_of_its_completions)``.
    """
    if len(prompt_lens) != len(completion_lens):
        raise ValueError(f"{len(prompt_lens)} prompts but {len(completion_lens)} completion groups")
    groups = range(len(prompt_lens))
    if max_tokens is None:
        return [[(g, slice(0, len(completion_lens[g]))) for g in groups]] if len(prompt_lens) else []
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer or None, got {max_tokens}")

    def cost(g: int, lens: Sequence[int]) -> int:
        P = prompt_lens[g]
        return P + sum(lens) if shared_prefix else sum(P + s for s in lens)

    plan: list[MicroBatch] = []
    current: MicroBatch = []
    used = 0
    for g in groups:
        lens = completion_lens[g]
        need = cost(g, lens)
        if need <= max_tokens:
            if used + need > max_tokens and current:
                plan.append(current)
                current, used = [], 0
            current.append((g, slice(0, len(lens))))
            used += need
            continue
        parts = _split_group(g, prompt_lens[g], lens, max_tokens, cost)
        if current:
            plan.append(current)
        current, used = [], 0
        if parts:  # the last part stays open: the next groups may join it
            plan.extend(parts[:-1])
            current, used = parts[-1], cost(g, lens[parts[-1][0][1]])
    if current:
        plan.append(current)
    return plan


def _split_group(g: int, prompt_len: int, lens: Sequence[int], max_tokens: int,
                 cost: Callable[[int, Sequence[int]], int]) -> list[MicroBatch]:
    """An oversize group's parts, each its prompt + a run of its completions within ``max_tokens``."""
    for i, s in enumerate(lens):
        if prompt_len + s > max_tokens:
            raise ValueError(
                f"group {g}, completion {i}: prompt ({prompt_len} tokens) + completion ({s} tokens) = "
                f"{prompt_len + s} tokens alone exceeds max_tokens_per_micro_batch={max_tokens}; "
                "raise the budget or truncate"
            )
    parts: list[MicroBatch] = []
    start = 0
    for stop in range(1, len(lens) + 1):  # a part ends at stop when the next completion would not fit (or none is left)
        if stop == len(lens) or cost(g, lens[start : stop + 1]) > max_tokens:
            parts.append([(g, slice(start, stop))])
            start = stop
    return parts


def scatter(mb: MicroBatch, comps, lp, ent, logps, ents) -> None:
    """Put one micro-batch's flat log-probs (and entropies) into the per-group, per-completion results."""
    lens = [len(r) for g, sl in mb for r in comps[g][sl]]
    lp_parts = lp.split(lens)
    ent_parts = ent.split(lens) if ent is not None else [None] * len(lens)
    n = 0
    for g, sl in mb:
        for i in range(*sl.indices(len(comps[g]))):
            logps[g][i], ents[g][i] = lp_parts[n], ent_parts[n]
            n += 1
