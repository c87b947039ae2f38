"""Sampled-evaluation metrics of one prompt's n samples; pure functions, no torch.

- ``pass@k``: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
  arXiv:2107.03374, eq. 1): with c of the n samples correct, pass@k = 1 - C(n - c, k) / C(n, k), the probability
  that a uniformly random k-subset of the n samples holds a correct one. Computed as the product
  1 - prod_{i = n-c+1}^{n} (1 - k / i) (the paper's numerically stable form: no huge binomials).
- ``maj@k``: majority voting (self-consistency, Wang et al. 2022, arXiv:2203.11171) over the k samples' answers. For
  k < n it is the exact average over every k-subset of the n samples (the same quantity verl estimates by bootstrap,
  and the subset average pass@k's estimator is): a subset's vote is correct when its most frequent answer is a correct
  one; a tie between t answers counts the share of them that are correct (a uniformly random tie-break); samples
  without an answer (None) do not vote, and a subset with no vote scores 0. Computed exactly by counting subsets
  class by class (`maj_at_k`), never by enumerating them.
- ``mean@n``: the mean of a score over the n samples.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. eq. 1 for ``c`` correct among ``n`` samples, ``1 <= k <= n``."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_at_n(scores: Sequence[float | None]) -> float:
    """The mean of the scores; a sample without one (None) counts 0 (it earned nothing)."""
    if not scores:
        raise ValueError("mean@n of no samples")
    return sum(s or 0.0 for s in scores) / len(scores)


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """Majority voting over k of the n samples, averaged over every k-subset (module docstring).

    ``answers[i]``: sample i's answer after the task's normalisation (None: it gave none); ``correct[i]``: whether
    the reward scored it correct. An answer is correct when any of its samples was scored correct (a reward scores
    equal answers alike). Counting: for a correct answer a drawn v times, the other answers may be drawn at most v
    times each; a polynomial over (samples drawn, answers tied at v) is built class by class."""
    n = len(answers)
    if len(correct) != n or not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n = len(answers) = len(correct) (n={n}, k={k})")
    counts = Counter(a for a in answers if a is not None)
    right = {a for a, ok in zip(answers, correct) if a is not None and ok}
    silent = n - sum(counts.values())
    total = 0.0
    for a in right:
        others = [c for b, c in counts.items() if b != a]
        for v in range(1, min(counts[a], k) + 1):
            ways = _others_ways(others, silent, v, k - v)  # tied -> number of subsets of the rest
            total += math.comb(counts[a], v) * sum(w / (1 + t) for t, w in ways.items())
    return total / math.comb(n, k)


def _others_ways(others: list[int], silent: int, v: int, size: int) -> dict[int, int]:
    """{t: the number of ways to draw ``size`` samples from the other answers (each drawn at most ``v`` times, t of
    them exactly ``v`` times) and the ``silent`` samples without an answer}."""
    dp = [{0: math.comb(silent, s)} if s <= silent else {} for s in range(size + 1)]  # dp[s][t]
    for c in others:
        new: list[dict[int, int]] = [{} for _ in range(size + 1)]
        for s, row in enumerate(dp):
            for t, w in row.items():
                for x in range(min(c, v, size - s) + 1):
                    key = t + (x == v)
                    new[s + x][key] = new[s + x].get(key, 0) + w * math.comb(c, x)
        dp = new
    return dp[size]


def prompt_metrics(scores: Sequence[float | None], answers: Sequence[Hashable | None] | None, ks: Sequence[int],
                   threshold: float) -> dict[str, float]:
    """One prompt's ``mean@n``, ``pass@k`` and (with ``answers``) ``maj@k`` for every k in ``ks``. A sample is correct
    when its score is at least ``threshold``."""
    n = len(scores)
    correct = [s is not None and s >= threshold for s in scores]
    out = {f"mean@{n}": mean_at_n(scores)}
    out.update({f"pass@{k}": pass_at_k(n, sum(correct), k) for k in ks})
    if answers is not None:
        out.update({f"maj@{k}": maj_at_k(answers, correct, k) for k in ks})
    return out
