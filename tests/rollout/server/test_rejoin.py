"""grpo/rollout/server/rejoin.py: rank 0's probes of dropped servers, over stand-in servers (the restarts of real fake
servers are tests/rollout/server/test_faults.py's)."""
import pytest

from grpo.rollout.server import rejoin
from grpo.rollout.server.client import ServerError
from grpo.rollout.server.rejoin import PROBE_S, Rejoiner


class _Server:
    def __init__(self, url="http://a:1", up=True, label=None, error=None):
        self.url, self._up, self.label, self.error, self.asked = url, up, label, error, []

    def up(self, timeout_s):
        self.asked.append(("up", timeout_s))
        return self._up

    def get(self, path, timeout_s, retries):
        self.asked.append((path, timeout_s, retries))
        if self.error:
            raise self.error
        return self.label


def test_probes_are_due_at_most_every_every_s_seconds(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(rejoin.time, "monotonic", lambda: now[0])
    r = Rejoiner(5.0, print)
    assert r.due() and r.last == 100.0  # the first is due at once
    now[0] = 104.9
    assert not r.due() and r.last == 100.0
    now[0] = 105.0
    assert r.due() and r.last == 105.0
    every = Rejoiner(0, print)
    assert every.due() and every.due()  # 0: before every push


def test_a_fresh_server_restarted_and_its_probes_are_bounded():
    r = Rejoiner(0, print)
    for label in (None, {}, {"weight_version": None}, {"weight_version": "default"}, {"weight_version": 3}):
        s = _Server(label=label)
        assert r.restarted(s, "run1") is True, label
        assert s.asked == [("up", PROBE_S), ("/weight_info", 5.0, 0)] and PROBE_S == 2.0


def test_a_server_down_or_failing_its_label_or_holding_this_runs_weights_did_not_restart():
    said = []
    r = Rejoiner(0, said.append)
    down = _Server(up=False)
    assert r.restarted(down, "run1") is False and down.asked == [("up", 2.0)]
    assert r.restarted(_Server(error=ServerError("x")), "run1") is False
    assert r.restarted(_Server(label={"weight_version": "3@run1"}), "run1") is False
    assert r.restarted(_Server(label={"weight_version": "3@run1@x"}), "run1@x") is False  # the first @ splits
    assert said == []
    with pytest.raises(RuntimeError):  # only the server's own errors mean "not back"
        r.restarted(_Server(error=RuntimeError("bug")), "run1")


def test_another_runs_weights_are_said_once_per_server():
    said = []
    r = Rejoiner(0, said.append)
    other = _Server(label={"weight_version": "7@run2"})
    assert r.restarted(other, "run1") is False and r.restarted(other, "run1") is False
    assert said == ["rollout server http://a:1 is up again but holds another run's weights ('7@run2'): another "
                    "trainer took it over, so it does not rejoin this run"]
    assert r.restarted(_Server("http://b:2", label={"weight_version": "1@run3"}), "run1") is False
    assert len(said) == 2 and "http://b:2" in said[1] and r.said == {"http://a:1", "http://b:2"}


def test_a_refusal_is_said_once_per_server():
    said = []
    r = Rejoiner(0, said.append)
    r.refused(_Server(), "it serves another model")
    r.refused(_Server(), "again")
    r.refused(_Server("http://b:2"), "too short")
    assert said == ["rollout server http://a:1 restarted but cannot rejoin: it serves another model",
                    "rollout server http://b:2 restarted but cannot rejoin: too short"]
    assert Rejoiner(3, print).said == set() and Rejoiner(3, print).every_s == 3
