"""grpo/rewards/final_answer.py: the final model turn of an episode is what is scored."""
from grpo.rewards.final_answer import final_answer, final_turn, tool_call

EPISODE = [{"role": "assistant", "text": "<calc>2*3</calc> maybe 5"}, {"role": "tool", "text": "6"},
           {"role": "assistant", "text": "It is 6"}]


def test_only_the_last_assistant_turn_counts():
    assert final_turn("whole text 5", EPISODE) == "It is 6"
    assert final_turn("whole text 5") == "whole text 5"
    assert final_turn([{"role": "assistant", "content": "msg 9"}]) == "msg 9"
    assert final_answer(None, ["... 5 ... 6", "... 6 ... 5"], [6, 6], episode=[EPISODE, None]) == [1.0, 0.0]


def test_the_last_of_three_assistant_turns_is_scored_not_the_second():
    """An episode of three tool rounds: the answer is the third assistant turn (with two, the second is also the
    last, so a reader taking turn 1 would pass)."""
    episode = EPISODE + [{"role": "tool", "text": "ok"}, {"role": "assistant", "text": "Final: 7"}]
    assert final_turn("whole text", episode) == "Final: 7"
    assert final_answer(None, ["unused"], [7], episode=[episode]) == [1.0]
    assert final_answer(None, ["unused"], [6], episode=[episode]) == [0.0]  # the middle turn's 6 does not count


def test_without_episodes_the_completion_is_the_final_turn():
    assert final_answer(None, ["so 6", "so 5"], [6, 6]) == [1.0, 0.0]


def test_tool_call_pays_an_episode_whose_calls_all_ran():
    assert tool_call(None, ["a", "b"]) == [0.0, 0.0]  # single-turn: no tool_calls column
    assert tool_call(None, ["a", "b", "c"], tool_calls=[0, 2, 1], tool_failures=[0, 0, 1]) == [0.0, 1.0, 0.0]
    assert tool_call(None, ["a", "b"], tool_calls=[0, 3]) == [0.0, 1.0]  # no failures column: none failed
    assert tool_call(None, ["a"], tool_calls=[1], tool_failures=[0]) == [1.0]  # one call is enough
