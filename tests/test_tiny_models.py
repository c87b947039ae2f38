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
