"""grpo/models.py: names checked before anything loads; tiny models deterministic in their seed."""
import pytest
import torch

from grpo.errors import ModelError
from grpo.models import check_name, head_dim, tiny_model


def test_unknown_names_fail_plainly():
    check_name("tiny:llama")
    check_name("org/name")  # a hub id: checked when it loads
    with pytest.raises(ModelError, match="tiny:gpt9 is not a known family"):
        check_name("tiny:gpt9")
    with pytest.raises(ModelError, match="unknown embedded model"):
        check_name("embedded:nope")
    with pytest.raises(ModelError, match="model.name_or_path='./no/such/dir'"):
        check_name("./no/such/dir")


def test_tiny_models_are_deterministic_and_their_head_dim_known():
    a, b = tiny_model("llama", 40, seed=3), tiny_model("llama", 40, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert head_dim("tiny:llama", {"hidden_size": 64, "num_attention_heads": 4}) == 16


def test_lora_on_a_text_model_adapts_every_target_without_a_tower_exclusion(recwarn):
    """A text model has no vision tower: LoRA asks peft to exclude nothing (peft warns on an exclusion that matches
    no module), and every attention projection gets its adapter."""
    from grpo.config.schema import LoraConfig
    from grpo.models import apply_lora

    model = apply_lora(tiny_model("llama", 40, seed=0), LoraConfig(enabled=True, r=2, alpha=4))
    assert model.peft_config["default"].exclude_modules is None
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted and all(n.split(".")[-1] in {"q_proj", "k_proj", "v_proj", "o_proj"} for n in adapted)
    assert not [w for w in recwarn if "exclude_modules" in str(w.message)]
