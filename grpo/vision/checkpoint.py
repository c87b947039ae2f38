"""Hub or local checkpoints of the served vision-language families (``model.name_or_path=Qwen/Qwen2.5-VL-3B-Instruct``,
or a folder): which family a checkpoint is, and its model, tokenizer chat template and image processor.

- :func:`vision_family`: the ``model_type`` of ``config.json`` when it is a served family (grpo/models.py passes
  grpo/vision/models.py's ``TINY_VLM_FAMILIES``), None for a text model; any other multimodal model type is refused
  in one line naming the served ones, before any weight loads;
- :func:`load_vlm`: the family's ``...ForConditionalGeneration`` (``AutoModelForImageTextToText``: never the causal-LM
  class, which for Qwen3.5 is its language model alone);
- :func:`processor_chat_template`: the processor's chat template (``chat_template.jinja`` / ``.json``), which the
  tokenizer takes (a hub folder may hold an older, text-only one in ``tokenizer_config.json``);
- :func:`load_image_processor`: transformers' PIL image processor of the checkpoint (no torchvision), checked against
  the config, which the engine reads: the patch, merge and temporal sizes of Qwen-VL's tower, Gemma 3's image tokens
  per image (``mm_tokens_per_image``), and the image token's id in the tokenizer.
"""
from __future__ import annotations

import json
from pathlib import Path

from grpo.errors import ModelError


def read_config(name_or_path: str) -> dict | None:
    """``config.json`` of a local directory or a hub id (from the hub cache or the hub), or None when there is none to
    read (the loader then says why)."""
    return read_json(name_or_path, "config.json")


def read_json(name_or_path: str, filename: str) -> dict | None:
    """The JSON file ``filename`` of a local directory or a hub id, or None when it has none (or cannot be reached)."""
    file = _file(name_or_path, filename)
    if not file:
        return None
    try:
        return json.loads(Path(file).read_text())
    except ValueError as e:
        raise ModelError(f"model.name_or_path={name_or_path!r}: its {filename} is not JSON ({e})") from None


def _file(name_or_path: str, filename: str) -> str | None:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path / filename) if (path / filename).is_file() else None
    try:
        from transformers.utils import cached_file

        return cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
    except Exception:  # not a hub id, gated, offline: the loader reports it
        return None


def is_multimodal(config: dict) -> bool:
    """Whether a ``config.json`` is a vision-language model's: it has a vision tower's config, or transformers files
    its type under image-text-to-text models."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return "vision_config" in config or config.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def family_of_config(config: dict | None, name_or_path: str, served: tuple[str, ...],
                     not_served: dict[str, str]) -> str | None:
    """The family of ``config`` (a ``config.json``) when it is one of ``served``, None for a text model; one line for
    another multimodal one (with its reason from ``not_served``, where it has one)."""
    if config is None or not is_multimodal(config):
        return None
    model_type = config.get("model_type")
    if model_type in served:
        return model_type
    why = f" ({not_served[model_type]})" if model_type in not_served else ""
    raise ModelError(f"model.name_or_path={name_or_path!r} is a {model_type} vision-language model, which is not "
                     f"served{why}; served: {', '.join(served)}")


def vision_family(name_or_path: str, served: tuple[str, ...], not_served: dict[str, str]) -> str | None:
    """The vision-language family of a hub or local checkpoint among ``served``, None for a text model (see the
    module doc)."""
    return family_of_config(read_config(name_or_path), name_or_path, served, not_served)


def load_vlm(path: str, name: str, dtype, attn_implementation: str):
    """The checkpoint as its family's ``ForConditionalGeneration`` (vision tower included) in ``dtype``."""
    from transformers import AutoModelForImageTextToText

    try:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    except Exception as e:
        raise ModelError(f"model.name_or_path={name!r}: no vision-language model could be loaded "
                         f"({_first_line(e)})") from None


def processor_chat_template(path: str) -> str | None:
    """The chat template of the checkpoint's processor, the one transformers' processor renders image parts with:
    ``chat_template.jinja``, or the older ``chat_template.json`` (``{"chat_template": ...}``); None when it has
    neither."""
    for name in ("chat_template.jinja", "chat_template.json"):
        file = _file(path, name)
        if file:
            text = Path(file).read_text()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return None


def load_image_processor(path: str, name: str, config: dict, tokenizer=None):
    """transformers' PIL image processor of the checkpoint at ``path`` (its ``preprocessor_config.json``), checked
    against ``config`` (see :func:`check_image_processor`; with ``tokenizer``, its image token too)."""
    from transformers import AutoImageProcessor

    try:
        proc = AutoImageProcessor.from_pretrained(path, backend="pil")  # never torchvision's (not installed)
    except Exception as e:
        raise ModelError(f"model.name_or_path={name!r}: no image processor could be loaded ({_first_line(e)}); a "
                         "vision-language checkpoint needs its preprocessor_config.json") from None
    if "mm_tokens_per_image" in config:  # Gemma 3: the image tokens per image are the config's (the engine's count)
        want = int(config["mm_tokens_per_image"])
        said = (read_json(path, "processor_config.json") or {}).get("image_seq_length")  # Gemma3Processor's
        if said is not None and int(said) != want:
            raise ModelError(f"model.name_or_path={name!r}: processor_config.json has image_seq_length={said} but "
                             f"config.json's mm_tokens_per_image is {want}")
        proc.image_seq_length = want
    if getattr(proc, "do_pan_and_scan", None):  # Gemma 3's crops: not served (one image, one block of image tokens)
        proc.do_pan_and_scan = False
    check_image_processor(proc, config, name)
    if tokenizer is not None:
        check_image_token(tokenizer, proc, config, name)
    return proc


# image processor attribute -> the vision config's key it must equal (Qwen-VL: the tower's patching)
_PATCHING = {"patch_size": "patch_size", "merge_size": "spatial_merge_size",
             "temporal_patch_size": "temporal_patch_size"}


def check_image_processor(proc, config: dict, name: str) -> None:
    """The processor makes the images the config's tower takes: one line naming the first size that differs, and a
    processor :mod:`grpo.vision.images` does not know refused."""
    from grpo.vision.images import FORMS

    if type(proc).__name__ not in FORMS:
        raise ModelError(f"model.name_or_path={name!r}: image processor {type(proc).__name__} is not supported; "
                         f"supported: {', '.join(FORMS)}")
    vision = config.get("vision_config", {})
    for attr, key in _PATCHING.items():
        if hasattr(proc, attr) and key in vision and getattr(proc, attr) != vision[key]:
            raise ModelError(f"model.name_or_path={name!r}: preprocessor_config.json has {attr}={getattr(proc, attr)} "
                             f"but the vision tower (config.json vision_config.{key}) takes {vision[key]}")


def image_token_id(config: dict) -> int | None:
    """The id of the image token in a ``config.json`` (``image_token_id``; Gemma 3's older ``image_token_index``)."""
    value = config.get("image_token_id", config.get("image_token_index"))
    return None if value is None else int(value)


def check_image_token(tokenizer, proc, config: dict, name: str) -> None:
    """The tokenizer writes the image token :mod:`grpo.vision.images` expands as the id the model (the engine, the
    rollout) reads image features into: ``config.json``'s."""
    from grpo.vision.images import FORMS

    token = FORMS[type(proc).__name__].image_token
    ids = tokenizer.convert_tokens_to_ids(token)
    want = image_token_id(config)
    if want is not None and ids != want:
        raise ModelError(f"model.name_or_path={name!r}: the tokenizer's {token} is id {ids} but config.json's "
                         f"image_token_id is {want}; the tokenizer and the model do not belong together")


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
