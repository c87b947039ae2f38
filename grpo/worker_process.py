"""A persistent helper process that can be hard-killed: reward functions and tool calls run in one.

`signal.alarm` cannot interrupt a stuck C loop, and asyncio cannot either; a separate process with a SIGKILL can.
The process is spawned (it shares no state with the trainer), answers requests one at a time with a handler
given by reference (a module-level function, imported there), and a request that overruns its timeout kills it:
the next request starts a fresh one.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from typing import Callable


class KillableWorker:
    """The trainer's side. ``handler(request) -> reply`` runs in the worker; ``describe(exception) -> str`` is the
    text sent back when it raises."""

    def __init__(self, name: str, handler: Callable, describe: Callable[[BaseException], str]):
        self.name, self.handler, self.describe = name, handler, describe
        self.proc = self.conn = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, list(sys.path), os.getcwd(), self.handler, self.describe),
                                daemon=True, name=self.name)
        self.proc.start()
        child.close()
        if self.conn.recv() != "ready":  # importing what it serves is not part of any timeout
            raise RuntimeError(f"{self.name} failed to start")

    def request(self, message, timeout_s: float) -> tuple[str, object]:
        """``("ok", reply)``, ``("error", text)`` (the handler raised), ``("timeout", None)`` (the worker was
        killed) or ``("died", None)`` (it exited on its own: a segfault, ``os._exit``)."""
        if self.proc is None or not self.proc.is_alive():
            self.start()
        self.conn.send(message)
        if not self.conn.poll(timeout_s):
            self.kill()
            return "timeout", None
        try:
            ok, payload = self.conn.recv()
        except EOFError:
            self.kill()
            return "died", None
        return ("ok" if ok else "error"), payload

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def kill(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.join(timeout=5)
        self.proc = None

    def __del__(self):
        try:
            self.kill()
        except Exception:
            pass


def _serve(conn, path: list[str], cwd: str, handler: Callable, describe: Callable) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and then kills us
    sys.path[:] = path
    os.chdir(cwd)
    conn.send("ready")
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send((True, handler(request)))
        except BaseException as e:  # noqa: BLE001 - whatever the user's code raised goes back as text
            conn.send((False, describe(e)))
