"""The calculator-tools recipe's parts: the multiplication task, the calculator (tool function and plain-text
environment), the final-turn reward, and why the recipe uses the plain-text protocol for SmolLM2."""
from __future__ import annotations

import pytest

from grpo.errors import ConfigError
from grpo.rewards.registry import resolve
from grpo.rollout.episodes.calculator import Calculator, calculate, evaluate, python
from grpo.rollout.episodes.spec import build_toolset, choose_format
from grpo.tasks import get_task


def test_multiplication_task():
    rows = get_task("multiplication")(50, 3)
    assert rows == get_task("multiplication")(50, 3) and len({r["prompt"] for r in rows}) == 50
    for r in rows:
        a, b = (int(x) for x in r["prompt"].split("Compute ")[1].split(".")[0].split(" * "))
        assert 100 <= a <= 999 and 100 <= b <= 999 and r["answer"] == a * b and "<calc>" in r["prompt"]
    assert get_task("multiplication")(2, 0, digits=1, template="{a}x{b}")[0]["prompt"].count("x") == 1
    tool = get_task("multiplication")(3, 3, tools=True)  # the same problems, the tool call's prompt
    a, b = (int(x) for x in tool[0]["prompt"].split("Compute ")[1].split(".")[0].split(" * "))
    assert [r["answer"] for r in tool] == [r["answer"] for r in rows[:3]] and "<calc>" not in tool[0]["prompt"]
    assert f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{a} * {b}"}}}}</tool_call>' \
        in tool[0]["prompt"]
    with pytest.raises(ValueError):
        get_task("multiplication")(1, 0, digits=0)


def test_the_calculator_evaluates_arithmetic_only():
    assert evaluate("347 * 589") == 204383 and evaluate("(2 + 3) ** 2 - 7 / 2") == 21.5 and evaluate("6/3") == 2
    assert evaluate("12 × 3") == 36 and evaluate("2^10") == 1024
    for bad in ("__import__('os')", "x * 2", "2 ** 1000", "[1, 2]", "1 +"):
        with pytest.raises(ValueError):
            evaluate(bad)
    assert calculate("19 * 21") == "399"


def test_the_python_tool_runs_arithmetic_programs_only():
    """What the calculator-tools recipe's model writes: assignments, print() of numbers, strings and f-strings, a
    last bare expression shown as a REPL would; imports skipped; anything else a ValueError (the model sees it)."""
    assert python("import math\nresult = 354 * 236\nprint(result)") == "83544"
    assert python('x = 3\ny = x * 2\nprint(f"x is {x}, y is {y}", "ok")\nx ** 2') == "x is 3, y is 6 ok\n9"
    assert python("print(7 / 2)\nprint(6 / 3)") == "3.5\n2" and python("x = 1") == "(nothing was printed)"
    for bad, why in [("def f():\n    return 1", "only assignments, print()"), ("print(y)", "'y' is not defined"),
                     ("open('f')", "only numbers"), ("print('a' * 10)", "only numbers"), ("2 ** 999", "exponent"),
                     ("print(", "not valid Python"), ("x.y = 1", "only assignments")]:
        with pytest.raises(ValueError, match=why):
            python(bad)


def test_the_calculator_environment():
    env = Calculator()
    assert env.reset({"answer": 1}) is None
    assert env.step("Let me use it: <calc>347 * 589</calc>") == "Result: 204383"
    assert env.step("<calc> 3 * </calc>").startswith("Error: cannot parse")
    assert env.step("<calc>10 // 0</calc>").startswith("Error:")
    assert env.step("<calc>2 * 21") == "Result: 42"  # the turn ended before the closing tag
    assert env.step("The answer is 204383.") is None and env.calls == 4


def test_both_ways_pass_the_start_up_checks():
    tools = build_toolset(["grpo.rollout.episodes.calculator:calculate"], None)
    assert tools.protocol == "tools" and tools.schemas[0]["function"]["parameters"]["required"] == ["expression"]
    assert build_toolset([], "grpo.rollout.episodes.calculator:Calculator").protocol == "text"


def test_smollm2s_template_has_no_tool_support():
    """Why SmolLM2 gets its tools in the hermes format (rollout.tool_format=auto chooses it)."""
    from grpo.models import load_tokenizer

    tok = load_tokenizer("embedded:smollm2-135m-instruct")
    ts = build_toolset(["grpo.rollout.episodes.calculator:calculate"], None)
    with pytest.raises(ConfigError, match="has no tool support"):
        choose_format(ts, "template", tok, True)
    chosen, note = choose_format(ts, "auto", tok, True)
    assert chosen.tool_format == "hermes" and "shows no tools" in note


def test_final_answer_reads_the_last_model_turn():
    fn = resolve("final_answer")
    episode = [{"role": "assistant", "text": "<calc>12*34</calc>"}, {"role": "user", "text": "Result: 408"},
               {"role": "assistant", "text": "I am not sure."}]
    whole = "<calc>12*34</calc>Result: 408I am not sure."
    # the number in the calculator's result is not the model's answer
    assert fn(["p"], [whole], answer=[408], episode=[episode]) == [0.0]
    episode[-1]["text"] = "It is 408."
    assert fn(["p"], [whole + " It is 408."], answer=[408], episode=[episode]) == [1.0]
    assert fn(["p"], ["so 408"], answer=[408]) == [1.0]  # single-turn: the whole completion


def test_tool_call_rewards_a_call_that_ran():
    fn = resolve("tool_call")
    assert fn(["p"] * 4, ["c"] * 4, tool_calls=[1, 0, 2, 1], tool_failures=[0, 0, 1, 1]) == [1.0, 0.0, 0.0, 0.0]
    assert fn(["p"], ["c"]) == [0.0]  # no episode: no call


def test_every_operator_sign_and_the_exponent_bound():
    assert [evaluate(f"7 {op} 2") for op in ("+", "-", "*", "/", "//", "%", "**")] == [9, 5, 14, 3.5, 3, 1, 49]
    assert (evaluate("-3"), evaluate("+3"), evaluate("--3"), evaluate("-(2 - 5)")) == (-3, 3, 3, 3)
    assert evaluate("2 ** 64") == 2 ** 64 and evaluate("2 ** -64") == 2.0 ** -64
    for bad in ("2 ** 65", "2 ** -65", "True + 1", "'a'", "not 1", "1 < 2", "abs(1)"):
        with pytest.raises(ValueError):
            evaluate(bad)
    assert evaluate("  2 + 2  ") == 4 and evaluate("1.5 * 2") == 3 and evaluate("0.5 + 0.25") == 0.75
    # a whole float comes back as an int (the model reads "2", not "2.0"); ints stay ints
    assert [type(evaluate(e)) for e in ("6 / 3", "7 / 2", "6", "2.5")] == [int, float, int, float]


def test_the_environment_answers_the_last_call_of_a_turn_and_counts_from_reset():
    env = Calculator()
    env.reset({})
    assert env.calls == 0
    assert env.step("<calc>1 + 1</calc> no, rather <calc>2 + 2</calc>") == "Result: 4" and env.calls == 1
    assert env.step("<calc>1e300 ** 2</calc>").startswith("Error: ")  # a float overflow is an error for the model
    assert env.step("nothing") is None and env.calls == 2
    env.reset({})
    assert env.calls == 0


def test_the_python_tool_statements_one_by_one():
    assert python("x = y = 3\nprint(x, y)") == "3 3" and python("print(5)") == "5" and python("print('hi')") == "hi"
    assert python("x = 2\nprint(-x, +x, x % 3, x // 3, x - 1, 3 - x)") == "-2 2 2 0 1 1" and python("7 / 2") == "3.5"
    assert python('print(f"{6 / 3} and {1.5}")') == "2 and 1.5" and python("6 / 3") == "2"
    assert python("from math import pi\nprint(1)") == "1" and python("x = 2 ** 64\nprint(x)") == str(2 ** 64)
    for bad in ("2 + 3\nprint(1)", "print(1, sep='-')", "x = True", "x = 2 ** 65", "x = 2\ny = x ** -65",
                "x = not 1", "x = [1]", "print(1 < 2)", "x, y = 1, 2", "math.floor(2.5)",
                "math.floor(2.5)\nprint(1)"):
        with pytest.raises(ValueError):
            python(bad)
