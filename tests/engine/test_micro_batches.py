"""grpo/engine/micro_batches.py: whole groups per micro-batch within the token budget, split only when needed."""
import pytest

from grpo.engine.micro_batches import plan_micro_batches


def _tokens(plan, prompts, comps, shared=True):
    out = []
    for mb in plan:
        out.append(sum((prompts[g] if shared else 0) + sum((prompts[g] if not shared else 0) + n
                                                               for n in comps[g][s]) for g, s in mb))
    return out


def test_groups_stay_whole_and_every_micro_batch_fits():
    prompts, comps = [10, 4, 6], [[3, 3], [2, 2, 2], [5]]
    plan = plan_micro_batches(prompts, comps, 20)
    assert all(t <= 20 for t in _tokens(plan, prompts, comps))
    assert sorted(g for mb in plan for g, s in mb) == [0, 1, 2] and all(s == slice(0, len(comps[g]))
                                                                         for mb in plan for g, s in mb)
    assert plan_micro_batches(prompts, comps, None) == [[(0, slice(0, 2)), (1, slice(0, 3)), (2, slice(0, 1))]]


def test_a_group_over_the_budget_is_split_by_completions_and_one_too_long_refused():
    plan = plan_micro_batches([4], [[3, 3, 3, 3]], 12)
    assert len(plan) > 1 and sum(s.stop - s.start for mb in plan for _, s in mb) == 4
    standard = plan_micro_batches([4], [[3, 3]], 7, shared_prefix=False)  # P + S per completion: 7 each
    assert [len(mb) for mb in standard] == [1, 1]
    with pytest.raises(ValueError):
        plan_micro_batches([10], [[5]], 12)
