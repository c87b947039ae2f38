import pytest
import torch

from grpo.algorithm.advantages import compute_advantages, group_stats, zero_std_groups


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


def test_constant_group_is_exactly_zero_even_when_float_mean_is_off():
    # 8 x 0.1 in float32: the mean is an ulp off, the naive std ~1e-9, naive advantages ~±0.9 with eps=0
    r = torch.full((8,), 0.1)
    for scale in ("group", "batch", "none"):
        assert torch.equal(compute_advantages(r, [8], scale, eps=0.0), torch.zeros(8))
    mixed = torch.cat([torch.full((16,), 0.7), torch.tensor([0.0, 1.0])])
    adv = compute_advantages(mixed, [16, 2], "group")
    assert torch.equal(adv[:16], torch.zeros(16)) and adv[16] < 0 < adv[17]


class _ThreadWorld:
    """Ranks as threads: all_reduce sums every rank's named values (enough for experience._batch_std)."""

    def __init__(self, n: int):
        import threading

        self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n)

    def runtime(self, rank: int):
        world = self

        class Rt:
            world_size = world.n

            def all_reduce(self, values):
                world.slots[rank] = dict(values)
                world.barrier.wait()
                out = {k: sum(slot[k] for slot in world.slots) for k in values}
                world.barrier.wait()
                return out

        return Rt()


def test_batch_std_is_the_same_for_one_and_two_processes():
    """scale_rewards=batch: one process and two processes (each holding half the groups) get the same std, that of
    all rewards, also for rewards far from 0 where a one-pass sum-of-squares formula loses digits."""
    import threading

    from grpo.experience import _batch_std

    r = 1000.0 + torch.tensor([0.0, 0.25, 0.5, 0.125, 1.0, 0.75, 0.5, 0.0, 0.375, 0.625, 0.0, 0.5])
    want = float(r.double().std())
    one = _batch_std(_ThreadWorld(1).runtime(0), r)
    world, got = _ThreadWorld(2), [None, None]
    parts = [r[:8], r[8:]]  # uneven: 2 groups of 4 on rank 0, 1 on rank 1

    def rank(k):
        got[k] = _batch_std(world.runtime(k), parts[k])

    threads = [threading.Thread(target=rank, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert abs(one - want) < 1e-12 * want and got[0] == got[1] and abs(got[0] - want) < 1e-12 * want
    assert torch.allclose(compute_advantages(parts[1], [4], "batch", batch_std=got[1]),
                          (parts[1] - parts[1].mean()) / (want + 1e-4), atol=1e-5)


def test_pairs_three_groups_dtypes_and_the_default_scale():
    """Mutation-testing survivors (docs/testing.md): a group of two (std over n-1 = 1), a third group (each group's
    own slice), float64 rewards keep their precision in group_stats, the advantages stay float32 with a float
    batch_std, and the default scale is the group std."""
    r = torch.tensor([1.0, 3.0, 0.0, 2.0, 4.0, 5.0, 5.0, 6.0])
    adv = compute_advantages(r, [2, 3, 3], eps=0.0)
    want = torch.cat([(g - g.mean()) / g.std() for g in (r[:2], r[2:5], r[5:])])
    assert torch.allclose(adv, want, atol=1e-6) and adv.dtype == torch.float32
    assert zero_std_groups(torch.tensor([1.0, 2.0, 3.0, 3.0, 4.0, 5.0]), [2, 2, 2]) == [False, True, False]
    mean, std = group_stats(r.double() + 1e9, [2, 3, 3])
    assert mean.dtype == std.dtype == torch.float64 and float(mean[0]) == 1e9 + 2.0
    assert torch.allclose(std, torch.tensor([2 ** 0.5] * 2 + [2.0] * 3 + [0.57735026919] * 3, dtype=torch.float64))
    assert compute_advantages(r, [2, 3, 3], "batch", batch_std=2.0).dtype == torch.float32


def test_batch_scale_edge_cases():
    """Two rewards in the whole batch have a std; one has none (exactly 0); a batch std of 0 with eps 0 gives 0, not
    inf, for groups that still differ (the guard behind the eps)."""
    two = torch.tensor([1.0, 3.0])
    assert torch.allclose(compute_advantages(two, [2], "batch", eps=0.0), torch.tensor([-1.0, 1.0]) / two.std())
    assert torch.equal(compute_advantages(torch.tensor([5.0]), [1], "batch"), torch.zeros(1))
    r = torch.tensor([0.0, 1.0, 2.0, 4.0])
    assert torch.equal(compute_advantages(r, [2, 2], "batch", eps=0.0, batch_std=0.0), torch.zeros(4))


def test_mismatched_sizes_and_unknown_scale_are_named():
    import pytest

    with pytest.raises(ValueError, match="^3 rewards for groups of total size 4$"):
        compute_advantages(torch.zeros(3), [2, 2])
    with pytest.raises(ValueError, match="^scale must be group, batch or none, got 'groups'$"):
        compute_advantages(torch.tensor([0.0, 1.0]), [2], "groups")


def test_batch_scale_keeps_the_rewards_dtype_and_one_reward_has_no_spread():
    from grpo.algorithm.advantages import batch_scale

    rewards = torch.tensor([1.0, 3.0], dtype=torch.float64)
    got = batch_scale(rewards, None, 2.0)  # the all-reduced batch std, a float
    assert got.dtype == torch.float64 and got.tolist() == [2.0, 2.0]
    assert batch_scale(torch.tensor([5.0]), None, None).tolist() == [0.0]  # not the nan of std() of one value
    assert batch_scale(rewards, None, None).tolist() == pytest.approx([2 ** 0.5] * 2)
