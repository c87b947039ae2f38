"""Ctrl-C and SIGTERM during training: the first asks the loop to stop after the current step (it writes a
checkpoint and exits cleanly; with many processes, the loop agrees through `Runtime.any_rank` so every rank
stops after the same step); a second Ctrl-C aborts at once."""
from __future__ import annotations

import signal


class StopSignals:
    """A context manager: while inside it, ``requested`` turns true at the first Ctrl-C / SIGTERM."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
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
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
