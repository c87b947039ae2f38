"""What a rollout backend is asked and returns.

`Sampling`: what to sample, with the same meaning for every backend; `Completions`: what came back;
`RolloutBackend`: the interface every backend implements (`grpo.rollout.registry`: its name and capabilities).
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
    # per prompt: the weight version (optimizer steps) of the server that sampled its group; None: the trainer's own
    versions: list[int | None] | None = None


class RolloutBackend(Protocol):
    """Registered by name with what it can do (`grpo.rollout.registry`); made by its maker at the first rollout."""

    def generate(self, prompt_ids: list[list[int]], group_size: int, sampling: Sampling, seed: int | None = None,
                 suffixes: list[list[list[int]]] | None = None) -> Completions: ...
    # suffixes (multi-turn, after the first turn): per prompt, the contexts to continue it with (prompt + suffix), one
    # sample each, returned nested and ordered like them; group_size is then 1 and unused

    def sync_weights(self, model, version: int) -> None: ...  # the policy's weights after ``version`` optimizer steps

    def stats(self) -> dict[str, float]: ...  # its own metrics of the step (a server's sync time and check), or {}

    def sleep(self) -> None: ...  # after a rollout: free what the update needs (vLLM on CUDA), or nothing

    def close(self) -> None: ...


def eos_ids(model, tokenizer) -> list[int]:
    """The ids that end a completion: the model's generation config's EOS ids, and the tokenizer's."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def cut_at_eos(ids: list[int], eos: list[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first EOS; truncated when there is none."""
    for k, t in enumerate(ids):
        if t in eos:
            return ids[: k + 1], False
    return ids[:max_new_tokens], True


def trainer_logprobs(model, ids: list[int], device="cpu") -> torch.Tensor:
    """The trainer's log-prob of each token of ``ids`` after the first, at temperature 1 (every rank: a ZeRO-3
    forward is a collective)."""
    with torch.no_grad():  # not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
        x = torch.tensor([ids], device=device)
        logits = model(input_ids=x).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].cpu()
