"""grpo/rollout/episodes/chat.py: tool calls parsed from a model turn, a broken one told back to the model."""
import pytest

from grpo.rollout.episodes.chat import ToolCall, after_turn, calls_from_blocks, clip_tokens, parse_tool_calls


def test_tagged_and_mistral_calls_and_invalid_json():
    calls = parse_tool_calls('x <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> y')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1}, None)]
    calls = parse_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]')
    assert [c.name for c in calls] == ["f", "g"]
    bad = parse_tool_calls("<tool_call>{not json</tool_call>")
    assert len(bad) == 1 and "not valid JSON" in bad[0].error
    assert parse_tool_calls("the answer is 4") == []


class ParsingTokenizer:
    """A tokenizer with a ``response_template`` (transformers' ``parse_response``): its answer, or its failure."""

    response_template = {"x": 1}

    def __init__(self, message=None, fails=False):
        self.message, self.fails, self.asked = message, fails, []

    def parse_response(self, text, prefix=None):
        self.asked.append((text, prefix))
        if self.fails:
            raise ValueError("no match")
        return self.message


def test_a_tokenizers_response_parser_is_asked_first_and_its_failure_falls_back():
    tok = ParsingTokenizer({"content": "", "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                           "arguments": {"a": 1}}},
                                                          {"name": "g", "arguments": {}}]})
    calls = parse_tool_calls('<tool_call>{"name": "other", "arguments": {}}</tool_call>', tok)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("f", {"a": 1}, None), ("g", {}, None)]
    assert tok.asked == [('<tool_call>{"name": "other", "arguments": {}}</tool_call>', "")]
    assert parse_tool_calls("no call", ParsingTokenizer({"content": "no call", "tool_calls": None})) == []
    assert parse_tool_calls("no call", ParsingTokenizer({"content": "no call"})) == []
    fallback = parse_tool_calls('<tool_call>{"name": "h", "arguments": {}}</tool_call>', ParsingTokenizer(fails=True))
    assert [c.name for c in fallback] == ["h"]
    no_template = ParsingTokenizer({"tool_calls": [{"name": "never"}]})
    no_template.response_template = None
    assert [c.name for c in parse_tool_calls('<tool_call>{"name": "h"}</tool_call>', no_template)] == ["h"]


def test_every_block_is_read_and_each_bad_one_is_an_error_call():
    text = ('<tool_call> {"name": "a", "parameters": {"x": 1}} </tool_call> then <tool_call>{bad}</tool_call>'
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call><tool_call>{"name": "c"}')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("", {}), ("b", {"y": 2}), ("c", {})]
    assert [c.error is None for c in calls] == [True, False, True, True]
    assert calls[1].error == "the tool call is not valid JSON (Expecting property name enclosed in double quotes at " \
                             "character 1)"
    assert [c.name for c in parse_tool_calls('  [TOOL_CALLS] [{"name": "m", "arguments": {}}]')] == ["m"]
    assert parse_tool_calls('say [TOOL_CALLS][{"name": "m", "arguments": {}}]') == []  # only at the turn's start
    # arguments under "arguments" win over "parameters"; an empty string is no arguments
    assert calls_from_blocks(['{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}'])[0].arguments == {"a": 1}
    assert calls_from_blocks(['{"name": "f", "arguments": "  "}']) == [ToolCall("f", {})]


@pytest.mark.parametrize("block,error", [
    ('"just text"', 'a tool call must be {"name": ..., "arguments": {...}}'),
    ('{"name": 3, "arguments": {}}', 'a tool call must be {"name": ..., "arguments": {...}}'),
    ('{"arguments": {}}', 'a tool call must be {"name": ..., "arguments": {...}}'),
    ('{"name": "f", "arguments": "{oops"}', "the tool call's arguments are not valid JSON"),
    ('{"name": "f", "arguments": [1, 2]}', "the tool call's arguments must be a JSON object"),
    ('{"name": "f", "arguments": "[1]"}', "the tool call's arguments must be a JSON object"),
])
def test_a_malformed_call_tells_the_model_what_is_wrong(block, error):
    [call] = calls_from_blocks([block])
    assert call.error == error and call.arguments == {}
    assert call.name == ("f" if '"name": "f"' in block else "")


class Template:
    """A chat template as strict as real ones (roles alternate from a user turn), rendering ``[role]content<eos>``
    per message, the tools first, and the assistant header when asked; what it was called with is recorded."""

    def __init__(self):
        self.kwargs = []

    def apply_chat_template(self, messages, tools=None, tokenize=True, add_generation_prompt=False):
        self.kwargs.append({"tools": tools, "tokenize": tokenize, "add_generation_prompt": add_generation_prompt})
        if [m["role"] for m in messages[:2]] != ["user", "assistant"]:
            raise ValueError("roles must alternate user/assistant")
        text = (f"[tools]{len(tools)}<eos>" if tools is not None else "") + \
            "".join(f"[{m['role']}]{m['content']}<eos>" for m in messages)
        text += "[assistant]" if add_generation_prompt else ""
        return [ord(c) for c in text] if tokenize else text


def test_after_turn_is_the_templates_text_after_the_turn_without_the_stop_token_it_ended_with():
    tok = Template()
    tool = [{"role": "tool", "content": "3"}]
    assert after_turn(tok, tool, chat=True, tools=None, ended_with="<eos>") == "[tool]3<eos>[assistant]"
    assert after_turn(tok, tool, chat=True, tools=None, ended_with=None) == "<eos>[tool]3<eos>[assistant]"
    assert after_turn(tok, tool, chat=True, tools=None, ended_with="</s>") == "<eos>[tool]3<eos>[assistant]"
    assert after_turn(tok, tool, chat=True, tools=[], ended_with="") == "<eos>[tool]3<eos>[assistant]"
    assert after_turn(tok, tool, chat=True, tools=[{"t": 1}], ended_with="<eos>") == "[tool]3<eos>[assistant]"
    assert tok.kwargs == [{"tools": None, "tokenize": False, "add_generation_prompt": True}] * 4 + \
        [{"tools": [{"t": 1}], "tokenize": False, "add_generation_prompt": True}]
    obs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert after_turn(None, obs, chat=False, tools=None, ended_with="<eos>") == "ab"


class CharTokenizer:
    """One id per character; a BOS (id 1) first when asked for special tokens."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] * add_special_tokens + [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_clip_tokens_keeps_a_text_of_limit_tokens_and_cuts_a_longer_one():
    tok = CharTokenizer()
    assert clip_tokens(tok, "abcd", 4) == "abcd" and clip_tokens(tok, "abcde", 4) == "abcd ...[cut]"
    assert clip_tokens(tok, "", 0) == "" and clip_tokens(tok, "a", 0) == " ...[cut]"
