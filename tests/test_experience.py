"""grpo/experience.py: collect(run) with a backend injected in the run (no module global patched): the batch's
rewards are those of the completions the backend returned, its advantages group-normalised."""
import torch

from grpo.experience import collect
from grpo.rollout.base import Completions
from grpo.trainer.build import build_run, close_run


class FixedBackend:
    """Every group gets the same completions: the digit strings in ``texts``, tokenized."""
    name = "hf"

    def __init__(self, tokenizer, texts):
        self.ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        self.calls = 0

    def generate(self, prompt_ids, group_size, sampling, seed=None, suffixes=None):
        self.calls += 1
        return Completions([[list(c) for c in self.ids[:group_size]] for _ in prompt_ids],
                           [[False] * group_size for _ in prompt_ids])

    def sync_weights(self, model):
        pass

    def sleep(self):
        pass

    def close(self):
        pass


def test_collect_scores_what_the_injected_backend_returned(cfg_factory):
    run = build_run(cfg_factory({"reward": {"functions": {"format": {"fn": "number_only", "weight": 1.0},
                                                          "accuracy": {"fn": "arithmetic", "weight": 0.0}}}}))
    try:
        run.rollout.backend = fake = FixedBackend(run.tokenizer, ["1", "x", "22", "yy"])
        batch = collect(run)
        assert fake.calls == 1 and batch.group_sizes == [4, 4]
        assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0] * 2  # number_only: bare numbers score 1
        assert torch.allclose(batch.advantages[:4].sum(), torch.tensor(0.0), atol=1e-5)
        assert batch.advantages[0] > 0 > batch.advantages[1]
    finally:
        close_run(run)


class _Tok:
    """Decodes ids as their digits; 0 is a special token (left out with skip_special_tokens)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(str(i) for i in ids if not (skip_special_tokens and i == 0))


class _Run:
    tokenizer = _Tok()
    rewards = [type("R", (), {"name": n})() for n in ("fmt", "acc")]


def _two_groups(**extra):
    from grpo.batch import Batch

    return Batch([{"prompt": "x" * 250 + "P", "answer": 7}, {"prompt": ["turn"]}], [[9], [8]],
                 [[[1, 0], [2]], [[5], [6, 0]]], [[False] * 2] * 2, torch.tensor([0.25, 0.5, 0.75, 1.5]),
                 torch.tensor([-1.0, 1.0, -2.0, 2.0]), **extra)


def test_sample_rows_take_the_first_of_each_group_then_the_second_and_keep_the_prompts_end():
    from grpo.experience import sample_rows

    eps = [[{"turns": "a0"}, {"turns": "a1"}], [{"turns": "b0"}, {"turns": "b1"}]]
    rows = sample_rows(_Run(), _two_groups(episodes=eps), 3)
    assert [r["completion"] for r in rows] == ["1", "5", "2"]  # special tokens skipped
    assert [r["reward"] for r in rows] == [0.25, 0.75, 0.5] and all(type(r["reward"]) is float for r in rows)
    assert rows[0]["prompt"] == ("x" * 250 + "P")[-200:] and rows[0]["answer"] == 7 and rows[1]["answer"] is None
    assert [r["episode"] for r in rows] == [{"turns": "a0"}, {"turns": "b0"}, {"turns": "a1"}]
    assert "episode" not in sample_rows(_Run(), _two_groups(), 1)[0]  # single-turn: no episode key
    assert len(sample_rows(_Run(), _two_groups(), 9)) == 4
    from grpo.batch import Batch

    one = Batch([{"prompt": "p"}], [[9]], [[[1], [2], [3]]], [[False] * 3], torch.zeros(3), torch.zeros(3))
    assert [r["completion"] for r in sample_rows(_Run(), one, 2)] == ["1", "2"]  # a rank holding one group


def test_completion_rows_list_every_completion_with_each_functions_score():
    from grpo.experience import completion_rows

    scores = [[{"fmt": 1.0, "acc": None}, {"fmt": 0.0, "acc": 1.0}], [{"fmt": 0.5}, {"acc": 0.25}]]
    rows = completion_rows(_Run(), _two_groups(scores=scores))
    assert [r["completion"] for r in rows] == ["1", "2", "5", "6"]
    assert [r["prompt"] for r in rows] == ["x" * 250 + "P"] * 2 + ["['turn']"] * 2  # whole; a list as text
    assert [(r["reward/fmt"], r["reward/acc"]) for r in rows] == [(1.0, None), (0.0, 1.0), (0.5, None), (None, 0.25)]
    assert [r["reward"] for r in rows] == [0.25, 0.5, 0.75, 1.5] and [r["advantage"] for r in rows] == [-1, 1, -2, 2]
    assert all(type(r["reward"]) is float and type(r["advantage"]) is float for r in rows)
    bare = completion_rows(_Run(), _two_groups())  # no per-function scores recorded
    assert [(r["reward/fmt"], r["reward/acc"]) for r in bare] == [(None, None)] * 4
    assert list(bare[0]) == ["prompt", "completion", "reward/fmt", "reward/acc", "reward", "advantage"]


def test_reduce_stats_makes_a_generators_statistics_again_over_every_rank(cfg_factory):
    """A batch sampled apart from the trainer's collectives (asynchronous GRPO, one generator per rank) keeps the
    local sums of its statistics; `reduce_stats` sums them over every rank: with one process the same numbers, with
    two ranks that sampled alike the counts double and the means stay."""
    import dataclasses

    from grpo.experience import reduce_stats, sample
    from grpo.runtime.local import LocalRuntime

    class TwoAlike(LocalRuntime):
        seen: list = []

        def all_reduce(self, values):
            self.seen.append(sorted(values))
            return {k: 2 * v for k, v in values.items()}

    run = build_run(cfg_factory({"algorithm": {"filter_zero_std_groups": True},
                                 "reward": {"functions": {"format": {"fn": "number_only", "weight": 1.0},
                                                          "accuracy": {"fn": "arithmetic", "weight": 0.0}}}}))
    try:
        run.rollout.backend = FixedBackend(run.tokenizer, ["1", "1", "22", "22"])  # every group: zero std
        batch = sample(run)
        local = dict(batch.stats)
        assert local["dropped_groups"] == 2 and local["num_groups"] == 0 and local["zero_std_frac"] == 1.0
        reduce_stats(run, batch)
        assert batch.stats == local
        twice = TwoAlike("cpu")
        reduce_stats(dataclasses.replace(run, runtime=twice), batch)
        assert [k for k in twice.seen if "reward" in k] and ["groups", "zero_std"] in twice.seen
        assert ["dropped", "groups"] in twice.seen and len(twice.seen) == 3  # the first round's rewards, once
        doubled = {"dropped_groups", "num_groups", "reward/format_errors", "reward/accuracy_errors"}
        assert {k: batch.stats[k] for k in doubled} == {k: 2 * local[k] for k in doubled}
        for k in ("reward_mean", "zero_std_frac", "completion_len_mean", "truncated_frac", "reward/format"):
            assert batch.stats[k] == local[k], k
        assert batch.stats["reward_std"] == local["reward_std"] == 0.0
    finally:
        close_run(run)
