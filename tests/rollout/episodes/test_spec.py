"""grpo/rollout/episodes/spec.py: rollout.tools checked at start; the lengths a multi-turn completion can reach."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
from transformers.utils import get_json_schema

from grpo.config.schema import RolloutConfig
from grpo.errors import ConfigError
from grpo.rollout.episodes.spec import (
    RESERVED,
    Toolset,
    build_toolset,
    choose_format,
    env_methods,
    max_completion_tokens,
    max_sampled_tokens,
    multi_turn,
    tool_schema,
)
from tests.tool_fixtures import add, undocumented, untyped


def test_a_documented_tool_becomes_its_schema_and_a_bad_name_one_line():
    ts = build_toolset(["grpo.rollout.episodes.calculator:calculate"], None)
    assert [s["function"]["name"] for s in ts.schemas] == ["calculate"]
    assert build_toolset([], None) is None
    with pytest.raises(ConfigError, match=r"rollout.tools\[0\]"):
        build_toolset(["grpo.rollout.episodes.calculator:nope"], None)


def test_lengths_of_single_and_multi_turn_completions():
    single = RolloutConfig(max_new_tokens=16)
    assert not multi_turn(single) and max_sampled_tokens(single) == max_completion_tokens(single) == 16
    multi = RolloutConfig(max_new_tokens=16, max_turns=3, max_tool_tokens=10,
                          environment="grpo.rollout.episodes.calculator:Calculator")
    assert multi_turn(multi) and max_sampled_tokens(multi) == 48
    assert max_completion_tokens(multi, overhead=2) == 48 + 2 * (10 + 2)


F = "tests.tool_fixtures"
HERE = "tests.rollout.episodes.test_spec"
NOT_A_FUNCTION = 3


def blank(a: int) -> int:
    """   """
    return a


class WithStep:
    """A plain-text environment that also has a public method and a private one."""

    def reset(self, row):
        return None

    def step(self, text: str):
        return None

    def reward(self) -> float:
        return 1.0

    def look(self, where: str) -> str:
        """Look somewhere.

        Args:
            where: the place
        """
        return where

    def _hidden(self):
        return None

    limit = 3  # a public attribute that is no method


class Bare:
    """An environment with reset only: neither tool methods nor step."""

    def reset(self, row):
        return None


class Anon:
    def __call__(self, a: int) -> int:
        return a


class Mute:
    """An environment whose tool method has no docstring."""

    def reset(self, row):
        return None

    def shout(self, a: int) -> int:
        return a


class Shadow:
    """An environment whose method has the name of a tool."""

    def reset(self, row):
        return None

    def add(self, a: int, b: int) -> int:
        """Add.

        Args:
            a: one
            b: two
        """
        return a + b


def test_tool_schemas_keys_and_names_of_each_refusal():
    schema = tool_schema(add, "k")
    assert schema == get_json_schema(add)
    assert schema["function"]["name"] == "add" and schema["function"]["parameters"]["required"] == ["a", "b"]
    with pytest.raises(ConfigError, match=r"^k: tool blank has no docstring"):
        tool_schema(blank, "k")
    with pytest.raises(ConfigError, match=r"^k: tool undocumented has no docstring"):
        tool_schema(undocumented, "k")
    with pytest.raises(ConfigError, match=r"^k: tool <tests.rollout.episodes.test_spec.Anon object at .+> has no doc"):
        tool_schema(Anon(), "k")  # an instance has no __qualname__: its repr names it
    with pytest.raises(ConfigError, match=r"^rollout.environment='.*:Mute' method shout: tool Mute.shout has no doc"):
        build_toolset([], f"{HERE}:Mute")
    with pytest.raises(ConfigError, match=r"^rollout.environment='tests.tool_fixtures:nope': module"):
        build_toolset([], f"{F}:nope")
    with pytest.raises(ConfigError, match=r"^k: tool untyped cannot be shown to the model: .+") as e:
        tool_schema(untyped, "k")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^rollout.tools\[1\]='tests.tool_fixtures:nope'"):
        build_toolset([f"{F}:add", f"{F}:nope"], None)
    with pytest.raises(ConfigError, match=r"^rollout.tools\[1\]='tests.tool_fixtures:untyped': tool untyped"):
        build_toolset([f"{F}:add", f"{F}:untyped"], None)
    for bad in (f"{HERE}:NOT_A_FUNCTION", f"{F}:Counter"):
        with pytest.raises(ConfigError, match=r"rollout.tools\[0\]=.* is not a function"):
            build_toolset([bad], None)
    with pytest.raises(ConfigError, match=r"^rollout.environment='tests.tool_fixtures:add' is not a class"):
        build_toolset([], f"{F}:add")
    with pytest.raises(ConfigError, match=r"^rollout.environment='.*:Bare': Bare has neither public tool methods"):
        build_toolset([], f"{HERE}:Bare")
    with pytest.raises(ConfigError, match="method 'add' has the name of a tool"):
        build_toolset([f"{F}:add"], f"{HERE}:Shadow")
    with pytest.raises(ConfigError, match=r"^rollout.environment='tests.tool_fixtures:NoReset'"):
        build_toolset([], f"{F}:NoReset")


def test_an_environments_public_methods_but_reset_reward_and_step_are_its_tools():
    assert env_methods(WithStep) == ["look"] and env_methods(Shadow) == ["add"]
    assert RESERVED == ("reset", "reward", "step")
    text = build_toolset([], f"{HERE}:WithStep")
    assert text == Toolset("text", environment=f"{HERE}:WithStep", env_name="WithStep", env_reward=True)
    assert build_toolset([], f"{F}:Echo").env_reward and not build_toolset([], f"{F}:TwoTurns").env_reward
    # a tool environment: its methods after the tools, the class named, reward() seen
    ts = build_toolset([f"{F}:add"], f"{F}:Counter")
    assert ts == Toolset("tools", {"add": f"{F}:add"}, ("increment",), ts.schemas, f"{F}:Counter", "Counter", True)
    assert [s["function"]["name"] for s in ts.schemas] == ["add", "increment"]
    plain = build_toolset([], f"{HERE}:Shadow")  # no reward(); no tools beside the methods
    assert (plain.functions, plain.methods, plain.env_reward, plain.env_name) == ({}, ("add",), False, "Shadow")
    assert build_toolset([f"{F}:add"], f"{HERE}:Bare").methods == ()  # tools only: an environment with reset alone
    tools = build_toolset([f"{F}:add", f"{F}:slow"], None)
    assert tools == Toolset("tools", {"add": f"{F}:add", "slow": f"{F}:slow"}, (), tools.schemas)
    assert [s["function"]["name"] for s in tools.schemas] == ["add", "slow"]
    assert (tools.tool_format, tools.result_role, tools.environment, tools.env_name) == ("template", "tool", None, None)


class Fmt:
    name, role = "pythonic", "user"


def test_choose_format_hands_the_format_the_schemas_and_whether_the_chat_template_is_used(monkeypatch):
    from grpo.rollout.episodes import formats

    asked = []
    monkeypatch.setattr(formats, "choose", lambda *a: asked.append(a) or (Fmt(), "why"))
    ts = build_toolset([f"{F}:add"], None)
    with_template = SimpleNamespace(chat_template="{{ x }}")
    assert choose_format(ts, "auto", with_template, True) == (replace(ts, tool_format="pythonic", result_role="user"),
                                                             "why")
    choose_format(ts, "hermes", with_template, False)
    choose_format(ts, "hermes", SimpleNamespace(chat_template=None), True)
    choose_format(ts, "hermes", SimpleNamespace(), True)
    schemas = list(ts.schemas)
    assert asked == [("auto", schemas, with_template, True), ("hermes", schemas, with_template, False),
                     ("hermes", schemas, asked[2][2], False), ("hermes", schemas, asked[3][2], False)]
    assert all(type(a[1]) is list and type(a[3]) is bool for a in asked)
    text = build_toolset([], f"{F}:Echo")
    assert choose_format(text, "hermes", with_template, True) == (text, None) and len(asked) == 4


def test_multi_turn_and_the_default_overhead():
    def r(**k):
        return SimpleNamespace(**{"tools": [], "environment": None, "max_new_tokens": 10, "max_turns": 3,
                                  "max_tool_tokens": 5, **k})

    assert not multi_turn(r()) and multi_turn(r(tools=["x"])) and multi_turn(r(environment="m:E"))
    assert multi_turn(r(environment="")) and not multi_turn(r(tools=None))
    assert max_sampled_tokens(r()) == 10 and max_sampled_tokens(r(tools=["x"])) == 30
    assert max_completion_tokens(r()) == 10 and max_completion_tokens(r(tools=["x"])) == 30 + 2 * (5 + 32)
