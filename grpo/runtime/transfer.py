"""A weight channel between the trainer and rollout servers on CPU: one gloo process group of its own.

vLLM's weight-transfer engines (nccl, ipc, ...) need CUDA; on CPU the trainer's weights travel through this:
a `torch.distributed` TCP store hosted by the trainer (rank 0) and a gloo group with every server's worker
(ranks 1..n), separate from the training's own process group (none is touched). The trainer streams one tensor at
a time (a fixed-size header, its name, its bytes), so a ZeRO-3 run sends each weight as it is gathered and never
holds the whole model; a header with ``more = 0`` ends the stream. The server side runs in vLLM's worker
(`grpo.rollout.server.worker`), the trainer side in `grpo.rollout.server.gloo`.

Before any weight, two ends prove to each other that they hold the same API key (`handshake`: a fresh random
challenge each, answered with HMAC-SHA256 of the key; the key itself never travels), so a peer that took the
store's free slot without the key gets no weights and pushes none.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import socket

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.int8, torch.bool]
MAX_DIMS, MAX_NAME = 8, 512
HEADER = 4 + MAX_DIMS     # more, dtype index, ndim, name length, shape...


class WeightChannel:
    """One end of the channel. ``rank`` 0 (the trainer) hosts the store at ``host:port``; ``world_size`` is
    1 + the number of servers. Every collective waits at most ``timeout_s``."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                   wait_for_workers=False)
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def _bcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        self.group.broadcast(t, root).wait()
        return t

    def handshake(self, key: str) -> bool:
        """Two ends (ranks 0 and 1): whether the other holds ``key`` too. Each sends a random challenge, then its
        answer to the other's (HMAC-SHA256 of the key over the challenge and its rank); both always finish the
        exchange, so a refusal is seen on both sides."""
        def proof(challenge: torch.Tensor, rank: int) -> torch.Tensor:
            digest = hmac.new(key.encode(), bytes(challenge.tolist()) + bytes([rank]), hashlib.sha256).digest()
            return torch.tensor(list(digest), dtype=torch.uint8)

        own = torch.tensor(list(os.urandom(32)), dtype=torch.uint8)
        asked = [self._bcast(own if r == self.rank else torch.zeros(32, dtype=torch.uint8), r) for r in (0, 1)]
        said = [self._bcast(proof(asked[1 - r], r) if r == self.rank else torch.zeros(32, dtype=torch.uint8), r)
                for r in (0, 1)]
        peer = 1 - self.rank
        return hmac.compare_digest(bytes(said[peer].tolist()), bytes(proof(asked[self.rank], peer).tolist()))

    def send_one(self, name: str, t: torch.Tensor) -> None:
        """Rank 0: one ``(name, tensor)`` of a stream to every other rank."""
        t = t.detach().contiguous()
        code = name.encode()
        if t.dim() > MAX_DIMS or len(code) > MAX_NAME:
            raise ValueError(f"weight {name!r} cannot be sent: more than {MAX_DIMS} dims or a name over "
                             f"{MAX_NAME} bytes")
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[:4] = torch.tensor([1, DTYPES.index(t.dtype), t.dim(), len(code)])
        header[4:4 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        self._bcast(header)
        self._bcast(torch.tensor(list(code), dtype=torch.uint8))
        self._bcast(t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8))

    def end(self) -> None:
        """Rank 0: the end of this stream."""
        self._bcast(torch.zeros(HEADER, dtype=torch.int64))

    def send(self, weights) -> int:
        """Rank 0: stream ``(name, tensor)`` pairs to every other rank; returns how many were sent."""
        n = 0
        for name, t in weights:
            self.send_one(name, t)
            n += 1
        self.end()
        return n

    def receive(self):
        """Ranks 1..n: yield each ``(name, tensor)`` rank 0 sends until its end marker."""
        while True:
            header = self._bcast(torch.zeros(HEADER, dtype=torch.int64)).tolist()
            if not header[0]:
                return
            dtype, ndim, name_len = DTYPES[header[1]], header[2], header[3]
            shape = header[4:4 + ndim]
            name = bytes(self._bcast(torch.zeros(name_len, dtype=torch.uint8)).tolist()).decode()
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            raw = self._bcast(torch.zeros(nbytes, dtype=torch.uint8))
            yield name, raw.view(dtype).reshape(shape)

    def close(self) -> None:
        self.group = self.store = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the trainer's store binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
