import torch

from grpo.advantages import compute_advantages, group_stats, zero_std_groups


def test_group_normalisation_matches_hand_computation():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0, 2.0])
    adv = compute_advantages(r, [4, 4], "group", eps=0.0)
    g1, g2 = r[:4], r[4:]
    exp1 = (g1 - g1.mean()) / g1.std(unbiased=True)
    exp2 = (g2 - g2.mean()) / g2.std(unbiased=True)
    assert torch.allclose(adv, torch.cat([exp1, exp2]), atol=1e-6)


def test_equal_rewards_give_exact_zero_not_nan():
    r = torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0])
    for scale in ("group", "batch", "none"):
        for eps in (0.0, 1e-4):
            adv = compute_advantages(r, [3, 2], scale, eps)
            assert torch.isfinite(adv).all()
            assert (adv[:3] == 0).all()


def test_ragged_groups_and_group_of_one():
    r = torch.tensor([3.0, 1.0, 2.0, 4.0])
    adv = compute_advantages(r, [1, 3], "group")
    assert adv[0] == 0
    mean, std = group_stats(r, [1, 3])
    assert torch.allclose(mean[1:], torch.full((3,), 7 / 3))
    assert abs(float(adv[1:].sum())) < 1e-5


def test_batch_and_none_scaling():
    r = torch.tensor([1.0, 3.0, 0.0, 4.0])
    none = compute_advantages(r, [2, 2], "none")
    assert torch.equal(none, torch.tensor([-1.0, 1.0, -2.0, 2.0]))
    batch = compute_advantages(r, [2, 2], "batch", eps=0.0)
    assert torch.allclose(batch, none / r.std())


def test_zero_std_groups():
    assert zero_std_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), [2, 2]) == [True, False]
