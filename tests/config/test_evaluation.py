"""The evaluation and alarms sections: every bad input is one line naming the key, before any model loads."""
import json

import pytest
from omegaconf import OmegaConf

from grpo.config.evaluation import AlarmRule, AlarmsConfig, _rule, check_evaluation
from grpo.config.schema import Config, load
from grpo.errors import ConfigError, DataError
from grpo.rewards.score import build as build_rewards
from grpo.tasks import get_task
from grpo.trainer.evaluate import check_sets
from tests.helpers import smoke_raw


def cfg(evaluation=None, **sections):
    raw = OmegaConf.merge(smoke_raw(), {"evaluation": evaluation or {}, "trainer": {"output_dir": "unused"}},
                          sections)
    return load(OmegaConf.to_container(raw, resolve=True))


@pytest.mark.parametrize("evaluation,says", [
    ({"n": 8}, "evaluation.n=8 at evaluation.temperature=0 (greedy) gives 8 identical samples"),
    ({"n": 4, "temperature": 0.6, "k": [1, 8]}, "evaluation.k=[1, 8]: each k must be an integer in 1..evaluation.n=4"),
    ({"n": 0}, "evaluation.n=0 is out of range"),
    ({"temperature": -1.0}, "evaluation.temperature=-1.0 is out of range"),
    ({"correct_reward": "acc"}, "evaluation.correct_reward='acc' is not a reward; choose one of: accuracy, format"),
    ({"sets": [{"name": "a", "source": "builtin:arithmetic"}, {"name": "a", "source": "builtin:countdown"}]},
     "evaluation.sets: the name 'a' is given twice"),
    ({"sets": [{"name": "a", "sorce": "x.jsonl"}]}, "evaluation.sets[0].sorce is not a key of an evaluation set "
                                                   "(did you mean 'source'?)"),
    ({"sets": [{"source": "builtin:arithmetic"}]}, "evaluation.sets[0].name=None"),
    ({"sets": [{"name": "a/b", "source": "builtin:arithmetic"}]}, "evaluation.sets[0].name='a/b'"),
    ({"sets": [{"name": "held-out", "source": "builtin:arithmetic"}]}, "(held-out is the data's held-out split)"),
    ({"sets": [{"name": "a"}]}, "evaluation.sets[0] (a) needs a source"),
    ({"sets": [{"name": "a", "source": "builtin:arithmetic", "num": 0}]}, "evaluation.sets[0].num=0 (a)"),
])
def test_bad_evaluation_is_one_line(evaluation, says):
    with pytest.raises(ConfigError) as e:
        cfg(evaluation)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_alarm_patience_range():
    with pytest.raises(ConfigError, match=r"alarms.truncation.patience=0 is out of range; allowed: >= 1"):
        cfg(alarms={"truncation": {"patience": 0}})


def test_set_without_the_answer_column_a_reward_reads(tmp_path):
    """arithmetic reads `answer`: a file set without that column is refused by name before a model loads; with
    answer_column naming its column it passes."""
    f = tmp_path / "qs.jsonl"
    f.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "solution": i + 1}) + "\n" for i in range(3)))
    c = cfg({"sets": [{"name": "mine", "source": str(f), "prompt_column": "question"}]})
    rewards = build_rewards(c.reward.functions)
    with pytest.raises(DataError) as e:
        check_sets(c.evaluation.sets, c.data, rewards)
    assert str(e.value) == ("evaluation.sets mine: no answer column 'answer' (answer_column), which reward 'accuracy' "
                            "reads; its columns are: question, solution")
    c = cfg({"sets": [{"name": "mine", "source": str(f), "prompt_column": "question", "answer_column": "solution"}]})
    check_sets(c.evaluation.sets, c.data, rewards)
    with pytest.raises(DataError, match="evaluation.sets mine: no column 'prompt'"):
        check_sets([{"name": "mine", "source": str(f)}], c.data, rewards)


def test_set_rows_from_a_file_a_task_and_their_own_columns(tmp_path):
    from grpo import data
    from grpo.models import char_tokenizer

    f = tmp_path / "qs.jsonl"
    f.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "solution": i + 1}) + "\n" for i in range(5)))
    c = cfg({"sets": [{"name": "file", "source": str(f), "prompt_column": "question", "answer_column": "solution",
                       "num": 3},
                      {"name": "task", "source": "builtin:multiplication", "num": 4}]})
    splits = data.build(c.data, char_tokenizer(), sets=c.evaluation.sets)
    assert list(splits.sets) == ["file", "task"]
    assert [r["answer"] for r in splits.sets["file"]] == [1, 2, 3]
    assert splits.sets["file"][0]["prompt"] == "What is 0 + 1?"
    task = get_task("multiplication")
    assert [r["prompt"] for r in splits.sets["task"]] == [r["prompt"] for r in task(4, c.data.seed)]


def test_a_set_is_held_apart_from_training():
    """A set drawn from the training task (same source, seed and arguments): its prompts leave the training rows."""
    from grpo import data
    from grpo.models import char_tokenizer

    c = cfg({"sets": [{"name": "same", "source": "builtin:arithmetic", "num": 20, "seed": 5}]})
    plain = data.build(c.data, char_tokenizer())
    splits = data.build(c.data, char_tokenizer(), sets=c.evaluation.sets)
    held = {r["prompt"] for r in splits.sets["same"]}
    assert held & {r["prompt"] for r in plain.train}, "the test needs an overlap to remove"
    assert not held & {r["prompt"] for r in splits.train}
    assert "training prompts that are in an evaluation set were dropped" in splits.note


# -------------------------------------------------------------- check_evaluation on a plain Config (no Hydra): fast
def plain(**evaluation) -> Config:
    c = Config()
    for k, v in evaluation.items():
        setattr(c.evaluation, k, v)
    return c


def refusal(c: Config) -> str:
    with pytest.raises(ConfigError) as e:
        check_evaluation(c)
    return str(e.value)


@pytest.mark.parametrize("evaluation", [
    {}, {"n": 1, "temperature": 0.0}, {"n": 2, "temperature": 0.6, "k": [1, 2]}, {"n": 4, "temperature": 1.0, "k": [4]},
    {"correct_reward": "accuracy"},
    {"sets": [{"name": "gsm8k.test-1", "source": "openai/gsm8k", "num": 1},
              {"name": "B_2", "source": "builtin:countdown", "num": None, "seed": 3, "task_kwargs": {}}]},
])
def test_evaluation_settings_that_fit_pass(evaluation):
    check_evaluation(plain(**evaluation))


def test_greedy_evaluation_takes_one_sample():
    assert refusal(plain(n=2)).startswith("evaluation.n=2 at evaluation.temperature=0 (greedy) gives 2 identical")


@pytest.mark.parametrize("k", [[True], [1.0], [0], [3], ["1"]])
def test_each_k_is_an_integer_in_one_to_n(k):
    assert refusal(plain(n=2, temperature=0.6, k=k)).startswith(f"evaluation.k={k}: each k must be an integer in "
                                                                 "1..evaluation.n=2")


def test_the_correct_reward_is_one_of_the_rewards():
    assert refusal(plain(correct_reward="acc")) == "evaluation.correct_reward='acc' is not a reward; choose one of: " \
                                                   "accuracy"


@pytest.mark.parametrize("spec, says", [
    ("gsm8k", "evaluation.sets[0] must be a mapping"),
    ({"name": "a", "source": "x", "sorce": "y"}, "evaluation.sets[0].sorce is not a key of an evaluation set (did you "
                                                 "mean 'source'?); allowed: name, source, num, split"),
    ({"name": "a", "source": "x", "zzzz": 1}, "evaluation.sets[0].zzzz is not a key of an evaluation set; allowed: "),
    ({"name": 3, "source": "x"}, "evaluation.sets[0].name=3: give each set a name"),
    ({"name": "", "source": "x"}, "evaluation.sets[0].name='': give each set a name"),
    ({"name": "a b", "source": "x"}, "evaluation.sets[0].name='a b': give each set a name"),
    ({"name": "held-out", "source": "x"}, "evaluation.sets[0].name='held-out': give each set a name"),
    ({"name": "a", "source": 5}, "evaluation.sets[0] (a) needs a source"),
    ({"name": "a", "source": ""}, "evaluation.sets[0] (a) needs a source"),
    ({"name": "a", "source": "x", "num": True}, "evaluation.sets[0].num=True (a) must be an integer >= 1"),
    ({"name": "a", "source": "x", "num": 2.0}, "evaluation.sets[0].num=2.0 (a) must be an integer >= 1"),
    ({"name": "a", "source": "x", "num": 0}, "evaluation.sets[0].num=0 (a) must be an integer >= 1"),
])
def test_a_bad_set_is_refused_by_its_index(spec, says):
    assert refusal(plain(sets=[spec])).startswith(says)


def test_two_sets_of_one_name_are_refused_and_every_set_is_checked():
    assert refusal(plain(sets=[{"name": "a", "source": "x"}, {"name": "a", "source": "y"}])).startswith(
        "evaluation.sets: the name 'a' is given twice")
    assert refusal(plain(sets=[{"name": "a", "source": "x"}, {"name": "b", "source": "y", "num": 0}])).startswith(
        "evaluation.sets[1].num=0 (b)")


def test_an_alarm_rule_field_builds_an_enabled_rule_of_its_own_each_time():
    f = _rule(0.3, 7)
    a, b = f.default_factory(), f.default_factory()
    assert a == AlarmRule(enabled=True, threshold=0.3, patience=7) and a is not b
    assert AlarmsConfig().entropy == AlarmRule(True, 0.01, 10)
