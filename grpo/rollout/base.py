"""What a rollout backend is asked and returns (`grpo.rollout.backends` picks and builds the backend).

`Sampling`: what to sample, with the same meaning for every backend; `Completions`: what came back;
`RolloutBackend`: the interface every backend implements.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Sampling:
    """What to sample: the same meaning for every backend (softmax(logits / temperature), then top-k, then top-p)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0               # 0 = off
    greedy: bool = False         # one completion per prompt, argmax


@dataclass
class Completions:
    ids: list[list[list[int]]]              # [prompt][sample] -> token ids, ending at the first EOS (kept)
    truncated: list[list[bool]]             # cut at max_new_tokens
    logprobs: list[list[torch.Tensor]] | None = None  # the sampler's log-prob of each token; None: the trainer's own


class RolloutBackend(Protocol):
    name: str

    def generate(self, prompt_ids: list[list[int]], group_size: int, sampling: Sampling, seed: int | None = None,
                 suffixes: list[list[list[int]]] | None = None) -> Completions: ...
    # suffixes (multi-turn, after the first turn): per prompt, the contexts to continue it with (prompt + suffix), one
    # sample each, returned nested and ordered like them; group_size is then 1 and unused

    def sync_weights(self, model) -> None: ...

    def sleep(self) -> None: ...  # after a rollout: free what the update needs (vLLM on CUDA), or nothing

    def close(self) -> None: ...
