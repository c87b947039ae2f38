"""Reward functions behind a process boundary, so a hung one can be hard-killed.

`signal.alarm` cannot interrupt a stuck C loop, and asyncio cannot either; a separate process with a
SIGKILL can. One persistent worker (spawned, so it shares no state with the trainer) resolves each
function by its config string and serves calls; a call that overruns ``timeout_s`` kills the worker
(a fresh one starts for the next call) and raises `RewardTimeout`.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import traceback

from grpo.errors import RewardTimeout


class RewardWorker:
    def __init__(self):
        self.proc = None
        self.conn = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, list(sys.path), os.getcwd()), daemon=True,
                                name="grpo-reward-worker")
        self.proc.start()
        child.close()
        if self.conn.recv() != "ready":  # importing the reward modules is not part of any timeout
            raise RuntimeError("reward worker failed to start")

    def call(self, spec: str, kwargs: dict, prompts, completions, columns, timeout_s: float) -> list:
        if self.proc is None or not self.proc.is_alive():
            self.start()
        self.conn.send((spec, kwargs, prompts, completions, columns))
        if not self.conn.poll(timeout_s):
            self.kill()
            raise RewardTimeout(f"reward {spec!r} did not return within reward.timeout_s={timeout_s}; killed")
        try:
            ok, payload = self.conn.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(f"reward worker died while running {spec!r}") from None
        if not ok:
            raise RuntimeError(f"reward {spec!r} raised in the worker:\n{payload}")
        return payload

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.join(timeout=5)
        self.proc = None

    def __del__(self):
        try:
            self.kill()
        except Exception:
            pass


def _serve(conn, path: list[str], cwd: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and then kills us
    sys.path[:] = path
    os.chdir(cwd)
    from grpo.rewards.registry import resolve

    cache: dict = {}
    conn.send("ready")
    while True:
        try:
            spec, kwargs, prompts, completions, columns = conn.recv()
        except (EOFError, OSError):
            return
        try:
            fn = cache.get(spec) or cache.setdefault(spec, resolve(spec))
            conn.send((True, list(fn(prompts, completions, **columns, **kwargs))))
        except BaseException:
            conn.send((False, traceback.format_exc()))
