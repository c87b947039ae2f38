"""The server backend against an in-process fake server that holds a real tiny model (no vLLM): the weights go
through the real gloo channel, versions are recorded, the sync check passes on a synced server and stops a stale
one, a server of another model or a shorter max length is refused at connect."""
import copy

import pytest
import torch

from grpo.models import char_tokenizer, tiny_model
from grpo.rollout.base import Sampling
from grpo.rollout.server.backend import ServerBackend
from grpo.rollout.server.client import ServerError, ServerPool
from grpo.rollout.server.facts import model_facts
from grpo.rollout.server.gloo import GlooTransfer

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
CHECK = [1, 40, 41, 42, 43, 44, 45]


@pytest.fixture
def tok():
    return char_tokenizer()


def _backend(model, servers, **kw):
    pool = ServerPool([s.url for s in servers], retries=0)
    return ServerBackend(model, pool, model_name="tiny:llama", facts=model_facts(model.config), eos_ids=[2],
                         max_model_len=128, check_ids=CHECK, transfer=GlooTransfer("127.0.0.1", timeout_s=30), **kw)


def _step(model, scale=1e-2):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def test_weights_pushed_at_connect_and_after_a_step_with_their_version(tok, fakes):
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    fake = fakes(model=tiny_model("llama", len(tok), seed=2, **TINY))  # other weights until the first push
    b = _backend(trainer, [fake])
    b.sync_weights(trainer, 0)
    assert fake.received == 1 and fake.version == b.label(0) == f"0@{b.run_id}" and b.version == 0
    assert b.stats()["server/sync_logprob_gap"] < 1e-5
    for name, t in trainer.state_dict().items():
        assert torch.equal(fake.model.state_dict()[name], t), name
    _step(trainer)
    b.sync_weights(trainer, 1)
    assert fake.received == 2 and fake.version == b.label(1) and b.stats()["server/sync_logprob_gap"] < 1e-5
    assert ("/reset_prefix_cache", {}) in fake.requests
    out = b.generate([[1, 3, 4], [1, 5]], 3, Sampling(8, temperature=0.7), seed=10)
    assert out.versions == [1, 1]
    assert out.ids[0] == [[15, 6, 7], [16, 6, 7], [17, 6, 7]]  # choices back in index order, seeds per group
    assert out.ids[1][0][0] == 10 + 3 + 5
    assert all(torch.equal(lp, torch.full((3,), -0.5)) for g in out.logprobs for lp in g)
    bodies = [body for path, body in fake.requests if path == "/v1/completions" and "n" in body]
    assert sorted(b_["prompt"] for b_ in bodies[-2:]) == [[1, 3, 4], [1, 5]]  # one request per group
    assert all(b_["n"] == 3 for b_ in bodies[-2:])


def test_sync_every_pushes_every_n_steps_and_logs_the_lag(tok, fakes):
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    fake = fakes(model=tiny_model("llama", len(tok), seed=1, **TINY))
    b = _backend(trainer, [fake], sync_every=2)
    b.sync_weights(trainer, 0)
    b.sync_weights(trainer, 1)
    assert fake.received == 1 and b.version == 0 and b.stats()["server/version_lag"] == 1.0
    assert b.generate([[1, 3]], 2, Sampling(4), seed=0).versions == [0]
    b.sync_weights(trainer, 2)
    assert fake.received == 2 and b.version == 2 and b.stats()["server/version_lag"] == 0.0


def test_a_stale_server_stops_the_run_with_one_line(tok, fakes):
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    fake = fakes(model=tiny_model("llama", len(tok), seed=1, **TINY), stale=True)
    b = _backend(trainer, [fake])
    b.sync_weights(trainer, 0)  # the same weights: the stale server agrees
    _step(trainer)
    with pytest.raises(ServerError) as e:
        b.sync_weights(trainer, 1)
    msg = str(e.value)
    assert "weight sync check failed" in msg and fake.url in msg and "\n" not in msg
    assert b.stats()["server/sync_logprob_gap"] > 1e-3


def test_the_check_spans_every_server_and_a_tolerance_decides(tok, fakes):
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    good = fakes(model=tiny_model("llama", len(tok), seed=1, **TINY))
    bad = fakes(model=tiny_model("llama", len(tok), seed=1, **TINY), stale=True)
    b = _backend(trainer, [good, bad], tol=1e-3)
    _step(trainer, 1e-5)  # a gap below the tolerance passes
    b.sync_weights(trainer, 0)
    assert 0 < b.stats()["server/sync_logprob_gap"] < 1e-3 and good.received == bad.received == 1
    _step(trainer)
    b.sync_weights(trainer, 1)  # one of two fails: it is dropped, the run carries on with the other
    assert [s.url for s in b.pool.servers] == [good.url] and b.stats()["server/servers_up"] == 1
    assert b.stats()["server/sync_logprob_gap"] < 1e-5
    alone = _backend(trainer, [fakes(model=copy.deepcopy(trainer), stale=True)])
    alone.sync_weights(trainer, 0)
    _step(trainer)
    with pytest.raises(ServerError, match=alone.pool.servers[0].url.replace(".", r"\.")):
        alone.sync_weights(trainer, 1)  # the only one fails: the run stops


@pytest.mark.parametrize("what", ["name", "shape", "length"])
def test_a_server_of_another_model_or_length_is_refused_at_connect(tok, fakes, what):
    trainer = tiny_model("llama", len(tok), seed=1, **TINY)
    kw = {"name": dict(name="tiny:qwen2"), "length": dict(max_model_len=64),
          "shape": dict(facts={**model_facts(trainer.config), "hidden_size": 128})}[what]
    fake = fakes(model=tiny_model("llama", len(tok), seed=1, **TINY), **kw)
    with pytest.raises(ServerError) as e:
        _backend(trainer, [fake])
    msg = str(e.value)
    assert fake.url in msg and "\n" not in msg
    assert {"name": "'tiny:llama'", "shape": "hidden_size=128", "length": "max_model_len=64"}[what] in msg
    assert fake.received == 0  # nothing was pushed


def test_lora_sends_the_merged_weights(tok, fakes):
    from peft import LoraConfig, get_peft_model

    base = tiny_model("llama", len(tok), seed=1, **TINY)
    trainer = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for n, p in trainer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    fake = fakes(model=tiny_model("llama", len(tok), seed=1, **TINY))
    b = _backend(trainer, [fake])
    b.sync_weights(trainer, 0)
    assert b.stats()["server/sync_logprob_gap"] < 1e-5  # the server's plain model scores as the adapted trainer
    q = trainer.base_model.model.model.layers[0].self_attn.q_proj
    merged = q.base_layer.weight + q.get_delta_weight("default")
    assert torch.allclose(fake.model.model.layers[0].self_attn.q_proj.weight, merged, atol=1e-6)
    assert not torch.allclose(q.base_layer.weight, merged)  # the trainer's own weight is left unmerged
