"""`bounded_under_mutmut`: under `make mutate` only (a mutant's run: docs/testing.md), a test that runs past
``BOUND_S`` fails. A mutant that turns a generator's `while` loop endless (its exit condition inverted, the value
it counts never added) is then killed in seconds, instead of after mutmut's wall-clock bound (40 x (the tests'
stats-run time + 1 s)), which such a loop spends on a whole core and some grow memory for (a text doubled each
round). For unit-level test files whose tests take well under a second; a module uses it with
``from tests.under_mutmut import bounded_under_mutmut  # noqa: F401``."""
import os
import signal

import pytest

BOUND_S = 3.0


def under_a_mutant() -> bool:
    """In a mutant's test run: not the stats run, nor mutmut's forced-fail check, nor a plain pytest run."""
    return os.environ.get("MUTANT_UNDER_TEST", "") not in ("", "stats", "fail")


@pytest.fixture(autouse=True)
def bounded_under_mutmut():
    if not under_a_mutant():
        yield
        return

    def stop(signum, frame):
        raise TimeoutError(f"the test ran past {BOUND_S} s under a mutant (tests/under_mutmut.py)")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, BOUND_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
