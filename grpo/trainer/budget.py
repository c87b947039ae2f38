"""Resolving ``engine.max_tokens_per_micro_batch`` for a run at start-up, once the model is loaded.

The run-facing side of grpo/engine/memory.py: it reads the config, the training data and the runtime, prints the
choice, and turns a budget that cannot hold the longest prompt + completion into a one-line SetupError.
"""
from __future__ import annotations

import sys

from grpo.engine.memory import choose_budget, estimate, free_for, group_score_bytes
from grpo.engine.unwrap import unwrap_model
from grpo.errors import SetupError
from grpo.rollout.episodes.spec import max_completion_tokens
from grpo.runtime.base import Runtime


def plan(cfg, splits, runtime: Runtime) -> int:
    """Resolve ``cfg.engine.max_tokens_per_micro_batch`` for this run (called after `Runtime.setup`); raises
    grpo.errors.SetupError with one line when the longest prompt of the training data plus
    ``rollout.max_new_tokens`` cannot fit. Text an environment's ``reset(row)`` adds to a prompt is not counted: it
    is known only once reset runs, in the rollout (running every row's reset here would start user code per row);
    the turn loop checks it there instead (`grpo.rollout.episodes.turns`: a prompt that leaves no room for one turn
    stops the run with one line, an episode ends early rather than outgrow the budget)."""
    limit = cfg.engine.memory_limit_gib
    if limit is not None and not limit > 0:
        raise SetupError(f"engine.memory_limit_gib={limit} must be > 0 (GiB the update may plan for) or null")
    longest_prompt = max((len(r["prompt_ids"]) for r in splits.train), default=0)
    completion = max_completion_tokens(cfg.rollout)  # multi-turn: every turn and the tool text between them
    longest = longest_prompt + completion
    device = runtime.device
    est = estimate(runtime.model)
    est.transient += group_score_bytes(unwrap_model(runtime.model).config, cfg.algorithm.group_size, longest_prompt,
                                       completion)
    try:
        tokens, note = choose_budget(cfg.engine.max_tokens_per_micro_batch, est, free_for(device, cfg.engine),
                                     longest, device.type == "cuda")
    except ValueError as e:
        note = "" if completion == cfg.rollout.max_new_tokens else (
            f" (multi-turn: a completion is up to {completion} tokens, rollout.max_turns turns of max_new_tokens with "
            "tool text of up to rollout.max_tool_tokens between them)")
        raise SetupError(str(e) + note) from None
    if runtime.is_main:
        print(f"[grpo] {note}", file=sys.stderr, flush=True)
    return tokens
