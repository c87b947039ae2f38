"""grpo/rollout/episodes/spec.py: rollout.tools checked at start; the lengths a multi-turn completion can reach."""
import pytest

from grpo.config.schema import RolloutConfig
from grpo.errors import ConfigError
from grpo.rollout.episodes.spec import build_toolset, max_completion_tokens, max_sampled_tokens, multi_turn


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
