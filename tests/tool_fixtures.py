"""Tools and environments the tests name in rollout.tools / rollout.environment (importable as tests.tool_fixtures)."""
from __future__ import annotations

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise ValueError(f"cannot handle {x}")


def slow(seconds: float) -> str:
    """Sleeps, then answers.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "awake"


def undocumented(a: int) -> int:
    return a


def untyped(a):
    """Returns a.

    Args:
        a: a value
    """
    return a


class Counter:
    """A tool environment: its count starts at the row's ``start``; ``reward()`` is the final count."""

    def reset(self, row):
        self.count = int(row.get("start", 0))
        return f"The counter starts at {self.count}."

    def increment(self, by: int) -> int:
        """Increase the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    def reward(self) -> float:
        return float(self.count)


class Echo:
    """The plain-text protocol: the first two turns get an observation back, the third ends the episode (rows with
    ``stop_at`` end at that turn). reward() is the number of turns it saw."""

    def reset(self, row):
        self.turns, self.stop_at = 0, int(row.get("stop_at", 3))
        return None

    def step(self, text: str):
        self.turns += 1
        if text.startswith("SLEEP"):
            time.sleep(30)
        if text.startswith("RAISE"):
            raise RuntimeError("step failed")
        return None if self.turns >= self.stop_at else f"\nobs{self.turns}: {len(text)}\n"

    def reward(self) -> float:
        return float(self.turns)


class NoReset:
    def step(self, text: str):
        return None


class NeedsArgs:
    def __init__(self, size):
        self.size = size

    def reset(self, row):
        return None

    def step(self, text: str):
        return None


class Briefing:
    """The plain-text protocol with a long prompt: reset(row) returns the row's ``brief``; every turn gets ``ok``."""

    def reset(self, row):
        return row["brief"]

    def step(self, text: str):
        return "ok"


class TwoTurns:
    """An environment: an observation after the model's first turn, the episode ends after its second."""

    def reset(self, row):
        self.turns = 0
        return "Think in steps."

    def step(self, text):
        self.turns += 1
        return None if self.turns >= 2 else "\n[observation]\n"
