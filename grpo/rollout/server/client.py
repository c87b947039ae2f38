"""The trainer's HTTP side of the server backend: requests to vLLM's OpenAI-compatible servers, nothing else.

- `Server`: one URL. ``post``/``get`` JSON with a timeout, the API key as ``Authorization: Bearer`` (vLLM's
  ``--api-key``); a request that cannot connect or times out is tried again ``retries`` times (one second apart),
  then raises `ServerDown` naming the URL: one line, no traceback.
- `ServerPool`: the run's servers. `drop` takes a server that died, hung or restarted out of the pool, saying so
  once (`add` puts one that restarted back: `grpo.rollout.server.rejoin`); the last one's loss stops the run
  (`ServerDown`, one line: which server, what happened, what to do).
  `wait_until_up` polls ``GET /health`` up to ``connect_timeout_s`` (saying once that it waits); `pick` chooses
  the server of the next group (``round_robin``: in turn; ``least_loaded``: the one with the fewest requests in
  flight); `group_request` / `parse_group` build one ``POST /v1/completions`` for a
  whole group (``n = G`` samples from one prompt given as token ids, so the server's prefix cache holds the prompt
  once) and read back token ids and sampling log-probs (no text, no re-tokenization).
"""
from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request

from grpo.errors import GRPOError


class ServerError(GRPOError, RuntimeError):
    """A rollout server that does not answer, answers an error, or serves something else than the trainer."""


class ServerDown(ServerError):
    """A server that stopped answering (refused, reset, timed out), restarted, or lost its weight channel: with other
    servers left the run carries on without it (`ServerPool.drop`)."""


RESUME = "restart it (grpo-serve with the run's recipe) and resume the run with trainer.resume=auto"


def _short(e: Exception) -> str:
    if isinstance(e, urllib.error.HTTPError):
        try:
            body = e.read().decode(errors="replace")
        except Exception:  # noqa: BLE001 - the body is only for the message
            body = ""
        return f"HTTP {e.code}: {' '.join(body.split())[:200]}"
    reason = getattr(e, "reason", None) or e
    return " ".join(str(reason).split())[:200] or type(e).__name__


def _decoded(raw: bytes):
    """An answer's JSON, its text where it is not JSON (vLLM's LoRA endpoints answer plain text), None if empty."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class Server:
    def __init__(self, url: str, timeout_s: float = 600.0, retries: int = 2, retry_wait_s: float = 1.0,
                 api_key: str | None = None):
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.retry_wait_s = timeout_s, retries, retry_wait_s
        self.in_flight = 0
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def request(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None,
                retries: int | None = None):
        """The decoded JSON answer (None for an empty one). Connection failures and timeouts are retried; an
        HTTP error answer is not (the server is up and said no)."""
        data = None if body is None else json.dumps(body).encode()
        tries = 1 + (self.retries if retries is None else retries)
        for attempt in range(tries):
            req = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers=self.headers)
            try:
                with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as r:
                    raw = r.read()
                return _decoded(raw)
            except urllib.error.HTTPError as e:
                if e.code == 401:
                    raise ServerError(f"rollout server {self.url} refused {path}: wrong or missing API key (the "
                                      "trainer sends $GRPO_SERVER_API_KEY, rollout.server.api_key_env; grpo-serve "
                                      "must be started with the same)") from None
                raise ServerError(f"rollout server {self.url} answered {path} with {_short(e)}") from None
            except (OSError, urllib.error.URLError) as e:  # refused, reset, timed out
                if attempt + 1 == tries:
                    raise ServerDown(f"rollout server {self.url} stopped answering ({path}: {_short(e)}); "
                                     f"{RESUME}") from None
                time.sleep(self.retry_wait_s)

    def post(self, path: str, body: dict | None = None, **kw):
        return self.request("POST", path, body if body is not None else {}, **kw)

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    def up(self, timeout_s: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False


class ServerPool:
    def __init__(self, urls: list[str], *, balance: str = "round_robin", timeout_s: float = 600.0, retries: int = 2,
                 connect_timeout_s: float = 300.0, say=None, api_key: str | None = None):
        self.servers = [Server(u, timeout_s, retries, api_key=api_key) for u in urls]
        self.known = list(self.servers)  # every server of the run, dropped or not, in the order given
        self.started = len(self.servers)  # how many the run started with (`drop` says how many are left)
        self.balance, self.connect_timeout_s = balance, connect_timeout_s
        self.say = say or (lambda msg: print(f"[grpo] {msg}", file=sys.stderr, flush=True))
        self._next, self._lock = 0, threading.Lock()

    def drop(self, url: str, why: str) -> None:
        """Take the server at ``url`` out of the pool (``why``: one line naming it, what happened and what to do)
        and say so; the last server's loss raises `ServerDown` with ``why``. Dropping a server already out is a
        no-op, so every thread that saw it fail may call this."""
        with self._lock:
            left = [s for s in self.servers if s.url != url]
            if len(left) == len(self.servers):
                return
            if not left:
                raise ServerDown(why)
            self.servers = left
        self.say(f"{why.split('; ')[0]}: carrying on with {len(left)} of {self.started} rollout servers "
                 f"({', '.join(s.url for s in left)})")

    def add(self, url: str) -> None:
        """Put the run's server at ``url`` back into the pool (a server that restarted and rejoined:
        `grpo.rollout.server.rejoin`), in its place in the order given."""
        with self._lock:
            back = {s.url for s in self.servers} | {url}
            self.servers = [s for s in self.known if s.url in back]

    def wait_until_up(self, poll_s: float = 1.0) -> None:
        """Every server answers ``/health`` within ``connect_timeout_s`` (one line saying so while waiting)."""
        deadline = time.monotonic() + self.connect_timeout_s
        for s in self.servers:
            said = False
            while not s.up():
                if time.monotonic() > deadline:
                    raise ServerError(f"rollout server {s.url} is not up after rollout.server.connect_timeout_s="
                                      f"{self.connect_timeout_s:g}; start it with grpo-serve (docs/rollout.md)")
                if not said:
                    self.say(f"waiting for the rollout server at {s.url} (up to {self.connect_timeout_s:g} s)")
                    said = True
                time.sleep(poll_s)

    def pick(self) -> Server:
        """The server of the next group, counted as in flight until `done`."""
        with self._lock:
            if self.balance == "least_loaded":
                s = min(self.servers, key=lambda x: x.in_flight)
            else:
                s = self.servers[self._next % len(self.servers)]
                self._next += 1
            s.in_flight += 1
            return s

    def done(self, s: Server) -> None:
        with self._lock:
            s.in_flight -= 1


def model_info(server) -> dict:
    """What the server's worker extension says of its model (``/collective_rpc`` -> ``grpo_model_info``: the
    config's sizes, max_model_len, its LoRA settings)."""
    info = (server.post("/collective_rpc", {"method": "grpo_model_info"}) or {}).get("results") or [{}]
    return info[0] or {}


def group_request(model: str, prompt: list[int], n: int, sampling, eos_ids: list[int], seed: int | None) -> dict:
    """One group as one ``/v1/completions`` body: the prompt as token ids, ``n`` samples, the sampler's
    log-prob of each sampled token, token ids back (``return_token_ids``)."""
    greedy = sampling.greedy
    if not greedy and sampling.temperature > 2.0:
        raise ServerError(f"rollout.temperature={sampling.temperature}: vLLM accepts temperatures in [0, 2]; "
                          "use rollout.backend=hf for a higher one")
    body = {"model": model, "prompt": list(prompt), "n": 1 if greedy else n, "max_tokens": sampling.max_new_tokens,
            "temperature": 0.0 if greedy else sampling.temperature, "top_p": 1.0 if greedy else sampling.top_p,
            "top_k": -1 if greedy or sampling.top_k <= 0 else sampling.top_k, "stop_token_ids": list(eos_ids),
            "ignore_eos": False, "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False}
    if seed is not None:
        body["seed"] = seed
    return body


def parse_group(answer: dict) -> tuple[list[list[int]], list[list[float]]]:
    """Token ids and sampled-token log-probs of each choice, in the order of their index."""
    ids, logps = [], []
    for c in sorted(answer["choices"], key=lambda c: c["index"]):
        toks = list(c.get("token_ids") or [])
        lp = (c.get("logprobs") or {}).get("token_logprobs") or []
        if len(lp) != len(toks):
            raise ServerError(f"the rollout server returned {len(toks)} tokens but {len(lp)} log-probs")
        ids.append(toks)
        logps.append([float(x) for x in lp])
    return ids, logps


def prompt_logprobs(answer: dict, ids: list[int]) -> list[float]:
    """The server's log-prob of each token of ``ids`` after the first (``prompt_logprobs``), in order."""
    rows = answer["choices"][0].get("prompt_logprobs") or []
    out = []
    for t, row in zip(ids[1:], rows[1:]):
        entry = (row or {}).get(str(t))
        if entry is None:
            raise ServerError("the rollout server's prompt log-probs do not cover the check sequence")
        out.append(float(entry["logprob"] if isinstance(entry, dict) else entry))
    return out
