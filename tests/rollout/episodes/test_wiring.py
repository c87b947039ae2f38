"""grpo/rollout/episodes/wiring.py: the columns episodes give the rewards, the rows as the model saw them, and the
environment's reward() as a reward function."""
from grpo.rollout.episodes.spec import Toolset
from grpo.rollout.episodes.turns import Episode, Episodes
from grpo.rollout.episodes.wiring import environment_reward, episode_columns, episode_records, seen_rows


def _episodes():
    a = Episode(ids=[1, 2], mask=[1, 0], segments=[{"role": "assistant", "text": "hi"}], turns=2, tool_calls=1,
                env_reward=0.5)
    b = Episode(ids=[3], mask=[1], turns=1)
    return Episodes(prompt_ids=[[9, 9, 7]], prompts=["P + seen"], groups=[[a, b]], added=["seen"])


def test_columns_and_records_follow_the_flat_order():
    eps = _episodes()
    cols = episode_columns(eps)
    assert cols["turns"] == [2, 1] and cols["tool_calls"] == [1, 0] and cols["env_reward"] == [0.5, None]
    assert episode_records(eps)[0][0]["turns"] == [{"role": "assistant", "text": "hi"}]


def test_rows_show_the_text_reset_added_and_the_environment_reward_is_passed_through():
    rows = seen_rows([{"prompt": "P", "prompt_ids": [9, 9], "answer": 1}], _episodes())
    assert rows == [{"prompt": "P + seen", "prompt_ids": [9, 9, 7], "answer": 1}]
    rf = environment_reward(Toolset("text", environment="m:Env", env_name="Env", env_reward=True))
    assert rf.name == "Env" and rf.weight == 1.0
    assert rf.fn(None, ["a", "b"], env_reward=[0.5, None]) == [0.5, None] and rf.fn(None, ["a"]) == [None]
