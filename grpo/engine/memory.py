"""How many tokens one forward/backward micro-batch of the update may hold: ``engine.max_tokens_per_micro_batch``.

``auto`` (the default) sizes the budget from the model's shape, its dtype, whether activation checkpointing is on
and the memory that is free (CPU: the machine's available memory, or the cgroup's limit if lower; GPU: the
device's free memory), with a safety margin. An explicit number wins. Either way the run refuses at start, in
one line, when the longest prompt plus ``rollout.max_new_tokens`` cannot be trained on at all, instead of dying
mid-step (grpo/trainer/budget.py resolves the budget for a run at start). The estimate (docs/recipes.md#memory) is
checked against measured saved activations in tests/engine/test_memory.py.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.engine import completion_attention
from grpo.engine.unwrap import unwrap_model

MARGIN = 0.75              # share of the free memory the update may plan to use
OVERHEAD = 1.3             # peak / saved activations (gradient buffers, temporaries, allocator), measured
TRANSIENT = 768 << 20      # work buffers whose size does not grow with the micro-batch (head and attention chunks)
CPU_CAP = 4096             # on CPU a bigger micro-batch is not faster, only bigger
GPU_CAP = 65536
_HINT = ("lower rollout.max_new_tokens (or data.max_prompt_tokens), set model.gradient_checkpointing=true, "
         "train LoRA (model.lora.enabled=true) or use model.dtype=bfloat16")


@dataclass
class Estimate:
    per_token: int    # bytes of activations kept for backward per token of a micro-batch (measured-style, no margin)
    fixed: int        # bytes the first optimizer step still allocates: gradients and AdamW's two states
    transient: int    # bytes of work buffers independent of the micro-batch size

    def tokens_within(self, free: int) -> int:
        """Tokens a micro-batch may hold when ``free`` bytes are free now."""
        usable = free * MARGIN - self.fixed - self.transient
        return max(0, int(usable // (self.per_token * OVERHEAD)))  # pragma: no mutate

    def bytes_for(self, tokens: int) -> int:
        return int(self.fixed + self.transient + tokens * self.per_token * OVERHEAD)


def _shape(config):
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = cfg.hidden_size
    heads = getattr(cfg, "num_attention_heads", None) or cfg.num_heads  # Mamba2 has no attention: its SSM heads
    d = getattr(cfg, "head_dim", None) or h // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * h
    return h, heads * d, kv * d, inter, cfg.num_hidden_layers


def activation_bytes_per_token(config, dtype: torch.dtype, checkpointing: bool) -> int:
    """Bytes of activations one token leaves for backward in a Llama-style decoder (shared-prefix engine).

    Per layer and token, in elements: the MLP keeps 4 x intermediate (gate, up, activation, product), the norms,
    residual stream and linear inputs about 5 x hidden, queries/outputs before and after rotary and inside the
    attention 4 x (heads x head_dim), keys/values 6 x (kv heads x head_dim). Norms compute in fp32 whatever the
    dtype. With checkpointing only each layer's input stays, plus one layer being recomputed.
    """
    h, q, kv, inter, layers = _shape(config)
    esize = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    layer = (4 * inter + 5 * h + 4 * q + 6 * kv) * esize + (0 if esize >= 4 else 4 * h * 4)
    head = 3 * h * 4  # final norm and the hidden state at the predicting position, for the fused head
    if checkpointing:
        return layers * h * esize + layer + head
    return layers * layer + head


def estimate(model, dtype: torch.dtype | None = None, checkpointing: bool | None = None) -> Estimate:
    """The update's memory for ``model`` (plain, peft-wrapped, DDP or DeepSpeed engine)."""
    lm = unwrap_model(model)
    params = list(model.parameters())
    if dtype is None:
        dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    if checkpointing is None:
        checkpointing = any(getattr(m, "gradient_checkpointing", False)  # pragma: no mutate
                            for m in lm.modules())
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return Estimate(activation_bytes_per_token(lm.config, dtype, checkpointing), 3 * trainable, TRANSIENT)


def free_bytes(device: torch.device) -> int:
    """Memory free for this process now: GPU free memory (plus what PyTorch's cache holds unused); on CPU the
    machine's available memory, or the cgroup's remaining limit if lower, shared by this node's processes."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    avail = _meminfo_available()
    limit = _cgroup_remaining()
    if limit is not None:
        avail = min(avail, limit)
    return avail // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _cgroup_remaining() -> int | None:
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":  # pragma: no mutate
            return None
        return int(limit) - int((root / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def parse_budget(value) -> int | None:
    """``auto`` -> None, an integer (or its digits) -> that integer."""
    if value == "auto":
        return None
    return int(value)


def choose_budget(value, est: Estimate, free: int, longest: int, on_gpu: bool) -> tuple[int, str]:
    """(tokens per micro-batch, a one-line note) for the configured ``value``; ValueError (one line) when the longest
    prompt + completion (``longest`` tokens) cannot be trained on."""
    explicit = parse_budget(value)
    if explicit is not None:
        if explicit < longest:
            raise ValueError(f"engine.max_tokens_per_micro_batch={explicit} is smaller than the longest prompt + "
                             f"rollout.max_new_tokens ({longest} tokens), which must fit in one micro-batch; raise it "
                             f"to at least {longest} (or set auto), or lower rollout.max_new_tokens / "
                             "data.max_prompt_tokens")
        need = est.bytes_for(explicit)
        note = (f"engine.max_tokens_per_micro_batch={explicit}: the update needs about {_gib(need)}")
        if need > free * MARGIN:
            fits = est.tokens_within(free)
            auto = (f"auto would pick {_auto_tokens(fits, longest, on_gpu)}" if fits >= longest else
                    f"auto cannot fit the longest prompt + completion ({longest} tokens) either")
            note += f", more than {MARGIN:.0%} of the {_gib(free)} free: it may run out of memory; {auto}"
        return explicit, note
    fits = est.tokens_within(free)
    if fits < longest:
        raise ValueError(f"one prompt + completion ({longest} tokens) needs about {_gib(est.bytes_for(longest))} "
                         f"for the update, more than {MARGIN:.0%} of the {_gib(free)} free; {_HINT}")
    tokens = _auto_tokens(fits, longest, on_gpu)
    return tokens, (f"engine.max_tokens_per_micro_batch=auto -> {tokens} tokens (about {_gib(est.bytes_for(tokens))} "
                    f"for the update; {_gib(free)} free, {est.per_token / 2**20:.2f} MiB of activations per token)")


def _auto_tokens(fits: int, longest: int, on_gpu: bool) -> int:
    """What ``auto`` picks when ``fits`` tokens fit in memory: at most the device's cap, at least the longest
    prompt + completion (which must fit in one micro-batch)."""
    return max(min(fits, GPU_CAP if on_gpu else CPU_CAP), longest)


def group_score_bytes(config, group_size: int, prompt: int, completion: int) -> int:
    """fp32 attention scores the grouped kernel holds at once (about three copies): a chunk of at most
    grpo.engine.completion_attention.CHUNK_SCORES, or one completion's scores if that is more."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    one = getattr(cfg, "num_attention_heads", 0) * completion * (prompt + completion)  # Mamba2: no attention
    return 3 * 4 * max(min(completion_attention.CHUNK_SCORES, one * group_size), one)


def free_for(device, ecfg) -> int:
    free = free_bytes(device)
    limit = getattr(ecfg, "memory_limit_gib", None)
    return free if limit is None else min(free, int(limit * 2**30))


_auto_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {memory limit: tokens}


def budget_for(model, value, ecfg=None) -> int:
    """The micro-batch budget for a config value outside a built run (``auto`` sized for ``model`` now, cached)."""
    explicit = parse_budget(value)
    if explicit is not None:
        return explicit
    if model is None:
        raise ValueError("engine.max_tokens_per_micro_batch=auto needs the model to size it")
    known = _auto_cache.setdefault(model, {})
    limit = getattr(ecfg, "memory_limit_gib", None)
    if limit not in known:
        device = next(model.parameters()).device
        known[limit] = max(1, min(estimate(model).tokens_within(free_for(device, ecfg)),
                                  GPU_CAP if device.type == "cuda" else CPU_CAP))
    return known[limit]
