"""The gloo weight channel to the servers (`GlooTransfer`) over stand-ins: a stand-in `WeightChannel` and stand-in
servers record what each end is asked, so a join, a push, a channel lost in the middle of one and a server that
received nothing are each seen without a gloo group or an HTTP server (the real channel: tests/runtime/test_transfer.py;
the real servers: test_backend.py and test_faults.py)."""
import json
import threading

import pytest
import torch

from grpo.rollout.server import gloo
from grpo.rollout.server.client import RESUME, ServerError
from grpo.rollout.server.gloo import GlooTransfer
from grpo.runtime import transfer


class _Channel:
    """What rank 0's end of one channel was asked; ``fail``: where it raises (``("send", name)``, ``("end",)``,
    ``("open",)``, ``("handshake",)``), ``peer_key``: the key the other end holds."""

    made: list = []

    def __init__(self, host, port, rank, world_size, timeout_s):
        self.args, self.sent, self.ended, self.closed, self.keys = (host, port, rank, world_size, timeout_s), [], 0, \
            False, []
        self.fail, self.peer_key = _Channel.plan.pop(0) if _Channel.plan else ((), "")
        _Channel.made.append(self)
        if self.fail == ("open",):
            raise RuntimeError("Connection refused\nat the store")

    def handshake(self, key):
        self.keys.append(key)
        if self.fail == ("handshake",):
            raise RuntimeError("the peer went away")
        return key == self.peer_key

    def send_one(self, name, t):
        if self.fail == ("send", name):
            raise RuntimeError("Connection reset by peer " + "x" * 200 + "\nsecond line")
        self.sent.append((name, t))

    def end(self):
        if self.fail == ("end",):
            raise RuntimeError("timed out at the end")
        self.ended += 1

    def close(self):
        self.closed = True


class _Server:
    """A stand-in `Server`: records each post; ``answer``: what ``/collective_rpc`` of a push answers (an exception
    is raised), ``join_error``: what ``grpo_join`` raises."""

    def __init__(self, url, answer=None, join_error=None):
        self.url, self.posts = url, []
        self.answer = {"results": [{"received": 3}]} if answer is None else answer
        self.join_error = join_error

    def post(self, path, body=None, **kw):
        self.posts.append((path, body, kw))
        if body["method"] == "grpo_join":
            if self.join_error is not None:
                raise self.join_error
            return {"results": [None]}
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


@pytest.fixture
def channels(monkeypatch):
    """The channels made, in order; ``channels.plan``: the behaviour of the next ones (see `_Channel`)."""
    ports = iter(range(29500, 29600))
    monkeypatch.setattr(_Channel, "made", [])
    monkeypatch.setattr(_Channel, "plan", [], raising=False)
    monkeypatch.setattr(_Channel, "port_hosts", [], raising=False)
    monkeypatch.setattr(transfer, "WeightChannel", _Channel)
    monkeypatch.setattr(transfer, "free_port", lambda host: _Channel.port_hosts.append(host) or next(ports))
    return _Channel


def _weights():
    return [("a", torch.zeros(2)), ("b", torch.ones(3)), ("c", torch.arange(4))]


def test_each_server_joins_a_channel_of_its_own_with_the_spec_and_the_key(channels):
    servers = [_Server("http://s1"), _Server("http://s2")]
    channels.plan = [((), "k3y"), ((), "k3y")]
    g = GlooTransfer("10.0.0.5", timeout_s=12.5, api_key="k3y")
    g.connect(servers)
    assert [c.args for c in channels.made] == [("10.0.0.5", 29500, 0, 2, 12.5), ("10.0.0.5", 29501, 0, 2, 12.5)]
    assert channels.port_hosts == ["10.0.0.5", "10.0.0.5"]  # a free port where the servers reach the trainer
    assert [c.keys for c in channels.made] == [["k3y"], ["k3y"]]
    assert g.channels == {"http://s1": channels.made[0], "http://s2": channels.made[1]}
    for s, port in zip(servers, (29500, 29501)):
        ((path, body, kw),) = s.posts
        assert path == "/collective_rpc" and body["method"] == "grpo_join" and kw == {}
        assert [json.loads(a) for a in body["args"]] == [{"host": "10.0.0.5", "port": port, "world_size": 2,
                                                          "timeout_s": 12.5, "rank": 1}]
    # a server that restarted joins again: its old channel is closed and replaced
    old = channels.made[0]
    channels.plan = [((), "k3y")]
    g.connect([servers[0]])
    assert old.closed and g.channels["http://s1"] is channels.made[2] and not channels.made[1].closed
    g.close()
    assert g.channels == {} and all(c.closed for c in channels.made)


def test_without_a_key_the_handshake_proves_the_empty_one_and_the_default_timeout_is_300_s(channels):
    g = GlooTransfer("127.0.0.1")
    g.connect([_Server("http://s")])
    assert channels.made[0].keys == [""] and channels.made[0].args[-1] == 300.0
    assert json.loads(_join_spec(channels, g))["timeout_s"] == 300.0


def _join_spec(channels, g):
    s = _Server("http://other")
    g.connect([s])
    return s.posts[0][1]["args"][0]


def test_a_peer_without_the_key_is_refused_naming_the_server_and_the_channel(channels):
    channels.plan = [((), "another-key")]
    with pytest.raises(ServerError) as e:
        GlooTransfer("127.0.0.1", api_key="k3y").connect([_Server("http://s")])
    assert str(e.value).startswith("rollout server http://s joined the weight channel at 127.0.0.1:29500 without ")


def test_a_channel_that_cannot_open_names_the_address_or_raises_what_the_servers_join_said(channels):
    channels.plan = [(("open",), "")]
    with pytest.raises(ServerError) as e:
        GlooTransfer("10.1.1.1").connect([_Server("http://s")])
    assert str(e.value).startswith("rollout server http://s could not join the trainer's weight channel at "
                                   "10.1.1.1:29500 (Connection refused); set rollout.server.trainer_host")
    channels.plan = [(("handshake",), "")]
    with pytest.raises(ServerError, match=r"at 10\.1\.1\.1:29501 \(the peer went away\)"):
        GlooTransfer("10.1.1.1").connect([_Server("http://s")])
    # the server's own answer (it refused the join) is the error, not the channel's timeout
    said = ServerError("rollout server http://s answered /collective_rpc with HTTP 500: no extension")
    for plan in ([(("open",), "")], [((), "")]):
        channels.plan = plan
        with pytest.raises(ServerError) as e:
            GlooTransfer("10.1.1.1").connect([_Server("http://s", join_error=said)])
        assert e.value is said


class _Deferred:
    """`_call`'s stand-in: the post runs when it is joined (the real one returns once the stream has ended), and the
    join's timeout is recorded."""

    def __init__(self, errors, fn):
        self.errors, self.fn, self.timeouts = errors, fn, []

    def join(self, timeout=None):
        self.timeouts.append(timeout)
        try:
            self.fn()
        except BaseException as e:  # noqa: BLE001 - as `_call` keeps it
            self.errors.append(e)


def _push(channels, monkeypatch, servers, plan, weights=None, **kw):
    calls = []
    monkeypatch.setattr(gloo, "_call", lambda errors, fn: calls.append(_Deferred(errors, fn)) or calls[-1])
    channels.plan = list(plan)
    g = GlooTransfer("127.0.0.1")
    g.connect(servers)
    calls.clear()
    failed = g.send(iter(_weights() if weights is None else weights), servers, **kw)
    return g, failed, calls


def test_a_push_streams_each_tensor_into_every_channel_then_ends_and_asks_each_worker(channels, monkeypatch):
    servers = [_Server("http://s1"), _Server("http://s2")]
    g, failed, calls = _push(channels, monkeypatch, servers, [], method="grpo_receive_adapter", args=("spec",))
    assert failed == {}
    for c in channels.made:
        assert [n for n, _ in c.sent] == ["a", "b", "c"] and c.ended == 1 and not c.closed
        assert all(torch.equal(t, w) for (_, t), (_, w) in zip(c.sent, _weights()))
    for s in servers:
        assert s.posts[-1] == ("/collective_rpc", {"method": "grpo_receive_adapter", "args": ["spec"]}, {"retries": 0})
    assert [c.timeouts for c in calls] == [[None], [None]]
    # the default method, no arguments; a server without a channel is not asked
    _, failed, calls = _push(channels, monkeypatch, servers[:1], [])
    assert failed == {} and servers[0].posts[-1][1] == {"method": "grpo_receive", "args": []}
    stranger = _Server("http://none")
    assert g.send(iter(_weights()), [stranger]) == {} and stranger.posts == []


def test_a_channel_lost_mid_push_is_dropped_and_the_others_get_the_whole_stream(channels, monkeypatch):
    servers = [_Server("http://s1"), _Server("http://s2"), _Server("http://s3")]
    g, failed, calls = _push(channels, monkeypatch, servers, [((), ""), (("send", "b"), ""), (("end",), "")])
    first, lost, unended = channels.made
    assert [n for n, _ in first.sent] == ["a", "b", "c"] and first.ended == 1 and not first.closed
    assert [n for n, _ in lost.sent] == ["a"] and lost.ended == 0 and lost.closed
    assert [n for n, _ in unended.sent] == ["a", "b", "c"] and unended.closed
    assert failed == {
        "http://s2": f"rollout server http://s2 lost its weight channel during a push (Connection reset by peer "
                     f"{'x' * 95}); {RESUME}",
        "http://s3": f"rollout server http://s3 lost its weight channel during a push (timed out at the end); {RESUME}"}
    assert list(g.channels) == ["http://s1"]
    assert [c.timeouts for c in calls] == [[None], [10], [10]]  # a lost one's post is waited for 10 s at most


def test_a_worker_that_received_nothing_or_missed_parameters_is_dropped_with_its_reason(channels, monkeypatch):
    missing = {"results": [{"received": 2, "missing": ["model.norm.weight " + "y" * 300, "other"]}]}
    servers = [_Server("http://ok"), _Server("http://nothing", answer={"results": [{"received": 0}]}),
               _Server("http://missing", answer=missing),
               _Server("http://broken", answer=RuntimeError("Remote end closed\nconnection"))]
    g, failed, _ = _push(channels, monkeypatch, servers, [])
    assert failed == {
        "http://nothing": "rollout server http://nothing received no weights from the trainer",
        "http://missing": "rollout server http://missing: vLLM parameters the trainer's weights did not fill: "
                          f"model.norm.weight {'y' * 182}",
        "http://broken": "rollout server http://broken lost its weight channel during a push (Remote end closed); "
                         f"{RESUME}"}
    assert list(g.channels) == ["http://ok"] and [c.closed for c in channels.made] == [False, True, True, True]


@pytest.mark.parametrize("answer", [None, {}, {"results": []}, {"results": [None]}, {"results": [{}]},
                                    {"results": [{"received": 0, "missing": []}]}])
def test_an_answer_without_a_count_is_no_weights_received(answer):
    with pytest.raises(ServerError, match="^rollout server u received no weights from the trainer$"):
        gloo._received(answer, "u")


def test_an_answer_with_a_count_passes():
    assert gloo._received({"results": [{"received": 1}, {"received": 0}]}, "u") is None
    assert gloo._received({"results": [{"received": 5, "missing": []}]}, "u") is None


def test_call_runs_on_a_daemon_thread_and_keeps_its_error():
    errors, ran, go = [], [], threading.Event()

    def fn():
        go.wait(5)
        ran.append(threading.current_thread())
        raise ValueError("lost")

    t = gloo._call(errors, fn)
    assert t.daemon and t.is_alive() and errors == []
    go.set()
    t.join(5)
    assert ran == [t] and [str(e) for e in errors] == ["lost"]
    ok = gloo._call(errors, lambda: None)
    ok.join(5)
    assert len(errors) == 1
