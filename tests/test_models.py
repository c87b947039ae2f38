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


def test_publish_folder_keeps_a_complete_folder_replaces_a_leftover_and_leaves_no_temporary(tmp_path):
    """The cache folders (the embedded model's conversion, grpo-serve's tiny models) are made through one helper:
    a folder another process completed first is kept, a half-written leftover replaced, a failed write leaves
    nothing behind."""
    import pytest

    from grpo.models import publish_folder

    complete = lambda d: (d / "config.json").exists()  # noqa: E731
    write = lambda text: lambda tmp: (tmp / "config.json").write_text(text)  # noqa: E731
    out = tmp_path / "m"
    out.mkdir()
    (out / "partial.bin").write_text("cut short")  # a leftover without its config
    publish_folder(out, write("new"), complete)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"] and (out / "config.json").read_text() == "new"
    publish_folder(out, write("other"), complete)  # complete already: kept as it is
    assert (out / "config.json").read_text() == "new"

    def fails(tmp):
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        publish_folder(tmp_path / "n", fails, complete)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
