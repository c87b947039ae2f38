"""Recurrent layers in the shared layout: each completion continues from its prompt's state.

A Gated DeltaNet layer (Qwen3.5, Qwen3-Next, OLMo-hybrid, Kimi's KDA), a Mamba2 layer (Bamba, Falcon-H1, Granite-4
hybrid, Nemotron-H, Zamba2, Mamba2) or a short convolution (LFM2) carries everything its past contributes in a
state: the recurrent memory or SSM state, and the short convolution's last ``K`` inputs. What the G completions
of a group share is that state after the prompt. So, for such a layer, instead of one pass over the packed row:

1. the prompts run through the layer's own forward (batched by length, no padding anywhere), recording the state
   after the last prompt token;
2. all completions run through it at once (right-padded, each a row), each row starting from its group's state
   (one copy per row, ``index_select``): autograd sums the G rows' gradients into the prompt's state, as the G
   copies of the prompt receive them in the standard layout;
3. outputs are put back in packed order.

The layer's code is not modified: it receives :class:`StateHandOver` as its cache, a differentiable stand-in for
transformers' linear-attention cache (``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``,
``update_recurrent_state``, ``is_recording_past``), the interface every such layer of transformers 5.24 continues
a chunked prefill through. Whatever kernels the layer dispatches to (transformers' torch references on CPU,
flash-linear-attention, mamba_ssm or causal_conv1d where installed) take the initial state that way.
See docs/prefix-engine.md ("Recurrent layers").
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F

from grpo.engine.layout import ACTIVE, PrefixLayout

# what a layer's forward calls when it keeps its state in transformers' linear-attention cache
_INTERFACE = ("get_conv_state", "get_recurrent_state")
# words in a forward that keeps a recurrent state some other way (MiniMax's lightning attention: get_linear_cache)
_OTHER_STATE = ("linear_cache", "ssm_state", "recurrent_state", "conv_state")
_CACHE_ARGS = ("cache", "cache_params", "past_key_values")


def forward_source(cls) -> str:
    """The source of ``cls.forward`` ("": none to read, e.g. a builtin), read once per class."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


# cached by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
forward_source = functools.lru_cache(maxsize=None)(forward_source)


def _cache_arg(cls) -> str | None:
    params = inspect.signature(cls.forward).parameters
    return next((name for name in _CACHE_ARGS if name in params), None)


# cached by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
_cache_arg = functools.lru_cache(maxsize=None)(_cache_arg)


def handed_over(module) -> bool:
    """Whether ``module`` is a recurrent layer whose state the engine hands from the prompt to its completions."""
    return hasattr(module, "layer_idx") and not_handed_over(module) is None


def not_handed_over(module) -> str | None:
    """Why the recurrent layer ``module`` cannot continue a completion from its prompt's state, or None: it must
    keep its state in transformers' linear-attention cache, take the cache as an argument, and its multi-token
    form must start from the recurrent state it is given (Jamba's Mamba scan does not: it reads it only when
    decoding one token)."""
    src = forward_source(type(module))
    if not any(k in src for k in _INTERFACE) or _cache_arg(type(module)) is None:
        return "a recurrent state outside transformers' linear-attention cache"
    if "get_recurrent_state" in src and "initial_state" not in src:
        return "its multi-token scan does not start from a given state"
    return None


def recurrent(module) -> bool:
    """Whether ``module`` is a layer with a recurrent state of any kind (handed over or not): never softmax
    attention, whatever its class is called (MiniMax's ``MiniMaxLightningAttention``, Kimi's
    ``KimiDeltaAttention``)."""
    src = forward_source(type(module))
    return hasattr(module, "layer_idx") and any(k in src for k in _INTERFACE + _OTHER_STATE)


def has_recurrent_layers(model) -> bool:
    """Whether ``model`` has recurrent layers of any kind."""
    return any(recurrent(m) for m in model.modules())


def state_layers(model) -> list:
    """The model's recurrent layers that the engine hands over."""
    return [m for m in model.modules() if handed_over(m)]


# --------------------------------------------------------------------------------------------- the stand-in cache
class StateHandOver:
    """Per layer, the state a recurrent layer continues from: the short convolution's last ``K`` inputs
    (``(N, C, K)``, zero on the left when fewer came) and the recurrent state, as transformers' linear-attention
    cache holds them, but kept out of place so that autograd follows them."""

    def __init__(self, conv: dict | None = None, recurrent: dict | None = None):
        self.conv, self.recurrent = dict(conv or {}), dict(recurrent or {})

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.conv.get((layer_idx, state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.recurrent.get((layer_idx, state_idx))

    def update_conv_state(self, states, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        """Returns the convolution's input with the held ``K`` inputs before it, and keeps its last ``K``."""
        prev = self.conv.get((layer_idx, state_idx))
        full = states if prev is None else torch.cat([prev.to(states.dtype), states], dim=-1)
        k = conv_kernel_size or full.shape[-1]
        kept = full[..., -k:]
        self.conv[(layer_idx, state_idx)] = F.pad(kept, (k - kept.shape[-1], 0))
        return full

    def update_recurrent_state(self, states, layer_idx: int, state_idx: int = 0, **kwargs):
        self.recurrent[(layer_idx, state_idx)] = states
        return states

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # never the per-token convolution update, which writes the held inputs in place

    def rows(self, index: torch.Tensor) -> StateHandOver:
        """The states of rows ``index`` (a copy per row: what each completion continues from)."""
        conv, rec = ({k: v.index_select(0, index.to(v.device)) for k, v in d.items()} for d in (self.conv,
                                                                                               self.recurrent))
        return StateHandOver(conv, rec)

    @staticmethod
    def cat(parts: list[StateHandOver]) -> StateHandOver:
        """The rows of ``parts``, one after the other."""
        conv = {k: torch.cat([p.conv[k] for p in parts]) for k in parts[0].conv}
        rec = {k: torch.cat([p.recurrent[k] for p in parts]) for k in parts[0].recurrent}
        return StateHandOver(conv, rec)


# --------------------------------------------------------------------------------------------- the shared forward
def shared_state_forward(module, forward, hidden_states: torch.Tensor, layout: PrefixLayout) -> torch.Tensor:
    """The layer on the packed row (1, T, D): prompts once (steps 1-3 of the module doc)."""
    layout.calls += 1
    x, arg = hidden_states[0], _cache_arg(type(module))
    B, Pmax, Gmax, Smax = layout.n_groups, layout.max_prompt, layout.max_group, layout.max_completion
    lens = layout.prompt_lens
    prompts = x.index_select(0, layout.prompt_idx).view(B, Pmax, -1)
    order, outs, states = [], [], []
    for n in sorted(set(lens)):  # 1. prompts of one length together: the state is the one after its last token
        rows = [b for b in range(B) if lens[b] == n]
        cache = StateHandOver()
        y = _out(forward(prompts[rows, :n], attention_mask=None, **{arg: cache}))
        order += rows
        outs.append(F.pad(y, (0, 0, 0, Pmax - n)))
        states.append(cache)
    back = torch.tensor(sorted(range(B), key=order.__getitem__), device=x.device)  # group b's row in `order`
    prompt_out = torch.cat(outs).index_select(0, back)
    start = StateHandOver.cat(states).rows(back.repeat_interleave(Gmax))  # 2. each completion from its prompt
    comps = x.index_select(0, layout.comp_idx).view(B * Gmax, Smax, -1)
    if Smax == 1:  # one more (discarded) token: one-token inputs take the layers' in-place decoding step
        comps = F.pad(comps, (0, 0, 0, 1))
    comp_out = _out(forward(comps, attention_mask=None, **{arg: start}))[:, :Smax]
    flat = torch.cat([prompt_out.reshape(B * Pmax, -1), comp_out.reshape(B * Gmax * Smax, -1)])
    return flat.index_select(0, layout.src)[None]  # 3. packed order


def _out(result):
    return result[0] if isinstance(result, tuple) else result


def _dispatching(module, forward):
    """``module``'s forward while switched: the shared one inside a shared-prefix training forward, its own
    otherwise (the rollout's decoding, which hands the states over through the ordinary cache)."""

    def run(hidden_states, *args, **kwargs):
        layout = ACTIVE.get()
        if isinstance(layout, PrefixLayout):
            return shared_state_forward(module, forward, hidden_states, layout)
        return forward(hidden_states, *args, **kwargs)

    run.grpo_switched = True
    return run


def switched_state_layers(layers: list):
    """For the duration, each of ``layers`` runs :func:`shared_state_forward` inside a shared-prefix forward
    (an instance attribute over the class's forward, removed on exit, also on exception). Re-entered (the
    recompute of gradient checkpointing inside the forward) it leaves switched layers as they are."""
    saved = []
    try:
        for m in layers:
            if getattr(vars(m).get("forward"), "grpo_switched", False):
                continue
            saved.append((m, vars(m).get("forward")))
            m.forward = _dispatching(m, saved[-1][1] or m.forward)
        yield
    finally:
        for m, own in saved:
            if own is None:
                del m.forward
            else:
                m.forward = own


# a context manager by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
switched_state_layers = contextlib.contextmanager(switched_state_layers)


# --------------------------------------------------------------------------------------------- decoding
_STATE_DICTS = ("conv_states", "recurrent_states")
_STATE_FLAGS = ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                "conv_kernel_size")


def fork_states(prefilled, fresh, rows: torch.Tensor):
    """The rollout's shared-prompt decoding: each prompt's recurrent states, prefilled once (one row per prompt in
    transformers' cache ``prefilled``), copied to the decoding rows in the cache ``fresh`` (which holds the rows'
    own attention tokens; the prompt's K/V stay shared): row r gets prompt ``rows[r]``'s. Returns ``fresh``."""
    for old, new in zip(getattr(prefilled, "layers", ()), getattr(fresh, "layers", ())):
        if not all(hasattr(old, a) for a in _STATE_DICTS):
            continue
        for a in _STATE_DICTS:
            held = getattr(old, a).items()
            setattr(new, a, {i: None if t is None else t.index_select(0, rows.to(t.device)) for i, t in held})
        for a in _STATE_FLAGS:
            setattr(new, a, dict(getattr(old, a)))
        new.device, new.dtype = old.device, old.dtype
    return fresh
