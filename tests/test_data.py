import json

import pandas as pd
import pytest

from grpo.config.schema import DataConfig
from grpo.data import DataError, PromptSampler, build, format_prompt, load_rows
from grpo.models import char_tokenizer


@pytest.fixture
def tok():
    return char_tokenizer()


ROWS = [{"question": f"What is {i} + 1?", "solution": i + 1, "level": "easy"} for i in range(30)]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_local_files_with_column_mapping(tmp_path, tok, suffix):
    path = tmp_path / f"d{suffix}"
    df = pd.DataFrame(ROWS)
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif suffix == ".parquet":
        df.to_parquet(path)
    else:
        df.to_csv(path, index=False)
    dcfg = DataConfig(source=str(path), prompt_column="question", answer_column="solution", num_eval=5,
                      chat_template=False, prompt_template="Q: {prompt} ({level})")
    splits = build(dcfg, tok)
    assert len(splits.train) + len(splits.eval) == 30 and len(splits.eval) == 5
    row = splits.train[0]
    assert row["prompt"] == "Q: What is 0 + 1? (easy)"
    assert row["answer"] == 1 and row["level"] == "easy"          # answer column travels as `answer`
    assert row["prompt_ids"] == tok(row["prompt"], add_special_tokens=False)["input_ids"]


def test_long_prompts_are_dropped_and_counted(tok):
    dcfg = DataConfig(source="builtin:arithmetic", num_train=50, num_eval=10, chat_template=False,
                      max_prompt_tokens=44, task_kwargs={"level": 1})
    splits = build(dcfg, tok)
    assert splits.dropped > 0
    assert all(len(r["prompt_ids"]) <= 44 for r in splits.train + splits.eval)


def test_builtin_held_out_prompts_never_appear_in_training(tok):
    dcfg = DataConfig(source="builtin:arithmetic", num_train=300, num_eval=100, chat_template=False,
                      task_kwargs={"level": 0})
    splits = build(dcfg, tok)
    assert len(splits.eval) == 100
    assert not {r["prompt"] for r in splits.eval} & {r["prompt"] for r in splits.train}
    again = build(dcfg, tok)
    assert [r["prompt"] for r in again.eval] == [r["prompt"] for r in splits.eval]  # seeded


def test_system_prompt_and_chat_template(tok):
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    dcfg = DataConfig(system_prompt="Be brief.", prompt_template="{prompt}!")
    assert format_prompt({"prompt": "Hi"}, dcfg, tok) == ("<system>Be brief.<user>Hi!<assistant>", None)
    plain = DataConfig(system_prompt="Be brief.", chat_template=False)
    assert format_prompt({"prompt": "Hi"}, plain, tok) == ("Be brief.\n\nHi", None)


def test_data_errors(tmp_path, tok, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no network here: fail fast
    with pytest.raises(DataError, match="file not found"):
        load_rows(DataConfig(source=str(tmp_path / "none.jsonl")))
    with pytest.raises(DataError, match="unknown built-in task 'nope'"):
        load_rows(DataConfig(source="builtin:nope"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(DataError, match="data row 1 has no 'prompt' value"):
        build(DataConfig(source=str(bad), num_eval=0), tok)
    with pytest.raises(DataError, match="uses column 'missing'"):
        build(DataConfig(source="builtin:arithmetic", prompt_template="{missing}", num_train=4, num_eval=1), tok)
    with pytest.raises(DataError, match="could not be loaded"):
        load_rows(DataConfig(source="definitely-not/a-dataset-here", load_kwargs={}))


def test_sampler_passes_and_state_round_trip():
    s = PromptSampler(5, seed=3)
    first = s.next(7)
    assert sorted(first[:5]) == [0, 1, 2, 3, 4]          # a full pass before any repeat
    state = s.state_dict()
    rest = s.next(6)
    t = PromptSampler(5, seed=3)
    t.load_state_dict(state)
    assert t.next(6) == rest


def test_small_files_say_how_many_prompts_are_held_out(tmp_path, tok):
    """A file holds out at most a fifth of its rows: fewer than 5 rows hold out none, and the note says so (it
    was silent); enough rows for data.num_eval need no note."""
    def splits(n, num_eval):
        path = tmp_path / f"d{n}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(n)))
        return build(DataConfig(source=str(path), num_eval=num_eval, chat_template=False), tok)

    four = splits(4, 2)
    assert (len(four.train), len(four.eval)) == (4, 0)
    assert "has 4 usable rows" in four.note and "held-out evaluation is off (it needs 5 rows or more" in four.note
    twelve = splits(12, 5)
    assert len(twelve.eval) == 2 and twelve.note.endswith("a fifth of them: 2 held out")
    assert splits(12, 2).note == "" and splits(4, 0).note == ""


def test_every_prompt_too_long_says_the_shortest_and_what_to_raise(tok):
    dcfg = DataConfig(source="builtin:arithmetic", num_train=20, num_eval=0, chat_template=False, max_prompt_tokens=2)
    shortest = min(len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) for r in load_rows(dcfg))
    with pytest.raises(DataError) as e:
        build(dcfg, tok)
    assert str(e.value) == (f"every prompt is longer than data.max_prompt_tokens=2: the shortest is {shortest} tokens "
                            f"(as the model sees it, template included); raise data.max_prompt_tokens to at least "
                            f"{shortest}")


@pytest.mark.parametrize("override,named", [
    ({"answer_column": "nope"}, "data.answer_column='nope': the data has no such column"),
    ({"prompt_column": "nope"}, "data.prompt_column='nope': the data has no such column"),
    ({"prompt_template": "{prompt} ({nope})"}, "data.prompt_template uses column 'nope'"),
])
def test_a_named_column_the_data_lacks_is_refused_before_the_model_loads(cfg_factory, tmp_path, monkeypatch,
                                                                         override, named):
    """Issue 41: a CSV with prompt,answer and data.answer_column=nope used to train to the end with no answer."""
    from grpo.trainer import build as build_module
    from grpo.trainer.loop import train

    csv = tmp_path / "qa.csv"
    csv.write_text("prompt,answer\n" + "".join(f"What is {i}+1?,{i + 1}\n" for i in range(8)))
    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = cfg_factory({"data": {"source": str(csv), "num_eval": 0, **override}})
    with pytest.raises(DataError) as e:
        train(cfg)
    assert str(e.value).startswith(named) and str(e.value).endswith("the data's columns are: prompt, answer")
    assert "\n" not in str(e.value)


def test_the_default_answer_column_may_be_absent_and_a_named_one_present_is_used(tok, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "gold": "1"}\n{"prompt": "b", "gold": "2"}\n')
    assert "answer" not in build(DataConfig(source=str(rows), num_eval=0), tok).train[0]  # optional: not named
    got = build(DataConfig(source=str(rows), num_eval=0, answer_column="gold"), tok).train
    assert sorted(r["answer"] for r in got) == ["1", "2"]
