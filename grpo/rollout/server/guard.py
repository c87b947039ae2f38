"""An ASGI middleware grpo-serve adds to vLLM's server (``--middleware``): the API key on every path but ``/health``.

vLLM's own ``--api-key`` guards only ``/v1/...`` (its `AuthenticationMiddleware`'s prefixes); the endpoints the
trainer drives the weights through (``/collective_rpc``, ``/init_weight_transfer_engine``, ``/update_weights``,
``/update_weight_version``, ``/reset_prefix_cache``, ...) would stay open to anyone who reaches the port. This one
wants ``Authorization: Bearer KEY`` on all of them; ``/health`` stays open (the trainer's wait for a server, a load
balancer's probe). The key is ``VLLM_API_KEY`` of the server's environment (grpo-serve puts it there, not on the
command line); without one it lets everything through, as vLLM does.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os

OPEN = ("/health",)


class RequireKey:
    def __init__(self, app, key: str | None = None):
        self.app = app
        key = key if key is not None else os.environ.get("VLLM_API_KEY")
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    def allowed(self, scope) -> bool:
        if self.digest is None or scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return True
        if scope["path"].removeprefix(scope.get("root_path", "")) in OPEN:
            return True
        given = dict(scope.get("headers") or []).get(b"authorization", b"").decode(errors="replace")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(token.encode()).digest(),
                                                                  self.digest)

    async def __call__(self, scope, receive, send):
        if self.allowed(scope):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": "Unauthorized: this grpo-serve server wants its API key"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
