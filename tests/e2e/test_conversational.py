"""Conversational datasets (a prompt column of messages, as TRL and verl store them) and the rewards written
for them: TRL's conversational reward convention and verl's compute_score, used unchanged."""
import json
import textwrap

import pytest

from grpo.config.schema import DataConfig
from grpo.data import DataError, format_prompt, prepare
from grpo.models import char_tokenizer
from grpo.rewards import resolve
from grpo.rewards.score import reward_inputs
from tests.helpers import in_one_process

CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
CONVERSATION = [{"role": "system", "content": "Think first."}, {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": "5"}, {"role": "user", "content": "4+4?"}]


@pytest.fixture
def tok():
    t = char_tokenizer()
    t.chat_template = CHAT
    return t


def test_messages_go_through_the_chat_template_as_they_are(tok):
    text, messages = format_prompt({"prompt": CONVERSATION}, DataConfig(system_prompt="ignored: has one"), tok)
    assert text == "<system>Think first.<user>2+3?<assistant>5<user>4+4?<assistant>"
    assert messages == CONVERSATION
    text, _ = format_prompt({"prompt": CONVERSATION[1:2]}, DataConfig(system_prompt="Be brief."), tok)
    assert text == "<system>Be brief.<user>2+3?<assistant>"  # no system turn: data.system_prompt is added
    text, _ = format_prompt({"prompt": CONVERSATION[1:2]}, DataConfig(chat_template=False), tok)
    assert text == "2+3?"


@pytest.mark.parametrize("prompt, dcfg, fragment", [
    ([{"role": "system", "content": "x"}], DataConfig(), "data row: the prompt messages have no 'user' turn"),
    ([{"role": "human", "content": "x"}], DataConfig(), "unknown role 'human' in the prompt messages"),
    ([{"role": "user"}], DataConfig(), "a user message has no text 'content'"),
    (CONVERSATION, DataConfig(prompt_template="Q: {prompt}"), "applies to text prompts"),
])
def test_bad_conversations_fail_in_one_line(tok, prompt, dcfg, fragment):
    with pytest.raises(DataError) as e:
        format_prompt({"prompt": prompt}, dcfg, tok)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_rewards_receive_what_trl_gives_them(tok):
    conv, _ = prepare([{"prompt": CONVERSATION, "solution": "8"}], DataConfig(), tok)
    text, _ = prepare([{"prompt": "2+3?", "answer": 5}], DataConfig(), tok)
    prompts, completions = reward_inputs(conv, ["8", "9"], 2, "auto")
    assert prompts == [CONVERSATION, CONVERSATION]
    assert completions == [[{"role": "assistant", "content": "8"}], [{"role": "assistant", "content": "9"}]]
    assert reward_inputs(text, ["5"], 1, "auto") == ([text[0]["prompt"]], ["5"])  # text data: strings, as before
    assert reward_inputs(conv, ["8"], 1, "text") == ([conv[0]["prompt"]], ["8"])
    assert reward_inputs(text, ["5"], 1, "messages")[1] == [[{"role": "assistant", "content": "5"}]]


def test_builtin_rewards_accept_both_formats():
    as_messages = [[{"role": "assistant", "content": "The answer is 12"}], [{"role": "assistant", "content": "7"}]]
    assert resolve("arithmetic")([CONVERSATION] * 2, as_messages, answer=[12, 7]) == [1.0, 1.0]
    assert resolve("arithmetic")(["p", "p"], ["The answer is 12", "7"], answer=[12, 7]) == [1.0, 1.0]
    assert resolve("number_only")([CONVERSATION], [[{"role": "assistant", "content": " 42 "}]]) == [1.0]


TRL_STYLE = '''
import json, os, re

def think_format(completions, **kwargs):
    """Written as for TRL: a conversational completion is a list with one assistant message."""
    texts = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(r"^<think>.*?</think>", t, re.DOTALL) else 0.0 for t in texts]

def contains_solution(prompts, completions, solution, **kwargs):
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps({"prompt": prompts[0], "completion": completions[0], "solution": solution[0]}) + "\\n")
    return [float(s in c[0]["content"]) for c, s in zip(completions, solution)]
'''

VERL_STYLE = '''
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps({"data_source": data_source, "solution_str": solution_str,
                            "ground_truth": ground_truth, "extra_info": extra_info}) + "\\n")
    return {"score": float(str(ground_truth) in solution_str), "acc": True}
'''


def _trl(cwd) -> list[str]:
    """A TRL conversational dataset and TRL-style rewards in ``cwd``: the arguments that train on them."""
    rows = [{"prompt": [{"role": "system", "content": "Think in <think> tags."},
                        {"role": "user", "content": f"What is {a} + {a}?"}], "solution": str(2 * a)}
            for a in range(10)]
    (cwd / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (cwd / "trl_rewards.py").write_text(textwrap.dedent(TRL_STYLE))
    return ["data.source=conv.jsonl", "reward.functions={fmt: {fn: trl_rewards:think_format}, "
            "acc: {fn: trl_rewards:contains_solution}}"]


def _verl(cwd) -> list[str]:
    """A verl parquet and its compute_score in ``cwd``: the arguments that train on them."""
    import pandas as pd

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {a} + 1?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + 1)},
             "extra_info": {"split": "train", "index": a}} for a in range(10)]
    pd.DataFrame(rows).to_parquet(cwd / "train.parquet")
    (cwd / "verl_reward.py").write_text(textwrap.dedent(VERL_STYLE))
    return ["data.source=train.parquet", "reward.functions={score: {fn: verl_reward:compute_score}}"]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> dict:
    """A one-step smoke run on each dataset, from a directory of its own holding it and its rewards, both in one
    process (tests/helpers.py `in_one_process`; conftest.py's TOGETHER keeps their tests on one worker): name -> (the
    step's metrics, what the rewards saw)."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("trl", "verl")}
    args = {"trl": _trl(dirs["trl"]), "verl": _verl(dirs["verl"])}
    ran = in_one_process([(cwd, ["grpo.train", "recipe=smoke", f"trainer.output_dir={cwd}/run", "trainer.max_steps=1",
                                 *args[name]], {"SEEN_FILE": str(cwd / "seen.jsonl")}) for name, cwd in dirs.items()])
    out = {}
    for (name, cwd), p in zip(dirs.items(), ran):
        assert p.returncode == 0, p.stderr[-3000:]
        step = [json.loads(line) for line in (cwd / "run" / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in line][0]
        out[name] = step, [json.loads(line) for line in (cwd / "seen.jsonl").read_text().splitlines()]
    return out


def test_a_trl_conversational_dataset_and_rewards_train_unchanged(smoke_runs):
    step, seen = smoke_runs["trl"]
    assert step["reward/fmt_errors"] == 0 and step["reward/acc_errors"] == 0
    assert step["reward/fmt"] is not None and step["reward/acc"] is not None
    first = seen[0]
    assert first["prompt"][0] == {"role": "system", "content": "Think in <think> tags."}
    assert first["prompt"][1]["role"] == "user" and first["prompt"][1]["content"].startswith("What is")
    assert first["completion"][0]["role"] == "assistant" and isinstance(first["completion"][0]["content"], str)


def test_a_verl_parquet_trains_with_its_compute_score(smoke_runs):
    step, seen = smoke_runs["verl"]
    assert step["reward/score_errors"] == 0 and step["reward/score"] is not None
    first = seen[0]
    assert first["data_source"] == "openai/gsm8k" and isinstance(first["solution_str"], str)
    assert first["ground_truth"] in {str(a + 1) for a in range(10)}
    assert first["extra_info"]["split"] == "train"
