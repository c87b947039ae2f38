"""LoRA adapters on the servers (`grpo.rollout.server.adapters`) without vLLM: grpo-serve's LoRA flags from the run's
settings, and what a server's LoRA settings make the trainer refuse (one line) or merge (said once). The adapters
going into a real grpo-serve: tests/e2e/test_server_lora.py (make test-vllm)."""
import json
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


# `connect_adapters` and `ServerAdapters.push` with stand-ins for the LoRA model, the servers and the weight channel
# (the test above runs them with a real server)
class _Server(SimpleNamespace):
    def post(self, path, body):
        self.log.append((self.url, path, body))


def _connect(monkeypatch, mode="auto", infos=None, gloo=True, syncs=True, rank=12):
    from grpo.rollout.server import adapters as ad

    asked, said = [], []
    monkeypatch.setattr(ad, "choose", lambda m, model, say=None: asked.append((m, model, say)) or syncs)
    monkeypatch.setattr(ad, "active_adapter", lambda model: ("default", SimpleNamespace(r=rank if model == "MODEL"
                                                                                    else None)))
    monkeypatch.setattr(ad, "served_rank", lambda r: asked.append(("rank", r)))
    servers = [SimpleNamespace(url="http://a:1"), SimpleNamespace(url="http://b:2")]
    infos = infos or [{"max_lora_rank": 16, "max_loras": 3, "lora_dir": "/da"},
                      {"max_lora_rank": 32, "max_loras": 4, "lora_dir": "/db"}]
    out = ad.connect_adapters("MODEL", servers, infos, mode, keep=3, gloo=gloo, say=said.append)
    return out, asked, said


def test_connect_holds_each_servers_folder_when_every_server_can_hold_the_adapters(monkeypatch):
    out, asked, said = _connect(monkeypatch)
    assert asked[0][:2] == ("auto", "MODEL") and asked[0][2] is not None and asked[1] == ("rank", 12)
    assert out.keep == 3 and out.dirs == {"http://a:1": "/da", "http://b:2": "/db"} and said == []
    assert out.base_loaded is False and out.resident == []
    out, asked, said = _connect(monkeypatch, mode="merged", syncs=False)  # merged weights: nothing asked further
    assert out is None and [a[0] for a in asked] == ["merged"] and said == []


def test_connect_falls_back_on_merged_weights_naming_the_server_or_the_channel(monkeypatch):
    infos = [{"max_lora_rank": 16, "max_loras": 3}, {"max_lora_rank": 8, "max_loras": 4}]
    out, _, said = _connect(monkeypatch, infos=infos)
    assert out is None and len(said) == 1
    assert said[0].startswith("LoRA: the merged weights go to the rollout servers at every sync, not the adapters: ")
    assert "http://b:2 serves LoRA ranks up to 8" in said[0]
    out, _, said = _connect(monkeypatch, gloo=False)
    assert out is None and said[0].endswith("the adapters go through the gloo weight channel "
                                            "(rollout.server.weight_transfer=gloo)")
    with pytest.raises(SetupError, match=r"^rollout\.vllm\.lora_sync=adapters: rollout server http://a:1 holds 2 "
                                         r".*; or rollout\.vllm\.lora_sync=auto \(merged weights\)$"):
        _connect(monkeypatch, mode="adapters", infos=[{"max_lora_rank": 16, "max_loras": 2}] * 2)
    with pytest.raises(SetupError, match="weight_transfer=gloo"):
        _connect(monkeypatch, mode="adapters", gloo=False)

    # the default say: the process's one line
    from grpo.rollout.server import adapters as ad

    printed = []
    monkeypatch.setattr(ad, "say_once", printed.append)
    assert ad.connect_adapters("MODEL", [SERVER], [{}], "auto", keep=1, gloo=True) is None
    assert "was started without LoRA" in printed[0]


def test_a_refusal_reads_a_missing_adapter_count_as_none():
    why = refusal(SERVER, {"max_lora_rank": 16}, rank=8, keep=1)
    assert "holds None adapters" in why
    assert why.endswith("; restart it with grpo-serve and the run's recipe (model.lora.enabled=true and the run's "
                        "rollout settings)")
    assert refusal(SERVER, {"max_lora_rank": 16, "max_loras": 1}, rank=16, keep=1) is None


def test_push_sends_the_tensors_loads_the_version_by_name_and_unloads_all_but_the_newest_keep():
    from grpo.rollout.lora_sync import Adapter
    from grpo.rollout.server.adapters import ServerAdapters

    log, sent = [], []
    servers = [_Server(url="http://a:1", log=log), _Server(url="http://b:2", log=log)]

    class Transfer:
        failed = []

        def send(self, tensors, to, method, args):
            sent.append((list(tensors), [s.url for s in to], method, json.loads(args[0])))
            return iter(self.failed)

    sa, t = ServerAdapters(2, {"http://a:1": "/da", "http://b:2": "/db"}), Transfer()
    adapter = Adapter({"x.lora_A.weight": 1, "x.lora_B.weight": 2}, {"r": 4})
    assert sa.push(adapter, 1, t, servers, "M") == {}
    assert sent == [([("x.lora_A.weight", 1), ("x.lora_B.weight", 2)], ["http://a:1", "http://b:2"],
                     "grpo_receive_adapter", {"version": 1, "config": {"r": 4}, "keep": 2})]
    assert log == [("http://a:1", "/v1/load_lora_adapter", {"lora_name": "M@v1", "lora_path": "/da/v1"}),
                   ("http://b:2", "/v1/load_lora_adapter", {"lora_name": "M@v1", "lora_path": "/db/v1"})]
    log.clear()
    sa.push(adapter, 2, t, servers, "M")
    assert sa.resident == [1, 2] and [e[1] for e in log] == ["/v1/load_lora_adapter"] * 2
    log.clear()
    t.failed = [("http://a:1", "broken")]  # a server that lost the push is not asked to load it
    assert sa.push(adapter, 3, t, servers, "M") == {"http://a:1": "broken"}
    assert log == [("http://b:2", "/v1/load_lora_adapter", {"lora_name": "M@v3", "lora_path": "/db/v3"}),
                   ("http://b:2", "/v1/unload_lora_adapter", {"lora_name": "M@v1"})]
    assert sa.resident == [2, 3]
    log.clear()
    t.failed = []
    sa.push(adapter, 2, t, servers[1:], "M")  # a version pushed again: unloaded first, then the newest
    assert log == [("http://b:2", "/v1/unload_lora_adapter", {"lora_name": "M@v2"}),
                   ("http://b:2", "/v1/load_lora_adapter", {"lora_name": "M@v2", "lora_path": "/db/v2"})]
    assert sa.resident == [3, 2]
    assert ServerAdapters.served("org/m", 7) == "org/m@v7"
