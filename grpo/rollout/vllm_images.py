"""Prompts with images for the vLLM backends (in-process and ``grpo-serve``): what vLLM takes in place of our
:class:`grpo.vision.images.ImagePrompt`.

vLLM takes a prompt's token ids with ONE image placeholder per image and the image inputs (``multi_modal_data``), and
expands each placeholder into as many image tokens as the image's grid makes. An ImagePrompt holds the expanded ids,
its pixels and grids, so for each prompt:

1. each run of image tokens is collapsed back to one placeholder (`placeholder_ids`);
2. the images go in vLLM's embedding form, ``{"image_embeds", "image_grid_thw"}``: the features of the trainer's own
   vision tower, run once per prompt on the pixels the trainer scores (`vllm_prompt`). Why not the pixels: vLLM
   0.32's CPU Qwen2.5-VL tower gives other features than transformers' from the same weights and pixels (0.15 apart
   on features of size 0.09, tests/rollout/test_vllm_vision.py), so vLLM would sample from another distribution
   than the one the trainer computes;
3. vLLM's engine dir holds the model's tokenizer and image processor (`save_processor`), which its input processing
   loads, and the prompt vLLM ran is compared with ours after generation (`check_expanded`), one line when not.
"""
from __future__ import annotations

VLLM_VISION_FAMILIES = ("qwen2_5_vl",)  # the vision-language model_types vLLM is tested with here (tests/rollout/)
MAX_IMAGES_PER_PROMPT = 8          # vLLM's limit_mm_per_prompt for images (videos: 0)


def placeholder_ids(ids: list[int], image_token_id: int) -> list[int]:
    """``ids`` with every run of ``image_token_id`` (one image's tokens) collapsed to one token."""
    out: list[int] = []
    for t in ids:
        if not (t == image_token_id and out and out[-1] == image_token_id):
            out.append(t)
    return out


def vllm_prompt(prompt, image_token_id: int | None, image_features) -> dict:
    """A vLLM prompt (``TokensPrompt``'s keys) for ``prompt``: its ids, and for an ImagePrompt with images the
    collapsed ids and its images' features (``image_features(pixel_values, image_grid_thw)``: the trainer's tower)."""
    if not getattr(prompt, "n_images", 0) or image_token_id is None:
        return {"prompt_token_ids": list(prompt)}
    feats = image_features(prompt.pixel_values, prompt.image_grid_thw)
    return {"prompt_token_ids": placeholder_ids(list(prompt), image_token_id),
            "multi_modal_data": {"image": {"image_embeds": feats, "image_grid_thw": prompt.image_grid_thw}}}


def tower_features(model):
    """``(pixel_values, image_grid_thw) -> (image tokens, hidden)``: ``model``'s vision tower and merger (a
    transformers vision-language model, or a peft / DeepSpeed wrapper of one), without grad."""
    import torch

    from grpo.engine.unwrap import unwrap_model

    core = unwrap_model(model).model

    @torch.no_grad()
    def features(pixel_values, grid):
        device = core.get_input_embeddings().weight.device
        out = core.get_image_features(pixel_values.to(device), grid.to(device), return_dict=True).pooler_output
        return torch.cat(list(out)).float().cpu()

    features.model = model  # whose tower it is
    return features


def check_expanded(ran: list[int], prompt) -> None:
    """vLLM's prompt (``ran``, its expansion of the placeholders) must be the trainer's ``prompt``."""
    if list(ran) != list(prompt):
        raise ValueError(f"vLLM expanded the prompt's images into {len(ran)} tokens, the trainer's processor into "
                         f"{len(prompt)}: the two image processors disagree (vLLM loads the one saved with the model)")


def save_processor(path: str, tokenizer, image_processor) -> None:
    """The tokenizer and image processor vLLM's multimodal processor loads from the engine dir ``path``."""
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)
