"""grpo/tiny_models.py: ``tiny:<family>`` for every family the engine serves, the same configs the engine's family
tests use, a table the hybrid families plug into, and the smoke recipe's step for every family, through the shared
layout."""
import pytest
import torch

from grpo import tiny_models
from grpo.errors import ModelError
from grpo.models import char_tokenizer, check_name, tiny_model
from grpo.tiny_models import ATTENTION_FAMILIES, families
from tests.helpers import train_cli_error

VOCAB = len(char_tokenizer())


def test_every_family_builds_a_working_model_with_the_character_tokenizers_ids():
    assert families()[:4] == ["llama", "qwen2", "qwen3", "mistral"] and len(families()) >= 28
    tok = char_tokenizer()
    ids = torch.tensor([tok("1 + 2 = 3")["input_ids"]])
    for family in families():
        model = tiny_model(family, VOCAB)
        cfg = model.config
        assert (cfg.model_type, cfg.vocab_size, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (
            family, VOCAB, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
        assert cfg._attn_implementation == ("eager" if family in tiny_models.EAGER_ONLY else "sdpa"), family
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all(), family


def test_model_tiny_overrides_win_and_a_bad_one_is_one_line():
    model = tiny_model("qwen3", VOCAB, hidden_size=32)
    assert (model.config.hidden_size, model.config.head_dim) == (32, 8)  # the head size follows the width
    assert tiny_model("qwen3_moe", VOCAB, num_experts=3).config.num_experts == 3
    with pytest.raises(ModelError, match=r"model.tiny=\{'num_attention_heads': 5\} does not make a valid llama"):
        tiny_model("llama", VOCAB, num_attention_heads=5)


def test_a_hybrid_family_plugs_into_the_table(monkeypatch):
    """An entry of HYBRID_FAMILIES (what the hybrid layers' support adds) is a tiny: family like the others."""
    monkeypatch.delitem(tiny_models.HYBRID_FAMILIES, "falcon_h1")
    with pytest.raises(ModelError, match="tiny:falcon_h1 is not a known family"):
        check_name("tiny:falcon_h1")
    monkeypatch.setitem(tiny_models.HYBRID_FAMILIES, "falcon_h1", dict(
        mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8))
    check_name("tiny:falcon_h1")
    model = tiny_model("falcon_h1", VOCAB, hidden_size=32)
    assert type(model).__name__ == "FalconH1ForCausalLM" and model.config.mamba_d_state == 8
    assert families()[-1] == "falcon_h1"


def test_an_unknown_family_is_one_line_listing_those_available(tmp_path, monkeypatch, capsys):
    code, err = train_cli_error(tmp_path, monkeypatch, capsys, "model.name_or_path=tiny:gpt9")
    err = err.strip()
    assert code != 0 and "\n" not in err and "Traceback" not in err and not (tmp_path / "run").exists()
    assert "tiny:gpt9 is not a known family; choose one of: " + ", ".join(ATTENTION_FAMILIES) in err


@pytest.mark.parametrize("family", families())
def test_the_smoke_recipe_trains_a_step_of_the_family(cfg_factory, monkeypatch, family):
    """``grpo-train recipe=smoke model.name_or_path=tiny:<family>``, in process and scaled down to one step (6 new
    tokens), for every served family: the step trains, and its log-probs came from the shared
    layout (the prefix engine's forward ran, no "standard layout" fallback was warned)."""
    import json
    import warnings
    from pathlib import Path

    from grpo.engine import logprobs
    from grpo.trainer.loop import fit

    shared = []
    forward = logprobs._forward_shared_prefix
    monkeypatch.setattr(logprobs, "_forward_shared_prefix", lambda *a, **k: shared.append(1) or forward(*a, **k))
    cfg = cfg_factory({"model": {"name_or_path": f"tiny:{family}"}, "data": {"num_eval": 0},
                       "rollout": {"max_new_tokens": 6}, "trainer": {"max_steps": 1}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fit(cfg)
    assert out["steps"] == 1
    fallbacks = [str(w.message) for w in caught if "standard layout" in str(w.message)]
    assert shared and not fallbacks, fallbacks
    rows = [json.loads(line) for line in (Path(cfg.trainer.output_dir) / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if "loss" in r][-1]
    assert step["grad_norm"] > 0 and torch.isfinite(torch.tensor(step["loss"]))


# ---- unit tests of tiny_config: the configs alone, no model built (what `make mutate` runs). Every family's config
# class is imported here, at collection (about 3 s once), so that no mutant's fork pays for transformers' lazy imports.
import transformers  # noqa: E402

from grpo.tiny_models import (  # noqa: E402
    HYBRID_FAMILIES,
    SIZES,
    WINDOW_LAYER_TYPES,
    WINDOWED,
    attention_implementation,
    tiny_config,
)

DEFAULTS = {f: transformers.AutoConfig.for_model(f) for f in families()}
LIN, FULL = "linear_attention", "full_attention"


def test_families_are_the_attention_ones_then_the_hybrid_table_and_an_unknown_one_is_a_key_error():
    assert families() == [*ATTENTION_FAMILIES, *HYBRID_FAMILIES] and len(ATTENTION_FAMILIES) == 28
    with pytest.raises(KeyError, match="gpt9"):
        tiny_config("gpt9", 10)


def test_every_attention_family_has_the_tiny_sizes_and_the_character_tokenizers_ids():
    for family in families():
        cfg = tiny_config(family, 77)
        assert (cfg.vocab_size, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (77, 0, 1, 2), family
        if family in HYBRID_FAMILIES:
            continue
        want = {**SIZES, **({"num_key_value_heads": 4} if family == "deepseek_v3" else {})}
        for key, value in want.items():
            if hasattr(DEFAULTS[family], key):
                assert getattr(cfg, key) == value, (family, key)
        if hasattr(DEFAULTS[family], "head_dim") and family != "deepseek_v3":
            assert cfg.head_dim == 16, family
    assert not hasattr(tiny_config("llama", 10), "num_experts")  # the parts only where the family has the key


def test_the_parts_of_experts_and_latent_attention_at_a_small_size():
    moe = tiny_config("qwen2_moe", 10)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size,
            moe.shared_expert_intermediate_size) == (4, 2, 16, 16)
    assert tiny_config("mixtral", 10).num_local_experts == 4
    ds = tiny_config("deepseek_v3", 10)
    assert (ds.n_routed_experts, ds.n_shared_experts, ds.n_group, ds.topk_group, ds.first_k_dense_replace) == (
        4, 1, 2, 1, 1)
    assert (ds.kv_lora_rank, ds.q_lora_rank, ds.qk_rope_head_dim, ds.qk_nope_head_dim, ds.v_head_dim) == (
        16, 24, 4, 8, 6)
    assert (ds.head_dim, ds.num_key_value_heads) == (4, 4)  # MLA: the rotary part, a K/V head per query head
    two = tiny_config("deepseek_v3", 10, num_attention_heads=2, qk_rope_head_dim=8)
    assert (two.head_dim, two.num_key_value_heads) == (8, 2)
    kimi = tiny_config("kimi_linear", 10)
    assert (kimi.head_dim, kimi.num_key_value_heads) == (8, 4)
    kimi = tiny_config("kimi_linear", 10, qk_rope_head_dim=4, num_attention_heads=2)
    assert (kimi.head_dim, kimi.num_key_value_heads) == (4, 2)


def test_the_head_size_follows_the_width_and_the_heads_given():
    assert tiny_config("qwen3", 10, hidden_size=32).head_dim == 8
    assert tiny_config("qwen3", 10, num_attention_heads=8).head_dim == 8
    assert tiny_config("qwen3", 10, head_dim=32).head_dim == 32  # an override wins
    assert tiny_config("llama", 10, num_attention_heads=2, hidden_size=96).head_dim == 48


def test_overrides_win_through_the_configs_aliases_and_reach_it_even_unknown():
    mixtral = tiny_config("mixtral", 10, num_experts=3)  # num_experts is mixtral's alias of num_local_experts
    assert mixtral.num_local_experts == 3
    assert tiny_config("mixtral", 10, num_local_experts=3).num_local_experts == 3  # the table's num_experts dropped
    cfg = tiny_config("llama", 10, my_key=5, num_hidden_layers=1, pad_token_id=3)
    assert (cfg.my_key, cfg.num_hidden_layers, cfg.pad_token_id) == (5, 1, 3)


def test_a_window_on_the_families_that_have_one():
    for family in sorted(WINDOWED):
        cfg, default = tiny_config(family, 10, window=4), DEFAULTS[family]
        assert (cfg.sliding_window, cfg.num_hidden_layers) == (4, 3), family
        if getattr(default, "layer_types", None) is not None:
            assert cfg.layer_types == WINDOW_LAYER_TYPES, family
        if hasattr(default, "use_sliding_window"):
            assert (cfg.use_sliding_window, cfg.max_window_layers) == (True, 3), family
    assert tiny_config("qwen3", 10, window=4).layer_types is not WINDOW_LAYER_TYPES  # a copy, not the table's list
    assert all(DEFAULTS[f].layer_types is not None for f in ("qwen2", "qwen3", "qwen2_moe"))  # windowed by their types
    for family in ("mistral", "mixtral", "starcoder2"):  # no layer types of their own: none given
        assert getattr(tiny_config(family, 10, window=4), "layer_types", None) is None, family
    plain = tiny_config("llama", 10, window=4)
    assert plain.num_hidden_layers == 2 and getattr(plain, "sliding_window", None) is None
    own = tiny_config("mistral", 10)
    assert own.num_hidden_layers == 2 and own.sliding_window == DEFAULTS["mistral"].sliding_window
    assert not tiny_config("qwen2", 10).use_sliding_window


def test_the_hybrid_families_table_and_their_layer_patterns_cycled():
    for family, kwargs in HYBRID_FAMILIES.items():
        cfg = tiny_config(family, 10)
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.max_position_embeddings) == (32, 48, 256), family
        for key in ("num_hidden_layers", "layer_types", "layers_block_type", "mamba_d_state", "linear_num_key_heads"):
            if key in kwargs and (family, key) != ("granitemoehybrid", "layer_types"):  # its config renames them
                assert getattr(cfg, key) == kwargs[key], (family, key)
    assert tiny_config("qwen3_5_text", 10, num_hidden_layers=5).layer_types == [LIN, FULL, LIN, LIN, FULL]
    assert tiny_config("qwen3_5_text", 10, num_hidden_layers=2).layer_types == [LIN, FULL]
    assert tiny_config("nemotron_h", 10, num_hidden_layers=2).layers_block_type == [LIN, FULL]
    mine = tiny_config("qwen3_5_text", 10, num_hidden_layers=2, layer_types=[FULL, FULL])
    assert mine.layer_types == [FULL, FULL]
    with pytest.raises(Exception, match="layer_types"):  # a pattern given is passed as it is, not cycled: refused
        tiny_config("qwen3_5_text", 10, num_hidden_layers=4, layer_types=[LIN, FULL])


def test_the_ssm_width_follows_the_hidden_size():
    assert tiny_config("bamba", 10).mamba_d_head == 16 and tiny_config("bamba", 10, hidden_size=64).mamba_d_head == 32
    with pytest.raises(Exception, match="Mamba head state do not match"):  # a head size given is kept: refused
        tiny_config("bamba", 10, hidden_size=64, mamba_d_head=8)
    assert tiny_config("granitemoehybrid", 10, hidden_size=64, mamba_n_heads=8).mamba_d_head == 16
    assert tiny_config("mamba2", 10, hidden_size=64).head_dim == 32
    assert tiny_config("mamba2", 10, hidden_size=64, expand=4).head_dim == 64
    assert tiny_config("falcon_h1", 10, hidden_size=64).mamba_d_head == 16  # not a family whose width is checked


def test_attention_implementation_of_the_eager_only_families():
    assert attention_implementation("gemma2", "sdpa") == "eager" == attention_implementation("gpt_oss", "sdpa")
    assert attention_implementation("gemma2", "flex_attention") == "flex_attention"
    assert attention_implementation("llama", "sdpa") == "sdpa"
