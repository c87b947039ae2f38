"""grpo/rewards/final_answer.py: the final model turn of an episode is what is scored."""
from grpo.rewards.final_answer import final_answer, final_turn

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
