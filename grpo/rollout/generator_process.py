"""A generator in its own process: the sampling side of asynchronous GRPO (``rollout.max_staleness`` > 0).

The trainer talks to a generator through three calls (`Generator`): ``publish(version, weights)`` hands it the
policy's weights after ``version`` loop steps, ``submit(step, version)`` asks for the batch of ``step`` sampled
with those weights, and ``receive()`` gives back the next finished batch (`Generated`). The schedule (which step
uses which version, `grpo.trainer.pipeline`) lives with the trainer; a generator only keeps the order it was given:
weights before the requests that use them.

`GeneratorProcess` is the local one for ``rollout.backend=hf``: a spawned process with its own copy of the policy
and one thread. Inside it, ``build(spec)`` (a module-level function, given by reference like the reward worker's
handler) returns the object that does the work: ``load(weights)`` and ``sample(step, version) -> Generated``.
Weights travel as shared-memory tensors (torch's multiprocessing pickler passes a file descriptor, not the bytes);
results come back pickled. Each side reads its pipe on a thread of its own, so that neither blocks on a send while
the other is busy. The process dies with the trainer (Linux: a parent-death signal; elsewhere at its next read).
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.multiprocessing  # noqa: F401  (registers the shared-memory tensor pickler on multiprocessing's)


@dataclass
class Generated:
    """One finished batch: what it is for, what sampled it, and what the generator spent on it."""
    step: int                  # the loop step that trains on it
    version: int               # the weights it was sampled with: the policy after this many loop steps
    batch: Any                 # a `grpo.batch.Batch`, scored, with ``sampling_logps`` = the behaviour log-probs
    sampler: dict              # the prompt sampler's state after this batch's prompts (refill rounds included)
    wait_s: float = 0.0        # the generator idle before it started this batch (waiting for weights or a request)
    busy_s: float = 0.0        # sampling, scoring and the behaviour log-probs
    load_s: float = 0.0        # copying published weights into its model since the previous batch
    extra: dict = field(default_factory=dict)


class Generator(Protocol):
    """What the trainer's pipeline drives. A server backend plugs in here: ``publish`` pushes the weights to the
    server(s), ``submit`` sends the step's prompts with its seed, ``receive`` returns them scored. ``reads_model``:
    ``publish`` reads the trainer's model itself, one weight at a time (``weights`` is None), instead of being handed
    every parameter whole (under ZeRO-3 the trainer then gathers the whole model for the moment of the copy)."""

    reads_model: bool = False

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None: ...

    def submit(self, step: int, version: int) -> None: ...

    def receive(self, timeout: float | None = None) -> Generated: ...

    def close(self) -> None: ...


class GeneratorError(RuntimeError):
    """The generator failed (its traceback's last line is the message) or its process died."""


class GeneratorProcess:
    """The trainer's handle on a spawned generator. ``build(spec)`` runs in the child; ``spec`` must pickle."""

    def __init__(self, build: Callable, spec, name: str = "grpo-generator"):  # pragma: no mutate block
        ctx = mp.get_context("spawn")
        requests, self._send = ctx.Pipe(duplex=False)    # trainer -> generator: weights, requests, stop
        self._results, results = ctx.Pipe(duplex=False)  # generator -> trainer: ready, batches, errors
        self.proc = ctx.Process(target=_serve, args=(requests, results, build, spec, list(sys.path), os.getcwd()),
                                name=name, daemon=False)  # not a daemon: it may start a reward worker of its own
        self.proc.start()
        requests.close()
        results.close()
        self._free: list = []      # shared-memory weight slots the generator has loaded: (layout, tensors)
        self._loading: dict = {}   # version -> the slot sent with it, until a batch of that version comes back
        self.inbox: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=_read_into, args=(self._results, self.inbox), daemon=True)
        self._reader.start()
        kind, payload = self._next(None)
        if kind != "ready":
            raise GeneratorError(f"the generator process failed to start: {payload}")

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """``weights``: name -> tensor, copied here into a shared-memory slot (the caller may go on changing its
        own). Slots are reused once the generator has loaded them: a fresh one costs page faults over the whole
        model (seconds for SmolLM2-135M on a loaded machine), a reused one a plain copy."""
        key = tuple((k, tuple(v.shape), v.dtype) for k, v in weights.items())
        mine = next((i for i, (k, _) in enumerate(self._free) if k == key), None)
        slot = self._free.pop(mine)[1] if mine is not None else \
            {k: torch.empty(v.shape, dtype=v.dtype).share_memory_() for k, v in weights.items()}
        with torch.no_grad():
            for k, v in weights.items():
                slot[k].copy_(v.detach())
        self._loading[version] = (key, slot)
        self._send.send(("weights", version, slot))

    def submit(self, step: int, version: int) -> None:
        self._send.send(("sample", step, version))

    def receive(self, timeout: float | None = None) -> Generated:
        kind, payload = self._next(timeout)
        if kind == "error":
            raise GeneratorError(f"the generator process failed: {payload}")
        for v in [v for v in self._loading if v <= payload.version]:  # loaded before this batch was sampled
            self._free.append(self._loading.pop(v))
        return payload

    def _next(self, timeout: float | None):
        deadline = None if timeout is None else time.time() + timeout
        while True:
            try:
                return self.inbox.get(timeout=1.0 if deadline is None else max(0.0, min(1.0, deadline - time.time())))
            except queue.Empty:
                if not self.proc.is_alive() and self.inbox.empty():
                    raise GeneratorError(f"the generator process died (exit code {self.proc.exitcode})") from None
                if deadline is not None and time.time() >= deadline:
                    raise TimeoutError("no batch from the generator in time") from None

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._send.send(("stop",))
            except OSError:
                pass
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(timeout=5)


def _read_into(conn, inbox: queue.Queue) -> None:
    """A reader thread: every message on ``conn`` into ``inbox`` until the pipe closes."""
    while True:
        try:
            inbox.put(conn.recv())
        except (EOFError, OSError):
            return


def _die_with_parent() -> None:  # pragma: no mutate block
    """Linux: SIGKILL this process when the trainer dies (kill -9 included)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _serve(requests, results, build: Callable, spec, path: list[str], cwd: str) -> None:
    """The generator process: build, then weights and requests in the order they came."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and then stops us
    sys.path[:] = path
    os.chdir(cwd)
    try:
        side = build(spec)
    except BaseException:  # noqa: BLE001 - the trainer reports it
        results.send(("error", traceback.format_exc().strip().splitlines()[-1]))
        return
    results.send(("ready", None))
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read_into, args=(requests, inbox), daemon=True).start()
    idle_since, load_s = time.time(), 0.0
    while True:
        try:
            msg = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() == 1:  # orphaned where there is no parent-death signal
                return
            continue
        if msg[0] == "stop":
            return
        if msg[0] == "weights":
            t = time.time()
            side.load(msg[1], msg[2])  # (version, weights)
            load_s += time.time() - t
            continue
        try:
            t0 = time.time()
            out = side.sample(msg[1], msg[2])
            out.wait_s, out.busy_s, out.load_s = t0 - idle_since - load_s, time.time() - t0, load_s
            results.send(("batch", out))
        except BaseException as e:  # noqa: BLE001 - whatever failed goes back as one line
            results.send(("error", f"{type(e).__name__}: {e}".splitlines()[0]))
            return
        idle_since, load_s = time.time(), 0.0
