"""Reward functions behind a process boundary, so a hung one can be hard-killed (`grpo.worker_process`).

One persistent worker resolves each function by its config string and serves calls; a call that overruns
``timeout_s`` kills the worker (a fresh one starts for the next call) and raises `RewardTimeout`.
"""
from __future__ import annotations

import traceback

from grpo.errors import RewardTimeout
from grpo.rewards.registry import resolve  # imported before the worker says it is ready
from grpo.worker_process import KillableWorker

_resolved: dict = {}  # in the worker process: config string -> function


class RewardWorker(KillableWorker):
    def __init__(self):
        super().__init__("grpo-reward-worker", _score, _traceback)

    def call(self, spec: str, kwargs: dict, prompts, completions, columns, timeout_s: float) -> list:
        status, payload = self.request((spec, kwargs, prompts, completions, columns), timeout_s)
        if status == "timeout":
            raise RewardTimeout(f"reward {spec!r} did not return within reward.timeout_s={timeout_s}; killed")
        if status == "died":
            raise RuntimeError(f"reward worker died while running {spec!r}")
        if status == "error":
            raise RuntimeError(f"reward {spec!r} raised in the worker:\n{payload}")
        return payload


def _traceback(e: BaseException) -> str:
    return traceback.format_exc()


def _score(request: tuple) -> list:
    spec, kwargs, prompts, completions, columns = request
    fn = _resolved.get(spec) or _resolved.setdefault(spec, resolve(spec))
    return list(fn(prompts, completions, **columns, **kwargs))
