"""Image prompts: a row's images read, its messages rendered, its image tokens expanded.

A row carries its images in a column (``images``: one image or a list), each a PIL image, a file path, raw bytes or
a ``{"bytes": ..., "path": ...}`` dict (how `datasets` stores an ``Image`` feature in Parquet). Its prompt is TRL's
conversational format: messages whose ``content`` is a list of ``{"type": "text", "text": ...}`` and
``{"type": "image"}`` parts, the images taken in order. The chat template renders one placeholder per image part;
:func:`encode` expands it into the image's tokens as the family's transformers processor does (:data:`FORMS`: Qwen's
image token once per merged patch of the image's grid; Gemma 3's begin-of-image, a fixed number of image tokens,
end-of-image; Idefics3's tiles, each tagged with its row and column, then the global image) and returns an
:class:`ImagePrompt`.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.errors import DataError

if TYPE_CHECKING:  # no torch at import: grpo/data.py imports this module, and the config checks stay light
    import torch


class ImagePrompt(list):
    """One prompt's token ids (image tokens expanded), a list like any prompt's, carrying the pixels of its images in
    order (Qwen-VL: ``(patches, channels * patch area)`` flattened patches, with their ``(t, h, w)`` patch grids;
    Gemma 3: ``(images, channels, height, width)`` at the tower's fixed size, no grid; Idefics3: ``(tiles, channels,
    height, width)``, every image's tiles then its global image, with their ``(tiles, height, width)`` pixel mask and
    each image's ``(rows, cols)`` of tiles in ``tiles``, ``(0, 0)`` for an image not split).
    Everything that handles token lists handles it; the engine and the rollout read its images. ``images``: the
    RGB images themselves (PIL), what a vLLM rollout sends (vLLM runs its own processor on them)."""

    def __init__(self, ids, pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                 images: list | None = None, pixel_attention_mask: torch.Tensor | None = None,
                 tiles: torch.Tensor | None = None):
        super().__init__(ids)
        self.pixel_values, self.image_grid_thw, self.images = pixel_values, image_grid_thw, images
        self.pixel_attention_mask, self.tiles = pixel_attention_mask, tiles

    @property
    def ids(self) -> list[int]:
        return list(self)

    def _n_images(self) -> int:
        if self.image_grid_thw is not None:  # Qwen's patches: one grid per image
            return len(self.image_grid_thw)
        if self.tiles is not None:  # Idefics3's tiles: one (rows, cols) per image
            return len(self.tiles)
        return 0 if self.pixel_values is None else len(self.pixel_values)  # one (C, H, W) per image

    # a property by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
    n_images = property(_n_images)

    def __reduce__(self):  # pickled with its images (checkpoints of in-flight batches, spawned generators)
        return type(self), (list(self), self.pixel_values, self.image_grid_thw, self.images,
                            self.pixel_attention_mask, self.tiles)


def load_image(value, where: str = "data row"):
    """A PIL RGB image from a PIL image, a path, bytes, or a ``{"bytes", "path"}`` dict; one clear line otherwise."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, Image.Image):
            img = value
        elif isinstance(value, (bytes, bytearray)):
            img = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, Path)):
            if not Path(value).is_file():
                raise DataError(f"{where}: image file {str(value)!r} not found")
            img = Image.open(value)
        else:
            raise DataError(f"{where}: an image must be a PIL image, a path, bytes or {{'bytes', 'path'}}; "
                            f"got {type(value).__name__}")
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{where}: unreadable image ({str(e).splitlines()[0][:120]})") from None


def image_parts(messages: list[dict]) -> int:
    """How many ``{"type": "image"}`` parts the messages hold."""
    return sum(1 for m in messages if not isinstance(m["content"], str)
               for part in m["content"] if part.get("type") == "image")


@dataclass(frozen=True)
class ImageForm:
    """How a family's processor writes an image into the prompt text: the chat template renders ``placeholder`` once
    per image, which becomes ``before + image_token * n + after`` (n: the image's number of tokens). ``kwargs``: what
    the image processor is called with besides the images."""

    placeholder: str
    image_token: str
    before: str = ""
    after: str = ""
    kwargs: tuple = ()

    def tokens(self, image_processor, out) -> list[int]:
        """The number of image tokens of every image the processor returned in ``out``: Qwen's merged patches of
        its grid, or the fixed count of a fixed-size tower (Gemma 3's ``image_seq_length``)."""
        if "image_grid_thw" in out:
            return [int(g.prod()) // image_processor.merge_size ** 2 for g in out["image_grid_thw"]]
        return [image_processor.image_seq_length] * len(out["pixel_values"])

    def strings(self, image_processor, out) -> list[str]:
        """What every image's placeholder becomes, in order."""
        return [self.before + self.image_token * n + self.after for n in self.tokens(image_processor, out)]

    def fields(self, out) -> dict:
        """The :class:`ImagePrompt` fields of the processor's output ``out``."""
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out.get("image_grid_thw")}


@dataclass(frozen=True)
class TiledForm(ImageForm):
    """Idefics3's (SmolVLM's, SmolVLM2's): a picture split into rows x columns of tiles plus its global image. The
    placeholder becomes, as Idefics3Processor writes it, every tile's ``<fake_token_around_image><row_r_col_c>`` and
    image tokens (a newline after each row), then a newline, ``<fake_token_around_image><global-img>``, the global
    image's tokens and ``<fake_token_around_image>``; an image not split (0 rows) is its global image alone, without
    the newlines. The processor is asked for the rows and columns; ``image_seq_len`` (Idefics3Processor's) is the
    tokens per tile."""

    def strings(self, image_processor, out) -> list[str]:
        return [self.image(image_processor.image_seq_len, rows, cols) for rows, cols in zip(out["rows"][0],
                                                                                         out["cols"][0])]

    def image(self, seq_len: int, rows: int, cols: int) -> str:
        """One image's text: its ``rows`` x ``cols`` tiles of ``seq_len`` image tokens each, then its global image."""
        tile, around = self.image_token * seq_len, self.before
        whole = f"{around}<global-img>{tile}{around}"
        if rows == 0:
            return whole
        grid = "".join("".join(f"{around}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return grid + "\n" + whole

    def fields(self, out) -> dict:
        """One prompt's images are one sample of the processor's batch: its tiles, none of them padding."""
        import torch

        tiles = torch.tensor(list(zip(out["rows"][0], out["cols"][0])), dtype=torch.long)
        return {"pixel_values": out["pixel_values"][0], "pixel_attention_mask": out["pixel_attention_mask"][0],
                "tiles": tiles}


_QWEN = ImageForm("<|image_pad|>", "<|image_pad|>")
# Gemma3Processor's full_image_sequence: "\n\n<start_of_image>" + image tokens + "<end_of_image>\n\n"; pan-and-scan off
_GEMMA3 = ImageForm("<start_of_image>", "<image_soft_token>", before="\n\n<start_of_image>",
                    after="<end_of_image>\n\n")
_IDEFICS3 = TiledForm("<image>", "<image>", before="<fake_token_around_image>",
                      kwargs=(("return_row_col_info", True),))
# image processor class -> how its images go into the prompt
FORMS = {"Qwen2VLImageProcessorPil": _QWEN, "Qwen2VLImageProcessor": _QWEN,
         "Gemma3ImageProcessorPil": _GEMMA3, "Gemma3ImageProcessor": _GEMMA3,
         "Idefics3ImageProcessorPil": _IDEFICS3, "Idefics3ImageProcessor": _IDEFICS3,
         "SmolVLMImageProcessorPil": _IDEFICS3, "SmolVLMImageProcessor": _IDEFICS3}


def encode(messages: list[dict], images: list, tokenizer, image_processor, where: str = "data row") -> ImagePrompt:
    """Render ``messages`` with the tokenizer's chat template (generation prompt added) and tokenize them, with
    ``images`` (one per image part, in order) through ``image_processor``."""
    images = [load_image(x, where) for x in images]
    if image_parts(messages) != len(images):
        raise DataError(f"{where}: the prompt has {image_parts(messages)} image part(s) but the row has "
                        f"{len(images)} image(s); give one image per {{'type': 'image'}} part")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    fields = {}
    if images:
        form = FORMS.get(type(image_processor).__name__)
        if form is None:
            raise DataError(f"image processor {type(image_processor).__name__} is not supported; supported: "
                            + ", ".join(FORMS))
        out = image_processor(images=images, return_tensors="pt", **dict(form.kwargs))
        fields = form.fields(out)
        pieces = text.split(form.placeholder)
        if len(pieces) != len(images) + 1:
            raise DataError(f"{where}: the chat template rendered {len(pieces) - 1} image placeholder(s) for "
                            f"{len(images)} image(s); the model's template must place one {form.placeholder} per "
                            "image")
        text = pieces[0] + "".join(s + rest for s, rest in zip(form.strings(image_processor, out), pieces[1:]))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ImagePrompt(ids=ids, images=images or None, **fields)


def asks_for_images(prompt) -> int:
    """How many images a row's prompt (a string, or messages) places: ``{"type": "image"}`` parts and ``<image>``
    markers."""
    if isinstance(prompt, str):
        return prompt.count("<image>")
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(m, dict) and "content" in m for m in prompt):
        return 0
    return image_parts(as_parts(list(prompt)))


def as_parts(messages: list[dict]) -> list[dict]:
    """Messages with verl's ``<image>`` markers in text content turned into TRL's ``{"type": "image"}`` parts (content
    already in parts is kept)."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, str) and "<image>" in content:
            pieces = content.split("<image>")
            parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
            for rest in pieces[1:]:
                parts.append({"type": "image"})
                if rest:
                    parts.append({"type": "text", "text": rest})
            content = parts
        out.append({**m, "content": content})
    return out


def encode_row(row: dict, prompt_column: str, image_column: str, tokenizer, image_processor,
               where: str = "data row") -> ImagePrompt:
    """A dataset row's :class:`ImagePrompt`: its messages (TRL parts, or verl's ``<image>`` markers) and the images
    in ``image_column`` (one image or a list)."""
    if image_column not in row:
        raise DataError(f"{where} has no image column {image_column!r}; its columns are: {', '.join(map(str, row))}")
    messages = row[prompt_column]
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    images = row[image_column]
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    messages = as_parts(messages)
    if images and image_parts(messages) == 0:  # a plain-text prompt: its images first
        messages = images_first(messages, len(images))
    return encode(messages, images, tokenizer, image_processor, where)


def images_first(messages: list[dict], n: int) -> list[dict]:
    """A prompt that places no image (plain text): its ``n`` images go before the first user turn's text, as TRL
    places them."""
    out, placed = [], False
    for m in messages:
        if m["role"] == "user" and not placed:
            text = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            m, placed = {**m, "content": [{"type": "image"}] * n + text}, True
        out.append(m)
    return out


def image_row(row: dict, dcfg, tokenizer, image_processor, where: str = "data row") -> dict:
    """A dataset row whose ``data.image_column`` holds images, prepared as grpo/data.py prepares a text row: its
    columns, ``prompt`` (the rendered text, one placeholder per image), ``prompt_messages`` and ``prompt_ids`` (an
    :class:`ImagePrompt`). A model without an image processor (a text model) is refused."""
    if image_processor is None:
        raise DataError(f"{where} has images in data.image_column={dcfg.image_column!r} but the model is a text model "
                        "(no image processor); use a vision-language model such as tiny:qwen2_5_vl, or drop the column")
    messages = row[dcfg.prompt_column]
    messages = as_parts([{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages))
    images = row[dcfg.image_column]
    if image_parts(messages) == 0:  # a plain-text prompt: its images first
        messages = images_first(messages, len(images) if isinstance(images, (list, tuple)) else 1)
    if dcfg.system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": dcfg.system_prompt}, *messages]
    prompt = encode_row({**row, dcfg.prompt_column: messages}, dcfg.prompt_column, dcfg.image_column, tokenizer,
                        image_processor, where)
    cols = {k: v for k, v in row.items() if k != dcfg.prompt_column}
    if dcfg.answer_column in row and dcfg.answer_column != "answer":
        cols["answer"] = row[dcfg.answer_column]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {**cols, "prompt": text, "prompt_messages": messages, "prompt_ids": prompt}
