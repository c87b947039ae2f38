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
