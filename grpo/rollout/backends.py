"""The ``hf`` rollout backend and what every backend is wrapped in.

A backend is a small object with ``generate(prompt_ids, group_size, sampling, seed, suffixes) -> Completions``,
``sync_weights(model, version)`` (called before a rollout whenever the policy has changed since the last one),
``stats()`` (its own metrics of the step), ``sleep()`` (after a rollout) and ``close()`` (`grpo.rollout.base`); it is
registered by name with its capabilities in `grpo.rollout.registry`. Three are built in:

- ``hf``: our own decode loop on the training model itself (`grpo.rollout.hf.generate`: each prompt prefilled once,
  the G samples decoding against one copy of its K/V). Exactly on-policy; nothing to sync.
- ``vllm``: a vLLM engine in this process, colocated with training (`grpo.rollout.vllm`), weights copied into it
  in memory after every optimizer step. It returns its own per-token log-probs, which the update uses for the
  rollout importance-sampling correction (`grpo.algorithm.rollout_is`).
- ``server``: vLLM's servers (`grpo.rollout.server`), weights pushed to them.

The run's backend is wrapped in a `SyncedBackend`: made at the first rollout, synced whenever the optimizer has
stepped.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Callable

import torch

from grpo.engine.unwrap import unwrap_model
from grpo.engine.vision_logprobs import VISION_FAMILIES
from grpo.errors import SetupError
from grpo.rollout.base import Completions, RolloutBackend, Sampling, eos_ids
from grpo.rollout.registry import BackendContext, Capabilities
from grpo.rollout.turn_cache import TurnCache

__all__ = ["Completions", "HFBackend", "RolloutBackend", "Sampling", "SyncedBackend", "make_hf", "step_seed"]


class HFBackend:
    """Our decode loop on the training model (``model()`` returns it, wrapped or not). ``seed=None`` draws from
    the process's torch generator (checkpointed), as the trainer always has. ``context``: the runtime's
    ``generation_context`` (ZeRO-3: every rank steps until all are done); ``generate_fn``: the decode loop
    (default `grpo.rollout.hf.generate`); ``desc``: the progress bar's label."""

    def __init__(self, model, tokenizer, *, batch_size: int = 8, share_prompt: bool = True, progress: bool = False,
                 context: Callable | None = None, generate_fn=None, desc: str = "rollout", keep_turns: bool = False):
        self._model, self.tokenizer = model, tokenizer
        self.batch_size, self.share_prompt, self.progress = batch_size, share_prompt, progress
        self.context, self._generate, self.desc = context, generate_fn, desc
        # multi-turn runs: each call keeps its rows' K/V for the next turn (`grpo.rollout.turn_cache`)
        self.turns = TurnCache() if keep_turns else None

    def generate(self, prompt_ids, group_size, sampling: Sampling, seed=None, suffixes=None) -> Completions:
        from grpo.rollout.hf import generate

        fn = self._generate or generate
        model = self._model() if callable(self._model) and not isinstance(self._model, torch.nn.Module) \
            else self._model
        if getattr(unwrap_model(model).config, "model_type", None) in VISION_FAMILIES:  # prompts with images
            return _generate_with_images(model, self.tokenizer, prompt_ids, group_size, sampling, seed, suffixes)
        # fork_rng's default devices: manual_seed reseeds every CUDA device too, and that must be undone as well
        with torch.random.fork_rng() if seed is not None else contextlib.nullcontext():
            if seed is not None:
                torch.manual_seed(seed)
            ids, truncated = fn(model, self.tokenizer, prompt_ids, sampling, group_size=group_size,
                                batch_size=self.batch_size, progress=self.progress, share_prompt=self.share_prompt,
                                context=self.context, desc=self.desc, suffixes=suffixes, turns=self.turns)
        return Completions(ids, truncated)

    def sync_weights(self, model, version: int) -> None:  # samples from the training model itself
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def sleep(self) -> None:  # after a rollout: the K/V kept between its turns
        if self.turns is not None:
            self.turns.clear()

    def close(self) -> None:
        pass


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
    current weights in it (synced whenever the optimizer has stepped since its last sync, as its ``capabilities``
    say). ``follow=False``: the weights are put in by whoever publishes them (sampling ahead), never synced here. A
    test injects a backend by setting ``backend`` before the first rollout."""

    def __init__(self, make: Callable[[], RolloutBackend], runtime, capabilities: Capabilities = Capabilities(),
                 follow: bool = True):
        self.make, self.runtime, self.caps = make, runtime, capabilities
        self.follow = follow and not capabilities.live_weights  # a backend on the live model has nothing to sync
        self.backend: RolloutBackend | None = None
        self.synced_at: tuple | None = None

    def ready(self) -> RolloutBackend:
        if self.backend is None:
            self.backend = self.make()
            # a vLLM engine starts with the weights it was made from; a server holds whatever it was last given
            self.synced_at = self._weights_version() if self.caps.starts_synced else None
        if not self.follow:
            return self.backend
        version = self._weights_version()
        if self.synced_at != version:  # the weights are labelled with the optimizer's steps
            self.backend.sync_weights(self.runtime.model, version[0])
            self.synced_at = version
        return self.backend

    def sleep(self) -> None:
        """After a rollout: the backend frees what the update needs (vLLM on CUDA), or nothing."""
        if self.backend is not None:
            self.backend.sleep()

    def stats(self) -> dict[str, float]:
        """The backend's own metrics of this step (the server's sync check and time), logged with the rollout's."""
        return self.backend.stats() if self.backend is not None else {}

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


def make_hf(ctx: BackendContext) -> HFBackend:
    """``rollout.backend=hf``: our decode loop on the runtime's (training) model."""
    rt, r = ctx.runtime, ctx.rollout
    return HFBackend(lambda: rt.model, ctx.tokenizer, batch_size=r.batch_size, share_prompt=r.share_prompt,
                     progress=ctx.progress, context=rt.generation_context, keep_turns=ctx.multi_turn)
