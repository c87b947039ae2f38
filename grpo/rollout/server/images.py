"""Prompts with images through the server backend: one ``POST /inference/v1/generate`` per group (vLLM's tokens-in
route, ``grpo-serve`` starts it with ``--enable-scale-out``), built here without vLLM (the trainer needs none).

Why that route and not ``/v1/completions`` or ``/v1/chat/completions``: the completions route takes token ids but no
images, the chat route takes images but renders the conversation itself (its token ids need not be the trainer's).
The tokens-in route takes the prompt's ids as they are, image tokens expanded (the ids the trainer scores, unchanged:
no placeholder is expanded again), and each image's inputs already processed (``features``):

1. ``mm_placeholders``: where each image's tokens sit in the ids (one run of the image token per image);
2. ``kwargs_data``: per image, vLLM's ``MultiModalKwargsItem`` serialized as its ``mm_serde`` does (msgpack, tensors
   inline, base64): ``image_embeds`` (the trainer's own vision tower's features of that image, computed once per
   prompt: `grpo.rollout.vllm_images` says why not vLLM's tower) and ``image_grid_thw``;
3. ``mm_hashes``: a digest of each image's features, what vLLM keys its prefix and encoder caches by: an image whose
   features change (new tower weights) is never served from the cache of its old ones.

The answer carries every sample's token ids and sampled-token log-probs (`parse_generate`), and the prompt vLLM ran,
which must be the trainer's ids (one line when not).
"""
from __future__ import annotations

import base64
import hashlib
import struct

import torch

from grpo.rollout.server.client import ServerError

GENERATE = "/inference/v1/generate"
RAW_VIEW = 3  # vLLM's msgpack extension code for a tensor's raw bytes (vllm/v1/serial_utils.py, CUSTOM_TYPE_RAW_VIEW)


def image_runs(ids: list[int], image_token_id: int) -> list[dict]:
    """``{"offset", "length"}`` of every run of ``image_token_id`` in ``ids``, in order: one image each."""
    runs: list[dict] = []
    for i, t in enumerate(ids):
        if t != image_token_id:
            continue
        if runs and runs[-1]["offset"] + runs[-1]["length"] == i:
            runs[-1]["length"] += 1
        else:
            runs.append({"offset": i, "length": 1})
    return runs


def per_image(features: torch.Tensor, grid: torch.Tensor, merge: int) -> list[torch.Tensor]:
    """A prompt's tower features (all its images' tokens, in order) cut into each image's (``t*h*w / merge**2``)."""
    sizes = [int(n) // (merge * merge) for n in grid.prod(-1)]
    if sum(sizes) != len(features):
        raise ServerError(f"the vision tower gave {len(features)} image features for images of {sum(sizes)} tokens")
    return list(features.split(sizes))


def _tensor(t: torch.Tensor) -> list:
    t = t.detach().contiguous().cpu()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), _Ext(RAW_VIEW, t.view(-1).view(torch.uint8).numpy()
                                                                      .tobytes())]


def kwargs_item(embeds: torch.Tensor, grid: torch.Tensor) -> str:
    """One image's ``MultiModalKwargsItem`` as vLLM's ``encode_mm_kwargs_item`` writes it: ``image_embeds`` a flat
    field (one slice of all its tokens), ``image_grid_thw`` a batched one kept on the CPU, as vLLM's Qwen2-VL
    processor declares them (``_create_qwen2vl_field_factory``)."""
    item = {"image_embeds": {"data": _tensor(embeds),
                             "field": ["flat", {"keep_on_cpu": False, "slices": [[0, len(embeds), None]], "dim": 0}]},
            "image_grid_thw": {"data": _tensor(grid), "field": ["batched", {"keep_on_cpu": True}]}}
    return base64.b64encode(pack(item)).decode("ascii")


def features(ids: list[int], image_token_id: int, embeds: list[torch.Tensor], grids: torch.Tensor) -> dict:
    """The request's ``features``: each image's placeholder, features and digest."""
    runs = image_runs(ids, image_token_id)
    if [r["length"] for r in runs] != [len(e) for e in embeds]:
        raise ServerError(f"a prompt's image tokens ({[r['length'] for r in runs]} per image) do not match its "
                          f"images' features ({[len(e) for e in embeds]})")
    hashes = [hashlib.sha256(e.float().contiguous().numpy().tobytes() + g.numpy().tobytes()).hexdigest()
              for e, g in zip(embeds, grids.to(torch.int64))]
    return {"mm_hashes": {"image": hashes}, "mm_placeholders": {"image": runs},
            "kwargs_data": {"image": [kwargs_item(e, g) for e, g in zip(embeds, grids.to(torch.int64))]}}


def image_request(body: dict, prompt, image_token_id: int, image_features, merge: int) -> dict:
    """The tokens-in request of one group: ``body`` is its ``/v1/completions`` body (`group_request`: the sampling
    settings), ``prompt`` an ImagePrompt, ``image_features(pixel_values, grid)`` the trainer's tower."""
    feats = image_features(prompt.pixel_values, prompt.image_grid_thw)
    embeds = per_image(feats, prompt.image_grid_thw, merge)
    sampling = {k: v for k, v in body.items() if k not in ("model", "prompt", "return_token_ids")}
    return {"model": body["model"], "token_ids": list(prompt), "sampling_params": sampling, "return_token_ids": True,
            "features": features(list(prompt), image_token_id, embeds, prompt.image_grid_thw)}


def parse_generate(answer: dict, prompt: list[int]) -> tuple[list[list[int]], list[list[float]]]:
    """Token ids and sampled-token log-probs of each sample of a tokens-in answer; the prompt vLLM ran must be
    ``prompt``."""
    ran = answer.get("prompt_token_ids")
    if ran is not None and list(ran) != list(prompt):
        raise ServerError(f"the rollout server ran a prompt of {len(ran)} tokens for the trainer's {len(prompt)}: it "
                          "expanded the images otherwise; start it with grpo-serve and the run's recipe")
    ids, logps = [], []
    for c in sorted(answer["choices"], key=lambda c: c["index"]):
        toks = list(c.get("token_ids") or [])
        lp = [e["logprob"] for e in ((c.get("logprobs") or {}).get("content") or [])]
        if len(lp) != len(toks):
            raise ServerError(f"the rollout server returned {len(toks)} tokens but {len(lp)} log-probs")
        ids.append(toks)
        logps.append([float(x) for x in lp])
    return ids, logps


def vision_inputs(model):
    """(image token id, the tower's spatial merge, `tower_features`) of a vision-language model the servers take
    images for (``VLLM_VISION_FAMILIES``), else None. The tower is the trainer's live one: the run samples with the
    version it just pushed (or a frozen tower, every version's: `grpo.rollout.registry.check_images`)."""
    from grpo.engine.unwrap import unwrap_model
    from grpo.rollout.vllm_images import VLLM_VISION_FAMILIES, tower_features

    config = unwrap_model(model).config
    if getattr(config, "model_type", None) not in VLLM_VISION_FAMILIES:
        return None
    return config.image_token_id, config.vision_config.spatial_merge_size, tower_features(model)


def frozen_tower(vision) -> bool:
    """Whether the tower of `vision_inputs` is frozen (model.freeze_vision_tower): no parameter of it trains."""
    from grpo.engine.unwrap import unwrap_model

    return not any(p.requires_grad for p in unwrap_model(vision[2].model).model.visual.parameters())


# ---------------------------------------------------------------------------------- msgpack (the subset vLLM reads)
class _Ext:
    def __init__(self, code: int, data: bytes):
        self.code, self.data = code, data


def pack(obj) -> bytes:
    """``obj`` (None, bool, int >= 0, str, list, dict, `_Ext`) in msgpack (msgpack.org's spec)."""
    if obj is None:
        return b"\xc0"
    if isinstance(obj, bool):
        return b"\xc3" if obj else b"\xc2"
    if isinstance(obj, int):
        if not 0 <= obj < 2 ** 64:
            raise ValueError(f"msgpack here packs integers in [0, 2**64), not {obj}")
        return bytes([obj]) if obj < 128 else b"\xcf" + struct.pack(">Q", obj)
    if isinstance(obj, str):
        raw = obj.encode()
        return (bytes([0xa0 | len(raw)]) if len(raw) < 32 else b"\xdb" + struct.pack(">I", len(raw))) + raw
    if isinstance(obj, (list, tuple)):
        head = bytes([0x90 | len(obj)]) if len(obj) < 16 else b"\xdd" + struct.pack(">I", len(obj))
        return head + b"".join(pack(x) for x in obj)
    if isinstance(obj, dict):
        head = bytes([0x80 | len(obj)]) if len(obj) < 16 else b"\xdf" + struct.pack(">I", len(obj))
        return head + b"".join(pack(k) + pack(v) for k, v in obj.items())
    if isinstance(obj, _Ext):
        return b"\xc9" + struct.pack(">Ib", len(obj.data), obj.code) + obj.data
    raise TypeError(f"msgpack here does not pack {type(obj).__name__}")
