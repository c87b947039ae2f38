"""Reward configuration edge values through the step's scoring (grpo/experience.py's score_groups over
grpo/rewards/score.py): ``weight: 0`` is monitoring only (logged, not in the total), a ``None`` score is left out
of its function's metrics and of the total (docs/rewards.md); and the verl adapter's ground-truth column precedence
(grpo/rewards/adapters.py)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from grpo.rewards.adapters import from_verl
from grpo.rewards.score import RewardFunction, build, score
from grpo.runtime.base import Runtime


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def _score_groups(rewards, n_rows=2, G=2):
    from grpo.experience import score_groups, score_stats

    sampler = SimpleNamespace(tokenizer=_Tok(), rewards=rewards, completion_format="text")
    rows = [{"prompt": f"p{i}", "answer": i} for i in range(n_rows)]
    comps = [[[g, j] for j in range(G)] for g in range(n_rows)]
    rewards, _, sums = score_groups(sampler, rows, comps, [[False] * G for _ in range(n_rows)])
    return rewards, score_stats(Runtime().all_reduce(sums))


def test_weight_zero_is_logged_but_not_in_the_total():
    watch = RewardFunction("watch", lambda p, c, **kw: [10.0, 20.0, 30.0, 40.0], weight=0.0)
    acc = RewardFunction("acc", lambda p, c, **kw: [1.0, 0.0, 0.0, 1.0], weight=2.0)
    rewards, stats = _score_groups([watch, acc])
    assert rewards.tolist() == [2.0, 0.0, 0.0, 2.0]  # 2 * acc; watch's scores add nothing
    assert stats["reward_mean"] == 1.0
    assert stats["reward/watch"] == 25.0 and stats["reward/watch_std"] == pytest.approx(math.sqrt(500 / 3))
    assert stats["reward/acc"] == 0.5 and stats["reward/watch_errors"] == 0
    built = build({"watch": {"fn": "number_only", "weight": 0}, "acc": {"fn": "number_only"}})
    assert [(r.name, r.weight) for r in built] == [("watch", 0.0), ("acc", 1.0)]  # 0 stays 0, missing is 1


def test_a_none_score_is_left_out_of_its_metrics_and_of_the_total():
    """None is "no score": not a 0 in the function's mean, std or count, not an error, nothing in the total."""
    partial = RewardFunction("partial", lambda p, c, **kw: [1.0, None, 3.0, None], weight=1.0)
    other = RewardFunction("other", lambda p, c, **kw: [0.5, 0.5, 0.5, 0.5], weight=1.0)
    silent = RewardFunction("silent", lambda p, c, **kw: [None] * len(c), weight=1.0)
    rewards, stats = _score_groups([partial, other, silent])
    assert rewards.tolist() == [1.5, 0.5, 3.5, 0.5]
    assert stats["reward/partial"] == 2.0  # mean of 1 and 3 (a zero for each None would give 1.0)
    assert stats["reward/partial_std"] == pytest.approx(math.sqrt(2.0))
    assert stats["reward/partial_errors"] == 0 and stats["reward/other"] == 0.5
    assert stats["reward/silent"] is None and stats["reward/silent_std"] is None  # no score at all: n/a, not 0
    assert stats["reward/silent_errors"] == 0


def test_a_single_score_has_zero_std_and_the_weighted_sum_skips_none():
    one = RewardFunction("one", lambda p, c, **kw: [None, 4.0, None, None], weight=0.5)
    rewards, stats = _score_groups([one])
    assert rewards.tolist() == [0.0, 2.0, 0.0, 0.0]
    assert stats["reward/one"] == 4.0 and stats["reward/one_std"] == 0.0
    s = score([one, RewardFunction("w0", lambda p, c, **kw: [7.0] * 4, weight=0.0)], ["p"] * 4, ["c"] * 4, {})
    assert s.total == [0.0, 2.0, 0.0, 0.0] and s.per_fn["w0"] == [7.0] * 4


def _echo(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(ground_truth)}


def test_verl_ground_truth_column_wins_over_answer_and_reward_model():
    fn = from_verl(_echo)
    cols = {"ground_truth": [1, 2], "answer": [10, 20], "reward_model": [{"ground_truth": 100}] * 2}
    assert fn(["p", "p"], ["a", "b"], **cols) == [1.0, 2.0]
    cols.pop("ground_truth")
    assert fn(["p", "p"], ["a", "b"], **cols) == [10.0, 20.0]  # then answer
    cols.pop("answer")
    assert fn(["p", "p"], ["a", "b"], **cols) == [100.0, 100.0]  # then reward_model.ground_truth
    assert fn(["p"], ["a"], reward_model=["not a dict"]) == [None]  # nothing to compare with: no score


def test_verl_arguments_by_name_by_position_and_keyword_only():
    """verl's four arguments reach a compute_score by name, by position when named otherwise (only required
    ones), or as keyword-only parameters; a parameter with a default named otherwise stops the positional ones."""
    seen = []

    def by_position(src, text, truth, info):
        seen.append((src, text, truth, info))
        return 1.0

    def by_name(solution_str, ground_truth):
        seen.append((solution_str, ground_truth))
        return 2.0

    def keyword_only(solution_str, *, ground_truth, extra_info=None, data_source="x"):
        seen.append((solution_str, ground_truth, extra_info, data_source))
        return 3.0

    def stops_at_a_default(data_source, solution_str, scale=10.0, **kw):
        seen.append((data_source, solution_str, scale, sorted(kw)))
        return scale

    cols = {"answer": ["4"], "data_source": ["math"], "extra_info": [{"i": 1}]}
    assert from_verl(by_position)(["p"], ["four"], **cols) == [1.0]
    assert from_verl(by_name)(["p"], ["four"], **cols) == [2.0]
    assert from_verl(keyword_only)(["p"], ["four"], **cols) == [3.0]
    assert from_verl(stops_at_a_default)(["p"], ["four"], **cols) == [10.0]
    assert seen == [("math", "four", "4", {"i": 1}), ("four", "4"), ("four", "4", {"i": 1}, "math"),
                    ("math", "four", 10.0, [])]
    # a fifth required parameter gets nothing: the call fails, the sample scores None (wrapping does not fail)
    assert from_verl(lambda a, b, c, d, e: 1.0)(["p"], ["x"]) == [None]


def test_verl_constants_from_the_config_and_non_finite_scores():
    """A value that is not an aligned list is a constant (a config argument): passed whole, not indexed; a list of
    another length too. A non-finite or non-numeric score is no score."""
    got = []

    def fn(data_source, solution_str, ground_truth, extra_info=None, mode="strict", weights=None):
        got.append((ground_truth, mode, weights))
        return {"score": float("nan")} if mode == "nan" else "n/a" if mode == "text" else 0.5

    two = from_verl(fn)
    assert two(["p", "p"], ["a", "b"], ground_truth=["x", "y"], mode="loose", weights=[1, 2, 3]) == [0.5, 0.5]
    assert got == [("x", "loose", [1, 2, 3]), ("y", "loose", [1, 2, 3])]
    assert two(["p"], ["a"], ground_truth="const", mode="nan") == [None]
    assert got[-1][0] == "const"  # a string constant, not its first character
    assert two(["p"], ["a"], ground_truth=["g"], mode="text") == [None]
    assert from_verl(lambda data_source, solution_str, ground_truth: float("inf"))(["p"], ["a"]) == [None]
    info = []
    one = from_verl(lambda data_source, solution_str, ground_truth, extra_info: info.append(extra_info) or 1.0)
    assert one(["p"], ["a"], extra_info={"k": 1}) == [1.0] and info == [{"k": 1}]  # a dict of length 1 is whole


def test_verl_wrapper_looks_like_a_batch_reward_and_keeps_the_original():
    """The wrapper's signature is the batch one (what the registry checks); ``verl_fn`` is what check_kwargs reads
    the config's arguments against; a compute_score taking **kwargs receives every config constant."""
    import inspect

    from grpo.rewards.score import RewardSpecError, check_kwargs

    def fn(data_source, solution_str, ground_truth, extra_info=None, mode="strict"):
        return 1.0

    wrapped = from_verl(fn)
    params = inspect.signature(wrapped).parameters
    assert [(p.name, p.kind) for p in params.values()] == [
        ("prompts", inspect.Parameter.POSITIONAL_OR_KEYWORD), ("completions", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("columns", inspect.Parameter.VAR_KEYWORD)]
    assert wrapped.verl_fn is fn
    check_kwargs("v", "my:fn", wrapped, {"mode": "loose"})  # fn has mode: accepted
    with pytest.raises(RewardSpecError, match="has no argument 'mdoe'"):
        check_kwargs("v", "my:fn", wrapped, {"mdoe": "loose"})
    got = []

    def open_kw(data_source, solution_str, ground_truth, **kw):
        got.append(kw)
        return 0.0

    assert from_verl(open_kw)(["p"], ["a"], ground_truth=["g"], mode="loose", scale=2) == [0.0]
    assert got == [{"mode": "loose", "scale": 2}]
    assert from_verl(fn)(["p"], ["a"], ground_truth=["g"], scale=2) == [1.0]  # fn takes no scale: not passed
