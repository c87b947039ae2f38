"""grpo/rewards/adapters.py: TRL's message format as text; verl's per-sample compute_score as a batch function."""
from grpo.rewards.adapters import as_text, from_verl


def test_messages_read_as_their_assistant_turns():
    assert as_text("plain") == "plain" and as_text(None) == ""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
            {"role": "assistant", "content": "a2"}]
    assert as_text(msgs) == "a1\n\na2" and as_text([{"role": "user", "content": "q"}]) == "q"
    calls = [{"role": "assistant", "content": None, "tool_calls": [{}]}, {"role": "assistant", "content": "42"}]
    assert as_text(calls) == "\n\n42"  # a turn of tool calls alone has no text (None, not "None")


def test_a_verl_function_gets_its_ground_truth_and_a_failure_scores_none():
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("bad sample")
        return {"score": float(solution_str == ground_truth)}

    fn = from_verl(compute_score)
    assert fn(["p"] * 3, ["7", "8", "boom"], answer=["7", "7", "7"]) == [1.0, 0.0, None]


def test_a_config_constant_named_like_a_positionally_filled_parameter_does_not_reach_it_twice():
    """``truth`` gets verl's ground truth by position: a scalar ``truth`` column (a config constant) is not passed
    on as a keyword too (which would fail every call); a parameter verl does not fill still gets its constant."""
    from grpo.rewards.adapters import from_verl

    got = []

    def by_position(src, text, truth, info, scale=1.0):
        got.append((truth, scale))
        return scale

    assert from_verl(by_position)(["p"], ["x"], answer=["4"], truth="cfg", scale=2.0) == [2.0]
    assert got == [("4", 2.0)]
