"""The gloo weight channel: what rank 0 streams arrives whole, in order, in every dtype, at every receiver."""
import threading

import torch

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
