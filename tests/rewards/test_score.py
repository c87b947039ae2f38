"""grpo/rewards/score.py: every function on every sample, weighted; a failing sample scores None, not 0."""
import pytest

from grpo.rewards.score import RewardFunction, score


def test_weighted_total_skips_a_failed_sample_and_counts_the_error():
    def half(prompts, completions, **_):
        return [0.5] * len(completions)

    def flaky(prompts, completions, **_):
        return [1.0, None, 1.0]

    def raises(prompts, completions, **_):
        raise ZeroDivisionError("boom")

    fns = [RewardFunction("a", half, 2.0), RewardFunction("b", flaky, 1.0), RewardFunction("c", raises, 5.0)]
    s = score(fns, ["p"] * 3, ["x", "y", "z"], {})
    assert s.total == pytest.approx([2.0, 1.0, 2.0]) and s.per_fn["b"] == [1.0, None, 1.0]
    assert s.per_fn["c"] == [None] * 3 and s.errors == {"a": 0, "b": 0, "c": 3}  # None returned is no error


@pytest.fixture
def fresh_reports(monkeypatch, caplog):
    """score's once-per-function failure records, emptied for the test; the warnings it logs captured."""
    import grpo.rewards.score as score_mod

    monkeypatch.setattr(score_mod, "_reported", set())
    monkeypatch.setattr(score_mod, "_first_failure", {})
    caplog.set_level("WARNING", logger="grpo.rewards")
    return caplog


def _lines(text: str) -> list[str]:
    """The logged text's lines without the ^ markers under code (Python versions differ in where they draw them)."""
    return [line for line in text.splitlines() if line.strip(" ^~")]


def _user_reward(tmp_path, filename: str):
    """A reward defined in the user's own file ``filename`` (outside the package) that raises on every call."""
    import importlib.util

    path = tmp_path / filename
    path.write_text("def bad_reward(prompts, completions, **_):\n    return helper(completions)\n\n\n"
                    "def helper(completions):\n    raise ValueError('no number in ' + repr(completions[0]))\n")
    spec = importlib.util.spec_from_file_location(f"user_{filename[:-3]}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.bad_reward


@pytest.mark.parametrize("filename", ["my_rewards.py", "score.py"])  # a user file may share a machinery file's name
def test_first_failure_is_logged_once_with_the_users_frames_not_the_machinerys(tmp_path, fresh_reports, filename):
    from grpo.rewards.score import first_failure

    fns = [RewardFunction("bad", _user_reward(tmp_path, filename))]
    score(fns, ["p", "p"], ["a", "b"], {})
    score(fns, ["p"], ["c"], {})  # a second failure, and a second batch: not logged again
    logged = [r.getMessage() for r in fresh_reports.records]
    assert len(logged) == 1, logged
    text = logged[0]
    assert text.startswith("reward function 'bad' raised ValueError: no number in 'a' (the samples")
    assert text.endswith("ValueError: no number in 'a'")  # the traceback ends at the exception, stripped
    path = tmp_path / filename
    assert text.startswith("reward function 'bad' raised ValueError: no number in 'a' (the samples it cannot score "
                           "get no score; shown once):\n  File ")
    assert _lines(text)[-5:] == [f'  File "{path}", line 2, in bad_reward', "    return helper(completions)",
                                 f'  File "{path}", line 6, in helper',
                                 "    raise ValueError('no number in ' + repr(completions[0]))",
                                 "ValueError: no number in 'a'"]
    assert "grpo/rewards/score.py" not in text and "in score_one" not in text and "in _call" not in text
    assert first_failure("bad") == "raised ValueError: no number in 'a'" and first_failure("other") is None


def test_each_function_reports_its_own_first_failure_and_long_messages_are_cut(fresh_reports):
    from grpo.rewards.score import first_failure

    def long(prompts, completions, **_):
        raise RuntimeError("x" * 400)

    def nan(prompts, completions, **_):
        return [float("nan")] * len(completions)

    s = score([RewardFunction("long", long), RewardFunction("nan", nan)], ["p"], ["a"], {})
    assert s.errors == {"long": 1, "nan": 1}
    assert first_failure("long") == ("raised RuntimeError: " + "x" * 400)[:300]
    assert first_failure("nan") == "returned nan"
    messages = [r.getMessage() for r in fresh_reports.records]
    assert len(messages) == 2 and messages[1] == ("reward function 'nan' returned nan (the samples it cannot score "
                                                  "get no score; shown once)")


def test_an_exception_of_several_lines_is_shown_whole_and_named_by_its_last(fresh_reports):
    """A SyntaxError (a reward compiling the completion) formats as several lines: the text and ^ marker, then the
    error; the one-line summary is that last line."""
    from grpo.rewards.score import first_failure

    def compiles(prompts, completions, **_):
        return [float(eval(compile(c, "<answer>", "eval"))) for c in completions]

    s = score([RewardFunction("calc", compiles)], ["p"], ["1 +"], {})
    assert s.errors == {"calc": 1} and s.per_fn["calc"] == [None]
    (text,) = [r.getMessage() for r in fresh_reports.records]
    assert first_failure("calc") == "raised SyntaxError: invalid syntax"
    assert _lines(text)[-3:] == ['  File "<answer>", line 1', "    1 +", "SyntaxError: invalid syntax"], text


def _named(prompts, completions, scale=1.0):
    return [scale] * len(completions)


def _open(prompts, completions, scale=1.0, **columns):
    return [scale] * len(completions)


def test_a_config_argument_the_function_does_not_name_is_refused_with_what_it_takes():
    from grpo.rewards.score import RewardSpecError, check_kwargs

    check_kwargs("r", "m:_named", _named, {"scale": 2.0})
    with pytest.raises(RewardSpecError) as e:
        check_kwargs("r", "m:_named", _named, {"sclae": 2.0})
    assert str(e.value) == ("reward.functions.r.sclae: 'm:_named' has no argument 'sclae' (did you mean 'scale'?); "
                            "it takes scale (and fn, weight)")  # no **kwargs: nothing more to say
    with pytest.raises(RewardSpecError) as e:
        check_kwargs("r", "m:_bare", lambda prompts, completions: [], {"scale": 1})
    assert str(e.value) == ("reward.functions.r.scale: 'm:_bare' has no argument 'scale'; it takes no arguments "
                            "(and fn, weight)")
    with pytest.raises(RewardSpecError) as e:
        check_kwargs("r", "m:_open", _open, {"zzz": 1})
    assert str(e.value) == ("reward.functions.r.zzz: 'm:_open' has no argument 'zzz'; it takes scale (and fn, weight); "
                            "a config argument must be a parameter it names (its **kwargs gets the dataset columns)")


def test_a_builtin_is_tried_once_with_its_arguments_and_its_own_complaint_is_the_error():
    from grpo.rewards.registry import resolve
    from grpo.rewards.score import RewardSpecError, check_kwargs

    fn = resolve("overlong_penalty")
    check_kwargs("o", "overlong_penalty", fn, {"max_len": 8})
    with pytest.raises(RewardSpecError) as e:
        check_kwargs("o", "overlong_penalty", fn, {})
    assert str(e.value) == ("reward.functions.o (overlong_penalty) cannot run with these arguments: overlong_penalty "
                            "needs max_len > 0 (the rollout's max new tokens)")
    with pytest.raises(RewardSpecError) as e:  # a built-in's own **kwargs are the columns: no advice about them
        check_kwargs("o", "overlong_penalty", fn, {"max_lne": 8})
    assert str(e.value) == ("reward.functions.o.max_lne: 'overlong_penalty' has no argument 'max_lne' "
                            "(did you mean 'max_len'?); it takes max_len, buffer_len, penalty_factor, completion_ids "
                            "(and fn, weight)")


def test_build_resolves_each_function_with_its_weight_arguments_and_spec_in_this_process():
    from grpo.rewards.score import build

    (fn,) = build({"n": {"fn": "number_only", "weight": 2}})
    assert (fn.name, fn.weight, fn.kwargs, fn.spec, fn.timeout_s, fn.worker) == ("n", 2.0, {}, "number_only", 0.0,
                                                                                 None)
    (fn,) = build({"o": {"fn": "overlong_penalty", "max_len": 8}})
    assert fn.kwargs == {"max_len": 8} and fn.weight == 1.0 and fn.spec == "overlong_penalty"


def test_reward_inputs_follow_trls_rule_for_conversational_and_text_datasets():
    from grpo.rewards.score import reward_inputs

    turns = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]
    chat = [{"prompt": "q1", "prompt_messages": turns}, {"prompt": "q2"}]
    prompts, completions = reward_inputs(chat, ["a", "b", "c", "d"], 2, "auto")
    assert prompts == [turns] * 2 + [[{"role": "user", "content": "q2"}]] * 2  # the row's own turns, else the prompt's
    assert completions[0] == [{"role": "assistant", "content": "a"}] and len(completions) == 4
    text = [{"prompt": "q1"}, {"prompt": "q2"}]
    assert reward_inputs(text, ["a", "b"], 1, "auto") == (["q1", "q2"], ["a", "b"])
    assert reward_inputs(chat, ["a", "b"], 1, "text") == (["q1", "q2"], ["a", "b"])
    prompts, completions = reward_inputs(text, ["a", "b"], 1, "messages")
    assert prompts[1] == [{"role": "user", "content": "q2"}] and completions[1] == [{"role": "assistant",
                                                                                    "content": "b"}]


def test_a_builtins_complaint_is_its_first_line_cut_to_200_characters_or_its_type(monkeypatch):
    from grpo.rewards import registry
    from grpo.rewards.score import RewardSpecError, check_kwargs

    def long(prompts, completions, **_):
        raise ValueError("x" * 300 + "\nsecond line")

    def silent(prompts, completions, **_):
        raise KeyError()

    for name, fn in (("long_builtin", long), ("silent_builtin", silent)):
        monkeypatch.setitem(registry.REWARDS._items, name, fn)
    with pytest.raises(RewardSpecError) as e:
        check_kwargs("r", "long_builtin", long, {})
    assert str(e.value) == "reward.functions.r (long_builtin) cannot run with these arguments: " + "x" * 200
    with pytest.raises(RewardSpecError) as e:
        check_kwargs("r", "silent_builtin", silent, {})
    assert str(e.value).endswith("cannot run with these arguments: KeyError")


def test_a_function_in_the_worker_process_is_called_there_by_its_spec_arguments_and_timeout():
    calls = []

    class Worker:  # what grpo.rewards.worker.RewardWorker.call receives (it imports the function by its spec)
        def call(self, spec, kwargs, prompts, completions, columns, timeout_s):
            calls.append((spec, kwargs, prompts, completions, columns, timeout_s))
            return [0.5] * len(completions)

    rf = RewardFunction("w", None, 2.0, {"scale": 3}, spec="my_mod:fn", timeout_s=4.0, worker=Worker())
    s = score([rf], ["p", "q"], ["a", "b"], {"answer": [1, 2]})
    assert s.total == [1.0, 1.0] and s.errors == {"w": 0}
    assert calls == [("my_mod:fn", {"scale": 3}, ["p", "q"], ["a", "b"], {"answer": [1, 2]}, 4.0)]


def test_a_failed_batch_is_retried_sample_by_sample_and_a_timeout_is_not(fresh_reports):
    from grpo.errors import RewardTimeout
    from grpo.rewards.score import first_failure

    seen = []

    def only_alone(prompts, completions, **columns):
        seen.append((prompts, completions, columns))
        if len(completions) > 1 or completions[0] == "bad":
            raise ValueError("one at a time")
        return [float(columns["answer"][0])]

    s = score([RewardFunction("alone", only_alone)], ["p0", "p1", "p2"], ["a", "bad", "c"], {"answer": [1, 2, 3]})
    assert s.per_fn["alone"] == [1.0, None, 3.0] and s.errors == {"alone": 1}
    assert seen == [(["p0", "p1", "p2"], ["a", "bad", "c"], {"answer": [1, 2, 3]}),  # the batch, then each alone
                    (["p0"], ["a"], {"answer": [1]}), (["p1"], ["bad"], {"answer": [2]}),
                    (["p2"], ["c"], {"answer": [3]})]

    class Hangs:
        calls = 0

        def call(self, *args):
            Hangs.calls += 1
            raise RewardTimeout("killed")

    rf = RewardFunction("slow", None, timeout_s=4.0, worker=Hangs())
    s = score([rf], ["p", "p"], ["a", "b"], {})
    assert s.per_fn["slow"] == [None, None] and s.errors == {"slow": 2} and Hangs.calls == 1  # not retried
    assert first_failure("slow") == "timed out after 4 s (reward.timeout_s) and was killed"
    assert [r.getMessage() for r in fresh_reports.records][-1].startswith(
        "reward function 'slow' timed out after 4 s (reward.timeout_s) and was killed (the samples")


def test_in_worker_gives_every_function_one_shared_worker_and_the_timeout():
    from grpo.rewards.score import in_worker
    from grpo.rewards.worker import RewardWorker

    rewards = [RewardFunction("a", _named, spec="m:a"), RewardFunction("b", _named, 2.0, spec="m:b")]
    assert in_worker(rewards, 0.0) is rewards
    moved = in_worker(rewards, 0.5)  # no process starts until a call
    assert [(r.name, r.weight, r.spec, r.timeout_s) for r in moved] == [("a", 1.0, "m:a", 0.5), ("b", 2.0, "m:b", 0.5)]
    assert isinstance(moved[0].worker, RewardWorker) and moved[0].worker is moved[1].worker
    assert rewards[0].worker is None  # copies: the configured ones are unchanged
