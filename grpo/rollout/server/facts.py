"""What a server must agree on with the trainer's model, compared at connect: one rule for both sides (the
trainer's `grpo.rollout.server.backend` and the server's worker extension, `grpo.rollout.server.worker`). Imports
nothing: the worker loads it inside vLLM's process."""
from __future__ import annotations

MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size")


def model_facts(config) -> dict:
    """``MODEL_KEYS`` of a Hugging Face config: the model type of the model itself, the sizes of its language model
    (a vision-language model's text config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {k: getattr(config if k == "model_type" else text, k, None) for k in MODEL_KEYS}
