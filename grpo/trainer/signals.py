"""Ctrl-C and SIGTERM during training. The first says at once (one line) that the run stops after the current
step, and asks the loop to do so (it writes a checkpoint and exits cleanly; with many processes, the loop agrees
through `Runtime.any_rank` so every rank stops after the same step). A second stops at once: one line saying what
is saved (the last complete checkpoint, which a stop never touches: see grpo/trainer/checkpoint.py), then `StopNow`,
which the command line turns into exit code 128 + the signal's number, without a traceback."""
from __future__ import annotations

import os
import signal
import sys
from typing import Callable


class StopNow(BaseException):
    """A second stop signal. A BaseException, like KeyboardInterrupt, so that no ``except Exception`` swallows
    it; ``exit_code`` is the shell's convention for a process ended by that signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


class StopSignals:
    """A context manager: while inside it, ``requested`` turns true at the first Ctrl-C / SIGTERM, and the second
    raises `StopNow`. ``step`` is the step under way (the loop sets it); ``saved()`` says what a stop at once
    leaves; ``announce``: whether this process prints (the main rank)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, announce: bool = True, saved: Callable[[], str] | None = None):
        self.requested = False
        self.step: int | None = None
        self.saved_step: int | None = None  # the step whose checkpoint the stop wrote (the loop sets it)
        self._announce, self._saved = announce, saved
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        try:
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        except ValueError:  # not the main thread (e.g. some test harnesses): no handlers
            pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            if self.saved_step is not None and self.saved_step == self.step:  # the stop's checkpoint is written
                self._say(f"second {name}: stopping now; step {self.step} was finished and its checkpoint written: "
                          f"{self._saved() if self._saved else 'it is complete'}")
            else:
                self._say(f"second {name}: stopping now, without finishing step {self.step}; "
                          f"{self._saved() if self._saved else 'nothing more is saved'}")
            raise StopNow(signum)
        self.requested = True
        self._say(f"{name}: stopping after step {self.step}, then writing a checkpoint "
                  "(send it again to stop at once, without saving that step)")

    def _say(self, msg: str) -> None:
        if not self._announce:
            return
        line = f"[grpo] {msg}\n"
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except RuntimeError:  # the signal landed inside a write to stderr (a reentrant call): write past it
            os.write(2, line.encode())
