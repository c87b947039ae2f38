"""grpo/rewards/adapters.py: TRL's message format as text; verl's per-sample compute_score as a batch function."""
from grpo.rewards.adapters import as_text, from_verl


def test_messages_read_as_their_assistant_turns():
    assert as_text("plain") == "plain" and as_text(None) == ""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
            {"role": "assistant", "content": "a2"}]
    assert as_text(msgs) == "a1\n\na2" and as_text([{"role": "user", "content": "q"}]) == "q"


def test_a_verl_function_gets_its_ground_truth_and_a_failure_scores_none():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("bad sample")
        return {"score": float(solution_str == ground_truth)}

    fn = from_verl(compute_score)
    assert fn(["p"] * 3, ["7", "8", "boom"], answer=["7", "7", "7"]) == [1.0, 0.0, None]
