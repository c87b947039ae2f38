import sys
import textwrap

import pytest

from grpo.rewards import RewardSpecError, available, resolve
from grpo.rewards.score import build, score


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def has_seven(prompts, completions, **columns):
            return [1.0 if "7" in c else 0.0 for c in completions]

        def flaky(prompts, completions, answer, **_):
            out = []
            for c, a in zip(completions, answer):
                if a == 3:
                    raise RuntimeError("boom")
                out.append(0.5)
            return out

        def verl_style(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": float(solution_str.strip() == str(ground_truth))}

        def wrong(x):
            return [0.0]

        def nan_maker(prompts, completions, **_):
            return [float("nan")] * len(completions)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_rewards", None)


def test_builtins_registered():
    assert {"arithmetic", "number_only"} <= set(available())
    assert resolve("arithmetic")(["p"], ["so it is 12"], answer=[12]) == [1.0]
    assert resolve("number_only")(["p"], [" 42 "]) == [1.0]


def test_dotted_paths(user_module):
    assert resolve("my_rewards:has_seven")(["p"], ["17"]) == [1.0]
    assert resolve("my_rewards.has_seven")(["p"], ["1"]) == [0.0]


def test_verl_style_adapted(user_module):
    fn = resolve("my_rewards:verl_style")
    assert fn(["p", "p"], ["5", "6"], answer=[5, 5]) == [1.0, 0.0]


@pytest.mark.parametrize("spec, fragment", [
    ("nosuchmodule:f", "cannot import module 'nosuchmodule'"),
    ("my_rewards:missing", "has no function 'missing'"),
    ("my_rewards:wrong", "expected fn(prompts, completions, **columns)"),
    ("not_a_builtin", "unknown reward 'not_a_builtin'; built-ins are"),
])
def test_bad_specs(user_module, spec, fragment):
    with pytest.raises(RewardSpecError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        resolve(spec)


def test_weighted_sum_errors_and_nonfinite(user_module):
    fns = build({"seven": {"fn": "my_rewards:has_seven", "weight": 2.0},
                 "flaky": {"fn": "my_rewards:flaky", "weight": 1.0},
                 "nan": {"fn": "my_rewards:nan_maker", "weight": 1.0}})
    s = score(fns, ["p"] * 3, ["7", "1", "77"], {"answer": [1, 3, 2]})
    assert s.per_fn["flaky"] == [0.5, None, 0.5]
    assert s.errors == {"seven": 0, "flaky": 1, "nan": 3}
    assert s.total == [2.5, 0.0, 2.5]


def test_kwargs_from_config_reach_the_function(tmp_path, monkeypatch):
    (tmp_path / "kw_rewards.py").write_text(
        "def scaled(prompts, completions, factor, **_):\n    return [factor * len(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fns = build({"len": {"fn": "kw_rewards:scaled", "weight": 1.0, "factor": 0.5}})
    assert score(fns, ["p"], ["abcd"], {}).total == [2.0]


def test_config_kwarg_typo_is_refused_even_with_open_kwargs(tmp_path, monkeypatch, cfg_factory):
    """The docs' `brevity(prompts, completions, target_words=50, **kwargs)`: a misspelled config argument is refused
    with a did-you-mean at start-up (before any model loads), while the dataset columns still reach **kwargs."""
    (tmp_path / "open_rewards.py").write_text(textwrap.dedent("""
        def brevity(prompts, completions, target_words=50, **kwargs):
            return [float(len(c.split()) <= target_words) + 0 * len(kwargs["answer"]) for c in completions]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        fns = build({"b": {"fn": "open_rewards:brevity", "target_words": 1}})
        assert score(fns, ["p", "p"], ["one", "one two"], {"answer": [1, 2]}).total == [1.0, 0.0]
        with pytest.raises(RewardSpecError) as e:
            build({"b": {"fn": "open_rewards:brevity", "target_wrds": 1}})
        assert str(e.value).startswith("reward.functions.b.target_wrds: 'open_rewards:brevity' has no argument "
                                       "'target_wrds' (did you mean 'target_words'?); it takes target_words")
        from grpo.trainer.build import preflight  # the checks that run before the runtime and the model

        with pytest.raises(RewardSpecError, match="did you mean 'target_words'"):
            preflight(cfg_factory({"reward": {"functions": {"b": {"fn": "open_rewards:brevity", "target_wrds": 1}}}}))
    finally:
        sys.modules.pop("open_rewards", None)


def test_a_function_registered_at_run_time_is_a_builtin_taking_text_or_messages():
    from grpo.rewards.registry import REWARDS, is_builtin, register

    def shout(prompts, completions, **_):
        return [float(p.isupper() and c.isupper()) for p, c in zip(prompts, completions)]

    assert register("test_shout")(shout) is shout
    try:
        assert is_builtin("test_shout") and "test_shout" in available()
        fn = resolve("test_shout")
        assert fn(["HI"], ["YO"]) == [1.0]
        assert fn([[{"role": "user", "content": "HI"}]], [[{"role": "assistant", "content": "no"}]]) == [0.0]
    finally:
        REWARDS._items.pop("test_shout")
    assert not is_builtin("test_shout") and not is_builtin("my_rewards:has_seven")


@pytest.fixture
def shapes_module(tmp_path, monkeypatch):
    """Reward functions of each signature `adapt` tells apart, in a package (``pkg.shapes``)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "shapes.py").write_text(textwrap.dedent("""
        NOT_A_FUNCTION = 3

        def trl(prompts, completions, **columns):
            return [float(len(c)) for c in completions]

        def two(p, c):
            return [float(len(x)) for x in c]

        def three(prompts, completions, answer):
            return [float(c == a) for c, a in zip(completions, answer)]

        def keyword_only(completions, **kwargs):
            return [float(len(c) + len(kwargs["prompts"])) for c in completions]

        def one(completions):
            return [0.0]

        def open_first(x, **kwargs):
            return [0.0]

        def solution_later(prompt, solution_str, ground_truth=None, extra_info=None):
            return float(solution_str == str(ground_truth))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("pkg", "pkg.shapes"):
        sys.modules.pop(name, None)


def test_batch_functions_are_used_as_they_are_and_keyword_callers_wrapped(shapes_module):
    import pkg.shapes as shapes

    for name in ("trl", "two", "three"):  # positional (prompts, completions, ...): no wrapper
        assert resolve(f"pkg.shapes:{name}") is getattr(shapes, name)
        assert resolve(f"pkg.shapes.{name}") is getattr(shapes, name)  # the module is all but the last dot part
    assert resolve("pkg.shapes:two")(["p"], ["abc"]) == [3.0]
    kw = resolve("pkg.shapes:keyword_only")  # TRL calls by keyword: (completions, **kwargs) is a valid reward
    assert kw is not shapes.keyword_only and kw(["pp", "q"], ["abc", "d"]) == [5.0, 3.0]
    verl = resolve("pkg.shapes:solution_later")  # verl's solution_str, not in second place
    assert verl(["p", "p"], ["4", "5"], answer=[4, 4]) == [1.0, 0.0]


@pytest.mark.parametrize("attr", ["one", "open_first"])
def test_a_function_taking_fewer_than_prompts_and_completions_is_refused_naming_the_reward(shapes_module, attr):
    with pytest.raises(RewardSpecError, match=rf"^reward 'pkg.shapes:{attr}' has signature \("):
        resolve(f"pkg.shapes:{attr}")


def test_a_name_that_is_not_a_function_and_a_spec_with_two_colons_are_refused(shapes_module):
    with pytest.raises(RewardSpecError, match="module 'pkg.shapes' has no function 'NOT_A_FUNCTION'"):
        resolve("pkg.shapes:NOT_A_FUNCTION")
    with pytest.raises(RewardSpecError, match="module 'pkg.shapes' has no function 'trl:x'"):
        resolve("pkg.shapes:trl:x")  # the module is what comes before the first colon


def test_a_registered_function_gets_the_columns_and_keeps_its_name_and_signature_for_the_config_check():
    import inspect

    from grpo.rewards.registry import REWARDS, register
    from grpo.rewards.score import check_kwargs

    def bonus_if(prompts, completions, answer=None, bonus: float = 1.0, **_):
        """Pays ``bonus`` for the answer."""
        return [bonus * (c == a) for c, a in zip(completions, answer or [])]

    register("test_bonus_if")(bonus_if)
    try:
        fn = resolve("test_bonus_if")
        assert fn(["p", "p"], ["4", "5"], answer=["4", "4"], bonus=2.0) == [2.0, 0.0]
        assert fn.__name__ == "bonus_if" and fn.__doc__ == bonus_if.__doc__ and fn.__wrapped__ is bonus_if
        assert inspect.signature(fn) == inspect.signature(bonus_if)
        check_kwargs("b", "test_bonus_if", fn, {"bonus": 2.0})  # a parameter it names
        with pytest.raises(RewardSpecError, match="did you mean 'bonus'"):
            check_kwargs("b", "test_bonus_if", fn, {"bonsu": 2.0})
        register("test_bonus_if")(bonus_if)  # the same function again (a module imported twice): fine
        with pytest.raises(ValueError, match="'test_bonus_if' is registered twice"):
            register("test_bonus_if")(lambda prompts, completions, **_: [])
    finally:
        REWARDS._items.pop("test_bonus_if")


def test_a_keyword_caller_wrapped_keeps_its_name_and_signature(shapes_module):
    import inspect

    import pkg.shapes as shapes

    kw = resolve("pkg.shapes:keyword_only")
    assert kw.__name__ == "keyword_only" and kw.__wrapped__ is shapes.keyword_only
    assert inspect.signature(kw) == inspect.signature(shapes.keyword_only)
