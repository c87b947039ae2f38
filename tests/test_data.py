import json

import datasets  # here, not in a test: a mutant's run (forked from the collected session) does not import it again
import pandas as pd
import pytest

from grpo.config.schema import DataConfig
from grpo.data import DataError, PromptSampler, build, format_prompt, load_rows
from grpo.models import char_tokenizer
from grpo.trainer import build as build_module
from grpo.trainer.loop import fit
from tests.under_mutmut import bounded_under_mutmut  # noqa: F401  (a looping mutant fails in seconds)


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
    csv = tmp_path / "qa.csv"
    csv.write_text("prompt,answer\n" + "".join(f"What is {i}+1?,{i + 1}\n" for i in range(8)))
    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = cfg_factory({"data": {"source": str(csv), "num_eval": 0, **override}})
    with pytest.raises(DataError) as e:
        fit(cfg)
    assert str(e.value).startswith(named) and str(e.value).endswith("the data's columns are: prompt, answer")
    assert "\n" not in str(e.value)


def test_the_default_answer_column_may_be_absent_and_a_named_one_present_is_used(tok, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "gold": "1"}\n{"prompt": "b", "gold": "2"}\n')
    assert "answer" not in build(DataConfig(source=str(rows), num_eval=0), tok).train[0]  # optional: not named
    got = build(DataConfig(source=str(rows), num_eval=0, answer_column="gold"), tok).train
    assert sorted(r["answer"] for r in got) == ["1", "2"]


# ---------------------------------------------------------------- unit level: each function of grpo/data.py
class ChatTok:
    """A tokenizer whose chat template shows what it was given (each turn as ``<role>content``, the tools' names)
    and whose ids are the characters' code points, a BOS id 0 first when asked for special tokens."""

    chat_template = "shown"

    def apply_chat_template(self, turns, *, tools, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        shown = "".join(f"<{m['role']}>{m['content']}" for m in turns) + "<assistant>"
        return shown if tools is None else f"[tools: {', '.join(t['name'] for t in tools)}]" + shown

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [0] * add_special_tokens + [ord(c) for c in text]}


class Loaded:
    """``datasets.load_dataset`` replaced: the calls it got, answered with ``rows`` (or raising ``error``)."""

    def __init__(self, rows=(), error=None):
        self.rows, self.error, self.calls = list(rows), error, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.error is not None:
            raise self.error
        return self.rows


@pytest.fixture
def loaded(monkeypatch):
    def make(rows=(), error=None):
        fake = Loaded(rows, error)
        monkeypatch.setattr(datasets, "load_dataset", fake)
        return fake
    return make


@pytest.fixture
def spy_task(monkeypatch):
    """builtin:zz-spy: rows ``{"prompt": "p<i>", "answer": i}``; the (n, seed, kwargs) of every call."""
    from grpo import tasks

    monkeypatch.setattr(tasks.TASKS, "_items", dict(tasks.TASKS._items))
    calls = []

    def spy(n, seed, level=0):
        calls.append((n, seed, level))
        return [{"prompt": f"p{i}", "answer": i} for i in range(n)]

    tasks.register_task("zz-spy")(spy)
    return calls


def _file(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_builtin_task_gets_its_arguments_the_rows_asked_for_and_the_seed(spy_task):
    from grpo.data import check_source

    dcfg = DataConfig(source="builtin:zz-spy", task_kwargs={"level": 4}, num_train=3, num_eval=2, seed=9)
    assert load_rows(dcfg) == [{"prompt": f"p{i}", "answer": i} for i in range(5)]
    load_rows(dcfg, n=2, seed=7)
    check_source(dcfg)  # one prompt generated: the arguments checked before a model loads
    assert spy_task == [(5, 9, 4), (2, 7, 4), (1, 9, 4)]
    with pytest.raises(DataError, match=r"data.task_kwargs={'level': 'x'} for builtin:arithmetic: arithmetic level"):
        check_source(DataConfig(source="builtin:arithmetic", task_kwargs={"level": "x"}))


def test_a_misspelt_task_argument_is_named_with_the_closest_one_and_every_argument_it_takes():
    def refused(kwargs):
        with pytest.raises(DataError) as e:
            load_rows(DataConfig(source="builtin:arithmetic", task_kwargs=kwargs))
        return str(e.value)

    tail = "it takes level, template (switch tasks with data=<group>, which brings its own task_kwargs)"
    assert refused({"levl": 1}) == ("data.task_kwargs.levl: builtin:arithmetic has no argument 'levl' (did you mean "
                                    f"'level'?); {tail}")
    assert refused({"zzz": 1}) == f"data.task_kwargs.zzz: builtin:arithmetic has no argument 'zzz'; {tail}"
    with pytest.raises(DataError, match="unknown built-in task 'arithmetic:x'"):  # all after the first colon
        load_rows(DataConfig(source="builtin:arithmetic:x"))


def test_a_file_or_a_hub_name_is_read_with_the_loader_its_kind_needs(tmp_path, loaded):
    fake = loaded([{"prompt": "a"}])
    for name, kind in (("r.jsonl", "json"), ("r.JSON", "json"), ("r.parquet", "parquet"), ("r.csv", "csv")):
        path = tmp_path / name
        path.write_text("x")
        assert load_rows(DataConfig(source=str(path), split="test")) == [{"prompt": "a"}]
        assert fake.calls.pop() == ((kind,), {"data_files": str(path), "split": "train"})  # a file: all its rows
    load_rows(DataConfig(source="org/set", split="test", load_kwargs={"name": "main"}))
    assert fake.calls == [(("org/set",), {"split": "test", "name": "main"})]


def test_a_source_that_does_not_load_is_one_line_with_its_first_line(tmp_path, loaded):
    def refused(error, src="org/set"):
        loaded(error=error)
        with pytest.raises(DataError) as e:
            load_rows(DataConfig(source=src))
        return str(e.value)

    assert refused(OSError("  no such dataset\nsecond line")) == \
        "data.source='org/set' could not be loaded: no such dataset"
    assert refused(ValueError()) == "data.source='org/set' could not be loaded: ValueError"
    assert refused(OSError("x" * 300)).endswith(": " + "x" * 200)
    path = _file(tmp_path, [{"prompt": "a"}])
    assert refused(OSError("bad"), str(path)) == f"data.source={str(path)!r} could not be loaded: bad"


def test_a_local_source_must_be_one_non_empty_file_of_a_known_kind(tmp_path):
    from grpo.data import _local_file, check_source

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "one.jsonl").write_text("x")
    (tmp_path / "notes.txt").write_text("x")
    assert _local_file(str(tmp_path / "one.jsonl")) == tmp_path / "one.jsonl"
    assert _local_file("org/set") is None and _local_file("gsm8k") is None
    for name, says in (("empty.jsonl", "the file is empty"), ("notes.txt", "unknown file type"),
                       ("missing.csv", "file not found"), ("", "is a folder")):
        with pytest.raises(DataError, match=says):
            check_source(DataConfig(source=str(tmp_path / name)))


def test_messages_are_checked_and_keep_only_their_role_and_content():
    from grpo.data import messages_of

    assert messages_of("text", "w") is None
    got = messages_of(({"role": "system", "content": "s", "x": 1}, {"role": "user", "content": "u"},
                       {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}), "w")
    assert got == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                   {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]
    for value, says in ((5, "w: the prompt is neither text nor a list"), (["u"], "w: the prompt is neither"),
                        ([{"role": "bot", "content": "u"}], "w: unknown role 'bot'"),
                        ([{"content": "u"}], "w: unknown role None"),
                        ([{"role": "user", "content": None}], "w: a user message has no text 'content'"),
                        ([{"role": "system", "content": "s"}], "w: the prompt messages have no 'user' turn")):
        with pytest.raises(DataError, match=says):
            messages_of(value, "w")


def test_prompt_turns_template_a_text_prompt_and_keep_a_conversation_as_it_is():
    from grpo.data import prompt_turns

    text = DataConfig(prompt_template="Q: {prompt} ({level})", system_prompt="Be brief.")
    assert prompt_turns({"prompt": "hi", "level": 2}, text) == (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: hi (2)"}], None)
    chat = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]
    assert prompt_turns({"prompt": chat}, DataConfig(system_prompt="Be brief.")) == (chat, chat)  # its own system
    user = [{"role": "user", "content": "hi"}]
    assert prompt_turns({"prompt": user}, DataConfig(system_prompt="S.")) == ([
        {"role": "system", "content": "S."}, *user], user)
    with pytest.raises(DataError, match=r"data.prompt_template='Q: \{prompt\}' applies to text prompts; row 3's"):
        prompt_turns({"prompt": user}, DataConfig(prompt_template="Q: {prompt}"), "row 3")
    with pytest.raises(DataError, match="^row 3: the prompt is neither"):
        prompt_turns({"prompt": 5}, DataConfig(), "row 3")
    with pytest.raises(DataError, match="^data row: the prompt is neither"):
        prompt_turns({"prompt": 5}, DataConfig())
    with pytest.raises(DataError, match="^data row: the prompt is neither"):
        format_prompt({"prompt": 5}, DataConfig(), ChatTok())


def test_turns_render_through_the_chat_template_with_the_tools_or_as_paragraphs():
    from grpo.data import render_turns

    turns = [{"role": "system", "content": "S."}, {"role": "user", "content": "hi"}]
    tools = [{"name": "calc"}, {"name": "search"}]
    assert render_turns(turns, DataConfig(), ChatTok()) == "<system>S.<user>hi<assistant>"
    assert render_turns(turns, DataConfig(), ChatTok(), tools) == "[tools: calc, search]<system>S.<user>hi<assistant>"
    assert render_turns(turns, DataConfig(), ChatTok(), []) == "<system>S.<user>hi<assistant>"  # no tools: none
    assert render_turns(turns, DataConfig(chat_template=False), ChatTok()) == "S.\n\nhi"
    assert render_turns(turns, DataConfig(), object()) == "S.\n\nhi"  # a tokenizer without a chat template
    assert format_prompt({"prompt": "hi"}, DataConfig(system_prompt="S."), ChatTok(), tools=tools) == (
        "[tools: calc, search]<system>S.<user>hi<assistant>", None)


def test_extra_text_goes_to_the_last_user_turn_and_system_text_to_the_system_turn():
    from grpo.data import with_extra_text, with_system_text

    turns = [{"role": "system", "content": "S."}, {"role": "user", "content": "u1"},
             {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2", "name": "x"},
             {"role": "tool", "content": "t"}]
    assert with_extra_text(turns, "more") == [*turns[:3], {"role": "user", "content": "u2\n\nmore", "name": "x"},
                                              turns[4]]
    assert turns[3]["content"] == "u2"  # the turns given are left as they were
    assert with_system_text(turns, "Tools.") == [{"role": "system", "content": "S.\n\nTools."}, *turns[1:]]
    assert with_system_text(turns[1:], "Tools.") == [{"role": "system", "content": "Tools."}, *turns[1:]]
    assert with_system_text([], "Tools.") == [{"role": "system", "content": "Tools."}]
    assert turns[0]["content"] == "S."


def test_prepare_renders_tokenizes_and_keeps_what_each_kind_of_row_needs():
    from grpo.data import prepare

    chat = [{"role": "user", "content": "hi"}]
    rows = [{"prompt": "a", "answer": 1, "gold": "g", "level": 2}, {"prompt": chat, "answer": 3},
            {"prompt": "x" * 40, "answer": 4}]
    dcfg = DataConfig(max_prompt_tokens=60, answer_column="gold", system_prompt="S.")
    out, dropped = prepare(rows, dcfg, ChatTok(), tools=[{"name": "calc"}], keep_turns=True, system_text="Tools.")
    first = "[tools: calc]<system>S.\n\nTools.<user>a<assistant>"
    second = "[tools: calc]<system>S.\n\nTools.<user>hi<assistant>"
    assert dropped == 1 and [r["prompt"] for r in out] == [first, second]
    assert out[0]["prompt_ids"] == [ord(c) for c in first]  # no special tokens added: the template has its own
    assert out[0]["answer"] == "g" and out[0]["level"] == 2 and "prompt_messages" not in out[0]
    assert out[1]["answer"] == 3 and out[1]["prompt_messages"] == chat  # a row without data.answer_column keeps its own
    assert out[0]["prompt_turns"] == [{"role": "system", "content": "S.\n\nTools."}, {"role": "user", "content": "a"}]
    plain, _ = prepare(rows[:2], DataConfig(), ChatTok())
    assert [set(r) for r in plain] == [{"prompt", "prompt_ids", "answer", "gold", "level"},
                                       {"prompt", "prompt_ids", "answer", "prompt_messages"}]
    assert plain[0]["prompt"] == "<user>a<assistant>"
    with pytest.raises(DataError, match="data row 1 has no 'prompt' value"):
        prepare([{"prompt": "a"}, {"prompt": ""}], DataConfig(), ChatTok())


def test_rows_with_images_go_to_the_image_path_and_a_prompt_placing_images_needs_them(monkeypatch):
    from grpo import data

    seen = []

    def image_row(row, dcfg, tokenizer, image_processor, where):
        seen.append((row["prompt"], dcfg.image_column, tokenizer, image_processor, where))
        return {"prompt": row["prompt"], "prompt_ids": [1] * row["n"]}

    monkeypatch.setattr(data, "image_row", image_row)
    tok, proc = ChatTok(), object()
    rows = [{"prompt": "a", "pics": ["i"], "n": 3}, {"prompt": "b", "pics": ["i"], "n": 4},
            {"prompt": "c", "pics": [], "n": 1}, {"prompt": "d", "pics": ["i"], "n": 2}]
    dcfg = DataConfig(image_column="pics", max_prompt_tokens=3, chat_template=False)
    out, dropped = data.prepare(rows, dcfg, tok, image_processor=proc)
    assert [r["prompt"] for r in out] == ["a", "c", "d"] and dropped == 1  # b: 4 tokens; c has no images
    assert seen == [(p, "pics", tok, proc, f"data row {i}") for i, p in ((0, "a"), (1, "b"), (3, "d"))]
    placed = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many?"}]}]
    with pytest.raises(DataError, match=r"data row 0: its prompt places 1 image\(s\) but the row has no images"):
        data.prepare([{"prompt": placed}], DataConfig(), tok)


def test_template_fields_name_their_column_before_any_attribute_or_index():
    from grpo.data import check_columns

    rows = [{"prompt": "p", "meta": {"x": 1}, "items": [1]}, {"prompt": "q", "gold": 2}]
    check_columns(rows, DataConfig(prompt_template="{prompt} {meta.x} {items[0]}", answer_column="gold"))
    with pytest.raises(DataError, match="uses column 'nope', which the data does not have; the data's columns are: "
                                        "prompt, meta, items, gold$"):
        check_columns(rows, DataConfig(prompt_template="{nope.x}"))
    with pytest.raises(DataError, match=r"data.prompt_template='\{prompt': "):
        check_columns(rows, DataConfig(prompt_template="{prompt"))


def test_builtin_held_out_prompts_are_the_first_generated_and_files_hold_out_their_tail(tmp_path, loaded):
    dcfg = DataConfig(source="builtin:arithmetic", num_train=20, num_eval=5, chat_template=False)
    splits = build(dcfg, ChatTok())
    assert [r["prompt"] for r in splits.eval] == [r["prompt"] for r in load_rows(dcfg)[:5]]
    loaded([{"prompt": f"q{i}"} for i in range(10)])
    splits = build(DataConfig(source=str(_file(tmp_path, [{}])), num_eval=2, chat_template=False), ChatTok())
    assert [r["prompt"] for r in splits.train] == [f"q{i}" for i in range(8)]
    assert [r["prompt"] for r in splits.eval] == ["q8", "q9"] and splits.note == ""
    three = build(DataConfig(source=str(_file(tmp_path, [{}])), num_eval=3, chat_template=False), ChatTok())
    assert len(three.eval) == 2 and three.note == (f"data.num_eval=3 but {tmp_path / 'rows.jsonl'} has 10 usable rows "
                                                   "and a file holds out at most a fifth of them: 2 held out")
    loaded([{"prompt": "a"}, {"prompt": "b"}])
    two = build(DataConfig(source=str(_file(tmp_path, [{}])), num_eval=1, chat_template=False), ChatTok())
    assert two.note.endswith("of them: held-out evaluation is off (it needs 5 rows or more; data.num_eval=0 silences "
                             "this)")
    with pytest.raises(DataError, match="no training rows left after holding out data.num_eval"):
        build(DataConfig(source="builtin:arithmetic", num_train=0, num_eval=3), ChatTok())


def test_build_hands_its_settings_to_the_training_rows_and_every_set(spy_task):
    sets = [{"name": "s1", "source": "builtin:zz-spy", "num": 2}, {"name": "s2", "source": "builtin:arithmetic",
                                                                    "num": 3, "prompt_column": "prompt"}]
    dcfg = DataConfig(source="builtin:multiplication", num_train=4, num_eval=1, system_prompt="S.")
    splits = build(dcfg, ChatTok(), tools=[{"name": "calc"}], keep_turns=True, system_text="Tools.", sets=sets)
    assert list(splits.sets) == ["s1", "s2"] and [len(v) for v in splits.sets.values()] == [2, 3]
    assert spy_task == [(2, 1234, 0)]
    for row in [*splits.train, *splits.eval, *splits.sets["s1"], *splits.sets["s2"]]:
        assert row["prompt"].startswith("[tools: calc]<system>S.\n\nTools.<user>")
        assert row["prompt_turns"][0] == {"role": "system", "content": "S.\n\nTools."}
    assert splits.sets["s1"][1]["prompt"].endswith("<user>p1<assistant>") and splits.note == ""


def test_training_prompts_in_a_set_are_dropped_and_counted_in_the_note(tmp_path, loaded):
    loaded([{"prompt": f"q{i}"} for i in range(4)])  # 4 rows: no held-out split, and a note saying so
    dcfg = DataConfig(source=str(_file(tmp_path, [{}])), num_eval=1, chat_template=False)
    set_file = _file(tmp_path, [{}], "set.jsonl")
    splits = build(dcfg, ChatTok(), sets=[{"name": "mine", "source": str(set_file), "num": 2}])
    assert [r["prompt"] for r in splits.train] == ["q2", "q3"] and [r["prompt"] for r in splits.sets["mine"]] == [
        "q0", "q1"]
    assert splits.note.endswith("held-out evaluation is off (it needs 5 rows or more; data.num_eval=0 silences this); "
                                "2 training prompts that are in an evaluation set were dropped")
    with pytest.raises(DataError, match="every training prompt is also in an evaluation set"):
        build(dcfg, ChatTok(), sets=[{"name": "mine", "source": str(set_file)}])


def test_a_set_reads_its_own_source_keys_and_the_datas_rendering(tmp_path, loaded):
    from grpo.data import build_sets, set_rows, set_source

    dcfg = DataConfig(source="builtin:countdown", split="dev", load_kwargs={"a": 1}, task_kwargs={"level": 2},
                      prompt_column="q", answer_column="gold", prompt_template="Q: {prompt}", system_prompt="S.",
                      chat_template=False, max_prompt_tokens=99, seed=5)
    got = set_source({"name": "n", "num": 3, "source": "builtin:arithmetic", "seed": 8}, dcfg)
    assert got == DataConfig(source="builtin:arithmetic", seed=8, prompt_template="Q: {prompt}", system_prompt="S.",
                             chat_template=False, max_prompt_tokens=99)
    assert len(set_rows({"name": "n", "source": "builtin:arithmetic"}, dcfg)) == 100
    assert set_rows({"name": "n", "source": "builtin:arithmetic", "num": 7, "seed": 8}, dcfg) == load_rows(got, n=7)
    fake = loaded([{"prompt": f"q{i}", "gold": i} for i in range(5)])
    path = _file(tmp_path, [{}])
    assert len(set_rows({"name": "n", "source": str(path)}, dcfg)) == 5
    assert set_rows({"name": "n", "source": str(path), "num": 2}, dcfg) == fake.rows[:2]
    sets = build_sets([{"name": "f", "source": str(path), "num": 1, "max_prompt_tokens": 9}], dcfg, ChatTok())
    assert sets == {"f": [{"gold": 0, "prompt": "S.\n\nQ: q0", "prompt_ids": [ord(c) for c in "S.\n\nQ: q0"]}]}
    with pytest.raises(DataError, match="^evaluation.sets f: every prompt is longer than max_prompt_tokens$"):
        build_sets([{"name": "f", "source": str(path), "max_prompt_tokens": 3}], dcfg, ChatTok())
    loaded([{"text": "a"}])
    with pytest.raises(DataError, match="^evaluation.sets n: no column 'prompt' .prompt_column.; its columns are: te"):
        set_rows({"name": "n", "source": str(path)}, dcfg)
    loaded([])
    with pytest.raises(DataError, match=f"^evaluation.sets n: source {str(path)!r} has no rows$"):
        set_rows({"name": "n", "source": str(path)}, dcfg)
    with pytest.raises(DataError, match="^evaluation.sets n: data.source='builtin:nope': unknown built-in task"):
        set_rows({"name": "n", "source": "builtin:nope"}, dcfg)


def test_prompts_with_images_are_the_same_only_with_the_same_pixels():
    import torch

    from grpo.data import _prompt_key

    class Ids(list):
        def __init__(self, pixels):
            super().__init__([1, 2])
            self.pixel_values = pixels

    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert _prompt_key({"prompt": "p", "prompt_ids": [1, 2]}) == "p"
    key = _prompt_key({"prompt": "p", "prompt_ids": Ids(a)})
    assert key[0] == "p" and key == _prompt_key({"prompt": "p", "prompt_ids": Ids(a.clone())})
    assert key != _prompt_key({"prompt": "p", "prompt_ids": Ids(b)})


def test_the_prompt_order_is_the_one_every_checkpoint_holds():
    """A checkpoint holds the sampler's (epoch, position) only: the order of each pass must come out of the seed the
    same way in every version, or a resumed run would train on other prompts than the run it resumes."""
    s = PromptSampler(5, seed=3)
    assert s.next(12) == [3, 1, 2, 4, 0, 0, 2, 1, 3, 4, 1, 2]
    assert s.state_dict() == {"epoch": 2, "position": 2, "num_rows": 5, "seed": 3}
    assert PromptSampler(5, seed=4).next(5) == [1, 3, 2, 0, 4]
    t = PromptSampler(5, seed=3)
    t.load_state_dict({"epoch": 1, "position": 3, "num_rows": 5, "seed": 3})
    assert t.next(4) == [3, 4, 1, 2] and (t.epoch, t.position) == (2, 2)


def test_the_template_reads_the_prompt_column_as_prompt_and_a_bad_row_is_named_by_its_index():
    from grpo.data import check_columns, prepare

    rows = [{"question": "hi", "gold": 1}]
    dcfg = DataConfig(prompt_column="question", answer_column="gold", prompt_template="Q: {prompt}",
                      chat_template=False)
    check_columns(rows, dcfg)  # {prompt} is the prompt column, whatever its name
    out, _ = prepare(rows, dcfg, ChatTok())
    assert out[0]["prompt"] == "Q: hi" and out[0]["answer"] == 1 and "question" not in out[0]
    with pytest.raises(DataError, match="^row 7: the prompt is neither"):
        format_prompt({"prompt": 5}, DataConfig(), ChatTok(), where="row 7")
    for bad in ({"text": "b"}, {"prompt": None, "text": "b"}):
        with pytest.raises(DataError, match=r"^data row 1 has no 'prompt' value \(data.prompt_column\); its columns "
                                            "are: (prompt, )?text$"):
            prepare([{"prompt": "a"}, bad], DataConfig(), ChatTok())
    with pytest.raises(DataError, match="^data row 1: the prompt is neither"):
        prepare([{"prompt": "a"}, {"prompt": 5}], DataConfig(), ChatTok())


@pytest.mark.parametrize("override,named", [
    ({"answer_column": "nope"}, "data.answer_column='nope': the data has no such column"),
    ({"prompt_column": "nope"}, "data.prompt_column='nope': the data has no such column"),
    ({"prompt_template": "{prompt} ({nope})"}, "data.prompt_template uses column 'nope', which the data does not have"),
])
def test_a_column_the_config_names_and_the_data_lacks_is_one_line_naming_the_key(override, named):
    from grpo.data import check_columns

    with pytest.raises(DataError) as e:
        check_columns([{"prompt": "a", "answer": 1}, {"prompt": "b", "level": 2}], DataConfig(**override))
    assert str(e.value) == f"{named}; the data's columns are: prompt, answer, level"


def test_rows_with_images_reach_the_image_path_with_the_models_processor_in_training_and_in_sets(monkeypatch,
                                                                                                  spy_task):
    from grpo import data

    processors = []

    def image_row(row, dcfg, tokenizer, image_processor, where):
        processors.append(image_processor)
        return {**row, "prompt_ids": [1, 2]}

    monkeypatch.setattr(data, "image_row", image_row)
    monkeypatch.setattr(data, "load_rows", lambda dcfg, n=None, seed=None: [
        {"prompt": f"p{i}", "images": ["i"]} for i in range(n or 4)])
    proc = object()
    splits = build(DataConfig(source="builtin:zz-spy", num_eval=1), ChatTok(), image_processor=proc,
                   sets=[{"name": "s", "source": "builtin:zz-spy", "num": 2}])
    assert processors == [proc] * 6 and [len(splits.train), len(splits.eval), len(splits.sets["s"])] == [2, 1, 2]
    rows, dropped = data._prepare([{"prompt": "a", "images": ["i"]}], DataConfig(max_prompt_tokens=1), ChatTok(),
                                  None, False, None, proc)
    assert (rows, dropped) == ([], [2])  # the dropped prompt's length, as for a text prompt


def test_build_keeps_the_turns_only_when_asked():
    rows = build(DataConfig(source="builtin:arithmetic", num_train=3, num_eval=1), ChatTok()).train
    assert set(rows[0]) == {"prompt", "prompt_ids", "answer"}
