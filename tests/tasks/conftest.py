from tests.under_mutmut import bounded_under_mutmut  # noqa: F401  (a looping mutant fails in seconds)
