"""K/V kept from one turn of a multi-turn rollout to the next, for the hf decode loop (`grpo.rollout.hf`).

After each call the rows' caches are kept, compacted (padding and masked columns dropped), with the tokens they
encode. The next call (the episodes' next turn: each context is an earlier row's tokens, then what the model
sampled, then the tool's text) takes for each context the kept row with the longest common token prefix and
prefills only the rest. K/V are a function of the tokens before them and their positions only, so a matched prefix
holds exactly the K/V a fresh prefill would compute (up to floating-point summation order): the sampled tokens and
their log-probs come from the same distribution as on the re-prefill path (`tests/rollout/test_turn_cache.py`).

Rows live for one call: a call takes from the previous call's rows and keeps its own; a first turn (no suffixes)
starts empty, and `TurnCache.clear` (the backend's ``sleep`` after a rollout) frees them for the update.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Kept:
    tokens: torch.Tensor          # (n,) the tokens whose K/V are held, in order
    keys: list[torch.Tensor]      # per layer (heads, n, head_dim)
    values: list[torch.Tensor]


class TurnCache:
    def __init__(self):
        self.rows: list[Kept] = []       # the last call's rows (what the next call may take from)
        self._new: list[Kept] = []       # this call's rows, so far
        self._index = None               # (stored tokens padded (S, L), lengths (S,)) of ``rows``

    def clear(self) -> None:
        self.rows, self._new, self._index = [], [], None

    def begin(self, first_turn: bool) -> None:
        """A call starts: it takes from the previous call's rows (none on a first turn)."""
        if first_turn:
            self.rows = []
        self._new, self._index = [], None

    def end(self) -> None:
        """The call ended: its rows are what the next one takes from."""
        self.rows, self._new, self._index = self._new, [], None

    def keep(self, tokens: list[list[int]], keys: list[torch.Tensor], values: list[torch.Tensor],
             valid: torch.Tensor) -> None:
        """Keep the rows of one decoded batch: ``keys``/``values`` per layer (rows, heads, width, dim), ``valid``
        (rows, width) the columns that hold a token, ``tokens`` per row the tokens of those columns, in order."""
        for r, toks in enumerate(tokens):
            cols = valid[r].nonzero()[:, 0]
            assert len(cols) == len(toks), "each valid K/V column holds one token"
            self._new.append(Kept(torch.tensor(toks), [k[r][:, cols] for k in keys], [v[r][:, cols] for v in values]))

    def take(self, context: list[int]) -> tuple[Kept | None, int]:
        """The kept row sharing the longest token prefix with ``context``, and that prefix's length (at most
        ``len(context) - 1``: the last token is the first one decoding feeds); (None, 0) when none shares one."""
        if not self.rows or len(context) < 2:
            return None, 0
        if self._index is None:
            lengths = torch.tensor([len(k.tokens) for k in self.rows])
            table = torch.full((len(self.rows), int(lengths.max())), -1, dtype=torch.long)
            for i, k in enumerate(self.rows):
                table[i, :len(k.tokens)] = k.tokens
            self._index = table
        table = self._index
        width = min(table.shape[1], len(context) - 1)
        same = table[:, :width] == torch.tensor(context[:width])[None]
        common = same.long().cumprod(-1).sum(-1)
        best = int(common.argmax())
        n = int(common[best])
        return (self.rows[best], n) if n > 0 else (None, 0)


def batched(model, kept: list[tuple[Kept, int]], device) -> tuple[object, torch.Tensor]:
    """A DynamicCache of the rows' kept prefixes (``(row, n)``: its first ``n`` tokens), left-padded to one width,
    and the (rows, width) mask of the columns that hold a token."""
    from transformers import DynamicCache

    width = max(n for _, n in kept)
    cache = DynamicCache(config=model.config)
    mask = torch.zeros(len(kept), width, dtype=torch.long, device=device)
    for i, (_, n) in enumerate(kept):
        mask[i, width - n:] = 1
    for layer in range(len(kept[0][0].keys)):
        ref = kept[0][0].keys[layer]
        k = ref.new_zeros(len(kept), ref.shape[0], width, ref.shape[2])
        v = k.clone()
        for i, (row, n) in enumerate(kept):
            k[i, :, width - n:] = row.keys[layer][:, :n]
            v[i, :, width - n:] = row.values[layer][:, :n]
        cache.update(k, v, layer)
    return cache, mask


def plain_layers(cache) -> bool:
    """Whether every layer of ``cache`` holds every position (no sliding window, no quantisation): what keeping
    its columns assumes."""
    layers = getattr(cache, "layers", None)
    return layers is not None and all(type(layer).__name__ == "DynamicLayer" for layer in layers)


def layer_tensors(cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
