"""``vision_token_logprobs``: per-token log-probs of GRPO completions whose prompts hold images (Qwen-VL, Gemma 3,
Idefics3).

The shared layout (the default) packs a micro-batch as the text engine does (grpo/engine/layout.py)::

    [P_1; R_11; ...; R_1G; P_2; ...]      P_b holding its images' tokens

and computes, in order:

1. the vision tower once per prompt, all images of the micro-batch in one call (not G times per prompt; Idefics3:
   every tile and global image of the micro-batch, padded into one batch as its image processor pads one);
2. the row's input embeddings: token embeddings, with the image features scattered into the image tokens of the
   prompts (never into a completion: a sampled image token stays a text embedding there);
3. the rotary positions: each prompt's as the model computes them (Qwen-VL's 3-D temporal, height, width from its
   ``get_rope_index``; Gemma 3's and Idefics3's 0..P-1), and for every completion ``R_i`` text positions restarting at
   ``max(prompt positions) + 1``, the position the per-sequence forward gives its first token (equal in every axis,
   as for any text token);
4. the language model on that row with the shared-prefix attention (every completion sees its prompt and itself;
   within a prompt, the family's bidirectional spans attend both ways: Gemma 3's image tokens, one block per image);
5. the log-prob head at the positions that predict a completion token.

``shared_prefix=False`` is the standard layout: every row ``[P; R_i]`` carries its own copy of its prompt's pixels
through the model's own forward (the vision tower runs G times per prompt). Both equal the per-sequence forward;
see docs/vision-language.md. What differs between families is their entry in grpo/engine/vision_families.py.
"""

from __future__ import annotations

import torch

from grpo.engine.layout import build_layout
from grpo.engine.logprob_head import head_logprobs
from grpo.engine.micro_batches import plan_micro_batches, scatter
from grpo.engine.patch import check_every_layer, placeholder_mask, shared_prefix_unsupported, switched_attention
from grpo.engine.prefix_attention import LAYOUT_KWARG
from grpo.engine.unwrap import unwrap_model
from grpo.engine.vision_families import FAMILIES, family_of, language_model
from grpo.vision.images import ImagePrompt
from grpo.vision.models import NOT_SERVED, image_side_params  # NOT_SERVED: families refused, and why

__all__ = ["vision_token_logprobs", "VISION_FAMILIES"]

# the model types served here (grpo.token_logprobs hands them over)
VISION_FAMILIES = tuple(FAMILIES)


def vision_token_logprobs(model, prompts, completion_ids, *, shared_prefix: bool = True, temperature: float = 1.0,
                          max_tokens_per_micro_batch: int | None = None, return_entropy: bool = False):
    """Per-token log p(completion token | prompt with images, earlier completion tokens).

    prompts: one :class:`grpo.vision.images.ImagePrompt` per group (token ids with the image tokens expanded, the
    images' pixels and grids; a prompt may hold 0, 1 or several images); completion_ids: per group, a list of token
    lists (ragged, G may differ per group). ``grpo.token_logprobs`` comes here for these models. Returns the
    nesting of ``grpo.token_logprobs``: one 1-D float32 tensor per completion, differentiable (vision tower
    included) when grad is enabled; with ``return_entropy`` a pair.
    """
    vlm = unwrap_model(model)
    prompts = [p if isinstance(p, ImagePrompt) else ImagePrompt(p) for p in prompts]  # token lists: no images
    core = _check(vlm, prompts, completion_ids, temperature)
    comps = [[[int(t) for t in r] for r in cs] for cs in completion_ids]
    if shared_prefix:
        reason = shared_prefix_unsupported(language_model(core), 1)
        if reason is not None:
            raise ValueError(f"the shared layout cannot serve this model's language model ({reason}); "
                             "call with shared_prefix=False")
    plan = plan_micro_batches([len(p.ids) for p in prompts], [[len(r) for r in cs] for cs in comps],
                              max_tokens_per_micro_batch, shared_prefix=shared_prefix)
    logps: list[list] = [[None] * len(cs) for cs in comps]
    ents: list[list] = [[None] * len(cs) for cs in comps]
    forward = _forward_shared if shared_prefix else _forward_standard
    for mb in plan:
        lp, ent = forward(vlm, core, [prompts[g] for g, _ in mb], [comps[g][sl] for g, sl in mb], temperature,
                          return_entropy)
        if torch.is_grad_enabled() and not any(prompts[g].n_images for g, _ in mb):
            lp = lp + image_side_zero(core)
        scatter(mb, comps, lp, ent, logps, ents)
    return (logps, ents) if return_entropy else logps


def image_side_zero(core) -> torch.Tensor | float:
    """0, computed from every trainable parameter on the image side (grpo/vision/models.py's ``image_side_params``),
    for a micro-batch without images: each such parameter gets a gradient of exactly 0 instead of none, so that every
    rank of a DeepSpeed run reduces the same parameters (grpo/runtime/deepspeed.py), whether its prompts hold images
    or not (text prompts, or an idle micro-batch matching another rank's count)."""
    params = image_side_params(core)
    return sum(p.sum() for p in params) * 0.0 if params else 0.0


def _check(vlm, prompts, comps, temperature):
    """The model's multimodal core (vision tower + language model), after checking the inputs."""
    model_type = getattr(vlm.config, "model_type", None)
    if model_type in NOT_SERVED:
        raise ValueError(f"{model_type} is not served: {NOT_SERVED[model_type]}; served: {', '.join(VISION_FAMILIES)}")
    if model_type not in VISION_FAMILIES:
        raise ValueError(f"vision_token_logprobs serves {', '.join(VISION_FAMILIES)} models, not {model_type!r}")
    if len(prompts) != len(comps):
        raise ValueError(f"{len(prompts)} prompts but {len(comps)} completion groups")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    image_id, family = vlm.config.image_token_id, family_of(vlm)
    for g, p in enumerate(prompts):
        n_tokens = sum(1 for t in p.ids if t == image_id)
        expected = family.image_tokens(vlm.config, p)
        if not p.ids or n_tokens != expected:
            raise ValueError(f"group {g}: the prompt has {n_tokens} image tokens but its images make {expected}"
                             + ("" if p.ids else " (the prompt is empty)"))
    return vlm.model


def _device(vlm) -> torch.device:
    return vlm.get_input_embeddings().weight.device


# --------------------------------------------------------------------------------------------- shared layout
def _forward_shared(vlm, core, prompts, comps, temperature, want_entropy):
    device = _device(vlm)
    if not any(len(r) for cs in comps for r in cs):
        return torch.zeros(0, device=device), torch.zeros(0, device=device)
    text = language_model(core)
    image_id = vlm.config.image_token_id
    layout = build_layout([p.ids for p in prompts], comps, device,
                          bidirectional=[family_of(vlm).bidirectional(p.ids, image_id) for p in prompts])
    embeds, extra = _embeddings(vlm, core, prompts, layout)  # steps 1-2
    positions = packed_positions(core, prompts, comps, image_id).to(device)  # step 3
    with switched_attention(text, state=layout):  # step 4: the vision tower ran outside, with its own attention
        out = text(inputs_embeds=embeds, position_ids=positions, attention_mask=placeholder_mask(device),
                   use_cache=False, **extra, **{LAYOUT_KWARG: layout})
    check_every_layer(layout.calls, text)
    h = out.last_hidden_state[0].index_select(0, layout.pred_idx)  # step 5
    return head_logprobs(h, vlm.get_output_embeddings(), text.config, layout.targets, temperature, want_entropy)


def _embeddings(vlm, core, prompts, layout) -> tuple[torch.Tensor, dict]:
    """(1, T, hidden): the packed row's token embeddings (the model's own: Gemma 3's scaled by sqrt(hidden)) with
    every prompt's image features in its image tokens, and the language model's extra inputs: Qwen3-VL's deepstack
    features (the tower's intermediate features, added to the image tokens' hidden states after the first language
    layers) with the mask of their slots."""
    slots = image_slots(layout, vlm.config.image_token_id)
    ids = layout.input_ids.index_put((torch.zeros_like(slots), slots), torch.zeros_like(slots))  # overwritten below
    embeds = core.get_input_embeddings()(ids)  # (an image id past the vocabulary, as Gemma 3's may be, embeds as 0)
    with_images = [p for p in prompts if p.n_images]
    if not with_images:
        return embeds, {}
    feats, deepstack = family_of(vlm).features(core, with_images)
    extra = {}
    if deepstack:
        mask = torch.zeros_like(layout.input_ids, dtype=torch.bool)
        mask[0, slots] = True  # the model adds the features at the mask's True slots, in order: slots ascend
        extra = {"visual_pos_masks": mask, "deepstack_visual_embeds": [f.to(embeds.dtype) for f in deepstack]}
    return embeds.index_put((torch.zeros_like(slots), slots), feats.to(embeds.dtype)), extra


def image_slots(layout, image_token_id: int) -> torch.Tensor:
    """The packed row's indices of the prompts' image tokens, in order (a completion's image token is text)."""
    in_prompt = layout.segment == layout.prompt_segment
    return torch.nonzero(in_prompt & (layout.input_ids[0] == image_token_id)).squeeze(-1)


def packed_positions(core, prompts, comps, image_token_id: int) -> torch.Tensor:
    """The rotary positions of the packed row, in the order of grpo/engine/layout.py's ``_pack``: each prompt's own
    (Qwen-VL: images laid out on their grids), then every completion of its group from the same start,
    ``max(prompt positions) + 1``. (3, 1, T) for Qwen-VL's 3-D positions, (1, T) for 1-D ones."""
    parts = []
    for p, cs in zip(prompts, comps):
        pos = prompt_positions(core, p, image_token_id)
        parts.append(pos)
        start = int(pos.max()) + 1
        parts.extend(completion_positions(start, len(r), len(pos)) for r in cs)
    pos = torch.cat(parts, dim=1)
    return pos if len(pos) == 1 else pos[:, None, :]


def prompt_positions(core, prompt, image_token_id: int) -> torch.Tensor:
    """(axes, P): the prompt's positions as the model computes them (grpo/engine/vision_families.py)."""
    return family_of(core).positions(core, prompt, image_token_id)


def completion_positions(start: int, n: int, axes: int = 3) -> torch.Tensor:
    """(axes, n): a completion's text positions, from ``start`` in every axis."""
    return torch.arange(start, start + n)[None, :].expand(axes, -1)


# --------------------------------------------------------------------------------------------- standard layout
def _forward_standard(vlm, core, prompts, comps, temperature, want_entropy):
    """Right-padded rows [P; R_i], each with its own copy of its prompt's pixels, through the model's own forward
    (Idefics3: the rows' tiles padded into one batch with zero tiles, as its image processor pads a batch)."""
    device = _device(vlm)
    family = family_of(vlm)
    rows = [(p, r) for p, cs in zip(prompts, comps) for r in cs if len(r)]
    if not rows:
        return torch.zeros(0, device=device), torch.zeros(0, device=device)
    L = max(len(p.ids) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    kinds = torch.zeros(len(rows), L, dtype=torch.int)
    pred, targets = [], []
    for n, (p, r) in enumerate(rows):
        ids[n, : len(p.ids) + len(r)] = torch.tensor(p.ids + r)
        mask[n, : len(p.ids) + len(r)] = 1
        kinds[n, : len(p.ids)] = (torch.tensor(p.ids) == vlm.config.image_token_id).int()
        pred.extend(n * L + len(p.ids) - 1 + k for k in range(len(r)))
        targets.extend(r)
    with_images = [p for p, _ in rows if p.n_images]
    images = {k: v.to(device) for k, v in family.image_inputs(with_images).items()} if with_images else {}
    kinds = {family.kinds_kwarg: kinds.to(device)} if family.kinds_kwarg else {}
    out = core(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False, **kinds, **images)
    hidden = out.last_hidden_state
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, torch.tensor(pred, device=device))
    tgt = torch.tensor(targets, dtype=torch.long, device=device)
    return head_logprobs(h, vlm.get_output_embeddings(), language_model(core).config, tgt, temperature, want_entropy)
