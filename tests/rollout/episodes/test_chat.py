"""grpo/rollout/episodes/chat.py: tool calls parsed from a model turn, a broken one told back to the model."""
from grpo.rollout.episodes.chat import parse_tool_calls


def test_tagged_and_mistral_calls_and_invalid_json():
    calls = parse_tool_calls('x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> y')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1}, None)]
    calls = parse_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]')
    assert [c.name for c in calls] == ["f", "g"]
    bad = parse_tool_calls("<tool_call>{not json</tool_call>")
    assert len(bad) == 1 and "not valid JSON" in bad[0].error
    assert parse_tool_calls("the answer is 4") == []
