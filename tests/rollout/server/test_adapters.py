"""LoRA adapters on the servers (`grpo.rollout.server.adapters`) without vLLM: grpo-serve's LoRA flags from the run's
settings, and what a server's LoRA settings make the trainer refuse (one line) or merge (said once). The adapters
going into a real grpo-serve: tests/e2e/test_server_lora.py (make test-vllm)."""
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from grpo.config.schema import load
from grpo.errors import SetupError
from grpo.models import char_tokenizer, tiny_model
from grpo.rollout.server.adapters import refusal
from grpo.rollout.server.launch import serve_command
from grpo.serve import settings
from tests.helpers import compose_recipe
from tests.rollout.server.test_backend import TINY, _backend

SERVER = SimpleNamespace(url="http://h:1")


def _cfg(*overrides):
    raw = compose_recipe("smoke", ["trainer.output_dir=unused", "model.lora.enabled=true", "model.lora.r=12",
                                   *overrides])
    return load(OmegaConf.to_container(raw, resolve=True))


def test_grpo_serve_enables_lora_for_a_run_that_syncs_adapters(tmp_path):
    argv, env = serve_command(settings(_cfg("rollout.max_staleness=2"), "cpu"), tmp_path)
    assert argv[argv.index("--enable-lora"):][:5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "3"]
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    for merged in (["rollout.vllm.lora_sync=merged"], ["model.lora.target_modules=[q_proj,lm_head]"],
                   ["model.lora.enabled=false"]):
        argv, env = serve_command(settings(_cfg(*merged), "cpu"), tmp_path)
        assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env, merged


@pytest.mark.parametrize("info, expect", [
    ({"max_lora_rank": 0}, "was started without LoRA (--enable-lora)"),
    ({"max_lora_rank": 8, "max_loras": 3}, "serves LoRA ranks up to 8 (--max-lora-rank), model.lora.r=12"),
    ({"max_lora_rank": 16, "max_loras": 1}, "holds 1 adapters (--max-loras), the run keeps 3 versions"),
])
def test_a_server_that_cannot_hold_the_adapters_is_named_with_what_to_do(info, expect):
    why = refusal(SERVER, info, rank=12, keep=3)
    assert why.startswith("rollout server http://h:1 ") and expect in why and "restart it with grpo-serve" in why
    assert refusal(SERVER, {"max_lora_rank": 16, "max_loras": 3}, rank=12, keep=3) is None


def test_a_server_without_lora_is_refused_with_adapters_and_gets_merged_weights_with_auto(fakes, capsys):
    from grpo.config.schema import LoraConfig
    from grpo.models import apply_lora

    model = apply_lora(tiny_model("llama", len(char_tokenizer()), seed=0, **TINY), LoraConfig(enabled=True, r=4))
    server = fakes(model=tiny_model("llama", len(char_tokenizer()), seed=0, **TINY))
    with pytest.raises(SetupError, match=r"^rollout\.vllm\.lora_sync=adapters: rollout server .* was started without "
                                         r"LoRA \(--enable-lora\); restart it with grpo-serve"):
        _backend(model, [server], lora_sync="adapters")
    backend = _backend(model, [server], lora_sync="auto")
    assert backend.adapters is None
    backend.sync_weights(model, 0)
    n = sum(t.numel() * t.element_size() for k, t in model.get_base_model().state_dict().items() if ".lora_" not in k)
    assert backend.stats()["sync/bytes"] == n and backend.stats()["sync/adapters"] == 0.0
    assert "the merged weights go to the rollout servers" in capsys.readouterr().err
    backend.close()
