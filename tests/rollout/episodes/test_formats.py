"""Tool formats (rollout.tool_format): what `auto` chooses, the hermes format rendered, parsed and answered with and
without a chat template, and episodes that stay token-in/token-out under a template that strips earlier <think>
blocks."""
from __future__ import annotations

import json

import pytest

from grpo.data import prepare
from grpo.errors import ConfigError
from grpo.models import char_tokenizer
from grpo.rollout.episodes.chat import after_turn
from grpo.rollout.episodes.formats import FORMATS, choose
from grpo.rollout.episodes.spec import build_toolset, choose_format
from tests.rollout.episodes.test_turns import TEMPLATE, _rows, _run

F = "tests.tool_fixtures"
CALL = '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>'
# every role rendered alike: a tool turn is shown, tools are not
GENERIC = "{% for m in messages %}[{{ m.role }}]{{ m.content }}<eos>{% endfor %}{% if add_generation_prompt %}" \
          "[assistant]{% endif %}"
# Qwen3-like: earlier assistant turns lose their <think> block; no tool role (it raises); tools not shown
STRIPS = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
          "{% set c = m.content %}{% if m.role == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1]"
          " %}{% endif %}[{{ m.role }}]{{ c }}<eos>{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def _tok(template):
    t = char_tokenizer()
    t.chat_template = template
    return t


@pytest.fixture(scope="module")
def schemas():
    return list(build_toolset([f"{F}:add"], None).schemas)


@pytest.mark.parametrize("template,chat,chosen,role,says", [
    (TEMPLATE, True, "template", "tool", "shows tools"),
    (GENERIC, True, "hermes", "tool", "shows no tools"),
    (STRIPS, True, "hermes", "user", "shows no tools"),
    (None, False, "hermes", None, "no chat template"),
])
def test_auto_uses_the_template_when_it_shows_tools_else_hermes(schemas, template, chat, chosen, role, says):
    fmt, note = choose("auto", schemas, _tok(template), chat)
    assert (fmt.name, fmt.role) == (chosen, role)
    assert note.startswith(f"rollout.tool_format={chosen} (") and says in note and "\n" not in note
    forced, note = choose("hermes", schemas, _tok(template), chat)
    assert forced.name == "hermes" and "as configured" in note


def test_the_tool_format_is_a_checked_config_key(cfg_factory):
    assert cfg_factory({}).rollout.tool_format == "auto"
    assert cfg_factory({"rollout": {"tool_format": "hermes"}}).rollout.tool_format == "hermes"
    with pytest.raises(ConfigError, match=r"rollout.tool_format='json' is not allowed; choose one of: auto, "
                                          r"template, hermes") as e:
        cfg_factory({"rollout": {"tool_format": "json"}})
    assert "\n" not in str(e.value)
    from grpo.config.schema import _CHOICES

    assert _CHOICES["rollout.tool_format"] == ("auto", *FORMATS)  # a registered format is a valid value


def test_hermes_shows_the_schemas_in_the_system_prompt(schemas):
    text = FORMATS["hermes"]("user").system_text(schemas)
    block = text.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in block.splitlines()] == schemas
    assert "<tool_call>" in text and "<tool_response>" in text
    tok = _tok(GENERIC)
    row = {"prompt": "What is 20 + 22?"}
    dcfg = type("D", (), {"prompt_column": "prompt", "prompt_template": "{prompt}", "system_prompt": "Be brief.",
                          "chat_template": True, "max_prompt_tokens": 10_000, "answer_column": "answer"})()
    (out,), _ = prepare([row], dcfg, tok, keep_turns=True, system_text=text)
    assert out["prompt"] == f"[system]Be brief.\n\n{text}<eos>[user]What is 20 + 22?<eos>[assistant]"
    assert out["prompt_turns"][0]["content"].endswith("</tool_response> tags.")  # reset(row) text keeps it
    dcfg.chat_template = False  # no chat template: the system text comes first, then the prompt
    (out,), _ = prepare([row], dcfg, tok, system_text=text)
    assert out["prompt"] == f"Be brief.\n\n{text}\n\nWhat is 20 + 22?"


def test_hermes_parses_only_its_own_convention():
    fmt = FORMATS["hermes"]("tool")
    assert [(c.name, c.arguments) for c in fmt.parse("ok " + CALL, None)] == [("add", {"a": 20, "b": 22})]
    assert fmt.parse('[TOOL_CALLS][{"name": "add", "arguments": {}}]', None) == []  # Mistral's is template-only
    assert fmt.parse("<tool_call>{oops}</tool_call>", None)[0].error.startswith("the tool call is not valid JSON")


@pytest.mark.parametrize("template,chat,expected", [
    (GENERIC, True, "[tool]<tool_response>\n42\n</tool_response><eos>[assistant]"),
    (STRIPS, True, "[user]<tool_response>\n42\n</tool_response><eos>[assistant]"),
    (None, False, "\n<tool_response>\n42\n</tool_response>\n"),
])
def test_hermes_episodes_with_and_without_a_template(template, chat, expected):
    """The hermes turn loop end to end over a scripted model: the result comes back in the template's tool turn, a
    marked user turn, or plain text, and only the model's tokens carry loss."""
    tok = _tok(template)
    ts, note = choose_format(build_toolset([f"{F}:add"], None), "auto", tok, chat)
    assert ts.tool_format == "hermes"

    def script(context, j):
        return "It is 42." if "<tool_response>\n42" in context else CALL

    (rows,) = [_rows(tok, "[user]What is 20+22?<eos>[assistant]")]
    eps, _ = _run(rows, 1, 80, tok, script, [f"{F}:add"], chat=chat, toolset=ts)
    e = eps.groups[0][0]
    assert tok.decode(e.ids) == CALL + "<eos>" + expected + "It is 42.<eos>"
    n = lambda t: len(tok(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert e.mask == [1] * n(CALL + "<eos>") + [0] * n(expected) + [1] * n("It is 42.<eos>")
    assert [s["role"] for s in e.segments] == ["assistant", "tool", "assistant"] and e.tool_calls == 1


def test_episodes_are_token_in_token_out_under_a_template_that_strips_think():
    """The trained sequence is exactly the sampled tokens plus the appended tool tokens: the <think> block of an
    earlier turn stays in it, though re-rendering the conversation with this template would drop it."""
    tok = _tok(STRIPS)
    ts, _ = choose_format(build_toolset([f"{F}:add"], None), "auto", tok, True)
    first = "<think>20+22, ask the tool</think>" + CALL

    def script(context, j):
        return "<think>it said 42</think>42" if "<tool_response>" in context else first

    rows = _rows(tok, "[user]What is 20+22?<eos>[assistant]")
    sampled = []

    def recording(context, j):
        reply = script(context, j)
        sampled.append(tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        return reply

    eps, _ = _run(rows, 1, 200, tok, recording, [f"{F}:add"], toolset=ts)
    e = eps.groups[0][0]
    tool_ids = tok(after_turn(tok, [{"role": "user", "content": "<tool_response>\n42\n</tool_response>"}], chat=True,
                              tools=None, ended_with="<eos>"), add_special_tokens=False)["input_ids"]
    assert e.ids == sampled[0] + tool_ids + sampled[1]
    assert [t for t, m in zip(e.ids, e.mask) if m] == sampled[0] + sampled[1]
    history = [{"role": "user", "content": "What is 20+22?"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}]
    rerendered = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert "<think>20+22" not in rerendered and "<think>20+22, ask the tool</think>" in tok.decode(e.ids)


def test_hermes_reads_a_call_cut_off_before_its_closing_tag():
    """A turn that stops at EOS right after the JSON (no ``</tool_call>``) is still one call."""
    fmt = FORMATS["hermes"]("tool")
    calls = fmt.parse(CALL.removesuffix("</tool_call>"), None)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 20, "b": 22})]


def test_several_results_in_one_turn_for_each_role():
    from grpo.rollout.episodes.chat import ToolCall

    calls = [ToolCall("add", {}), ToolCall("mul", {})]
    hermes = FORMATS["hermes"]
    assert hermes("user").results(calls, ["1", "2"]) == [
        {"role": "user", "content": "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"}]
    assert hermes(None).results(calls, ["1", "2"]) == [
        {"role": "user", "content": "\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>\n"}]
    assert [m["name"] for m in hermes("tool").results(calls, ["1", "2"])] == ["add", "mul"]
    assert FORMATS["template"]("tool").results(calls, ["1", "2"]) == [
        {"role": "tool", "name": "add", "content": "1"}, {"role": "tool", "name": "mul", "content": "2"}]


def test_only_the_template_format_gives_the_template_tools_and_never_an_empty_list(schemas):
    """``apply_chat_template(tools=[])`` makes some templates (Qwen's) write an empty tools header: no tools is None."""
    assert FORMATS["template"]("tool").template_tools(schemas) == schemas
    assert FORMATS["template"]("tool").template_tools([]) is None
    assert FORMATS["hermes"]("tool").template_tools(schemas) is None
    assert FORMATS["template"]("tool").system_text(schemas) is None
