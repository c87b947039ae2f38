"""grpo/rollout/server/facts.py: what a server must agree on with the trainer's model."""
from types import SimpleNamespace

from grpo.rollout.server.facts import MODEL_KEYS, model_facts

SIZES = dict(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128)


def test_a_text_models_facts_are_its_config_keys_and_missing_ones_are_none():
    facts = model_facts(SimpleNamespace(model_type="llama", **SIZES, rope_theta=1e4))
    assert list(facts) == list(MODEL_KEYS) and facts == {"model_type": "llama", **SIZES}
    assert model_facts(SimpleNamespace(model_type="x")) == {"model_type": "x", **{k: None for k in SIZES}}


def test_a_vision_language_model_has_its_own_type_and_its_language_models_sizes():
    text = SimpleNamespace(model_type="qwen2", **SIZES)
    config = SimpleNamespace(model_type="qwen2_vl", vocab_size=1, get_text_config=lambda: text)
    assert model_facts(config) == {"model_type": "qwen2_vl", **SIZES}
