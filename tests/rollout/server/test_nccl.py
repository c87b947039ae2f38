"""The nccl weight path (grpo/rollout/server/nccl.py) with a fake engine in vLLM's place (no GPU, no vLLM): it does
what vLLM's `NCCLTrainerWeightTransferEngine.send_weights` does with its source (metadata first, then one pass,
each pair checked against the metadata) and the control plane's calls, so the tests see what vLLM would receive.
The engine reads the snapshot it is fed, not the live model; a server whose send fails is dropped by the backend."""
import copy

import pytest
import torch

from grpo.models import char_tokenizer, tiny_model
from grpo.rollout.server.backend import ServerBackend
from grpo.rollout.server.client import ServerPool
from grpo.rollout.server.facts import model_facts
from grpo.rollout.server.nccl import HTTPWeightSyncClient, NCCLTransfer, StreamSource
from grpo.rollout.weights import hf_weights

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)


class FakeEngine:
    made: list = []

    def __init__(self, host, port, world_size, client, source, fail=False):
        self.client, self.source, self.world_size, self.fail, self.got = client, source, world_size, fail, []
        client.init_weight_transfer_engine({"master_port": port, "world_size": world_size})
        FakeEngine.made.append(self)

    def send_weights(self):
        if self.fail:
            raise RuntimeError("NCCL error: remote process exited")
        meta = self.source.metadata()
        self.client.start_weight_update()
        self.client.update_weights({"names": [m[0] for m in meta]})
        got = {}
        for (name, t), m in zip(self.source, meta, strict=True):
            assert (name, t.dtype, tuple(t.shape)) == m, (name, m)  # vLLM's _checked_iter
            got[name] = t.clone()
        self.got.append(got)
        self.client.finish_weight_update()

    def shutdown(self):
        self.closed = True


@pytest.fixture
def trainer():
    return tiny_model("llama", len(char_tokenizer()), seed=1, **TINY)


def _backend(trainer, servers, failing=()):
    FakeEngine.made = []
    transfer = NCCLTransfer("127.0.0.1", 1, device="cpu", source=StreamSource,
                            engine=lambda *a: FakeEngine(*a, fail=a[3].server.url in failing))
    return ServerBackend(trainer, ServerPool([s.url for s in servers], retries=0, api_key="k", say=lambda m: None),
                         model_name="tiny:llama", facts=model_facts(trainer.config), eos_ids=[2], max_model_len=128,
                         check_ids=[1, 40, 41, 42], transfer=transfer)


def test_the_engine_reads_the_snapshot_it_is_fed_not_the_live_model(fakes, trainer):
    fake = fakes(model=copy.deepcopy(trainer), api_key="k")
    b = _backend(trainer, [fake])
    (engine,) = FakeEngine.made
    assert engine.world_size == 2 and fake.requests[-1][0] == "/init_weight_transfer_engine"
    snapshot = {n: t.clone() for n, t in hf_weights(trainer)}  # version 0, as ServerGenerator.publish takes it
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(1.0)  # the optimizer goes on while version 0 is sent
    b.push(iter(snapshot.items()), 0)
    assert list(engine.got[0]) == list(snapshot) and all(torch.equal(engine.got[0][n], t) for n, t in snapshot.items())
    paths = [p for p, _ in fake.requests]
    assert paths[-5:] == ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache",
                          "/update_weight_version"]  # with the API key: the fake answers 401 without it
    assert fake.version == b.label(0)
    b.push(hf_weights(trainer), 1)  # the synchronous path: the stream of the trainer's weights between two steps
    assert all(torch.equal(engine.got[1][n], t) for n, t in hf_weights(trainer))


def test_several_servers_each_get_the_stream_and_a_failed_send_drops_its_server(fakes, trainer):
    a, b_ = (fakes(model=copy.deepcopy(trainer), api_key="k") for _ in range(2))
    b = _backend(trainer, [a, b_], failing={a.url})
    b.push(hf_weights(trainer), 0)  # a generator: held whole for the push, so both engines read all of it
    ea, eb = FakeEngine.made
    assert not ea.got and ea.closed and len(eb.got[0]) == len(dict(trainer.state_dict()))
    assert [s.url for s in b.pool.servers] == [b_.url] and b.stats()["server/servers_up"] == 1


def test_the_control_plane_is_vllms_four_calls_and_the_metadata_is_the_first_streams():
    calls = []

    class Server:
        def post(self, path, body=None):
            calls.append((path, body))

    c = HTTPWeightSyncClient(Server())
    c.init_weight_transfer_engine({"x": 1}), c.start_weight_update(), c.update_weights({"names": ["w"]})
    c.finish_weight_update("3")
    assert calls == [("/init_weight_transfer_engine", {"init_info": {"x": 1}}), ("/start_weight_update", None),
                     ("/update_weights", {"update_info": {"names": ["w"]}}),
                     ("/finish_weight_update", {"weight_version": "3"})]
    s = StreamSource("cpu")
    s.feed(iter([("w", torch.zeros(2, 3)), ("b", torch.ones(3, dtype=torch.float64))]))
    assert s.metadata() == [("w", torch.float32, (2, 3)), ("b", torch.float64, (3,))]
    assert [n for n, _ in s] == ["w", "b"] and list(s) == []  # one pass per feed
