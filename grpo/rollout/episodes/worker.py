"""Tool and environment calls behind a process boundary, so that a stuck one can be hard-killed
(`grpo.worker_process`).

One persistent worker process imports the tools, holds one environment instance per live episode, and serves
calls. A call that overruns ``rollout.tool_timeout_s`` kills the worker; the next call starts a fresh one, which
first replays the live episodes' history (``reset(row)`` and every call that returned) so that their environments
are where they were. A call that raises or times out comes back as an error message for the model, never as an
exception.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from grpo.worker_process import KillableWorker


@dataclass
class CallResult:
    text: str | None        # what the model sees (None: step() ended the episode)
    ok: bool                # False: it raised, timed out, or its episode's environment was lost
    seconds: float
    timed_out: bool = False


class ToolWorker(KillableWorker):
    """The trainer's side: ``reset``/``call``/``step``/``reward`` per episode key, each with ``timeout_s``."""

    def __init__(self, environment: str | None, timeout_s: float):
        super().__init__("grpo-tool-worker", _handle, _describe)
        self.environment, self.timeout_s = environment, timeout_s
        self.history: dict[object, list[tuple]] = {}   # live episode -> the requests that built its state
        self.lost: set = set()

    def start(self) -> None:
        super().start()
        for key, requests in list(self.history.items()):  # a restarted worker: rebuild the live environments
            for req in requests:
                ok, _, _ = self._send(req)
                if not ok:
                    self.lost.add(key)
                    self.history.pop(key, None)
                    break

    def _send(self, request: tuple) -> tuple[bool, object, bool]:
        """(ok, payload, timed_out); starts the worker when needed."""
        status, payload = self.request(request, self.timeout_s)
        if status == "died":
            return False, "the tool worker process died", False
        return status == "ok", payload, status == "timeout"

    # ---------------------------------------------------------------- episodes
    def reset(self, key, row: dict) -> str | None:
        """A new environment instance for ``key``; returns the text ``reset(row)`` adds to the prompt (or None).
        A reset that raises or times out is the environment's bug: a RuntimeError naming it."""
        request = ("new", key, self.environment, row)
        ok, payload, timed_out = self._send(request)
        if not ok:
            why = f"timed out after rollout.tool_timeout_s={self.timeout_s}" if timed_out else payload
            raise RuntimeError(f"{self.environment} reset(row) failed: {why}")
        self.history[key] = [request]
        return payload

    def call(self, key, name: str, arguments: dict, function: str | None) -> CallResult:
        """Tool ``name``: the function ``function`` ('module:function') or, when None, the episode's environment
        method."""
        request = ("fn", function, arguments) if function is not None else ("call", key, name, arguments)
        return self._run(key, request, f"tool {name}", keep=function is None)

    def step(self, key, text: str) -> CallResult:
        return self._run(key, ("step", key, text), "step()", keep=True)

    def _run(self, key, request: tuple, what: str, keep: bool) -> CallResult:
        if key in self.lost:
            return CallResult(f"Error: the environment was lost when another call timed out; {what} not run",
                              False, 0.0)
        t0 = time.perf_counter()
        ok, payload, timed_out = self._send(request)
        seconds = time.perf_counter() - t0
        if timed_out:
            return CallResult(f"Error: {what} timed out after {self.timeout_s:g} s", False, seconds, True)
        if not ok:
            return CallResult(f"Error: {payload}", False, seconds)
        if keep:
            self.history[key].append(request)
        return CallResult(payload, True, seconds)

    def reward(self, key) -> float | None:
        if key in self.lost:
            return None
        ok, payload, _ = self._send(("reward", key))
        return float(payload) if ok and payload is not None else None

    def drop_all(self) -> None:
        """Forget every episode (their instances are freed in the worker)."""
        if self.history and self.alive():
            self._send(("drop",))
        self.history.clear()
        self.lost.clear()


def as_text(value) -> str:
    """A tool's return value as the text the model reads."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


_objects: dict = {}  # in the worker process: 'module:name' -> the imported object
_envs: dict = {}     # in the worker process: episode key -> its environment instance


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def _handle(request: tuple):
    from grpo.objects import import_attr

    objects, envs = _objects, _envs

    def load(spec):
        if spec not in objects:
            module, _, attr = spec.partition(":")
            objects[spec] = import_attr(module, attr)
        return objects[spec]

    kind = request[0]
    if kind == "fn":
        _, spec, arguments = request
        return as_text(load(spec)(**arguments))
    if kind == "new":
        _, key, spec, row = request
        envs[key] = load(spec)()
        out = envs[key].reset(row)
        return None if out is None else as_text(out)
    if kind == "call":
        _, key, name, arguments = request
        return as_text(getattr(envs[key], name)(**arguments))
    if kind == "step":
        _, key, text = request
        out = envs[key].step(text)
        return None if out is None else as_text(out)
    if kind == "reward":
        fn = getattr(envs[request[1]], "reward", None)
        return None if fn is None else fn()
    if kind == "drop":
        envs.clear()
        return None
    raise ValueError(f"unknown request {kind!r}")
