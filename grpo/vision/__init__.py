"""Vision-language models: the tiny random ones (``tiny:qwen2_5_vl`` ...), their processor, and image prompts.

- ``models``: ``tiny:qwen2_5_vl``, ``tiny:qwen2_vl``, ``tiny:qwen3_vl``, ``tiny:qwen3_vl_moe``, ``tiny:qwen3_5``,
  ``tiny:gemma3``, ``tiny:idefics3``, ``tiny:smolvlm``: randomly initialised vision-language models (vision tower
  included) with a character tokenizer and a small image processor, built offline and deterministic in their seed;
  ``freeze_vision_tower`` (``model.freeze_vision_tower``)
- ``checkpoint``: hub or local checkpoints of the served families (``model.name_or_path=Qwen/Qwen2.5-VL-3B-Instruct``):
  the family from ``config.json`` (another multimodal one refused), its ``ForConditionalGeneration``, the processor's
  chat template, and transformers' PIL image processor checked against the config
- ``images``: images from a row (PIL, a path, bytes, ``{"bytes"|"path"}``), conversational prompts with
  ``{"type": "image"}`` parts rendered by the chat template, and :class:`ImagePrompt`, what the engine
  (grpo/engine/vision_logprobs.py) takes: the prompt's token ids with its image tokens, pixels and grids (Idefics3,
  SmolVLM2: tiles and their pixel mask)

See docs/vision-language.md.
"""
