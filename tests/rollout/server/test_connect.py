"""Which address the servers reach the trainer at, and which weight path a run takes."""
import socket
from types import SimpleNamespace

import pytest
import torch

from grpo.rollout.server import connect, nccl
from grpo.rollout.server.connect import trainer_host, transfer_kind


def test_local_servers_reach_the_trainer_on_loopback_and_a_given_address_wins():
    assert trainer_host(["http://127.0.0.1:8000", "http://localhost:8001"], None) == "127.0.0.1"
    assert trainer_host(["http://127.0.0.1:8000"], "10.0.0.5") == "10.0.0.5"
    # a remote server: the local end of the route to it (no packet is sent; any local address is a real one here)
    assert trainer_host(["http://192.0.2.7:8000"], None) not in ("", "0.0.0.0")


def test_auto_is_nccl_on_cuda_and_gloo_elsewhere():
    assert (transfer_kind("auto", "cuda"), transfer_kind("auto", "cpu")) == ("nccl", "gloo")
    assert transfer_kind("gloo", "cuda") == "gloo"


def test_a_server_run_without_urls_or_with_a_bad_one_fails_in_one_line(cfg_factory):
    
    from grpo.errors import ConfigError
    from grpo.rollout import registry

    cfg = cfg_factory({"rollout": {"backend": "server"}})  # the backend that needs URLs asks for them (preflight)
    with pytest.raises(ConfigError, match=r"^rollout.backend=server needs rollout.server.urls, e.g. "):
        registry.check(cfg.rollout, cfg.model, "cpu")
    registry.check(cfg_factory().rollout, cfg.model, "cpu")  # hf: no URL needed
    with pytest.raises(ConfigError, match=r"^rollout.server.urls: '127.0.0.1:8000' is not a URL; give http://HOST"):
        cfg_factory({"rollout": {"backend": "server", "server": {"urls": ["127.0.0.1:8000"]}}})
    with pytest.raises(ConfigError, match="rollout.server.balance='random' is not allowed"):
        cfg_factory({"rollout": {"server": {"balance": "random"}}})
    assert cfg_factory({"rollout": {"backend": "server", "server": {"urls": ["http://h:1"]}}}).rollout.server.urls \
        == ["http://h:1"]


def test_the_api_key_variable_must_be_a_name_and_the_key_comes_from_it(cfg_factory, monkeypatch):
    from grpo.errors import ConfigError
    from grpo.rollout.server.connect import api_key

    with pytest.raises(ConfigError, match="rollout.server.api_key_env must be the NAME") as e:
        cfg_factory({"rollout": {"server": {"api_key_env": "sk-live-123"}}})
    assert "sk-live-123" not in str(e.value)  # a key given by mistake is not echoed
    cfg = cfg_factory({"rollout": {"server": {"api_key_env": "MY_KEY"}}})
    monkeypatch.delenv("MY_KEY", raising=False)
    assert api_key(cfg.rollout.server) is None
    monkeypatch.setenv("MY_KEY", "k")
    assert api_key(cfg.rollout.server) == "k"


# ------------------------------------------------------------------ unit-level: stand-ins for the pool, the transfers,
# the backend and the socket (the real ones are tests/rollout/server/test_backend.py's, over fake servers)
def test_a_remote_server_is_reached_at_the_local_end_of_the_route_to_the_first_one(monkeypatch):
    made = []

    class Sock:
        def __init__(self, family, kind):
            made.append((family, kind))

        def __enter__(self):
            return self

        def __exit__(self, *a):
            made.append("closed")

        def connect(self, addr):
            made.append(addr)

        def getsockname(self):
            return ("10.1.2.3", 5555)

    monkeypatch.setattr(connect.socket, "socket", Sock)
    assert trainer_host(["http://127.0.0.1:1", "http://gpu7:8000", "http://gpu8:8000"], None) == "10.1.2.3"
    assert made == [(socket.AF_INET, socket.SOCK_DGRAM), ("127.0.0.1", 9), "closed"]
    made.clear()
    assert trainer_host(["http://gpu7:8000"], "") == "10.1.2.3" and made[1] == ("gpu7", 9)
    made.clear()
    assert trainer_host(["http://[::1]:8000", "http://localhost:1"], None) == "127.0.0.1" and made == []
    made.clear()
    assert trainer_host(["http://:8000"], None) == "10.1.2.3" and made[1] == ("", 9)  # no host name: not loopback


def test_an_empty_api_key_is_none():
    assert connect.api_key(SimpleNamespace(api_key_env="GRPO_TEST_UNSET_KEY_VARIABLE")) is None


def _server(**kw):
    return SimpleNamespace(**{"urls": ["http://h:1"], "balance": "least", "request_timeout_s": 7.0, "retries": 2,
                              "connect_timeout_s": 3.0, "api_key_env": "GRPO_TEST_KEY", "trainer_host": "th",
                              "weight_transfer": "auto", "tensor_parallel_size": 2, "sync_check_tol": 0.5,
                              "sync_every": 1, "rejoin_every_s": 9.0, **kw})


class _Rt:
    def __init__(self, rank=0, world_size=1, device="cpu"):
        self.rank, self.world_size, self.device, self.is_main = rank, world_size, torch.device(device), rank == 0
        config = SimpleNamespace(model_type="llama", vocab_size=10)
        self.model = SimpleNamespace(config=config, generation_config=SimpleNamespace(eos_token_id=[5]))

    def full_weights(self, params):
        return params

    def barrier(self):
        return None

    def all_max(self, values):
        return values


@pytest.fixture
def built(monkeypatch):
    """What `for_runtime` built: the pool's, the transfer's and the backend's arguments."""
    seen = {}
    monkeypatch.setattr(connect, "ServerPool", lambda urls, **kw: seen.setdefault("pool", (urls, kw)) and "pool")
    monkeypatch.setattr(connect, "GlooTransfer", lambda host, **kw: seen.setdefault("gloo", (host, kw)) and "gloo")
    monkeypatch.setattr(nccl, "NCCLTransfer", lambda host, tp, device: seen.setdefault("nccl", (host, tp, device))
                        and "nccl")
    monkeypatch.setattr(connect, "ServerBackend", lambda model, pool, **kw: seen.setdefault(
        "backend", (model, pool, kw)) and "backend")
    monkeypatch.setenv("GRPO_TEST_KEY", "key1")
    return seen


def test_rank_0_of_one_process_sends_over_gloo_on_cpu(built):
    rt = _Rt()
    tok = SimpleNamespace(eos_token_id=2)
    assert connect.for_runtime(rt, tok, _server(), "m", 64, [1, 2], lora_sync="merged", lora_keep=3) == "backend"
    urls, kw = built["pool"]
    assert urls == ["http://h:1"] and kw.pop("say") is None
    assert kw == dict(balance="least", timeout_s=7.0, retries=2, connect_timeout_s=3.0, api_key="key1")
    assert built["gloo"] == ("th", {"timeout_s": 7.0, "api_key": "key1"}) and "nccl" not in built
    model, pool, kw = built["backend"]
    assert model is rt.model and pool == "pool"
    facts = kw.pop("facts")
    assert facts["model_type"] == "llama" and facts["vocab_size"] == 10
    assert kw.pop("full_weights") == rt.full_weights
    assert kw == dict(model_name="m", eos_ids=[5, 2], max_model_len=64, check_ids=[1, 2], tol=0.5, sync_every=1,
                      transfer="gloo", rank=0, barrier=None, all_max=None, device=rt.device, lora_sync="merged",
                      lora_keep=3, rejoin_every_s=9.0)


def test_the_trainer_host_is_found_when_not_given(built):
    s = _server(trainer_host=None, urls=["http://127.0.0.1:1"])
    connect.for_runtime(_Rt(), SimpleNamespace(eos_token_id=None), s, "m", 8,
                       [1])
    assert built["gloo"][0] == "127.0.0.1" and built["backend"][2]["lora_sync"] == "auto"
    assert built["backend"][2]["lora_keep"] == 1


def test_rank_0_on_cuda_sends_over_nccl_to_each_servers_gpus(built):
    rt = _Rt(device="cuda")
    connect.for_runtime(rt, SimpleNamespace(eos_token_id=None), _server(), "m", 8, [1])
    assert built["nccl"] == ("th", 2, rt.device) and "gloo" not in built
    assert built["backend"][2]["transfer"] == "nccl"


def test_the_other_ranks_sample_quietly_send_nothing_and_meet_at_barriers(built):
    rt = _Rt(rank=1, world_size=2)
    connect.for_runtime(rt, SimpleNamespace(eos_token_id=None), _server(), "m", 8, [1])
    say = built["pool"][1]["say"]
    assert say is not None and say("a line") is None
    assert "gloo" not in built and "nccl" not in built
    kw = built["backend"][2]
    assert kw["transfer"] is None and kw["rank"] == 1 and kw["barrier"] == rt.barrier and kw["all_max"] == rt.all_max
    built.clear()
    connect.for_runtime(_Rt(rank=0, world_size=2), SimpleNamespace(eos_token_id=None), _server(), "m", 8, [1])
    assert built["backend"][2]["barrier"] is not None and built["gloo"]


def test_make_builds_it_from_the_backend_context(built, monkeypatch):
    calls = []
    monkeypatch.setattr(connect, "for_runtime", lambda *a, **kw: calls.append((a, kw)) or "made")
    rollout = SimpleNamespace(server="srv", max_new_tokens=16, vllm=SimpleNamespace(lora_sync="adapters"),
                              max_staleness=2)
    ctx = SimpleNamespace(rollout=rollout, runtime="rt", tokenizer="tok", model_name="m", longest_prompt=40,
                          check_ids=[1])
    assert connect.make(ctx) == "made"
    assert calls == [(("rt", "tok", "srv", "m", 56, [1]), {"lora_sync": "adapters", "lora_keep": 3})]
