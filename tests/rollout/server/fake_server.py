"""A small stand-in for vLLM's server, in-process, for the client logic where vLLM is not installed.

It speaks the few endpoints the server backend uses (``/health``, ``/v1/models``, ``/v1/completions``,
the tokens-in ``/inference/v1/generate`` of prompts with images (canned, each log-prob -0.25),
``/collective_rpc``, ``/reset_prefix_cache``, ``/update_weight_version``) and holds a real HF model: the weights
the trainer streams through the real gloo channel (`grpo.runtime.transfer`) are loaded into it, and the
prompt log-probs of the sync check are that model's. ``stale=True``: it receives the weights but keeps its old
ones (the silent failure the sync check exists for). Generation is canned: ``n`` choices of ``tokens`` (the
seed added to the first one), each token's log-prob -0.5; with ``vocab`` (a training run) the first token is taken
modulo it and the log-probs are the held model's. Every request body is recorded in ``requests``, and each
answered request in ``spans`` as (path, body, start, end, the weight version held at its start).

Faults: ``kill()`` (the process gone: no answers, its weight channel closed), ``restart()`` (up again at the same
URL with other weights, no channel and no weight label, as a fresh vLLM), ``die_after`` tensors of a push (the
server dies half way through receiving), ``kill_after`` generation requests (it dies mid-run), ``restart_after``
generation requests (it dies under the next and is up again at once, with its first weights and ``restart_label``),
``api_key`` (every path but ``/health`` wants it as a bearer token, as grpo-serve's server does, and the weight
channel's handshake proves it; ``channel_key``: another key for the channel only).
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class FakeServer:
    def __init__(self, model=None, name: str = "tiny:llama", max_model_len: int = 256, stale: bool = False,
                 tokens=(5, 6, 7), delay_s: float = 0.0, drop_first: int = 0, facts: dict | None = None,
                 vocab: int | None = None, api_key: str | None = None, die_after: int | None = None,
                 kill_after: int | None = None, channel_key: str | None = None, restart_after: int | None = None,
                 restart_label: str | None = None):
        self.model, self.name, self.max_model_len, self.stale = model, name, max_model_len, stale
        self.tokens, self.delay_s, self.drop_first = list(tokens), delay_s, drop_first
        self.facts, self.vocab = facts, vocab  # vocab: the first token is taken modulo it (a training run's seeds)
        self.requests: list[tuple[str, dict]] = []
        self.spans: list[tuple[str, dict, float, float, str]] = []
        self.version, self.channel, self.received = "default", None, 0
        self.lock = threading.Lock()
        self.api_key, self.die_after, self.dead, self.stopped = api_key, die_after, False, False
        self.kill_after = kill_after  # generation requests answered before the server dies
        # generation requests answered before it restarts under the next one (its connection dropped; up again at once
        # with its first weights and ``restart_label``: None as a fresh vLLM, or another run's that took it over)
        self.restart_after, self.restart_label, self.restarts = restart_after, restart_label, 0
        self.first = None if model is None else {k: v.clone() for k, v in model.state_dict().items()}
        self.channel_key = api_key if channel_key is None else channel_key  # what its weight channel proves
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                fake._answer(self, "GET", None)

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                fake._answer(self, "POST", json.loads(self.rfile.read(n) or b"{}"))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> "FakeServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = self.dead = True
            self.httpd.shutdown()
            self.httpd.server_close()

    def kill(self) -> None:
        """The server's process gone: the port refuses, its channel's sockets close."""
        self.stop()
        self._drop_channel()

    def restart(self, model=None) -> None:
        """A fresh server at the same URL: other weights (``model``), no trainer joined, no weight label."""
        self._drop_channel()
        with self.lock:
            self.model = model if model is not None else self.model
            self.version = None

    def _drop_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    # ------------------------------------------------------------------------------------ answers
    def _answer(self, h, method: str, body):
        if self.api_key and h.path != "/health" and h.headers.get("Authorization") != f"Bearer {self.api_key}":
            h.send_response(401)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        with self.lock:
            if self.kill_after is not None and h.path == "/v1/completions" and "n" in (body or {}):
                if self.kill_after == 0:
                    self.dead = True
                self.kill_after -= 1
            if self.restart_after is not None and h.path == "/v1/completions" and "n" in (body or {}):
                self.restart_after -= 1
                if self.restart_after < 0:  # it dies under this request and comes back at once, fresh
                    self.restart_after, self.restarts = None, self.restarts + 1
                    self._drop_channel()
                    self.model.load_state_dict(self.first)
                    self.version = self.restart_label
                    h.close_connection = True
                    return
            if self.dead:  # gone: the connection drops unanswered
                h.close_connection = True
                threading.Thread(target=self.kill, daemon=True).start()
                return
            self.requests.append((h.path, body))
            if self.drop_first > 0:  # a connection reset before any answer
                self.drop_first -= 1
                h.close_connection = True
                h.connection.close()
                return
        t0, held = time.monotonic(), self.version
        if self.delay_s:
            time.sleep(self.delay_s)
        try:
            out = self._route(h.path, body)
        except Exception as e:  # noqa: BLE001 - answered as vLLM does: HTTP 500 with the error; a dead one hangs up
            if self.dead:
                h.close_connection = True
                return
            data = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
            h.send_response(500)
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
            return
        with self.lock:
            self.spans.append((h.path, body, t0, time.monotonic(), held))
        data = json.dumps(out).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _route(self, path: str, body):
        if path == "/health":
            return {}
        if path == "/v1/models":
            return {"data": [{"id": self.name, "max_model_len": self.max_model_len}]}
        if path == "/collective_rpc":
            return {"results": [getattr(self, "_rpc_" + body["method"])(*body.get("args", []))]}
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return {"success": True}
        if path == "/weight_info":
            return {"weight_version": self.version}
        if path == "/v1/completions":
            return self._completions(body)
        if path == "/inference/v1/generate":  # vLLM's tokens-in route (prompts with images): canned, as above
            return self._generate(body)
        return {}

    def _rpc_grpo_model_info(self):
        from grpo.rollout.server.facts import model_facts

        facts = self.facts or model_facts(self.model.config)
        return {**facts, "max_model_len": self.max_model_len}

    def _rpc_grpo_join(self, spec):
        from grpo.runtime.transfer import WeightChannel

        s = json.loads(spec)
        channel = WeightChannel(s["host"], s["port"], s["rank"], s["world_size"], s["timeout_s"])
        if not channel.handshake(self.channel_key or ""):
            raise PermissionError("the trainer did not present this server's API key")
        self.channel = channel
        return {"joined": True}

    def _rpc_grpo_receive(self, *left_out):
        self.left_out = left_out
        if self.channel is None:
            raise RuntimeError("no trainer has joined this server's weight channel")
        weights = {}
        for name, t in self.channel.receive():
            weights[name] = t
            if self.die_after is not None and len(weights) >= self.die_after:
                self.kill()  # half way through the stream: nothing is loaded
                raise ConnectionAbortedError("killed during a push")
        self.received += 1
        if not self.stale:
            weights = {k: v for k, v in weights.items() if k in self.model.state_dict()}
            self.model.load_state_dict(weights, strict=False)
        return {"received": len(weights), "missing": []}

    def _scored(self, prompt, toks, temperature: float) -> list[float]:
        """The model's log-prob of each canned token after ``prompt``, at ``temperature`` (vLLM's processed
        log-probs): the behaviour log-probs of the weights the server holds."""
        x = torch.tensor([list(prompt) + toks])
        logits = self.model(input_ids=x).logits[0, len(prompt) - 1:-1].float() / max(temperature, 1e-6)
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks)[:, None])[:, 0].tolist()

    @torch.no_grad()
    def _completions(self, body):
        prompt = body["prompt"]
        if body.get("prompt_logprobs") is not None:
            logp = torch.log_softmax(self.model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
            rows = [None] + [{str(t): {"logprob": float(logp[i, t])}} for i, t in enumerate(prompt[1:])]
            return {"choices": [{"index": 0, "token_ids": [0], "prompt_logprobs": rows,
                                 "logprobs": {"token_logprobs": [0.0]}}]}
        seed = body.get("seed") or 0
        choices = []
        for i in range(body["n"]):
            first = self.tokens[0] + seed + i
            toks = [first % self.vocab if self.vocab else first] + self.tokens[1:]
            lps = self._scored(prompt, toks, body["temperature"]) if self.vocab else [-0.5] * len(toks)
            choices.append({"index": i, "token_ids": toks, "logprobs": {"token_logprobs": lps}})
        return {"choices": choices[::-1]}  # out of order, as a server may answer

    def _generate(self, body):
        sp, seed = body["sampling_params"], body["sampling_params"].get("seed") or 0
        choices = [{"index": i, "token_ids": [self.tokens[0] + seed + i] + self.tokens[1:],
                    "logprobs": {"content": [{"token_id": t, "logprob": -0.25} for t in self.tokens]}}
                   for i in range(sp["n"])]
        ran = body["token_ids"] if body.get("return_token_ids") else None
        return {"choices": choices[::-1], "prompt_token_ids": ran}
