"""The step counter of the console line: ``step k/N [elapsed<remaining]`` (tqdm's and TRL's notation), the
remaining time from this process's mean seconds per step so far."""
from __future__ import annotations

import time

from tqdm import tqdm


class StepClock:
    """Started when the loop's first step starts (after the held-out evaluation before training); a resumed run
    counts from its checkpoint's step, so its rate is this process's own."""

    def __init__(self, start_step: int, max_steps: int, now=time.monotonic):
        self.start_step, self.max_steps, self._now = start_step, max_steps, now
        self._t0 = now()

    def line(self, step: int) -> str:
        """The head of step ``step``'s console line, called when that step is done."""
        elapsed = self._now() - self._t0
        remaining = elapsed / (step - self.start_step) * (self.max_steps - step)
        width = len(str(self.max_steps))
        return (f"step {step:>{width}}/{self.max_steps} "
                f"[{tqdm.format_interval(elapsed)}<{tqdm.format_interval(remaining)}]")
