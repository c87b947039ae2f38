"""The gloo weight channel: what rank 0 streams arrives whole, in order, in every dtype, at every receiver."""
import datetime
import threading

import pytest
import torch

from grpo.runtime import transfer
from grpo.runtime.transfer import WeightChannel, free_port


def _weights():
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(7, 5, generator=g)),
            ("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.randn(5, generator=g).half()),
            ("scalar", torch.tensor(3.5, dtype=torch.float64)),
            ("empty", torch.zeros(0, 3)),
            ("ids", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
            ("a.non_contiguous", torch.randn(3, 4, generator=g).t())]


def test_every_receiver_gets_every_tensor_bit_for_bit_then_the_next_stream():
    port, received, errors = free_port(), {1: [], 2: []}, []

    def receiver(rank):
        try:
            ch = WeightChannel("127.0.0.1", port, rank, 3, timeout_s=60)
            for _ in range(2):  # two streams over one channel
                received[rank].append(list(ch.receive()))
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=receiver, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sender = WeightChannel("127.0.0.1", port, 0, 3, timeout_s=60)
    assert sender.send(iter(_weights())) == 7
    assert sender.send(iter(_weights()[:2])) == 2
    for t in threads:
        t.join(60)
    assert not errors, errors
    for rank in (1, 2):
        first, second = received[rank]
        assert [n for n, _ in first] == [n for n, _ in _weights()]
        for (n, got), (_, want) in zip(first, _weights()):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), n
        assert [n for n, _ in second] == [n for n, _ in _weights()[:2]]


# ------------------------------------------------------------------ over an in-process stand-in for the gloo group
# (the test above runs the real one with a TCP store: `make test`; these are the mutation tests' selection)
class _Bus:
    """What a broadcast does between ``n`` ends that run in threads: the root's tensor is copied into everyone's."""

    def __init__(self, n):
        # an end left waiting (the others stopped early) fails after 2 s; an end that fails breaks the barrier at once
        self.barrier, self.value, self.roots = threading.Barrier(n, timeout=2), None, []

    def broadcast(self, rank, t, root):
        try:
            if rank == root:
                self.value = t.clone()
                self.roots.append(root)
            self.barrier.wait()
            if rank != root:
                assert t.shape == self.value.shape and t.dtype == self.value.dtype, (t.shape, self.value.shape)
                t.copy_(self.value)
            self.barrier.wait()
        except BaseException:
            self.barrier.abort()
            raise


class _Group:
    def __init__(self, bus, rank):
        self.bus, self.rank = bus, rank

    def broadcast(self, t, root):
        self.bus.broadcast(self.rank, t, root)
        return self

    def wait(self):
        return True


def _ends(n):
    bus = _Bus(n)
    ends = []
    for rank in range(n):
        ch = WeightChannel.__new__(WeightChannel)
        ch.rank, ch.world_size, ch.group, ch.store = rank, n, _Group(bus, rank), "store"
        ends.append(ch)
    return bus, ends


def _run(*jobs):
    out, errors = [None] * len(jobs), []

    def run(i, job):
        try:
            out[i] = job()
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    return out


def test_a_stream_arrives_bit_for_bit_at_every_receiver_and_ends_at_its_marker():
    bus, (sender, r1, r2) = _ends(3)
    sent, got1, got2 = _run(lambda: sender.send(iter(_weights())), lambda: list(r1.receive()),
                            lambda: list(r2.receive()))
    assert sent == 7 and set(bus.roots) == {0}
    for got in (got1, got2):
        assert [n for n, _ in got] == [n for n, _ in _weights()]
        for (n, t), (_, want) in zip(got, _weights()):
            assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want), n


def test_every_dtype_and_up_to_eight_dims_and_a_512_byte_name():
    bus, (sender, receiver) = _ends(2)
    weights = [(f"w{i}", torch.ones(1, 2, dtype=dt)) for i, dt in enumerate(transfer.DTYPES)]
    weights += [("d" * 512, torch.arange(2 ** 8, dtype=torch.float32).reshape([2] * 8))]
    sent, got = _run(lambda: sender.send(iter(weights)), lambda: list(receiver.receive()))
    assert sent == len(weights) == 10
    for (n, t), (wn, want) in zip(got, weights):
        assert n == wn and t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)


def test_a_weight_with_more_than_eight_dims_or_a_longer_name_is_refused_before_anything_is_sent():
    bus, (sender, _) = _ends(2)
    with pytest.raises(ValueError, match="cannot be sent"):
        sender.send_one("w", torch.zeros([1] * 9))
    with pytest.raises(ValueError, match="cannot be sent"):
        sender.send_one("é" * 257, torch.zeros(1))  # 514 bytes, 257 characters
    assert bus.roots == []


def test_send_one_and_end_make_a_stream_too():
    bus, (sender, receiver) = _ends(2)

    def send():
        sender.send_one("a", torch.tensor([1.0, 2.0]))
        sender.end()

    _, got = _run(send, lambda: list(receiver.receive()))
    assert [(n, t.tolist()) for n, t in got] == [("a", [1.0, 2.0])]


def test_the_handshake_passes_with_the_same_key_and_fails_on_both_sides_otherwise():
    bus, (a, b) = _ends(2)
    assert _run(lambda: a.handshake("k1"), lambda: b.handshake("k1")) == [True, True]
    assert bus.roots == [0, 1, 0, 1]
    bus, (a, b) = _ends(2)
    assert _run(lambda: a.handshake("k1"), lambda: b.handshake("k2")) == [False, False]


def test_the_handshake_answers_the_peers_challenge_with_its_own_rank():
    """A peer that echoes rank 0's own proof back (no key) is refused: each proof covers the prover's rank."""
    import hashlib
    import hmac

    bus, (a, b) = _ends(2)
    seen = []
    real = bus.broadcast

    def record(rank, t, root):
        real(rank, t, root)
        if rank == 0:
            seen.append(bytes(t.tolist()))

    bus.broadcast = record
    assert _run(lambda: a.handshake("key"), lambda: b.handshake("key")) == [True, True]
    assert len(seen) == 4 and len(seen[0]) == 32 and seen[0] != seen[1]  # two fresh challenges
    assert seen[2] == hmac.new(b"key", seen[1] + bytes([0]), hashlib.sha256).digest()
    assert seen[3] == hmac.new(b"key", seen[0] + bytes([1]), hashlib.sha256).digest()


def test_the_channel_hosts_its_store_on_rank_0_and_makes_a_gloo_group_of_its_own(monkeypatch):
    made = []
    monkeypatch.setattr(transfer.dist, "TCPStore", lambda *a, **k: made.append(("store", a, k)) or "store")
    monkeypatch.setattr(transfer.dist, "ProcessGroupGloo", lambda *a: made.append(("group", a)) or "group")
    for rank in (0, 2):
        ch = WeightChannel("h", 5, rank, 3, timeout_s=7)
        assert (ch.rank, ch.world_size, ch.store, ch.group) == (rank, 3, "store", "group")
        ch.close()
        assert ch.store is None and ch.group is None
    t = datetime.timedelta(seconds=7)
    assert made == [("store", ("h", 5, 3), {"is_master": True, "timeout": t, "wait_for_workers": False}),
                    ("group", ("store", 0, 3, t)),
                    ("store", ("h", 5, 3), {"is_master": False, "timeout": t, "wait_for_workers": False}),
                    ("group", ("store", 2, 3, t))]
    WeightChannel("h", 5, 1, 2)
    assert made[-1][1][-1] == datetime.timedelta(seconds=300)


def test_free_port_is_one_that_can_be_bound():
    import socket

    port = free_port()
    assert isinstance(port, int) and port >= 1024  # one the system picked (port 0 asked), never a privileged one
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
