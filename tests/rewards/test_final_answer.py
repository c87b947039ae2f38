"""grpo/rewards/final_answer.py: the final model turn of an episode is what is scored."""
from grpo.rewards.final_answer import final_answer, final_turn

EPISODE = [{"role": "assistant", "text": "<calc>2*3</calc> maybe 5"}, {"role": "tool", "text": "6"},
           {"role": "assistant", "text": "It is 6"}]


def test_only_the_last_assistant_turn_counts():
    assert final_turn("whole text 5", EPISODE) == "It is 6"
    assert final_turn("whole text 5") == "whole text 5"
    assert final_turn([{"role": "assistant", "content": "msg 9"}]) == "msg 9"
    assert final_answer(None, ["... 5 ... 6", "... 6 ... 5"], [6, 6], episode=[EPISODE, None]) == [1.0, 0.0]
