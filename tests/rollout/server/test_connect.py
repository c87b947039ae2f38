"""Which address the servers reach the trainer at, and which weight path a run takes."""
from grpo.rollout.server.connect import trainer_host, transfer_kind


def test_local_servers_reach_the_trainer_on_loopback_and_a_given_address_wins():
    assert trainer_host(["http://127.0.0.1:8000", "http://localhost:8001"], None) == "127.0.0.1"
    assert trainer_host(["http://127.0.0.1:8000"], "10.0.0.5") == "10.0.0.5"
    # a remote server: the local end of the route to it (no packet is sent; any local address is a real one here)
    assert trainer_host(["http://192.0.2.7:8000"], None) not in ("", "0.0.0.0")


def test_auto_is_nccl_on_cuda_and_gloo_elsewhere():
    assert (transfer_kind("auto", "cuda"), transfer_kind("auto", "cpu")) == ("nccl", "gloo")
    assert transfer_kind("gloo", "cuda") == "gloo"
