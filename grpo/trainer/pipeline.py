"""The batch for step t: collected in the loop (``rollout.max_staleness=0``, the synchronous run) or sampled ahead by
a generator in its own process on a fixed lag (K > 0, asynchronous GRPO; docs/async.md).

The schedule. Steps are 1-based; *version* v is the policy after v loop steps (version 0: the initial weights).
The batch of step t is sampled with version ``max(0, t-1-K)`` (`sampled_with`), always: K = 0 is the synchronous
loop (step t samples with the weights step t-1 left), and with K = 2 step 5 trains on a batch sampled with
version 2 while the generator samples steps 6 and 7 with versions 3 and 4. Which version samples which step never
depends on timing, so the same config and seed give the same run. Before step t trains (`AsyncBatches.batch`),
version t-1 is published to the generator, and with it the request for step t+K, the first step that uses it.
With ``algorithm.num_iterations=mu`` > 1 a batch trains mu loop steps and the lag counts batches: the batch first
trained at step t is sampled with version ``max(0, t-1-K*mu)``. With many processes every rank drives a generator of
its own, which samples the rank's share (the ranks publish and ask in step, the same versions for the same steps).

What is in flight at a checkpoint after step t: the batches of steps t+1..t+K. Their versions (t-K..t-1) are all
older than the checkpoint's weights, so regenerating them after a resume would need K old copies of the weights
in the checkpoint (and, with a server backend, pushing old weights back). Instead the checkpoint waits for them to
finish and stores them (token ids, rewards, behaviour log-probs: small), with the prompt sampler's state after
their prompts; the resumed generator starts at step t+K+1. Nothing is trained twice or skipped.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

import torch

from grpo import experience
from grpo.batch import Batch
from grpo.config.schema import Config
from grpo.errors import SetupError
from grpo.rollout import registry
from grpo.rollout.generator_process import Generated, Generator, GeneratorError
from grpo.trainer.run import LoopState, Run


def sampled_with(step: int, lag: int, passes: int = 1) -> int:
    """The weights version that samples the batch of ``step`` (1-based) with ``rollout.max_staleness=lag``.
    ``passes``: algorithm.num_iterations, the loop steps each batch trains (a new batch at steps 1, 1 + passes, ...):
    the lag counts batches, so the batch first trained at ``step`` is sampled with the weights ``lag`` batches
    earlier, when that batch's first pass started."""
    return max(0, step - 1 - lag * passes)


def check(cfg: Config) -> None:
    """What asynchronous GRPO does not run with yet (as the backend's capabilities say): one line, before any model
    loads."""
    K, why = cfg.rollout.max_staleness, None
    if K == 0:
        return
    device = cfg.trainer.device if cfg.trainer.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    a, r, dist = cfg.algorithm, cfg.rollout, cfg.distributed.backend
    b = registry.backend(registry.pick(r.backend, device))
    caps = b.capabilities
    if caps.ahead is None:
        why = f"drives the hf generator process or the rollout servers (rollout.backend={r.backend}); use " \
              f"rollout.backend={' or '.join(n for n in registry.BACKENDS if registry.capabilities(n).ahead)}"
    elif caps.ahead == "process" and dist != "none" and a.filter_zero_std_groups and a.resample_zero_std > 0:
        why = (f"with distributed.backend={dist} samples in one generator process per rank, which cannot "
               f"agree on refill rounds (algorithm.resample_zero_std={a.resample_zero_std}); use "
               "algorithm.resample_zero_std=0 (the zero-std filter alone works), rollout.backend=server, or "
               "distributed.backend=none")
    elif not caps.ahead_ranks and dist != "none":
        why = f"with rollout.backend={r.backend} runs one trainer process for now (distributed.backend={dist}); use " \
              "distributed.backend=none, or rollout.backend=hf (a generator per rank)"
    elif not caps.ahead_passes and a.num_iterations > 1:
        why = f"with rollout.backend={r.backend} trains each batch once for now (algorithm.num_iterations=" \
              f"{a.num_iterations}); use algorithm.num_iterations=1, or rollout.backend=hf"
    elif b.refuse_ahead is not None:
        why = b.refuse_ahead(r, device)
    if why:
        raise SetupError(f"rollout.max_staleness={K} {why}")


def batches(run: Run, cfg: Config, state: LoopState, process: bool | None = None):
    """The run's source of batches: `InlineBatches` (K = 0) or `AsyncBatches` with the generator the backend samples
    ahead with (`grpo.trainer.generators`: a `GeneratorProcess`, or the servers' `ServerGenerator`).
    ``process=True`` drives the generator process at K = 0 too (benchmarks and tests: every batch then samples
    with the trainer's current weights, one side idle while the other works)."""
    K, saved = cfg.rollout.max_staleness, state.in_flight
    if saved is not None and saved["lag"] != K:
        raise SetupError(f"the checkpoint holds batches sampled ahead with rollout.max_staleness={saved['lag']}; "
                         f"resume with that value (it is {K})")
    if not (K > 0 if process is None else process):
        return InlineBatches(run)
    from grpo.trainer import generators

    thread = registry.capabilities(run.settings.sampler.backend).ahead == "thread"  # the servers, in this process

    def start():
        return generators.server_generator(run) if thread else generators.process_generator(run, cfg.model)

    return AsyncBatches(run, start, K, cfg.trainer.max_steps, saved, passes=cfg.algorithm.num_iterations)


class InlineBatches:
    """K = 0: `grpo.experience.collect` in the loop, as the synchronous trainer always has."""

    def __init__(self, run: Run):
        self.run = run

    def batch(self, step: int) -> Batch:
        run = self.run
        return experience.collect(run.sampler, run.runtime, run.settings.collect, run)

    def in_flight(self) -> dict | None:
        return None

    def close(self) -> None:
        pass


class AsyncBatches:
    """K > 0: batches sampled ahead by ``generator`` on the fixed lag; ``saved``: a checkpoint's `in_flight`;
    ``passes``: algorithm.num_iterations (`batch` is called at steps 1, 1 + passes, ...). ``generator`` may be a
    function that starts one: it is called when the first batch is asked of it, so that a resume whose remaining
    steps are all in flight in its checkpoint starts none (a generator process costs seconds to start)."""

    def __init__(self, run: Run, generator: Generator | Callable[[], Generator], lag: int, max_steps: int,
                 saved: dict | None = None, passes: int = 1):
        self.run, self.lag, self.max_steps, self.passes = run, lag, max_steps, passes
        self.gen, self.start = (generator, None) if hasattr(generator, "submit") else (None, generator)
        self.ready: dict[int, Generated] = dict(saved["batches"]) if saved else {}
        self.submitted = set(self.ready)    # steps asked of the generator (or stored by the checkpoint)
        self.published: int | None = None   # the last version this generator has
        self.taken: set[int] = set()        # steps handed to the loop
        self.sampler: dict | None = None    # the prompt sampler after the newest batch received
        self.waits = {"trainer": 0.0, "generator": 0.0, "steps": 0}  # after the first batch (always waited for)

    def batch(self, step: int) -> Batch:
        t0 = time.time()
        t0 += self._publish(step - 1)  # the generator's start (at the first batch it samples) is not the publish's
        t1 = time.time()
        got = self._take(step)
        t2 = time.time()
        run = self.run  # the generators' statistics are reduced over every rank here
        batch = experience.finish(got.batch, run.runtime, run.settings.collect, run)
        stale = [step - 1 - v for v in batch.versions or [got.version]]
        batch.stats.update({
            "async/staleness_mean": sum(stale) / len(stale), "async/staleness_max": max(stale),
            "async/version": got.version, "async/in_flight": sum(s > step for s in self.submitted),
            "time/trainer_wait_s": t2 - t1, "time/generator_wait_s": got.wait_s,
            "time/generator_busy_s": got.busy_s, "time/weights_publish_s": t1 - t0, "time/weights_load_s": got.load_s})
        if len(self.taken) > 1:
            self.waits = {"trainer": self.waits["trainer"] + t2 - t1, "steps": self.waits["steps"] + 1,
                          "generator": self.waits["generator"] + got.wait_s}
        if step % 10 == 0:
            self._say(self.bottleneck())
        return batch

    def _publish(self, version: int) -> float:
        """Hand the generator ``version`` (the policy now) and the requests that sample with it (the generator
        started first when none is yet). Returns the seconds the start took."""
        if self.published is not None and version <= self.published:
            return 0.0
        # the batch steps up to the first that samples with this version (a fresh start: steps 1, 1 + mu, ...,
        # 1 + K mu use version 0)
        later = range(version + 1, min(version + self.lag * self.passes + 1, self.max_steps) + 1, self.passes)
        steps = [s for s in later if s not in self.submitted]
        if not steps:
            return 0.0
        t0 = time.time()
        if self.gen is None:
            self.gen = self.start()
        started = time.time() - t0
        if getattr(self.gen, "reads_model", False):  # the servers' snapshot: each weight gathered on its own
            self.gen.publish(version, None)
        else:
            full = self.published is None  # a new generator gets every weight; after that only the trained ones
            params = {n: p for n, p in self.run.policy.named_parameters() if full or p.requires_grad}
            with self.run.runtime.full_weights(list(params.values())):  # ZeRO-3: gathered on every rank, then copied
                self.gen.publish(version, params)
        self.published = version
        for s in steps:
            self.gen.submit(s, version)
            self.submitted.add(s)
        return started

    def _take(self, step: int) -> Generated:
        if step not in self.ready and step not in self.submitted:
            raise RuntimeError(f"the batch of step {step} was never asked of the generator")
        while step not in self.ready:
            self._receive()
        self.taken.add(step)
        return self.ready.pop(step)

    def _receive(self) -> None:
        try:
            got = self.gen.receive()
        except GeneratorError as e:  # the server generator's workers lost a rank in their collectives: one line
            lost = self.run.runtime.peer_failure(e.__cause__) if isinstance(e.__cause__, Exception) else None
            raise (lost or SetupError(str(e))) from None
        self.ready[got.step] = got
        if got.step == max(self.submitted):  # the generator has drawn every prompt asked for so far
            self.sampler = got.sampler

    def in_flight(self) -> dict:
        """For a checkpoint after the last step trained: every batch asked for, finished (their weights exist), and
        the trainer's prompt sampler set to the generator's after them (the checkpoint saves it)."""
        while any(s not in self.ready for s in self._pending()):
            self._receive()
        if self.sampler is not None:
            self.run.sampler.prompts.load_state_dict(self.sampler)
        return {"lag": self.lag, "batches": {s: self.ready[s] for s in self._pending()}}

    def _pending(self) -> list[int]:
        return sorted(self.submitted - self.taken)

    def bottleneck(self) -> str:
        n = max(self.waits["steps"], 1)
        tw, gw = self.waits["trainer"] / n, self.waits["generator"] / n
        side = "generation (sampling and rewards)" if tw > gw else "training (the update)"
        side = "neither" if max(tw, gw) < 0.005 else side  # both 0.00 s: no side waited for the other
        return (f"async K={self.lag}: the trainer waited {tw:.2f} s per step for batches, the generator {gw:.2f} s "
                f"for weights: {side} is the bottleneck")

    def close(self) -> None:
        if self.waits["steps"]:
            self._say(self.bottleneck())
        if self.gen is not None:
            self.gen.close()

    def _say(self, msg: str) -> None:
        if self.run.runtime.is_main:
            print(f"[grpo] {msg}", file=sys.stderr, flush=True)


