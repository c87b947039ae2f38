"""The CPU weight path of the server backend: a gloo channel of its own with each server's worker.

One channel per server (`grpo.runtime.transfer.WeightChannel`, two ends), not one group over all of them: a server
that dies, hangs or restarts breaks only its own channel, so with several servers the push carries on into the
others and the run drops the lost one (`grpo.rollout.server.backend.ServerBackend.push`). Each channel starts with
the API key's handshake (a peer without the key is refused before any weight travels). The stream is read once:
each tensor (gathered on its own under ZeRO-3) goes down every live channel before the next one is read.
"""
from __future__ import annotations

import json
import threading

from grpo.rollout.server.client import RESUME, ServerError


class GlooTransfer:
    """Rank 0's channels with the servers; ``host``: the address they reach this process at; ``api_key``: what
    both ends prove they hold (None: the empty key, for servers started without one)."""

    def __init__(self, host: str, timeout_s: float = 300.0, api_key: str | None = None):
        self.host, self.timeout_s, self.key = host, timeout_s, api_key or ""
        self.channels: dict = {}  # url -> WeightChannel

    def connect(self, servers) -> None:
        for s in servers:
            if s.url in self.channels:  # a server that restarted and rejoins: its old channel is dead
                self.channels.pop(s.url).close()
            self.channels[s.url] = self._join(s)

    def _join(self, server):
        from grpo.runtime.transfer import WeightChannel, free_port

        port = free_port(self.host)
        spec = {"host": self.host, "port": port, "world_size": 2, "timeout_s": self.timeout_s, "rank": 1}
        errors: list[BaseException] = []
        t = _call(errors, lambda: server.post("/collective_rpc", {"method": "grpo_join", "args": [json.dumps(spec)]}))
        try:
            channel = WeightChannel(self.host, port, 0, 2, self.timeout_s)
            ok = channel.handshake(self.key)
        except RuntimeError as e:
            t.join()
            if errors:
                raise errors[0]
            raise ServerError(f"rollout server {server.url} could not join the trainer's weight channel at "
                              f"{self.host}:{port} ({str(e).splitlines()[0][:120]}); set rollout.server.trainer_host "
                              "to an address it reaches") from None
        t.join()
        if not ok:
            raise ServerError(f"rollout server {server.url} joined the weight channel at {self.host}:{port} without "
                              "the trainer's API key: refused (start grpo-serve with the key the trainer has in "
                              "$GRPO_SERVER_API_KEY, rollout.server.api_key_env)")
        if errors:
            raise errors[0]
        return channel

    def send(self, weights, servers, method: str = "grpo_receive", args: list[str] = ()) -> dict[str, str]:
        """Stream ``weights`` into every server's ``method`` (the worker extension's; ``args``: its string
        arguments); returns {url: why} of those that lost their channel (the others received the whole stream and
        loaded it)."""
        live = [s for s in servers if s.url in self.channels]
        errors = {s.url: [] for s in live}
        body = {"method": method, "args": list(args)}
        calls = {s.url: _call(errors[s.url], lambda s=s: _received(s.post(
            "/collective_rpc", body, retries=0), s.url)) for s in live}
        failed: dict[str, str] = {}

        def down(url: str, e: BaseException) -> None:
            failed[url] = str(e) if isinstance(e, ServerError) else (
                f"rollout server {url} lost its weight channel during a push ({str(e).splitlines()[0][:120]}); "
                f"{RESUME}")
            self.channels.pop(url).close()

        for name, t in weights:
            for s in live:
                if s.url not in failed:
                    try:
                        self.channels[s.url].send_one(name, t)
                    except RuntimeError as e:
                        down(s.url, e)
        for s in live:
            if s.url not in failed:
                try:
                    self.channels[s.url].end()
                except RuntimeError as e:
                    down(s.url, e)
        for s in live:
            calls[s.url].join(None if s.url not in failed else 10)
            if errors[s.url] and s.url not in failed:
                down(s.url, errors[s.url][0])
        return failed

    def close(self) -> None:
        for c in self.channels.values():
            c.close()
        self.channels = {}


def _call(errors: list, fn) -> threading.Thread:
    """``fn()`` on a thread of its own (it blocks until the channel's collective ends); its error kept in
    ``errors``."""
    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised in the calling thread
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _received(answer, url: str) -> None:
    r = ((answer or {}).get("results") or [{}])[0] or {}
    if r.get("missing"):
        raise ServerError(f"rollout server {url}: vLLM parameters the trainer's weights did not fill: "
                          f"{r['missing'][0][:200]}")
    if not r.get("received"):
        raise ServerError(f"rollout server {url} received no weights from the trainer")
