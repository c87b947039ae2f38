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


def test_a_verl_function_by_default_gets_data_source_unknown_and_not_the_columns_it_has_no_use_for():
    got = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
        got.append((data_source, ground_truth, extra_info, kw))
        return 1.0

    fn = from_verl(compute_score)
    # reward_model and completion_ids are not config constants even when they are not aligned lists
    assert fn(["p"], ["x"], reward_model={"ground_truth": "7"}, completion_ids=[[1], [2]], scale=2) == [1.0]
    assert got == [("unknown", "7", {}, {"scale": 2})]


def test_the_first_failure_of_a_verl_function_is_logged_once_with_its_traceback(caplog):
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        raise RuntimeError("bad sample")

    fn = from_verl(compute_score)
    with caplog.at_level("WARNING", logger="grpo.rewards"):
        assert fn(["p"] * 2, ["a", "b"], answer=["1", "1"]) == [None, None]
        assert fn(["p"], ["c"], answer=["1"]) == [None]
    records = [r for r in caplog.records if r.name == "grpo.rewards"]
    assert len(records) == 1 and records[0].exc_info[0] is RuntimeError


def test_the_batch_function_is_named_as_the_verl_one_and_has_trls_signature():
    import inspect

    def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
        """verl's."""
        return 0.0

    fn = from_verl(compute_score)
    assert fn.__name__ == "compute_score" and fn.__doc__ == "verl's." and fn.__wrapped__ is compute_score
    assert str(inspect.signature(fn)) == "(prompts, completions, **columns)" and fn.verl_fn is compute_score
