"""grpo/engine/micro_batches.py: whole groups per micro-batch within the token budget, split only when needed."""
import pytest
import torch

from grpo.engine.micro_batches import plan_micro_batches, scatter


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


def test_the_plan_is_exact_and_a_group_that_fits_exactly_joins_the_open_micro_batch():
    prompts, comps = [10, 4, 6], [[3, 3], [2, 2, 2], [5]]  # shared costs 16, 10, 11
    assert plan_micro_batches(prompts, comps, 20) == [[(0, slice(0, 2))], [(1, slice(0, 3))], [(2, slice(0, 1))]]
    assert plan_micro_batches(prompts, comps, 21) == [[(0, slice(0, 2))], [(1, slice(0, 3)), (2, slice(0, 1))]]
    assert plan_micro_batches(prompts, comps, 26) == [[(0, slice(0, 2)), (1, slice(0, 3))], [(2, slice(0, 1))]]
    assert plan_micro_batches(prompts, comps, 37) == [[(0, slice(0, 2)), (1, slice(0, 3)), (2, slice(0, 1))]]
    # the standard layout pays the prompt once per completion: 26, 18, 11
    assert plan_micro_batches(prompts, comps, 29, shared_prefix=False) == [[(0, slice(0, 2))],
                                                                          [(1, slice(0, 3)), (2, slice(0, 1))]]
    assert plan_micro_batches(prompts, comps, 28, shared_prefix=False) == [[(0, slice(0, 2))], [(1, slice(0, 3))],
                                                                          [(2, slice(0, 1))]]


def test_no_budget_is_one_micro_batch_and_no_groups_none_and_a_budget_of_one_token_is_allowed():
    assert plan_micro_batches([], [], None) == []
    assert plan_micro_batches([], [], 5) == []
    assert plan_micro_batches([0], [[1]], 1) == [[(0, slice(0, 1))]]
    with pytest.raises(ValueError, match="max_tokens"):
        plan_micro_batches([0], [[1]], 0)
    with pytest.raises(ValueError, match="2 prompts but 1"):
        plan_micro_batches([1, 2], [[1]], 5)


def test_a_split_group_fills_each_part_to_the_budget_and_its_last_part_stays_open():
    # shared: P + 4 + 4 = 12 fits exactly, a third completion does not
    assert plan_micro_batches([4], [[4, 4, 4]], 12) == [[(0, slice(0, 2))], [(0, slice(2, 3))]]
    # the last part (P + 3 + 3 = 10 tokens) takes the next group (2 tokens: 12 exactly) but not one of 3
    assert plan_micro_batches([4, 1], [[3, 3, 3, 3], [1]], 12) == [[(0, slice(0, 2))],
                                                                   [(0, slice(2, 4)), (1, slice(0, 1))]]
    assert plan_micro_batches([4, 1], [[3, 3, 3, 3], [2]], 12) == [[(0, slice(0, 2))], [(0, slice(2, 4))],
                                                                   [(1, slice(0, 1))]]
    # the open micro-batch before a split group is closed first
    assert plan_micro_batches([1, 4], [[1], [3, 3, 3, 3]], 12) == [[(0, slice(0, 1))], [(1, slice(0, 2))],
                                                                   [(1, slice(2, 4))]]
    # a prompt + completion of exactly the budget is one part each; one token more is refused with its numbers
    assert plan_micro_batches([4], [[8, 8]], 12) == [[(0, slice(0, 1))], [(0, slice(1, 2))]]
    with pytest.raises(ValueError, match="group 0, completion 1: prompt \\(4 tokens\\) \\+ completion \\(9 tokens\\)"):
        plan_micro_batches([4], [[8, 9]], 12)
    # the standard layout splits by P + S per completion
    assert plan_micro_batches([4], [[3, 3, 3]], 14, shared_prefix=False) == [[(0, slice(0, 2))], [(0, slice(2, 3))]]


def test_scatter_puts_each_completions_log_probs_and_entropies_in_place():
    comps = [[[1, 2], [3]], [[4, 5, 6], [7], [8, 9]]]
    logps = [[None] * 2, [None] * 3]
    ents = [[None] * 2, [None] * 3]
    mb = [(0, slice(1, 2)), (1, slice(0, 2))]  # 1 + 3 + 1 tokens
    lp = torch.arange(5.0)
    scatter(mb, comps, lp, -lp, logps, ents)
    assert [x.tolist() if x is not None else None for x in logps[0]] == [None, [0.0]]
    assert [x.tolist() if x is not None else None for x in logps[1]] == [[1.0, 2.0, 3.0], [4.0], None]
    assert ents[1][0].tolist() == [-1.0, -2.0, -3.0] and ents[0][1].tolist() == [-0.0]
    logps, ents = [[None, None], [None] * 3], [[0, 0], [0] * 3]
    scatter([(1, slice(1, 3))], comps, torch.tensor([5.0, 6.0, 7.0]), None, logps, ents)
    assert logps[1][1].tolist() == [5.0] and logps[1][2].tolist() == [6.0, 7.0] and ents[1][1:] == [None, None]
    assert logps[1][0] is None and ents[1][0] == 0


def test_a_group_of_three_parts_and_what_the_open_part_holds():
    # P + 4 + 4 fits, so parts 0:2, 2:4 and 4:5; the last (P + 4 = 8 tokens) takes the next group of 2 tokens
    assert plan_micro_batches([4, 1], [[4] * 5, [1]], 12) == [[(0, slice(0, 2))], [(0, slice(2, 4))],
                                                              [(0, slice(4, 5)), (1, slice(0, 1))]]
    assert plan_micro_batches([4, 2], [[4] * 5, [2]], 12) == [[(0, slice(0, 2))], [(0, slice(2, 4))],
                                                              [(0, slice(4, 5)), (1, slice(0, 1))]]
    assert plan_micro_batches([4, 3], [[4] * 5, [2]], 12) == [[(0, slice(0, 2))], [(0, slice(2, 4))],
                                                              [(0, slice(4, 5))], [(1, slice(0, 1))]]


def test_groups_without_completions():
    # a group of no completions costs its prompt: within the budget it is kept (and costs nothing more when its
    # prompt is empty: the next group of exactly the budget joins it); over it there is nothing to score
    assert plan_micro_batches([0, 4], [[], [4, 4]], 12) == [[(0, slice(0, 0)), (1, slice(0, 2))]]
    assert plan_micro_batches([13, 4, 4], [[], [2], [2]], 12) == [[(1, slice(0, 1)), (2, slice(0, 1))]]
