"""Final hidden states of groups that share a prefix, each prefix encoded once: what a reward model pools.

``shared_prefix_hidden`` lays groups out as ``[prefix; suffix_1; ...; suffix_G]`` (grpo/engine/layout.py), runs the
decoder stack once with the shared-prefix attention, and returns the hidden state at any position of any row
``prefix + suffix_i``: equal to running every row alone (the same exactness as ``token_logprobs``). The reward
model (grpo/rewards/reward_model.py) scores a group's completions with it at each row's last token.
"""

from __future__ import annotations

import torch

from grpo.engine.layout import build_layout
from grpo.engine.patch import check_every_layer, placeholder_mask, switched_attention
from grpo.engine.prefix_attention import LAYOUT_KWARG
from grpo.engine.unwrap import unwrap_model


def decoder_of(model):
    """The decoder stack of a causal-LM or sequence-classification model (plain or wrapped)."""
    lm = unwrap_model(model)
    decoder = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
    if decoder is None or decoder is lm:
        raise ValueError(f"cannot find the decoder stack of {type(lm).__name__}")
    return lm, decoder


def shared_prefix_hidden(model, prefixes: list[list[int]], suffixes: list[list[list[int]]],
                         at: list[list[int]]) -> torch.Tensor:
    """(rows, hidden): for every group g and row i, the final hidden state at position ``at[g][i]`` of the tokens
    ``prefixes[g] + suffixes[g][i]`` (0-based, anywhere in the prefix or the suffix). Prefixes must be non-empty;
    check ``shared_prefix_unsupported`` first (grpo/engine/patch.py)."""
    lm, decoder = decoder_of(model)
    device = lm.get_input_embeddings().weight.device  # pragma: no mutate
    layout = build_layout(prefixes, suffixes, device)  # pragma: no mutate
    picks = []
    for g, (p, rows) in enumerate(zip(prefixes, at)):
        for i, pos in enumerate(rows):
            if not 0 <= pos < len(p) + len(suffixes[g][i]):
                raise ValueError(f"position {pos} is outside row {i} of group {g}")
            if pos < len(p):
                picks.append(layout.prompt_idx[g * layout.max_prompt + pos])
            else:
                picks.append(layout.comp_idx[(g * layout.max_group + i) * layout.max_completion + pos - len(p)])
    mask = placeholder_mask(device)  # pragma: no mutate
    with switched_attention(lm, state=layout):
        out = decoder(input_ids=layout.input_ids, position_ids=layout.position_ids, attention_mask=mask,
                      use_cache=False, **{LAYOUT_KWARG: layout})
    check_every_layer(layout.calls, lm)
    return out[0][0].index_select(0, torch.stack(picks))  # out[0]: last_hidden_state, of a ModelOutput or a tuple
