"""What differs between the served vision-language families, one entry each: the engine and the rollout read it.

grpo/engine/vision_logprobs.py (the update) and grpo/rollout/vision.py (the hf rollout) are written once; a
family is served by its :class:`VisionFamily` entry in :data:`FAMILIES`, which says

* ``tower``: the attribute of the model's core (``model.model``) holding its vision tower;
* ``kinds_kwarg``: the name under which its own forward takes the token-kind mask (1 at image tokens), or None for
  a forward that takes none (Idefics3: its image tokens are text positions in a causal language model);
* ``axes``: how many rotary position axes its language model takes (Qwen-VL's temporal, height, width: 3);
* ``image_tokens(config, prompt)``: how many image tokens the prompt's images make;
* ``image_inputs(prompts)``: the pixel arguments of its own forward for those prompts' images, in order;
* ``features(core, prompts)``: those images' features (image tokens, hidden), in order, and the tower's
  intermediate features its language model adds later (Qwen3-VL's deepstack), or None;
* ``positions(core, prompt, image_token_id)``: the prompt's rotary positions (axes, P), as its forward computes them;
* ``bidirectional(ids, image_token_id)``: the spans ``[start, end)`` of the prompt whose tokens attend to each other
  both ways (Gemma 3: each image's run of image tokens); ``()`` for a family that is causal throughout. The
  engine's layout carries them to every attention kernel (grpo/engine/layout.py's ``blocks``);
* ``text``: the attribute of the core holding its language model (``language_model``; Idefics3's ``text_model``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class VisionFamily:
    tower: str
    kinds_kwarg: str | None
    axes: int
    image_tokens: Callable
    image_inputs: Callable
    features: Callable
    positions: Callable
    bidirectional: Callable = lambda ids, image_token_id: ()
    text: str = "language_model"


# --------------------------------------------------------------------------------------------- Qwen-VL
def _qwen_image_tokens(config, prompt) -> int:
    merge = config.vision_config.spatial_merge_size
    return 0 if prompt.n_images == 0 else int(prompt.image_grid_thw.prod(1).sum()) // merge ** 2  # (images, 3)


def _qwen_image_inputs(prompts) -> dict:
    return {"pixel_values": torch.cat([p.pixel_values for p in prompts]),
            "image_grid_thw": torch.cat([p.image_grid_thw for p in prompts])}


def _qwen_features(core, prompts):
    """The tower's merged features of every image (one call) and Qwen3-VL's deepstack features (or None)."""
    device = core.get_input_embeddings().weight.device  # pragma: no mutate
    inputs = _qwen_image_inputs(prompts)
    inputs = {k: v.to(device) for k, v in inputs.items()}  # pragma: no mutate
    out = core.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    deep = getattr(out, "deepstack_features", None)
    return torch.cat(out.pooler_output), ([torch.cat(f) for f in deep] if deep else None)


def _qwen_positions(core, prompt, image_token_id: int) -> torch.Tensor:
    """(3, P): the model's ``get_rope_index`` (images laid out on their grids); 0..P-1 without images."""
    ids = torch.tensor(prompt.ids)  # int64: the ids are ints
    if prompt.n_images == 0:
        return ids.new_tensor(range(len(ids)))[None, :].expand(3, -1)
    kinds = (ids == image_token_id).int()[None, :]
    pos, _ = core.get_rope_index(ids[None, :], mm_token_type_ids=kinds, image_grid_thw=prompt.image_grid_thw.cpu())
    return pos[:, 0, :]


_QWEN = VisionFamily(tower="visual", kinds_kwarg="mm_token_type_ids", axes=3, image_tokens=_qwen_image_tokens,
                     image_inputs=_qwen_image_inputs, features=_qwen_features, positions=_qwen_positions)


# --------------------------------------------------------------------------------------------- Gemma 3
def _gemma3_image_tokens(config, prompt) -> int:
    return prompt.n_images * config.mm_tokens_per_image


def _gemma3_image_inputs(prompts) -> dict:
    return {"pixel_values": torch.cat([p.pixel_values for p in prompts])}


def _gemma3_features(core, prompts):
    """SigLIP on every image (one call, fixed-size images), pooled and projected by the multi-modal projector."""
    device = core.get_input_embeddings().weight.device  # pragma: no mutate
    pixels = _gemma3_image_inputs(prompts)["pixel_values"]
    pixels = pixels.to(device)  # pragma: no mutate
    out = core.get_image_features(pixels, return_dict=True)
    return out.pooler_output.flatten(0, 1), None


def text_positions(core, prompt, image_token_id: int) -> torch.Tensor:
    return torch.arange(len(prompt.ids))[None, :]  # 1-D: image tokens are positions like any other


def image_runs(ids, image_token_id: int) -> list[tuple[int, int]]:
    """The runs of consecutive image tokens (one per image, between its begin- and end-of-image tokens): what
    transformers' ``get_block_sequence_ids_for_mask`` makes a block of, from ``token_type_ids``."""
    runs, start = [], None
    for j, t in enumerate([*ids, None]):
        if t == image_token_id and start is None:
            start = j
        elif t != image_token_id and start is not None:
            runs.append((start, j))
            start = None
    return runs


_GEMMA3 = VisionFamily(tower="vision_tower", kinds_kwarg="token_type_ids", axes=1, image_tokens=_gemma3_image_tokens,
                       image_inputs=_gemma3_image_inputs, features=_gemma3_features, positions=text_positions,
                       bidirectional=image_runs)


# --------------------------------------------------------------------------------------------- Idefics3, SmolVLM2
def _idefics3_image_tokens(config, prompt) -> int:
    """Every tile (and global image) is the connector's pixel shuffle of its patches: (H/p)(W/p) / scale^2 tokens."""
    if prompt.n_images == 0:
        return 0
    tiles, _, height, width = prompt.pixel_values.shape
    patch = config.vision_config.patch_size
    return tiles * (height // patch) * (width // patch) // config.scale_factor ** 2


def pad_tiles(prompts) -> dict:
    """The prompts' tiles as one batch of the image processor: ``pixel_values`` (prompts, most tiles, C, H, W) and
    ``pixel_attention_mask`` (prompts, most tiles, H, W), each prompt's tiles first, then zero tiles with a zero mask
    (which the model drops as padding), each tile padded with zeros at the bottom and right to the largest."""
    n = max(len(p.pixel_values) for p in prompts)
    c, h, w = (max(p.pixel_values.shape[d] for p in prompts) for d in (1, 2, 3))
    pixels = prompts[0].pixel_values.new_zeros(len(prompts), n, c, h, w)
    mask = prompts[0].pixel_attention_mask.new_zeros(len(prompts), n, h, w)
    for b, p in enumerate(prompts):
        t, _, ph, pw = p.pixel_values.shape
        pixels[b, :t, :, :ph, :pw] = p.pixel_values
        mask[b, :t, :ph, :pw] = p.pixel_attention_mask
    return {"pixel_values": pixels, "pixel_attention_mask": mask}


def _idefics3_features(core, prompts):
    """The tower on every tile of the prompts (one call, padding tiles dropped by the model), pixel-shuffled and
    projected by the connector."""
    device = core.get_input_embeddings().weight.device  # pragma: no mutate
    inputs = pad_tiles(prompts)
    inputs = {k: v.to(device) for k, v in inputs.items()}  # pragma: no mutate
    out = core.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"], return_dict=True)
    return torch.cat(out.pooler_output), None


_IDEFICS3 = VisionFamily(tower="vision_model", kinds_kwarg=None, axes=1, image_tokens=_idefics3_image_tokens,
                         image_inputs=pad_tiles, features=_idefics3_features, positions=text_positions,
                         text="text_model")

# model_type -> its entry: the families served (grpo.token_logprobs hands them to grpo/engine/vision_logprobs.py)
FAMILIES: dict[str, VisionFamily] = {"qwen2_5_vl": _QWEN, "qwen2_vl": _QWEN, "qwen3_vl": _QWEN, "qwen3_vl_moe": _QWEN,
                                     "qwen3_5": _QWEN, "gemma3": _GEMMA3, "idefics3": _IDEFICS3, "smolvlm": _IDEFICS3}


def family_of(model) -> VisionFamily:
    """The entry of ``model`` (a vision-language model or its core: both carry the family's config)."""
    return FAMILIES[model.config.model_type]


def language_model(core):
    """The language model of a vision-language model's core (``model.model``)."""
    return getattr(core, family_of(core).text)
