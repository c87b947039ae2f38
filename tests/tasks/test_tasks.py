"""Built-in tasks countdown and retrieval: deterministic in the seed, solvable, scored right."""
import re
from collections import Counter

import pytest

from grpo.rewards import resolve
from grpo.rewards.countdown import evaluate, score_one
from grpo.tasks import available_tasks, get_task


def test_registered():
    assert {"countdown", "retrieval"} <= set(available_tasks())


def test_a_task_registered_by_name_is_found_by_that_name(monkeypatch):
    from grpo import tasks

    monkeypatch.setattr(tasks.TASKS, "_items", dict(tasks.TASKS._items))  # the registry as it was, afterwards

    def mine(n, seed):
        return [{"prompt": str(seed)}] * n

    assert tasks.register_task("zz-mine")(mine) is mine
    assert get_task("zz-mine") is mine and "zz-mine" in available_tasks()
    with pytest.raises(KeyError, match="unknown built-in task 'zz-other'; available: arithmetic, countdown"):
        get_task("zz-other")


# ---------------------------------------------------------------- countdown
def test_countdown_deterministic_in_seed():
    make = get_task("countdown")
    assert make(20, seed=3) == make(20, seed=3)
    assert make(20, seed=3) != make(20, seed=4)
    assert make(5, seed=3) == make(20, seed=3)[:5]


def test_countdown_solutions_are_valid():
    rows = get_task("countdown")(200, seed=0)
    assert len({(tuple(sorted(r["numbers"])), r["target"]) for r in rows}) == 200
    for r in rows:
        assert 3 <= len(r["numbers"]) <= 4 and all(1 <= x <= 99 for x in r["numbers"])
        assert 1 <= r["target"] <= 999
        value, used = evaluate(r["answer"])
        assert value == r["target"]
        assert Counter(used) == Counter(r["numbers"])
        assert str(r["target"]) in r["prompt"] and str(r["numbers"]) in r["prompt"]
        assert set(r) == {"prompt", "target", "numbers", "answer"}
    rows = get_task("countdown")(10, seed=1, min_numbers=4, max_numbers=4, max_number=20, max_target=100)
    assert all(len(r["numbers"]) == 4 and r["target"] <= 100 for r in rows)


def test_countdown_reward_levels():
    fn = resolve("countdown")
    target, numbers = 24, [3, 8, 5]
    cases = [
        ("<think>3*8=24</think><answer>3 * 8</answer>", 1.0),            # unused number is fine
        ("<answer> (5 - 3) * 8 + 8 </answer>", 0.1),                      # 8 used twice
        ("<answer>(8 * 3) = 24</answer>", 1.0),                            # "= target" tolerated
        ("<answer>8 * 3 + 5</answer>", 0.1),                               # wrong value
        ("<answer>24</answer>", 0.1),                                      # number not given
        ("<answer>__import__('os').system('echo hi')</answer>", 0.1),      # never evaluated
        ("<answer>8 ** 3</answer>", 0.1),                                  # power not allowed
        ("<answer>8 / (5 - 5)</answer>", 0.1),                             # division by zero
        ("<answer>-3 + 27</answer>", 0.1),
        ("3 * 8 = 24", 0.0),                                               # no tags
        ("", 0.0),
        ("<answer>3 * 8</answer> wait, <answer>5 * 3</answer>", 0.1),      # the last answer counts
    ]
    out = fn(["p"] * len(cases), [c for c, _ in cases], target=[target] * len(cases),
             numbers=[numbers] * len(cases))
    assert out == [s for _, s in cases]
    assert fn(["p"], ["<answer>3 * 8</answer>"], target=[None], numbers=[[3]]) == [None]
    assert fn(["p"], ["<answer>3 * 8</answer>"]) == [None]


def test_countdown_use_all_and_fractions():
    assert score_one("<answer>3 * 8</answer>", 24, [3, 8, 5], use_all=True) == 0.1
    assert score_one("<answer>(5 - 3 + 1) * 8</answer>", 24, [3, 8, 5, 1], use_all=True) == 1.0
    assert score_one("<answer>(1 / 3 + 1) * 6</answer>", 8, [1, 3, 1, 6]) == 1.0  # exact fractions
    assert score_one("<answer>" + "(" * 300 + "1" + ")" * 300 + "</answer>", 1, [1]) == 0.1


# ---------------------------------------------------------------- retrieval
def test_retrieval_deterministic_in_seed():
    make = get_task("retrieval")
    assert make(3, seed=7) == make(3, seed=7)
    assert make(3, seed=7) != make(3, seed=8)


def test_retrieval_answer_is_in_the_passage_once():
    for r in get_task("retrieval")(20, seed=0):
        name = re.search(r"What is the code of (.+?)\?", r["prompt"]).group(1)
        codes = re.findall(rf"The code of {re.escape(name)} is (\d+)\.", r["prompt"])
        assert codes == [r["answer"]]
        assert r["prompt"].count(r["answer"]) == 1
        assert set(r) == {"prompt", "answer"}


def test_retrieval_length_scales_with_num_facts():
    make = get_task("retrieval")
    default = make(5, seed=0)
    # ~1,200 tokens with a digit-splitting tokenizer (measured with SmolLM2's): ~2,800 characters
    assert all(2400 <= len(r["prompt"]) <= 3600 for r in default)
    small, big = make(1, seed=0, num_facts=5)[0], make(1, seed=0, num_facts=200)[0]
    assert len(small["prompt"]) < len(default[0]["prompt"]) < len(big["prompt"])
    with pytest.raises(ValueError):
        make(1, seed=0, num_facts=0)


def test_retrieval_scored_by_exact_match():
    r = get_task("retrieval")(1, seed=0)[0]
    fn = resolve("exact_match")
    comps = [f"<answer>{r['answer']}</answer>", f"<answer>{int(r['answer']) + 1}</answer>",
             f"The code is {r['answer']}.", ""]
    assert fn(["p"] * 4, comps, answer=[r["answer"]] * 4) == [1.0, 0.0, 0.0, 0.0]
    assert fn(["p"] * 4, comps, answer=[r["answer"]] * 4, mode="contains") == [1.0, 0.0, 1.0, 0.0]


def test_retrieval_default_length_in_tokens():
    import os
    from pathlib import Path

    cache = Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo"))
    path = cache / "SmolLM2-135M-Instruct" / "tokenizer.json"
    if not path.exists():
        pytest.skip("SmolLM2's tokenizer is not in the local cache")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    lengths = [len(tok.encode(r["prompt"]).ids) for r in get_task("retrieval")(10, seed=0)]
    assert all(800 <= n <= 1500 for n in lengths)
