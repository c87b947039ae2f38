"""Per-token log-probabilities of GRPO completions, with the prompt encoded once per group.

Public API: :func:`token_logprobs` and :func:`plan_micro_batches`. See docs/prefix-engine.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from grpo.attention import LAYOUT_KWARG, build_layout, checkpointing_is_wrappable, prefix_attention
from grpo.flex_kernel import build_block_mask, flex_available
from grpo.logprob_head import head_logprobs

__all__ = ["token_logprobs", "plan_micro_batches", "SUPPORTED_MODEL_TYPES", "ATTENTION_KERNELS"]

ATTENTION_KERNELS = ("auto", "grouped", "flex")

# Model families whose decoder routes every attention layer through transformers' AttentionInterface, takes
# explicit position_ids, and was checked token-for-token against the per-sequence forward in the tests.
# Others get the standard layout (with a warning): never a silently wrong answer.
SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "qwen3", "mistral"}


# --------------------------------------------------------------------------------------------- planning
def plan_micro_batches(
    prompt_lens: list[int],
    completion_lens: list[list[int]],
    max_tokens: int | None,
    *,
    shared_prefix: bool = True,
) -> list[list[tuple[int, slice]]]:
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

    plan: list[list[tuple[int, slice]]] = []
    current: list[tuple[int, slice]] = []
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
        # oversize group: split by completions, each part is prompt + a run of completions
        for i, s in enumerate(lens):
            if prompt_lens[g] + s > max_tokens:
                raise ValueError(
                    f"group {g}, completion {i}: prompt ({prompt_lens[g]} tokens) + completion ({s} tokens) = "
                    f"{prompt_lens[g] + s} tokens alone exceeds max_tokens_per_micro_batch={max_tokens}; "
                    "raise the budget or truncate"
                )
        if current:
            plan.append(current)
            current, used = [], 0
        start = 0
        while start < len(lens):
            stop = start + 1
            while stop < len(lens) and cost(g, lens[start : stop + 1]) <= max_tokens:
                stop += 1
            if current:
                plan.append(current)
            current, used = [(g, slice(start, stop))], cost(g, lens[start:stop])
            start = stop
    if current:
        plan.append(current)
    return plan


# --------------------------------------------------------------------------------------------- model access
def _unwrap(model):
    """Return (causal LM, decoder stack, output embedding) of a plain, peft-wrapped or DDP/DeepSpeed model."""
    m = model
    for _ in range(8):
        if hasattr(m, "peft_config") and hasattr(m, "get_base_model"):
            cfg = getattr(m, "active_peft_config", None)
            if cfg is not None and getattr(cfg, "is_prompt_learning", False):
                raise NotImplementedError("prompt-learning PEFT adapters (prefix/prompt tuning) are not supported")
            m = m.get_base_model()
        elif type(m).__name__ in ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine") \
                and hasattr(m, "module"):
            if type(m).__name__ == "DistributedDataParallel" and torch.is_grad_enabled():
                warnings.warn(
                    "token_logprobs calls the decoder inside DistributedDataParallel directly, so DDP does not "
                    "all-reduce these gradients; all-reduce them yourself (or use DeepSpeed/FSDP)", stacklevel=3
                )
            m = m.module
        else:
            break
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(m).__name__} has no output embeddings: token_logprobs needs a causal LM")
    decoder = m.get_decoder() if hasattr(m, "get_decoder") else getattr(m, "model", None)
    if decoder is None or decoder is m:
        decoder = getattr(m, "model", None)
    if decoder is None:
        raise ValueError(f"cannot find the decoder stack of {type(m).__name__}")
    return m, decoder, head


def _shared_unsupported_reason(lm, max_seq_len: int) -> str | None:
    cfg = lm.config
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder model"
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {cfg.model_type!r} is not in grpo.prefix_engine.SUPPORTED_MODEL_TYPES"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping (attn_logit_softcapping) is not implemented by the shared layout"
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    uses_window = window is not None and (layer_types is None or "sliding_attention" in layer_types)
    if cfg.model_type == "qwen2" and not getattr(cfg, "use_sliding_window", False):
        uses_window = False
    if uses_window and window < max_seq_len:
        return f"sliding window ({window} tokens) is shorter than the longest prompt+completion ({max_seq_len})"
    if not checkpointing_is_wrappable(lm):
        return "gradient checkpointing is applied by a mechanism the engine cannot follow"
    return None


def shared_prefix_unsupported(model, max_seq_len: int) -> str | None:
    """Why the shared layout cannot serve ``model`` (plain, peft or engine-wrapped) exactly, or None."""
    return _shared_unsupported_reason(_unwrap(model)[0], max_seq_len)


def _device(lm) -> torch.device:
    emb = lm.get_input_embeddings()
    return emb.weight.device if emb is not None else next(lm.parameters()).device


def _hidden(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


# --------------------------------------------------------------------------------------------- forwards
def _forward_standard(lm, decoder, head, prompts, comps, temperature, want_entropy):
    device = _device(lm)
    rows = [(p, r) for p, cs in zip(prompts, comps) for r in cs if len(r)]
    if not rows:
        return _empty(device), _empty(device)
    L = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    pred, targets = [], []
    for n, (p, r) in enumerate(rows):
        seq = list(p) + list(r)
        ids[n, : len(seq)] = torch.tensor(seq)
        mask[n, : len(seq)] = 1
        pred.extend(n * L + len(p) - 1 + k for k in range(len(r)))
        targets.extend(r)
    out = decoder(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    hidden = _hidden(out)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, torch.tensor(pred, device=hidden.device))
    tgt = torch.tensor(targets, dtype=torch.long, device=h.device)
    return head_logprobs(h, head, lm.config, tgt, temperature, want_entropy)


def _resolve_kernel(kernel: str, lm) -> str:
    """'grouped' or 'flex' for this call; see token_logprobs."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}")
    device = _device(lm)
    dropout = lm.training and (getattr(lm.config, "attention_dropout", 0.0) or 0.0) > 0
    if kernel == "auto":  # flex stays opt-in until it has been measured on a GPU (docs/prefix-engine.md)
        return "grouped"
    if kernel == "flex":
        if not flex_available():
            raise ValueError("attention_kernel='flex' needs torch.nn.attention.flex_attention "
                             f"(torch {torch.__version__} "
                             "has none); use 'grouped' or 'auto'")
        if device.type == "cpu" and torch.is_grad_enabled():
            raise ValueError("attention_kernel='flex' cannot run backward on CPU (PyTorch's FlexAttention has no CPU "
                             "backward); use 'grouped' or 'auto' there, or call under torch.no_grad()")
        if dropout:
            raise ValueError("attention_kernel='flex' has no attention dropout and the model trains with "
                             "attention_dropout > 0; use 'grouped' or 'auto'")
    return kernel


def _forward_shared(lm, decoder, head, prompts, comps, temperature, want_entropy, kernel="grouped"):
    device = _device(lm)
    if not any(len(r) for cs in comps for r in cs):
        return _empty(device), _empty(device)
    layout = build_layout(prompts, comps, device)
    if kernel == "flex":
        layout.block_mask = build_block_mask(layout)
    # A 4-D mask is passed through untouched by transformers; our attention ignores it. Its shape broadcasts
    # against nothing, so if any foreign code path ever ran the stock eager/sdpa attention on this packed row
    # it would fail loudly instead of attending across completions.
    sentinel = torch.ones(1, 1, 1, 0, dtype=torch.bool, device=device)
    with prefix_attention(lm):
        out = decoder(
            input_ids=layout.input_ids,
            position_ids=layout.position_ids,
            attention_mask=sentinel,
            use_cache=False,
            **{LAYOUT_KWARG: layout},
        )
    n_layers = getattr(lm.config, "num_hidden_layers", 1)
    if layout.calls < n_layers:
        return None  # some layer bypassed the attention interface: caller falls back
    hidden = _hidden(out)[0]
    h = hidden.index_select(0, layout.pred_idx)
    return head_logprobs(h, head, lm.config, layout.targets, temperature, want_entropy)


def _empty(device):
    return torch.zeros(0, device=device)


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(t) for t in x]


def token_logprobs(
    model,
    prompt_ids,
    completion_ids,
    *,
    shared_prefix: bool = True,
    temperature: float = 1.0,
    max_tokens_per_micro_batch: int | None = None,
    return_entropy: bool = False,
    attention_kernel: str = "auto",
):
    """Per-token log p(completion token | prompt, earlier completion tokens) for GRPO groups.

    prompt_ids: list (one per group) of token lists; completion_ids: list (per group) of list (per completion)
    of token lists. Everything may be ragged, G may differ per group. Returns the same nesting of 1-D float32
    tensors (one value per completion token), computed from logits / temperature, differentiable when grad is
    enabled. With ``return_entropy=True`` returns ``(logps, entropies)``.

    ``shared_prefix=True`` encodes each prompt once per group (exact; see docs/prefix-engine.md);
    ``shared_prefix=False`` is the standard right-padded layout. Models the shared layout cannot serve exactly
    fall back to the standard one with a warning.

    ``attention_kernel`` picks how the shared layout's attention is computed: ``grouped`` (any device),
    ``flex`` (FlexAttention block mask, compiled; CUDA, or CPU without grad) or ``auto`` (grouped for now:
    flex becomes the CUDA default once it has been measured on a GPU).
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completion groups")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    prompts = [_as_list(p) for p in prompt_ids]
    comps = [[_as_list(r) for r in cs] for cs in completion_ids]
    for g, p in enumerate(prompts):
        if not p:
            raise ValueError(f"group {g} has an empty prompt: the first completion token needs a context")

    lm, decoder, head = _unwrap(model)
    kernel = _resolve_kernel(attention_kernel, lm)
    shared = shared_prefix
    if shared:
        max_len = max([len(p) + max([0] + [len(r) for r in cs]) for p, cs in zip(prompts, comps)] + [0])
        reason = _shared_unsupported_reason(lm, max_len)
        if reason is not None:
            warnings.warn(f"shared-prefix forward disabled, using the standard layout: {reason}", stacklevel=2)
            shared = False

    plan = plan_micro_batches(
        [len(p) for p in prompts], [[len(r) for r in cs] for cs in comps], max_tokens_per_micro_batch,
        shared_prefix=shared,
    )
    logps: list[list] = [[None] * len(cs) for cs in comps]
    ents: list[list] = [[None] * len(cs) for cs in comps]
    for mb in plan:
        sub_p = [prompts[g] for g, _ in mb]
        sub_c = [comps[g][sl] for g, sl in mb]
        res = None
        if shared:
            res = _forward_shared(lm, decoder, head, sub_p, sub_c, temperature, return_entropy, kernel)
            if res is None:
                warnings.warn(
                    "shared-prefix forward disabled, using the standard layout: some attention layers of "
                    f"{type(lm).__name__} do not go through transformers' AttentionInterface", stacklevel=2
                )
                shared = False
        if res is None:
            res = _forward_standard(lm, decoder, head, sub_p, sub_c, temperature, return_entropy)
        lp, ent = res
        lens = [len(r) for cs in sub_c for r in cs]
        lp_parts = torch.split(lp, lens)
        ent_parts = torch.split(ent, lens) if ent is not None else [None] * len(lens)
        n = 0
        for g, sl in mb:
            for i in range(*sl.indices(len(comps[g]))):
                logps[g][i], ents[g][i] = lp_parts[n], ent_parts[n]
                n += 1
    return (logps, ents) if return_entropy else logps
