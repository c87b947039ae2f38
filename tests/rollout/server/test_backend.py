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


# ------------------------------------------------------------------ over stand-ins (no HTTP server, no model, no gloo
# group): the mutation tests' selection (`make mutate`). The pool is the real `ServerPool` over stand-in servers.
from grpo.rollout.lora_sync import Adapter  # noqa: E402
from grpo.rollout.server import backend as sb  # noqa: E402
from grpo.rollout.server.client import RESUME, ServerDown  # noqa: E402

FACTS = {"model_type": "llama", "hidden_size": 64}


class _Srv:
    """A stand-in `Server`: vLLM's answers of one server; ``down``: the paths it stops answering on; ``gap``: how far
    its prompt log-probs are from ``MINE``."""

    def __init__(self, url, *, served="m", length=256, facts=FACTS, down=(), gap=0.0, samples=None):
        self.url, self.in_flight, self.calls, self.down, self.gap = url, 0, [], set(down), gap
        self.served, self.length, self.facts, self.held = served, length, facts, "default"
        self.samples = samples if samples is not None else {}

    def _maybe_down(self, path):
        if path in self.down:
            self.refused = getattr(self, "refused", 0) + 1
            assert self.refused < 50, "a server that stopped answering was asked again and again"  # not dropped
            raise ServerDown(f"rollout server {self.url} stopped answering ({path}: refused); {RESUME}")

    def up(self, timeout_s=5.0):
        self.calls.append(("up", timeout_s))
        return "/health" not in self.down

    def get(self, path, **kw):
        self.calls.append((path, kw) if kw else (path,))
        self._maybe_down(path)
        if path == "/v1/models":
            return {"data": [{"id": self.served, "max_model_len": self.length}]}
        if path == "/weight_info":
            return {"weight_version": self.held}
        raise AssertionError(path)

    def post(self, path, body=None, **kw):
        self.calls.append((path, body))
        self._maybe_down(path)
        if path == "/collective_rpc":
            return {"results": [{**self.facts, "max_model_len": self.length}]}
        if path == "/update_weight_version":
            self.held = body["new_version"]
        if path == "/v1/completions" and "prompt_logprobs" in body:
            rows = [None] + [{str(t): {"logprob": float(m) + self.gap}} for t, m in zip(body["prompt"][1:], MINE)]
            return {"choices": [{"prompt_logprobs": rows}]}
        if path == "/v1/completions":
            toks = self.samples.get(tuple(body["prompt"]), [[5, 2, 7]] * body["n"])
            return {"choices": [{"index": i, "token_ids": t, "logprobs": {"token_logprobs": [-0.1 * (k + 1) for k in
                                                                                              range(len(t))]}}
                                for i, t in reversed(list(enumerate(toks)))]}
        return None

    def paths(self):
        return [c[0] for c in self.calls]

    def sampled(self):
        """The bodies of its sampling requests (not the sync check's)."""
        return [c[1] for c in self.calls if c[0] == "/v1/completions" and "prompt_logprobs" not in c[1]]


MINE = torch.tensor([-1.0, -2.0, -0.5])


class _Gloo(GlooTransfer):
    """A stand-in gloo channel: records each join and push; ``fail``: {url: why} a push loses."""

    def __init__(self, fail=None):
        self.joined, self.pushes, self.fail, self.closed = [], [], dict(fail or {}), 0

    def connect(self, servers):
        self.joined.append([s.url for s in servers])

    def send(self, weights, servers, **kw):
        self.pushes.append(([n for n, _ in weights], [s.url for s in servers], kw))
        return {u: w for u, w in self.fail.items() if u in [s.url for s in servers]}

    def close(self):
        self.closed += 1


def _pool(servers, **kw):
    said = []
    pool = ServerPool([s.url for s in servers], say=said.append, **kw)
    pool.servers, pool.known = list(servers), list(servers)
    return pool, said


def _other_ranks(*theirs):
    """An ``all_max`` stand-in: each collective in turn meets another rank's values (``theirs``, in order; a key not
    there: 0); what this rank sent is kept in ``.sent``."""
    it = iter(theirs)

    def all_max(d):
        all_max.sent.append(dict(d))
        other = next(it, {})
        return {k: max(v, other.get(k, 0.0)) for k, v in d.items()}

    all_max.sent = []
    return all_max


def _stand_in(monkeypatch, servers, *, vision=None, adapters=None, weights=None, logprobs=MINE, **kw):
    """A `ServerBackend` over ``servers`` with stand-ins for what reads the model; returns it and what it said."""
    seen = {}
    monkeypatch.setattr(sb, "vision_inputs", lambda model: seen.setdefault("vision", model) and vision)
    monkeypatch.setattr(sb, "connect_adapters", lambda *a, **k: seen.setdefault("adapters", (a, k)) and adapters)
    monkeypatch.setattr(sb, "trainer_logprobs", lambda model, ids, device: seen.setdefault("logprobs", []).append(
        (model, list(ids), device)) or logprobs)
    monkeypatch.setattr(sb, "hf_weights", lambda model, **k: seen.setdefault("hf", []).append((model, k)) or iter(
        weights if weights is not None else [("w", torch.zeros(4)), ("visual.p", torch.zeros(2))]))
    pool, said = _pool(servers)
    kw = {"transfer": _Gloo(), **kw}
    b = ServerBackend("MODEL", pool, model_name="m", facts=FACTS, eos_ids=(2,), max_model_len=200,
                      check_ids=[1, 9, 4, 9], **kw)
    return b, said, seen


def test_connect_checks_each_server_joins_the_channel_and_draws_one_run_id(monkeypatch):
    a, c = _Srv("http://a"), _Srv("http://c")
    draws = []
    monkeypatch.setattr(sb.secrets, "randbelow", lambda n: draws.append(n) or 255)
    b, said, seen = _stand_in(monkeypatch, [a, c], lora_sync="adapters", lora_keep=3)
    assert draws == [2 ** 48] and b.run_id == "0000000000ff" and b.label(4) == "4@0000000000ff"
    assert b.label(None) == "None@0000000000ff"
    assert b.urls == ["http://a", "http://c"] and b.stats() == {"server/servers_up": 2.0}
    assert b.transfer.joined == [["http://a", "http://c"]] and b.version is None and b.rejoiner is None
    assert b.check_ids == [1, 9, 4, 9] and b.eos_ids == [2] and b.served() == "m" and seen["vision"] == "MODEL"
    assert all(s.calls[:3] == [("up", 5.0), ("/v1/models",), ("/collective_rpc", {"method": "grpo_model_info"})]
               for s in (a, c))
    args, kw = seen["adapters"]
    assert args == ("MODEL", b.pool.servers, [{**FACTS, "max_model_len": 256}] * 2, "adapters", 3)
    assert kw == {"gloo": True, "say": b.pool.say}
    # the run id every rank agrees on is the largest draw (all_max), as 12 hex digits
    ranks = _stand_in(monkeypatch, [_Srv("http://a")], all_max=lambda d: {k: 4096.0 for k in d})[0]
    assert ranks.run_id == "000000001000"
    stats = b.stats()
    stats["server/servers_up"] = 0.0
    assert b.stats()["server/servers_up"] == 2.0  # a copy


def test_the_gloo_flag_of_the_adapters_and_the_rejoiner_of_several_servers(monkeypatch):
    from grpo.rollout.server.rejoin import Rejoiner

    class _Other:  # vLLM's nccl engine: not the gloo channel
        def connect(self, servers):
            pass

    for transfer, gloo_ in ((_Other(), False), (None, True), (_Gloo(), True)):
        b, _, seen = _stand_in(monkeypatch, [_Srv("http://a")], transfer=transfer)
        assert seen["adapters"][1]["gloo"] is gloo_
        assert seen["adapters"][0][3:] == ("auto", 1)  # the defaults
    two = [_Srv("http://a"), _Srv("http://b")]
    b = _stand_in(monkeypatch, two, rejoin_every_s=7.5)[0]
    assert isinstance(b.rejoiner, Rejoiner) and b.rejoiner.every_s == 7.5 and b.rejoiner.say is b.pool.say
    assert _stand_in(monkeypatch, two)[0].rejoiner is None  # never probed
    assert _stand_in(monkeypatch, two[:1], rejoin_every_s=0)[0].rejoiner is None  # one server: nothing to rejoin
    assert _stand_in(monkeypatch, two, rejoin_every_s=0, adapters=object())[0].rejoiner is None  # adapters never
    assert _stand_in(monkeypatch, two, rejoin_every_s=0)[0].rejoiner is not None


def test_the_default_tolerance_is_a_thousandth(monkeypatch):
    assert _stand_in(monkeypatch, [_Srv("http://a", gap=9e-4)])[0].check(mine=MINE) == pytest.approx(9e-4, rel=1e-2)
    with pytest.raises(ServerError, match="sync_check_tol=0.001"):
        _stand_in(monkeypatch, [_Srv("http://a", gap=2e-3)])[0].check(mine=MINE)


def test_an_image_token_is_left_out_of_the_check_sequence(monkeypatch):
    b = _stand_in(monkeypatch, [_Srv("http://a")], vision=(9, 2, "tower"))[0]
    assert b.check_ids == [1, 4] and b.vision == (9, 2, "tower")


@pytest.mark.parametrize("what", ["name", "facts", "length", "length from info"])
def test_check_server_refuses_another_model_or_a_shorter_length(what):
    srv = {"name": _Srv("http://a", served="other"), "facts": _Srv("http://a", facts={**FACTS, "hidden_size": 8}),
           "length": _Srv("http://a", length=199), "length from info": _Srv("http://a", length=None)}[what]
    if what == "length from info":
        srv.facts = {**FACTS}
        srv.post = lambda path, body=None: {"results": [{**FACTS, "max_model_len": 150}]}
    with pytest.raises(ServerError) as e:
        sb.check_server(srv, "m", FACTS, 200)
    assert {"name": "serves other, not 'm'", "facts": "hidden_size=8 (the trainer's 64)",
            "length": "max_model_len=199,", "length from info": "max_model_len=150,"}[what] in str(e.value)


def test_check_server_passes_what_serves_the_run_and_returns_its_info():
    info = sb.check_server(_Srv("http://a", length=200), "m", FACTS, 200)
    assert info == {**FACTS, "max_model_len": 200}
    served = _Srv("http://a", length=300)  # /v1/models' length is the served one, before the worker's
    served.post = lambda path, body=None: {"results": [{**FACTS, "max_model_len": 100}]}
    assert sb.check_server(served, "m", FACTS, 300)["max_model_len"] == 100
    srv = _Srv("http://a", length=None)
    srv.post = lambda path, body=None: {"results": [{**FACTS, "max_model_len": 300}]}
    assert sb.check_server(srv, "m", FACTS, 300)["max_model_len"] == 300  # the worker's, where /v1/models has none
    empty = _Srv("http://a")
    empty.get = lambda path: {"data": []}
    with pytest.raises(ServerError, match="serves nothing, not 'm'"):
        sb.check_server(empty, "m", FACTS, 1)
    missing = _Srv("http://a", length=None)
    missing.post = lambda path, body=None: {"results": [{**FACTS}]}
    with pytest.raises(ServerError, match="max_model_len=0,"):
        sb.check_server(missing, "m", FACTS, 1)


def test_a_push_labels_every_server_after_the_stream_and_counts_what_went(monkeypatch):
    a, c = _Srv("http://a"), _Srv("http://c")
    barriers = []
    b, said, seen = _stand_in(monkeypatch, [a, c], weights=[("w", torch.zeros(4)), ("x", torch.zeros(2, 3,
                                                                                                   dtype=torch.int64))],
                              barrier=lambda: barriers.append(b.transfer.pushes[:]))
    b.sync_weights("MODEL", 3)
    assert b.version == 3 and b.transfer.pushes == [(["w", "x"], ["http://a", "http://c"], {})]
    assert barriers == [b.transfer.pushes]  # after the push
    assert seen["hf"] == [("MODEL", {})]
    for s in (a, c):
        assert s.paths()[3:] == ["/reset_prefix_cache", "/update_weight_version", "/v1/completions"]
        assert s.calls[4] == ("/update_weight_version", {"new_version": b.label(3)})
        assert s.calls[5][1] == {"model": "m", "prompt": [1, 9, 4, 9], "max_tokens": 1, "temperature": 1.0,
                                 "prompt_logprobs": 0, "return_token_ids": True}
    st = b.stats()
    assert st["sync/bytes"] == 4 * 4 + 6 * 8 and st["sync/adapters"] == 0.0 and st["server/version_lag"] == 0.0
    assert 0.0 <= st["time/sync_s"] < 60 and st["server/sync_logprob_gap"] == 0.0
    assert seen["logprobs"] == [("MODEL", [1, 9, 4, 9], "cpu")]


def test_sync_every_skips_the_push_until_its_steps_have_passed(monkeypatch):
    b, _, seen = _stand_in(monkeypatch, [_Srv("http://a")], sync_every=3, device="meta")
    b.sync_weights("MODEL", 2)
    assert b.version == 2 and b.stats()["server/version_lag"] == 0.0 and seen["logprobs"][0][2] == "meta"
    b.metrics["time/sync_s"] = 5.0
    b.sync_weights("MODEL", 4)
    assert b.version == 2 and b.stats()["server/version_lag"] == 2.0 and b.stats()["time/sync_s"] == 0.0
    assert len(b.transfer.pushes) == 1
    b.sync_weights("MODEL", 5)
    assert b.version == 5 and len(b.transfer.pushes) == 2 and b.stats()["server/version_lag"] == 0.0


def test_a_rank_that_does_not_send_walks_the_stream_and_every_rank_drops_what_one_saw(monkeypatch):
    a, c = _Srv("http://a"), _Srv("http://c")
    walked = []

    def stream():
        for n in ("w", "v"):
            walked.append(n)
            yield n, torch.zeros(3)

    agreed = []

    def all_max(d):
        agreed.append(dict(d))
        return {**d, "http://c": 1.0} if "http://c" in d and "run_id" not in d else d

    b = _stand_in(monkeypatch, [a, c], transfer=None, all_max=all_max)[0]
    b.push(stream(), 0)
    assert walked == ["w", "v"] and b.stats()["sync/bytes"] == 24.0
    assert [s.url for s in b.pool.servers] == ["http://a"] and a.paths()[3:] == []  # no rank-0 label from here
    assert agreed[-1] == {"http://a": 0.0, "http://c": 0.0} and b.version == 0
    assert b.stats()["server/servers_up"] == 1.0


def test_a_server_that_loses_its_push_or_its_label_is_dropped_on_every_rank(monkeypatch):
    a, c, d = _Srv("http://a"), _Srv("http://c", down={"/update_weight_version"}), _Srv("http://d")
    b, said, _ = _stand_in(monkeypatch, [a, c, d], transfer=_Gloo(fail={"http://a": "lost a"}))
    b.push(iter([("w", torch.zeros(1))]), 1)
    assert [s.url for s in b.pool.servers] == ["http://d"] and b.stats()["server/servers_up"] == 1.0
    assert "/reset_prefix_cache" not in a.paths()  # a lost push is not labelled
    assert said == ["lost a: carrying on with 2 of 3 rollout servers (http://c, http://d)",
                    "rollout server http://c stopped answering (/update_weight_version: refused): carrying on with 1 "
                    "of 3 rollout servers (http://d)"]
    # another rank saw the loss: this one drops it too, naming what happened
    e, f = _Srv("http://e"), _Srv("http://f")
    b2, said2, _ = _stand_in(monkeypatch, [e, f], all_max=lambda d: {k: float(k == "http://f") if k != "run_id" else v
                                                                     for k, v in d.items()})
    b2.push(iter([]), 0)
    assert [s.url for s in b2.pool.servers] == ["http://e"]
    assert said2 == ["rollout server http://f failed its weight push on another rank: carrying on with 1 of 2 "
                     "rollout servers (http://e)"]
    # what this rank saw itself is said as it saw it
    g, h, i = _Srv("http://g"), _Srv("http://h"), _Srv("http://i")
    b3, said3, _ = _stand_in(monkeypatch, [g, h, i], transfer=_Gloo(fail={"http://g": "g lost its channel"}),
                             all_max=_other_ranks({}, {"http://h": 1.0}))
    b3.push(iter([]), 0)
    assert said3 == ["g lost its channel: carrying on with 2 of 3 rollout servers (http://h, http://i)",
                     "rollout server http://h failed its weight push on another rank: carrying on with 1 of 3 "
                     "rollout servers (http://i)"]


def test_the_check_drops_a_server_too_far_stops_when_none_agrees_and_nan_is_the_worst(monkeypatch):
    a, c, d = _Srv("http://a", gap=1e-4), _Srv("http://c", gap=0.5), _Srv("http://d", down={"/v1/completions"})
    b, said, _ = _stand_in(monkeypatch, [d, a, c], tol=1e-3)  # one down does not end the check of the next
    b.version = 4
    gap = b.check(mine=MINE)
    assert gap == pytest.approx(1e-4, rel=1e-2) and b.stats()["server/sync_logprob_gap"] == gap
    assert [s.url for s in b.pool.servers] == ["http://a"] and b.stats()["server/servers_up"] == 1.0
    assert said == [
        "rollout server http://d stopped answering (/v1/completions: refused): carrying on with 2 of 3 rollout servers "
        "(http://a, http://c)",
        "weight sync check failed: rollout server http://c scores the check sequence 0.5 away from the trainer "
        "(rollout.server.sync_check_tol=0.001) after pushing weight version 4: it does not sample from the trainer's "
        "policy: carrying on with 1 of 3 rollout servers (http://a)"]
    # a gap at the tolerance passes; NaN fails; the largest gap names the run's stop
    at = _Srv("http://a", gap=0.25)
    assert _stand_in(monkeypatch, [at], tol=0.25)[0].check(mine=MINE) == 0.25
    nan = _Srv("http://n")
    one = _stand_in(monkeypatch, [nan, _Srv("http://m", gap=3.0)], tol=1.0)[0]
    with pytest.raises(ServerError) as e:
        one.check(mine=torch.tensor([float("nan"), 0.0, 0.0]))
    assert "rollout server http://n scores the check sequence inf away" in str(e.value)
    assert one.stats()["server/sync_logprob_gap"] == float("inf") and len(one.pool.servers) == 2
    far = _stand_in(monkeypatch, [_Srv("http://x", gap=2.0), _Srv("http://y", gap=3.0), _Srv("http://z", gap=1.5)],
                    tol=1.0)[0]
    with pytest.raises(ServerError, match=r"^weight sync check failed: rollout server http://y scores the check "
                                          r"sequence 3 away"):
        far.check(mine=MINE)
    assert far.stats()["server/sync_logprob_gap"] == 3.0


def test_the_check_takes_the_largest_gap_of_every_rank_and_reads_the_model_unless_given(monkeypatch):
    a, c = _Srv("http://a", gap=1e-4), _Srv("http://c", gap=1e-4)
    # another rank's largest gaps (the collectives in turn: the run id, the check's gaps, the drops)
    b, said, seen = _stand_in(monkeypatch, [a, c], tol=1e-3,
                              all_max=_other_ranks({}, {"http://a": 2e-4, "http://c": 0.1}))
    assert b.check("MODEL") == pytest.approx(2e-4)
    assert seen["logprobs"] == [("MODEL", [1, 9, 4, 9], "cpu")] and [s.url for s in b.pool.servers] == ["http://a"]
    assert said == ["weight sync check failed: rollout server http://c scores the check sequence 0.1 away from the "
                    "trainer (rollout.server.sync_check_tol=0.001) after pushing weight version None: it does not "
                    "sample from the trainer's policy: carrying on with 1 of 2 rollout servers (http://a)"]
    # this rank's own gap where it is the larger; a server out of the pool sends 0; one another rank saw fail is
    # dropped naming the check
    e, f, g = _Srv("http://e", gap=1e-4), _Srv("http://f", gap=1e-4), _Srv("http://g")
    b, said, _ = _stand_in(monkeypatch, [e, f, g], tol=1e-3, all_max=_other_ranks({}, {"http://e": 5e-5},
                                                                                  {"http://f": 1.0}))
    b.pool.drop("http://g", "g lost")
    assert b.check(mine=MINE) == pytest.approx(1e-4, rel=1e-2)
    assert b.all_max.sent[1] == {"http://e": pytest.approx(1e-4, rel=1e-2), "http://f": pytest.approx(1e-4, rel=1e-2),
                       "http://g": 0.0}
    assert said[-1] == ("rollout server http://f failed the weight sync check on another rank: carrying on with 1 of 3 "
                        "rollout servers (http://e)")
    # a sequence of one token has no log-probs to compare: no gap
    short = _stand_in(monkeypatch, [_Srv("http://a", gap=5.0)])[0]
    short.check_ids = [1]
    assert short.check(mine=torch.zeros(0)) == 0.0


def test_the_adapters_go_with_their_own_label_and_the_base_weights_once(monkeypatch):
    class _Adapters:
        def __init__(self):
            self.base_loaded, self.pushed = False, []

        def served(self, name, version):
            return f"{name}@v{version}"

        def push(self, adapter, version, transfer, servers, name):
            self.pushed.append((adapter, version, transfer, [s.url for s in servers], name))
            return {"http://c": "lost c"}

    ad = _Adapters()
    a, c = _Srv("http://a"), _Srv("http://c")
    adapter = Adapter({"A": torch.zeros(2, 3), "B": torch.zeros(3)}, {"r": 2})
    states = []
    monkeypatch.setattr(sb, "adapter_state", lambda model, full: states.append((model, full)) or adapter)
    b, said, seen = _stand_in(monkeypatch, [a, c], adapters=ad)
    assert b.served() == "m"  # before the first push: the base model
    assert b.weights("MODEL") is adapter and ad.base_loaded and seen["hf"] == [("MODEL", {"merge": False})]
    assert b.transfer.pushes[0][0] == ["w", "visual.p"] and a.calls[4][1]["new_version"] == b.label(-1)
    assert states == [("MODEL", sb.as_they_are)]
    assert b.weights("MODEL") is adapter and len(b.transfer.pushes) == 1  # the base weights went once
    b.push(adapter, 2)
    assert ad.pushed == [(adapter, 2, b.transfer, ["http://a", "http://c"], "m")] and b.version == 2
    assert a.calls[-1] == ("/update_weight_version", {"new_version": b.label(2)})
    assert b.served() == "m@v2" and [s.url for s in b.pool.servers] == ["http://a"]
    assert a.paths()[-1] == "/update_weight_version" and "/reset_prefix_cache" not in a.paths()[-2:]
    assert b.stats()["sync/bytes"] == 6 * 4 + 3 * 4 and b.stats()["sync/adapters"] == 1.0
    assert said == ["lost c: carrying on with 1 of 2 rollout servers (http://a)"]
    # a rank that does not send only agrees on the drops; full_weights gathers on every path
    full = object()
    other = _stand_in(monkeypatch, [_Srv("http://a")], adapters=_Adapters(), transfer=None, full_weights=full)[0]
    other.adapters.base_loaded = True
    other.push(other.weights("MODEL"), 1)
    assert other.version == 1 and states[-1] == ("MODEL", full) and other.adapters.pushed == []
    merged, _, seen = _stand_in(monkeypatch, [_Srv("http://a")], full_weights=full)
    assert [n for n, _ in merged.weights("MODEL")] == ["w", "visual.p"]
    assert seen["hf"] == [("MODEL", {"full_weights": full})]
    # the base weights gathered through full_weights too, labelled with the version the servers hold
    late, _, seen = _stand_in(monkeypatch, [_Srv("http://a")], adapters=_Adapters(), full_weights=full)
    late.version = 5
    assert late.weights("MODEL") is adapter and seen["hf"] == [("MODEL", {"merge": False, "full_weights": full})]
    assert late.pool.servers[0].held == late.label(5) and states[-1] == ("MODEL", full)
    # another rank lost its adapter push: this one drops that server too, saying so
    two = [_Srv("http://a"), _Srv("http://c")]
    other, said, _ = _stand_in(monkeypatch, two, adapters=_Adapters(), transfer=None,
                               all_max=_other_ranks({}, {"http://c": 1.0}))
    other.push(adapter, 3)
    assert said == ["rollout server http://c failed its adapter push on another rank: carrying on with 1 of 2 "
                    "rollout servers (http://a)"]


def test_with_images_the_label_empties_the_encoder_cache_and_a_frozen_tower_goes_once(monkeypatch):
    a = _Srv("http://a")
    frozen = []
    monkeypatch.setattr(sb, "frozen_tower", lambda vision: frozen.append(vision) or True)
    vision = (9, 2, "tower")
    b = _stand_in(monkeypatch, [a], vision=vision)[0]
    assert b._frozen_tower() == ""  # nothing pushed yet: the tower goes
    b.push(iter([("w", torch.zeros(1)), ("visual.p", torch.zeros(1))]), 0)
    assert a.paths()[-3:] == ["/reset_prefix_cache", "/reset_encoder_cache", "/update_weight_version"]
    b.push(iter([("w", torch.zeros(1)), ("model.visual.p", torch.zeros(1))]), 1)
    assert b.transfer.pushes[-1] == (["w"], ["http://a"], {"args": ["visual."]}) and frozen == [vision]
    b.rejoined = ["http://a"]  # a server back from a restart holds no tower
    assert b._frozen_tower() == ""
    b.rejoined = []
    monkeypatch.setattr(sb, "frozen_tower", lambda vision: False)
    assert b._frozen_tower() == ""
    monkeypatch.setattr(sb, "frozen_tower", lambda vision: True)
    assert b._frozen_tower() == "visual."
    b.transfer = object()  # vLLM's nccl engine takes every weight
    assert b._frozen_tower() == ""
    assert _stand_in(monkeypatch, [_Srv("http://t")])[0]._frozen_tower() == ""  # a text model


def test_a_restarted_server_rejoins_before_the_push_and_is_said_after_its_check(monkeypatch):
    a, c = _Srv("http://a"), _Srv("http://c")
    b, said, _ = _stand_in(monkeypatch, [a, c], rejoin_every_s=0)
    b.sync_weights("MODEL", 0)
    b.pool.drop("http://c", f"rollout server http://c stopped answering; {RESUME}")
    c.calls.clear()
    c.held = "default"  # it restarted
    b.transfer.joined.clear()
    b.sync_weights("MODEL", 1)
    assert [s.url for s in b.pool.servers] == ["http://a", "http://c"] and b.transfer.joined == [["http://c"]]
    assert b.transfer.pushes[-1][1] == ["http://a", "http://c"] and c.held == b.label(1)
    assert c.paths()[:3] == ["up", "/weight_info", "/v1/models"]
    assert said[-1] == "rollout server http://c rejoined at version 1: 2 of 2 rollout servers up"
    assert b.rejoined == [] and b.stats()["server/servers_up"] == 2.0


def test_a_dropped_server_that_did_not_restart_or_fails_its_checks_stays_out(monkeypatch):
    a, c = _Srv("http://a"), _Srv("http://c")
    b, said, _ = _stand_in(monkeypatch, [a, c], rejoin_every_s=0)
    b.sync_weights("MODEL", 0)
    b.pool.drop("http://c", "c hung")
    b.sync_weights("MODEL", 1)  # it holds this run's label: it did not restart
    assert [s.url for s in b.pool.servers] == ["http://a"] and b.stats()["server/servers_up"] == 1.0
    c.held, c.length = "default", 10  # restarted with a shorter max length: refused, said once
    b.sync_weights("MODEL", 2)
    b.sync_weights("MODEL", 3)
    assert [s.url for s in b.pool.servers] == ["http://a"]
    assert [m for m in said if "cannot rejoin" in m] == [
        "rollout server http://c restarted but cannot rejoin: rollout server http://c has max_model_len=10, the run "
        "needs 200 (its longest prompt + rollout.max_new_tokens); start it with grpo-serve and the run's recipe or a "
        "larger rollout.vllm.max_model_len"]
    # not yet due: not probed
    b.rejoiner.every_s, c.length = 3600, 256
    b.rejoiner.last = float("inf")
    c.calls.clear()
    b.sync_weights("MODEL", 4)
    assert c.calls == [] and [s.url for s in b.pool.servers] == ["http://a"]


def test_a_rank_that_does_not_probe_takes_back_the_servers_rank_0_took_back(monkeypatch):
    a, c = _Srv("http://a"), _Srv("http://c")
    b, said, _ = _stand_in(monkeypatch, [a, c], rejoin_every_s=0, transfer=None,
                           all_max=lambda d: {k: (1.0 if k == "http://c" else v) for k, v in d.items()})
    b._drop_everywhere({"http://c": "c lost"}, "lost")
    assert b.stats()["server/servers_up"] == 1.0
    b._rejoin()
    assert [s.url for s in b.pool.servers] == ["http://a", "http://c"] and b.rejoined == ["http://c"]
    assert c.calls[3:] == [] and b.stats()["server/servers_up"] == 2.0  # rank 0 probed it, not this one


def test_generate_sends_one_request_per_group_seeded_and_cuts_each_sample_at_its_eos(monkeypatch):
    samples = {(1, 3): [[4, 2, 9], [5, 6, 7, 8]]}
    a, c = _Srv("http://a", samples=samples), _Srv("http://c", samples=samples)
    b = _stand_in(monkeypatch, [a, c])[0]
    b.version = None
    out = b.generate([[1, 3], [1, 4]], 2, Sampling(3, temperature=0.5), seed=100)
    assert out.ids == [[[4, 2], [5, 6, 7]], [[5, 2], [5, 2]]] and out.truncated == [[False, True], [False, False]]
    assert [[lp.tolist() for lp in g] for g in out.logprobs] == [[pytest.approx([-0.1, -0.2])] + [
        pytest.approx([-0.1, -0.2, -0.3])], [pytest.approx([-0.1, -0.2])] * 2]
    assert all(lp.dtype == torch.float32 for g in out.logprobs for lp in g) and out.versions == [None, None]
    bodies = sorted((body["prompt"], body["seed"], body["n"], body["model"]) for s in (a, c) for body in s.sampled())
    assert bodies == [([1, 3], 100, 2, "m"), ([1, 4], 102, 2, "m")]
    assert a.paths().count("/v1/completions") == c.paths().count("/v1/completions") == 1  # in turn
    assert all(s.in_flight == 0 for s in (a, c)) and "/weight_info" not in a.paths()  # nothing pushed: no label asked
    unseeded = b.generate([[1, 3]], 2, Sampling(3), seed=None)
    sent = [body for s in (a, c) for body in s.sampled()]
    assert len(sent) == 3 and sum("seed" in body for body in sent) == 2 and unseeded.ids[0][0] == [4, 2]


def test_a_group_of_a_server_that_went_down_or_restarted_is_asked_again_of_the_others(monkeypatch):
    a, c, d = _Srv("http://a", down={"/v1/completions"}), _Srv("http://c"), _Srv("http://d")
    b, said, _ = _stand_in(monkeypatch, [a, c, d])
    b.version = 7
    for s in (c, d):
        s.held = b.label(7)
    d.held = "7@another"
    out = b.generate([[1], [1, 1], [1, 1, 1]], 1, Sampling(4), seed=0)
    assert out.versions == [7, 7, 7] and [s.url for s in b.pool.servers] == ["http://c"]
    assert b.stats()["server/servers_up"] == 1.0
    prompts = [body["prompt"] for body in c.sampled()]
    assert sorted(map(len, prompts)) == sorted(set(map(len, prompts))) and set(map(len, prompts)) == {1, 2, 3}
    assert any(m.startswith("rollout server http://a stopped answering") for m in said)
    assert [m for m in said if m.startswith("rollout server http://d")] == [
        "rollout server http://d restarted or was taken over: it holds weights '7@another', not this run's version "
        f"'7@{b.run_id}', so its samples were not used: carrying on with 1 of 3 rollout servers (http://c)"]
    # a server whose label cannot be read is dropped with its reason
    e, f = _Srv("http://e", down={"/weight_info"}), _Srv("http://f")
    b2, said2, _ = _stand_in(monkeypatch, [e, f])
    b2.version = 0
    f.held = b2.label(0)
    assert b2._relabelled(["http://e", "http://f", "http://x"]) == {
        "http://e": f"rollout server http://e stopped answering (/weight_info: refused); {RESUME}"}
    f.get = lambda path: None
    assert list(b2._relabelled(["http://f"])) == ["http://f"]
    assert list(b2._relabelled(["http://e", "http://f"])) == ["http://e", "http://f"]  # one unreadable, then the next


def test_the_sampler_log_probs_are_float32_and_the_groups_go_out_at_once_up_to_64(monkeypatch):
    made = []

    class _Executor(sb.ThreadPoolExecutor):
        def __init__(self, max_workers=None):
            made.append(max_workers)
            super().__init__(max_workers=max_workers)

    monkeypatch.setattr(sb, "ThreadPoolExecutor", _Executor)
    b = _stand_in(monkeypatch, [_Srv("http://a"), _Srv("http://c")])[0]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = b.generate([[1]], 2, Sampling(4), seed=0)
    finally:
        torch.set_default_dtype(default)
    assert out.logprobs[0][0].dtype == torch.float32
    b.generate([[1]] * 3, 1, Sampling(4), seed=0)
    b.generate([[1]] * 70, 1, Sampling(4), seed=0)
    assert made == [1, 3, 64]


def test_the_last_servers_loss_stops_generate_in_one_line(monkeypatch):
    b = _stand_in(monkeypatch, [_Srv("http://a", down={"/v1/completions"})])[0]
    with pytest.raises(ServerDown, match="^rollout server http://a stopped answering"):
        b.generate([[1]], 1, Sampling(2), seed=0)


def test_multi_turn_contexts_are_one_sample_requests_regrouped_per_prompt(monkeypatch):
    a = _Srv("http://a", samples={(1, 5, 6): [[8, 2]], (1, 5, 7): [[9, 9, 9]], (3, 4): [[2]]})
    b = _stand_in(monkeypatch, [a])[0]
    b.version = None
    out = b.generate([[1, 5], [3]], 4, Sampling(2), seed=10, suffixes=[[[6], [7]], [[4]]])
    assert out.ids == [[[8, 2], [9, 9]], [[2]]] and out.truncated == [[False, True], [False]]
    assert [[len(lp) for lp in g] for g in out.logprobs] == [[2, 2], [1]] and out.versions == [None, None]
    sent = [(body["prompt"], body["n"], body["seed"]) for body in a.sampled()]
    assert sorted(sent) == [([1, 5, 6], 1, 10), ([1, 5, 7], 1, 11), ([3, 4], 1, 12)]

    class _Img(list):
        n_images = 1

    with pytest.raises(sb.SetupError, match="do not take image prompts"):
        b.generate([_Img([1])], 1, Sampling(2), suffixes=[[[4]]])


def test_an_image_prompt_goes_to_the_tokens_in_route_with_its_features(monkeypatch):
    class _Img(list):
        n_images = 2

    monkeypatch.setattr(sb, "image_request", lambda body, prompt, image_id, tower, merge: {
        "body": body["prompt"], "image": (list(prompt), image_id, tower, merge)})
    parsed = []
    monkeypatch.setattr(sb, "parse_generate", lambda answer, prompt: parsed.append((answer, prompt)) or (
        [[3, 2]], [[-1.0, -2.0]]))
    a = _Srv("http://a")
    b = _stand_in(monkeypatch, [a], vision=(9, 2, "tower"))[0]
    a.post = lambda path, body=None: a.calls.append((path, body)) or {"from": path}
    b.version = None
    out = b.generate([_Img([1, 9, 9])], 1, Sampling(4), seed=0)
    assert a.calls[-1] == (sb.GENERATE, {"body": [1, 9, 9], "image": ([1, 9, 9], 9, "tower", 2)})
    assert parsed == [({"from": sb.GENERATE}, [1, 9, 9])] and out.ids == [[[3, 2]]]
    assert b._request([1, 2], {"x": 1}) == ("/v1/completions", {"x": 1}, None)
    text = _stand_in(monkeypatch, [_Srv("http://t")])[0]
    with pytest.raises(ServerError, match="rollout.backend=hf"):
        text._request(_Img([1]), {})


def test_close_drops_the_channel_and_leaves_the_servers_sleep_keeps_them(monkeypatch):
    a = _Srv("http://a")
    b = _stand_in(monkeypatch, [a])[0]
    before = list(a.calls)
    b.sleep()
    b.close()
    assert b.transfer.closed == 1 and a.calls == before
    _stand_in(monkeypatch, [a], transfer=None)[0].close()  # nothing to close
