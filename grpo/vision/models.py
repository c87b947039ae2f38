"""``tiny:qwen2_5_vl``, ``tiny:qwen2_vl``, ``tiny:qwen3_vl``, ``tiny:qwen3_vl_moe``, ``tiny:qwen3_5``, ``tiny:gemma3``,
``tiny:idefics3``, ``tiny:smolvlm``: tiny random vision-language models and their processor, with no download.

The language model has the shapes of ``tiny:qwen2`` (grpo/models.py: hidden 64, 2 layers, 4 heads) with
3-D multimodal rotary positions (``mrope_section`` [2, 3, 3] of the 8 rotary frequencies, interleaved for Qwen3-VL
and Qwen3.5; Qwen3.5's layers alternate Gated DeltaNet and attention); the vision tower is 2 blocks of width 32 on
4x4 patches merged 2x2, so a 32x32 image is 16 image tokens, in each family's own tower (Qwen2-VL: full attention in
every block; Qwen2.5-VL: windowed blocks and one full one; Qwen3-VL: learned position embeddings and deepstack
features from block 0, and its mixture-of-experts form, 4 experts of which 2 per token; Qwen3.5: Qwen3-VL's without
deepstack). The tokenizer is the character tokenizer of the text
tiny models plus Qwen's vision tokens. grpo/models.py builds both; this module imports nothing of it.

``tiny:gemma3`` (Gemma3ForConditionalGeneration): the same language model widths in Gemma 3's form (its scaled
embeddings, q/k norms, ``query_pre_attn_scalar`` 24 for heads of 16, a sliding-window layer of 8 tokens then a
global one with its own linearly scaled rotary base, as Gemma 3's 4B and larger), a 2-block SigLIP tower on 32x32
images in 4x4 patches, pooled 2x2 by the multi-modal projector into 16 image tokens (its projection seeded, not
Gemma's zeros, so images matter), Gemma 3's image tokens (``<start_of_image>``, ``<image_soft_token>``,
``<end_of_image>``) and Gemma 3's image processor at 32x32 (pan-and-scan off).

``tiny:idefics3`` (Idefics3ForConditionalGeneration, the SmolVLM architecture): the same widths in Llama's form (the
language model Idefics3 builds by default), a 2-block SigLIP-style tower on 16x16 tiles in 4x4 patches, the
connector's pixel shuffle with scale factor 2 (a tile is 4 image tokens), Idefics3's tokens
(``<fake_token_around_image>``, ``<image>``, ``<global-img>``, ``<row_i_col_j>``, ``<end_of_utterance>``) and its
image processor with image splitting on: a picture is resized to 32 pixels on its longest edge, then to whole tiles,
and split into its rows x columns of 16x16 tiles plus the global image (a square picture 2x2 + 1 = 5 tiles, 20
image tokens; a 40x16 one 1x2 + 1 = 3). ``tiny:smolvlm`` is the same in SmolVLM2's classes
(SmolVLMForConditionalGeneration and its image processor), whose architecture is Idefics3's.
"""
from __future__ import annotations

import torch

from grpo.errors import ModelError
from grpo.tiny_models import HYBRID_FAMILIES

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
GEMMA3_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
# Idefics3Processor's tokens: around each tile, the image token, the global image's tag, the tiles' row/column tags
IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                   *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)))
TINY_VLM_FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "gemma3", "idefics3", "smolvlm")
# Idefics3 and SmolVLM2 (model type smolvlm: the same architecture in classes of its own): config, model, processor
_TILED = {"idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration", "idefics3", "Idefics3ImageProcessorPil"),
          "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration", "smolvlm", "SmolVLMImageProcessorPil")}
# vision-language families of transformers not served (yet), and why: refused in one line, not computed inexactly
NOT_SERVED = {
    "lfm2_vl": "its NaViT tower takes pixel masks and spatial shapes, which image prompts (Qwen's patches) lack",
}


def _template(image: str) -> str:  # pragma: no mutate block (it runs once, at import, before a mutant is chosen)
    """The prompt as the chat template renders it, ``image`` for an image part (the processor expands it:
    grpo/vision/images.py)."""
    return ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' %}" + image +
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


# Qwen: <|vision_start|><|image_pad|><|vision_end|>, <|image_pad|> repeated once per image token
CHAT_TEMPLATE = _template("<|vision_start|><|image_pad|><|vision_end|>")
# Gemma 3: <start_of_image>, expanded into "\n\n<start_of_image>", the image tokens, "<end_of_image>\n\n"
GEMMA3_CHAT_TEMPLATE = _template("<start_of_image>")
GEMMA3_IMAGE = dict(image_size=32, patch_size=4, mm_tokens_per_image=16)
# Idefics3: the image part renders <image>, which the processor expands into the tiles' tokens and the global image's
IDEFICS3_CHAT_TEMPLATE = _template("<image>")
# a picture resized to 32 on its longest edge, split into 16x16 tiles (the tower's image size) + the global image;
# 4x4 patches shuffled 2x2 into 4 image tokens a tile
IDEFICS3_IMAGE = dict(longest_edge=32, tile=16, patch_size=4, scale_factor=2)

_PATCHES = dict(patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
# family -> (config class, model class, vision config kwargs; the tower's output width is the language model's)
_FAMILIES = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                   dict(_PATCHES, depth=2, hidden_size=32, intermediate_size=64, num_heads=2, window_size=16,
                        fullatt_block_indexes=[1])),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 dict(_PATCHES, depth=2, embed_dim=32, mlp_ratio=2, num_heads=2)),
    # deepstack: the features after tower block 0 are added to the image tokens after language layer 0
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 dict(_PATCHES, depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                     dict(_PATCHES, depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                          num_position_embeddings=64, deepstack_visual_indexes=[0])),
    # Qwen3.5: Qwen3-VL's tower without deepstack, a hybrid language model (Gated DeltaNet and attention layers)
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
                dict(_PATCHES, depth=2, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=64)),
}
_OUT_WIDTH = {f: "hidden_size" if f == "qwen2_vl" else "out_hidden_size" for f in _FAMILIES}
_INTERLEAVED = {"qwen3_vl", "qwen3_vl_moe", "qwen3_5"}  # (t, h, w) frequencies interleaved, not in three blocks
_EXPLICIT_HEAD_DIM = _INTERLEAVED  # configs whose head size is a key of its own
_MOE_TEXT = {"qwen3_vl_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)}
# the language model's recurrent layers at a tiny size (grpo/tiny_models.py's qwen3_5_text), attention every 2nd
_HYBRID_TEXT = {"qwen3_5": "qwen3_5_text"}


def with_vision_tokens(tok, family: str = "qwen2_5_vl"):
    """``tok`` (grpo/models.py's character tokenizer) with the family's vision tokens and chat template (Qwen's,
    Gemma 3's or Idefics3's)."""
    forms = {"gemma3": (GEMMA3_TOKENS, GEMMA3_CHAT_TEMPLATE),
             **dict.fromkeys(_TILED, (IDEFICS3_TOKENS, IDEFICS3_CHAT_TEMPLATE))}
    tokens, template = forms.get(family, (VISION_TOKENS, CHAT_TEMPLATE))
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    tok.chat_template = template
    return tok


def image_processor(family: str = "qwen2_5_vl", min_pixels: int = 16 * 16, max_pixels: int = 64 * 64):
    """The family's image processor (a PIL one: no torchvision needed) at the tiny tower's sizes. Qwen2-VL's
    resizes an image to a multiple of 8 pixels a side with between ``min_pixels`` and ``max_pixels`` pixels;
    Gemma 3's to 32x32, with ``image_seq_length`` (Gemma3Processor's: the image tokens per image) set; Idefics3's
    splits a picture into 16x16 tiles and the global image, with ``image_seq_len`` (Idefics3Processor's: the image
    tokens per tile) set."""
    if family in _TILED:
        import importlib

        _, _, module, cls = _TILED[family]
        pil = getattr(importlib.import_module(f"transformers.models.{module}.image_processing_pil_{module}"), cls)
        v = IDEFICS3_IMAGE
        proc = pil(size={"longest_edge": v["longest_edge"]}, max_image_size={"longest_edge": v["tile"]},
                   do_image_splitting=True)
        proc.image_seq_len = (v["tile"] // v["patch_size"]) ** 2 // v["scale_factor"] ** 2
        return proc
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        side = GEMMA3_IMAGE["image_size"]
        proc = Gemma3ImageProcessorPil(size={"height": side, "width": side}, do_pan_and_scan=False)
        proc.image_seq_length = GEMMA3_IMAGE["mm_tokens_per_image"]
        return proc
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    v = _PATCHES
    return Qwen2VLImageProcessorPil(patch_size=v["patch_size"], merge_size=v["spatial_merge_size"],
                                    temporal_patch_size=v["temporal_patch_size"], min_pixels=min_pixels,
                                    max_pixels=max_pixels)


def tiny_vlm(family: str, tokenizer, text: dict, seed: int = 0):
    """A randomly initialised vision-language model of ``family`` (deterministic in ``seed``) whose language model
    has the config ``text`` (what grpo/models.py gives a text tiny model) and whose vision tokens are ``tokenizer``'s
    (made by :func:`with_vision_tokens`)."""
    import transformers

    if family not in TINY_VLM_FAMILIES:
        raise ModelError(f"tiny:{family} is not a vision-language family; choose one of: "
                         + ", ".join(TINY_VLM_FAMILIES))
    if family == "gemma3":
        return _tiny_gemma3(tokenizer, text, seed)
    if family in _TILED:
        return _tiny_tiled(family, tokenizer, text, seed)
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(t)
           for name, t in zip(("vision_start", "image", "vision_end", "video"), VISION_TOKENS)}
    text = dict(text)
    half = text["hidden_size"] // text["num_attention_heads"] // 2  # rotary frequencies, split over (t, h, w)
    hw = half * 3 // 8  # as Qwen2.5-VL's [16, 24, 24] of 64
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * hw, hw, hw],
                               **({"mrope_interleaved": True} if family in _INTERLEAVED else {})}
    if family in _EXPLICIT_HEAD_DIM:
        text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
    text = {**_MOE_TEXT.get(family, {}), **text}
    if family in _HYBRID_TEXT:
        own = {k: v for k, v in HYBRID_FAMILIES[_HYBRID_TEXT[family]].items() if k.startswith("linear_")}
        text = {**own, **text}
        text.setdefault("layer_types", [("linear_attention", "full_attention")[i % 2]
                                        for i in range(text["num_hidden_layers"])])
    config_cls, model_cls, vision = _FAMILIES[family]
    vision = {**vision, _OUT_WIDTH[family]: text["hidden_size"]}
    return _seeded(family, text, seed, lambda: getattr(transformers, model_cls)(
        getattr(transformers, config_cls)(text_config=text, vision_config=vision, **ids)))


def _seeded(family: str, text: dict, seed: int, build):
    """``build()`` with torch's generator seeded by ``seed`` (and left as it was after), a config it refuses
    (transformers' ValueError or TypeError, or the validation error of its checked configs) as one line naming
    ``model.tiny``."""
    from huggingface_hub.errors import StrictDataclassError  # what a checked config raises (not a ValueError)

    try:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return build()
    except (ValueError, TypeError, StrictDataclassError) as e:
        raise ModelError(f"model.tiny={text} does not make a valid {family} model: {_reason(e)}") from None


def _reason(e: Exception) -> str:
    """The line of a refused config's error that says why: the wrapped error's (``ValueError: ...``) where a
    validation error wraps one, else its first line."""
    lines = str(e).strip().splitlines()
    return next((ln.split("Error: ", 1)[1] for ln in lines if "Error: " in ln), lines[0][:200] if lines else
                type(e).__name__)


def _tiny_gemma3(tokenizer, text: dict, seed: int):
    """Gemma3ForConditionalGeneration with the language model ``text`` in Gemma 3's form (see the module doc)."""
    import transformers

    ids = {f"{name}_token_index": tokenizer.convert_tokens_to_ids(t)
           for name, t in zip(("boi", "image", "eoi"), GEMMA3_TOKENS)}
    text = {"head_dim": text["hidden_size"] // text["num_attention_heads"], "query_pre_attn_scalar": 24,
            "sliding_window": 8, "layer_types": [("sliding_attention", "full_attention")[i % 2]
                                                 for i in range(text["num_hidden_layers"])],
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
            **text}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=GEMMA3_IMAGE["image_size"], patch_size=GEMMA3_IMAGE["patch_size"])
    def build():
        model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
            text_config=text, vision_config=vision, tie_word_embeddings=False,
            mm_tokens_per_image=GEMMA3_IMAGE["mm_tokens_per_image"], **ids))
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.05)
        return model

    return _seeded("gemma3", text, seed, build)


def _tiny_tiled(family: str, tokenizer, text: dict, seed: int):
    """Idefics3ForConditionalGeneration (or SmolVLM2's same architecture) with a Llama language model ``text`` (see
    the module doc)."""
    import transformers

    config_cls, model_cls, _, _ = _TILED[family]
    v = IDEFICS3_IMAGE
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=v["tile"], patch_size=v["patch_size"])
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    return _seeded(family, text, seed, lambda: getattr(transformers, model_cls)(getattr(transformers, config_cls)(
        text_config={"model_type": "llama", **text}, vision_config=vision, scale_factor=v["scale_factor"],
        tie_word_embeddings=False, image_token_id=image_token_id)))


# the core's attribute holding the vision tower: Qwen-VL's, Gemma 3's, Idefics3's
TOWERS = ("visual", "vision_tower", "vision_model")


def vision_tower(model):
    """The vision tower of a vision-language model (``model.model.visual`` / ``.vision_tower`` / ``.vision_model``),
    or None."""
    core = getattr(model, "model", None)
    return next((getattr(core, a) for a in TOWERS if getattr(core, a, None) is not None), None)


def freeze_vision_tower(model, name: str = "the model") -> None:
    """``model.freeze_vision_tower``: the vision tower's parameters get no gradient (the optimizer skips them).
    Gemma 3's multi-modal projector (pooling, norm, projection) is not part of its tower: it still trains."""
    tower = vision_tower(model)
    if tower is None:
        raise ModelError(f"model.freeze_vision_tower=true but {name} has no vision tower (a text model); "
                         "set model.freeze_vision_tower=false")
    tower.requires_grad_(False)


def image_side_params(model) -> list:
    """The trainable parameters on the image side of a vision-language model (or of its core ``model.model``), taken
    out of its wrappers (grpo/engine/unwrap.py): those of the core's modules other than the one holding the token
    embeddings (the vision tower, and a projector or connector outside it). ``[]`` for a text model, a frozen tower,
    or LoRA on the language model."""
    has_tower = lambda m: any(getattr(m, a, None) is not None for a in TOWERS)  # noqa: E731
    core = model if has_tower(model) else getattr(model, "model", None)
    if core is None or not has_tower(core):
        return []
    embeddings = core.get_input_embeddings()
    return [p for m in core.children() if all(e is not embeddings for e in m.modules())
            for p in m.parameters() if p.requires_grad]

