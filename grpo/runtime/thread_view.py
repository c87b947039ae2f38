"""`ThreadView`: a runtime's collectives for a thread that runs beside the trainer's (the server generator's worker,
`grpo.rollout.server.generator_thread`), over a gloo group of their own.

Two threads of one process must never share a process group: their collectives would interleave in an order that
differs from rank to rank, and the ranks would pair one thread's all-reduce with the other's. The view answers
everything as its runtime does (rank, world size, model, device, `full_weights`, ...) except the collectives
(`all_reduce`, `all_max`, `any_rank`, `gather`, `barrier`), which go over its group, on CPU tensors. The thread
that holds it calls them at the same points on every rank, as the trainer's thread does its own.
"""
from __future__ import annotations

import torch


class ThreadView:
    def __init__(self, runtime, group):
        """``runtime``: the trainer's (`grpo.runtime.deepspeed.DeepSpeedRuntime`); ``group``: a gloo process group over
        every rank, made for this view (`Runtime.thread_view`)."""
        self._runtime, self._group = runtime, group

    def __getattr__(self, name):  # everything but the collectives is the runtime's
        return getattr(self._runtime, name)

    def all_reduce(self, values: dict[str, float]) -> dict[str, float]:
        return self._reduce(values, torch.distributed.ReduceOp.SUM)

    def all_max(self, values: dict[str, float]) -> dict[str, float]:
        return self._reduce(values, torch.distributed.ReduceOp.MAX)

    def _reduce(self, values: dict[str, float], op) -> dict[str, float]:
        return self._runtime._reduce(values, op, group=self._group, device="cpu")  # gloo: CPU tensors

    def any_rank(self, flag: bool) -> bool:
        return self.all_reduce({"flag": float(flag)})["flag"] > 0

    def gather(self, obj) -> list:
        out = [None] * self._runtime.world_size
        torch.distributed.all_gather_object(out, obj, group=self._group)
        return out

    def barrier(self) -> None:
        torch.distributed.barrier(group=self._group)
