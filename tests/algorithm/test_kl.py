"""grpo/algorithm/kl.py: Schulman's k1/k2/k3 estimators of KL(pi || pi_ref)."""
import math

import pytest
import torch

from grpo.algorithm.kl import kl_estimate


def test_the_three_estimators_on_known_log_ratios():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])  # log r = ref - logp = -0.5, +1.0
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) + 0.5 - 1, math.e - 2])
    assert (kl_estimate(logp, ref, "k3") >= 0).all() and kl_estimate(logp, logp).abs().max() == 0
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_estimate(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_for_the_true_kl():
    torch.manual_seed(0)
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    x = torch.multinomial(p, 200_000, replacement=True)
    true = float((p * (p / q).log()).sum())
    for est in ("k1", "k3"):
        assert float(kl_estimate(p.log()[x], q.log()[x], est).mean()) == pytest.approx(true, abs=5e-3)
