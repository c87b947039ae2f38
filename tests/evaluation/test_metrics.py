"""pass@k, maj@k and mean@n against hand-computed values and a brute-force count over every k-subset."""
import itertools
import random
from collections import Counter
from fractions import Fraction

import pytest

from grpo.evaluation.metrics import maj_at_k, mean_at_n, pass_at_k, prompt_metrics


def brute_pass(correct: list[bool], k: int) -> Fraction:
    subsets = list(itertools.combinations(range(len(correct)), k))
    return Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))


def brute_maj(answers: list, correct: list[bool], k: int) -> Fraction:
    """Every k-subset: its most frequent answers (ties: each equally likely), credit = the share that are right."""
    right = {a for a, ok in zip(answers, correct) if a is not None and ok}
    subsets = list(itertools.combinations(range(len(answers)), k))
    total = Fraction(0)
    for s in subsets:
        votes = Counter(answers[i] for i in s if answers[i] is not None)
        if not votes:
            continue
        top = max(votes.values())
        tied = [a for a, c in votes.items() if c == top]
        total += Fraction(sum(a in right for a in tied), len(tied))
    return total / len(subsets)


def test_pass_at_k_by_hand():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)       # C(3,2)/C(4,2) subsets miss the one correct
    assert pass_at_k(8, 7, 2) == 1.0                              # n - c < k: every pair holds a correct one
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)     # 1 - C(7,4)/C(10,4)


def test_pass_at_k_stable_for_large_n():
    """C(1000, 500) overflows a float; the product form stays exact to rounding."""
    p = pass_at_k(1000, 1, 500)
    assert p == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_pass_at_k_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    correct = [rng.random() < 0.4 for _ in range(n)]
    for k in range(1, n + 1):
        assert pass_at_k(n, sum(correct), k) == pytest.approx(float(brute_pass(correct, k)), abs=1e-12)


def test_maj_at_k_by_hand():
    # answers 3,3,5,None; 3 is right. k=n: 3 wins outright.
    assert maj_at_k([3, 3, 5, None], [True, True, False, False], 4) == 1.0
    # k=1: a single sample's answer: right for 2 of 4 samples (None scores 0)
    assert maj_at_k([3, 3, 5, None], [True, True, False, False], 1) == pytest.approx(0.5)
    # a 1-1 tie between a right and a wrong answer is worth one half
    assert maj_at_k([1, 2], [True, False], 2) == pytest.approx(0.5)
    # the wrong answer is the majority: 0 at k = n, though one sample is right
    assert maj_at_k([7, 7, 1], [False, False, True], 3) == 0.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0


@pytest.mark.parametrize("seed", range(60))
def test_maj_at_k_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    answers = [rng.choice([None, 0, 1, 2, 3][: rng.randint(2, 5)]) for _ in range(n)]
    truth = rng.choice([0, 1, 2])
    correct = [a == truth for a in answers]
    for k in range(1, n + 1):
        assert maj_at_k(answers, correct, k) == pytest.approx(float(brute_maj(answers, correct, k)), abs=1e-12)


def test_maj_at_k_two_right_answers_tied():
    """Two different answers both scored right (a reward's equivalence is wider than the vote's key): a tie between
    them is fully right."""
    answers, correct = ["1/2", "0.5", "3"], [True, True, False]
    assert maj_at_k(answers, correct, 2) == pytest.approx(float(brute_maj(answers, correct, 2)))
    assert maj_at_k(answers, correct, 3) == pytest.approx(2 / 3)


def test_mean_and_prompt_metrics():
    assert mean_at_n([1.0, 0.0, None, 0.5]) == pytest.approx(0.375)
    m = prompt_metrics([1.0, 0.0, 0.0, 1.0], [4, 5, 5, 4], ks=[1, 4], threshold=1.0)
    assert m == pytest.approx({"mean@4": 0.5, "pass@1": 0.5, "pass@4": 1.0, "maj@1": 0.5, "maj@4": 0.5})
    assert "maj@1" not in prompt_metrics([1.0, 0.0], None, ks=[1], threshold=1.0)


def test_bad_arguments_refused():
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        maj_at_k([1, 2], [True, False], 3)
