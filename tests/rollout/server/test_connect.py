"""Which address the servers reach the trainer at, and which weight path a run takes."""
import pytest

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
