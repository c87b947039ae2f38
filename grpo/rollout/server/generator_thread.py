"""The server backend as the generator of asynchronous GRPO (``rollout.backend=server``, ``rollout.max_staleness`` > 0).

`ServerGenerator` is a `grpo.rollout.generator_process.Generator` that lives in the trainer's process: the servers
hold the sampling weights, so no second copy of the policy is needed. One worker thread does, strictly in the order the
trainer asked, two kinds of work:

- **push** version v (after ``publish``): stream a snapshot of version v's weights into every server
  (`ServerBackend.push`), then the sync check against the trainer's log-probs of that snapshot;
- **sample** step t with version v (after ``submit``): ``sample(step, version)``, given by the trainer
  (`grpo.trainer.generators.server_generator`): the step's prompts, its HTTP requests to the servers, its rewards,
  its refill rounds.

Because one thread does both in order, the push of version v starts only after every request sampled with an older
version has come back (a sample task returns when all of its requests have: the servers never reload weights under
a request), and before the requests of the steps that use it. Generation and reward scoring thus run while the
trainer's thread runs the update.

Publishing must not race with the optimizer: ``publish`` runs in the trainer's thread between two steps and copies
the weights of version v (under their Hugging Face names, LoRA merged: `grpo.rollout.weights.hf_weights`) into a
snapshot, and takes the trainer's log-probs of the sync check's sequence on them; the worker pushes the snapshot
later. LoRA with adapters (`grpo.rollout.server.adapters`): the base weights are pushed at the first publication
(nothing is in flight yet), and each snapshot is that version's A and B only. A snapshot costs one copy of the
weights in host memory while it waits (at most K of them, usually one); its buffers are reused once pushed, so a
publication is a plain copy.

With several training processes every rank has a generator, and the version is published once: every rank calls
``publish`` at the same step (under ZeRO-3 each weight is gathered on its own, a collective), only the rank that
sends (rank 0) keeps the snapshot, and every rank's worker takes part in the push (the others wait for rank 0's
to end) and its check. The workers' collectives (the push's barrier, the check's maximum, the refill rounds'
"is any rank short") go over a group of their own (``backend``'s collectives: `grpo.runtime.thread_view`),
never the trainers'.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch

from grpo.errors import GRPOError
from grpo.rollout.generator_process import Generated, GeneratorError
from grpo.rollout.server.backend import ServerBackend, trainer_logprobs
from grpo.rollout.weights import hf_weights


class ServerGenerator:
    """``backend``: the connected `ServerBackend`; ``model``: the trainer's model (read only in ``publish``);
    ``sample(step, version) -> Generated``: one step's batch from the servers, run on the worker thread."""

    reads_model = True  # `publish` reads the model a weight at a time (`grpo.rollout.generator_process.Generator`)

    def __init__(self, backend: ServerBackend, model, sample: Callable[[int, int], Generated], full_weights=None,
                 closers: list[Callable[[], None]] = ()):
        """``full_weights``: the runtime's (`grpo.rollout.weights.hf_weights`); ``closers``: called at `close`, after
        the worker has stopped (the sampling side's reward and tool workers, the backend)."""
        self.backend, self.model, self.sample, self.full_weights = backend, model, sample, full_weights
        self.closers = list(closers)
        self.todo: queue.Queue = queue.Queue()     # trainer -> worker: ("push", v, snapshot, mine), ("sample", t, v)
        self.done: queue.Queue = queue.Queue()     # worker -> trainer: ("batch", Generated) or ("error", exception)
        self.free: queue.Queue = queue.Queue()     # snapshots pushed, their buffers free for the next publication
        self.thread = threading.Thread(target=self._work, name="grpo-server-generator", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------------ the trainer's side
    def publish(self, version: int, weights=None) -> None:
        """Snapshot version ``version`` (the trainer's model now) for the worker to push. ``weights`` is None
        (`reads_model`): the servers need every weight under its Hugging Face name, LoRA merged, each time, read
        here one at a time (under ZeRO-3 each gathered on its own, never the whole model on a rank's device); or,
        syncing LoRA adapters, that version's A and B (every rank: the gathers are collectives)."""
        # a `with`, not @torch.no_grad(): mutmut (`make mutate`) does not mutate a decorated function
        with torch.no_grad():
            if getattr(self.backend, "adapters", None) is not None:  # LoRA: the base weights once, then A and B
                snapshot = self.backend.weights(self.model)
                self.todo.put(("push", version, snapshot, trainer_logprobs(self.model, self.backend.check_ids,
                                                                           self.backend.device)))
                return
            keep = self.backend.transfer is not None  # the rank that sends (rank 0); the others only gather (ZeRO-3)
            try:
                snapshot = self.free.get_nowait()
            except queue.Empty:
                snapshot = {}
            stream = hf_weights(self.model, self.full_weights) if self.full_weights else hf_weights(self.model)
            for name, w in stream:
                if not keep:
                    continue
                mine = snapshot.get(name)
                if mine is None or mine.shape != w.shape or mine.dtype != w.dtype:
                    snapshot[name] = w.detach().to("cpu", copy=True)
                else:
                    mine.copy_(w)
            check = trainer_logprobs(self.model, self.backend.check_ids, self.backend.device)
            self.todo.put(("push", version, snapshot, check))

    def submit(self, step: int, version: int) -> None:
        self.todo.put(("sample", step, version))

    def receive(self, timeout: float | None = None) -> Generated:
        """The next finished batch. A failure on the worker thread is raised here: a `GRPOError` (a server that
        stopped answering, a failed sync check) as it is, anything else as a one-line `GeneratorError` caused by it (a
        collective of the workers that lost another rank: the trainer names the rank, `Runtime.peer_failure`)."""
        deadline = None if timeout is None else time.time() + timeout
        while True:
            try:
                kind, payload = self.done.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.thread.is_alive() and self.done.empty():
                    raise GeneratorError("the server generator's thread has stopped") from None
                if deadline is not None and time.time() >= deadline:
                    raise TimeoutError("no batch from the rollout servers in time") from None
        if kind == "error":
            if isinstance(payload, GRPOError):
                raise payload
            raise GeneratorError(f"the server generator failed: {type(payload).__name__}: "
                                 f"{str(payload).splitlines()[0] if str(payload) else ''}") from payload
        return payload

    def close(self, wait_s: float = 10.0) -> None:
        """Stop the worker after the task it is on, then the closers. Nothing is in flight at the end of a run or
        at a checkpoint (they wait for every batch asked for); after a failure the task under way is given
        ``wait_s`` to end, then left to its daemon thread (a half-sent push leaves a server's weights as they were:
        it loads a stream only once it is whole)."""
        while True:  # what was asked and not started is dropped
            try:
                self.todo.get_nowait()
            except queue.Empty:
                break
        self.todo.put(("stop",))
        self.thread.join(timeout=wait_s)
        for close in self.closers:
            close()

    # ------------------------------------------------------------------------------------ the worker thread
    def _work(self) -> None:
        idle_since, load_s = time.time(), 0.0
        while True:
            task = self.todo.get()
            try:
                if task[0] == "stop":
                    return
                if task[0] == "push":
                    t = time.time()
                    _, version, snapshot, check = task
                    adapter = not isinstance(snapshot, dict)  # an `Adapter` (LoRA), or every weight by name
                    self.backend.push(snapshot if adapter else iter(snapshot.items()), version)
                    self.backend.check(mine=check)
                    if not adapter:
                        self.free.put(snapshot)
                    load_s += time.time() - t
                    continue
                _, step, version = task
                if self.backend.version != version:
                    raise RuntimeError(f"step {step} wants the weights of version {version}, the servers hold "
                                       f"{self.backend.version}: published out of order")
                t0 = time.time()
                out = self.sample(step, version)
                out.wait_s, out.busy_s, out.load_s = t0 - idle_since - load_s, time.time() - t0, load_s
                self.done.put(("batch", out))
                idle_since, load_s = time.time(), 0.0
            except BaseException as e:  # noqa: BLE001 - raised in the trainer's thread by `receive`
                self.done.put(("error", e))
                return
