"""grpo/batch.py: a step's experience; `select` and `concat` cut and join every field alike."""
from dataclasses import fields

import torch

from grpo.batch import Batch


def _batch(tag: str, sizes: list[int]) -> Batch:
    n = sum(sizes)
    nested = lambda f: [[f(g, j) for j in range(s)] for g, s in enumerate(sizes)]  # noqa: E731
    return Batch(rows=[{"g": f"{tag}{g}"} for g in range(len(sizes))], prompt_ids=[[g] for g in range(len(sizes))],
                 completion_ids=nested(lambda g, j: [g, j]), truncated=nested(lambda g, j: j == 0),
                 rewards=torch.arange(n, dtype=torch.float32), advantages=-torch.arange(n, dtype=torch.float32),
                 old_logps=nested(lambda g, j: torch.tensor([g + j])),
                 ref_logps=nested(lambda g, j: torch.tensor([0.0])),
                 stats={"tag": tag}, sampling_logps=nested(lambda g, j: torch.tensor([1.0])),
                 completion_masks=nested(lambda g, j: [1, 1]), episodes=nested(lambda g, j: {"e": f"{tag}{g}{j}"}))


def test_select_keeps_the_chosen_groups_in_every_field():
    b = _batch("a", [2, 3, 1])
    kept = b.select([True, False, True])
    assert kept.group_sizes == [2, 1] and [r["g"] for r in kept.rows] == ["a0", "a2"]
    assert kept.rewards.tolist() == [0.0, 1.0, 5.0] and kept.advantages.tolist() == [0.0, -1.0, -5.0]
    for f in fields(Batch):  # every per-group field was cut (none left at its old length)
        value = getattr(kept, f.name)
        if isinstance(value, list):
            assert len(value) == 2, f.name
    assert kept.episodes[1][0] == {"e": "a20"} and kept.old_logps[1][0].item() == 2
    kept.stats["x"] = 1
    assert "x" not in b.stats  # a copy


def test_concat_joins_groups_and_drops_a_field_one_side_lacks():
    a, b = _batch("a", [2]), _batch("b", [1, 1])
    b.sampling_logps = None
    both = a.concat(b)
    assert both.group_sizes == [2, 1, 1] and [r["g"] for r in both.rows] == ["a0", "b0", "b1"]
    assert both.rewards.tolist() == [0.0, 1.0, 0.0, 1.0] and both.stats == {"tag": "a"}
    assert both.sampling_logps is None and both.episodes[2][0] == {"e": "b10"}
    assert both.flat_index(2, 0) == 3


def test_token_mask_and_sampled_count_of_single_and_multi_turn_completions():
    single = _batch("a", [2, 1])
    single.completion_masks = None  # single-turn: every token was sampled
    assert torch.equal(single.token_mask(1, 0), torch.ones(2)) and single.token_mask(1, 0).dtype == torch.float32
    assert single.sampled_count(0, 1) == 2
    multi = _batch("a", [2, 1])
    multi.completion_masks[1][0] = [1, 0]  # the second token a tool wrote
    m = multi.token_mask(1, 0)
    assert m.tolist() == [1.0, 0.0] and m.dtype == torch.float32  # float: it weights float log-probs as they are
    assert multi.sampled_count(1, 0) == 1 and multi.sampled_count(0, 0) == 2
