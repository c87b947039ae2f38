"""Tool formats (rollout.tool_format): what `auto` chooses, the hermes format rendered, parsed and answered with and
without a chat template, and episodes that stay token-in/token-out under a template that strips earlier <think>
blocks."""
from __future__ import annotations

import json
from types import SimpleNamespace

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
                          "chat_template": True, "max_prompt_tokens": 10_000, "answer_column": "answer",
                          "image_column": "images"})()
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


# ------------------------------------------------------------------------------- pythonic and code
PY_TOOL = "grpo.rollout.episodes.calculator:python"


def test_pythonic_parses_calls_of_the_tools_only(schemas):
    fmt = FORMATS["pythonic"]("tool", schemas)
    got = lambda text: [(c.name, c.arguments, c.error) for c in fmt.parse(text, None)]  # noqa: E731
    assert got("add(a=20, b=22)") == [("add", {"a": 20, "b": 22}, None)]
    assert got("[add(20, b=22)] then print(3)") == [("add", {"a": 20, "b": 22}, None)]  # print is not a tool
    assert got("x.add(1, 2) or madd(1, 2)") == []
    assert got("add(1, 2, 3)")[0][2] == "add takes 2 argument(s), the call gives 3"
    assert got("add(a=1 + 2, b=2)")[0][2].startswith("the argument a of")  # integers: literals only
    assert got("add(1, ")[0][2].startswith("the call to add is not closed")
    assert "add(a: int, b: int)" in fmt.system_text(schemas)
    text = 'I will call [add(a=1, b=")")] now, then more'
    assert text[:fmt.call_end(text)] == 'I will call [add(a=1, b=")")]' and fmt.call_end("add(1,") is None
    calc = FORMATS["pythonic"]("tool", build_toolset(["grpo.rollout.episodes.calculator:calculate"], None).schemas)
    assert [c.arguments for c in calc.parse('calculate(12 * 34) calculate("5")', None)] == \
        [{"expression": "12 * 34"}, {"expression": "5"}]  # a string parameter takes the expression as written


def test_code_blocks_are_calls_of_the_tool_they_name():
    schemas = build_toolset([PY_TOOL], None).schemas
    fmt = FORMATS["code"]("tool", schemas)
    text = "Like this:\n```python:\nprint(12 * 34)\n```\nIt prints 408.\n```python\nprint(1)\n```"
    assert [(c.name, c.arguments) for c in fmt.parse(text, None)] == [("python", {"code": "print(12 * 34)"}),
                                                                     ("python", {"code": "print(1)"})]
    assert text[:fmt.call_end(text)] == "Like this:\n```python:\nprint(12 * 34)\n```"
    assert [c.arguments for c in fmt.parse("```\nx = 2\n```", None)] == [{"code": "x = 2"}]  # the only tool
    assert fmt.parse("```output\n408\n```\n```js\nf()\n```", None) == []
    assert fmt.call_end("```python\nprint(1)") is None and len(fmt.parse("```python\nprint(1)", None)) == 1
    assert fmt.results(fmt.parse(text, None)[:1], ["408"]) == [{"role": "tool", "name": "python",
                                                                "content": "```output\n408\n```"}]
    assert "```python" in fmt.system_text(list(schemas)) and "```output" in fmt.system_text(list(schemas))


def test_a_turn_stops_where_its_call_closes_and_stays_token_in_token_out():
    """The code format stops a turn at its first complete block (a stop string): what the model wrote after it is
    dropped, the kept tokens are exactly a prefix of the sampled ones, and the tool text follows them."""
    tok = _tok(GENERIC)
    ts, _ = choose_format(build_toolset([PY_TOOL], None), "code", tok, True)
    block = "```python\nprint(20 + 22)\n```"
    sampled = []

    def script(context, j):
        reply = "It is 42." if "```output\n42" in context else block + "\nIt prints 41, I think."
        sampled.append(tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        return reply

    eps, _ = _run(_rows(tok, "[user]What is 20+22?<eos>[assistant]"), 1, 200, tok, script, [PY_TOOL], toolset=ts)
    e = eps.groups[0][0]
    kept = tok(block, add_special_tokens=False)["input_ids"]
    assert sampled[0][:len(kept)] == kept and len(sampled[0]) > len(kept)
    tool_text = "<eos>[tool]```output\n42\n```<eos>[assistant]"  # the turn's end marker is tool text: never sampled
    assert tok.decode(e.ids) == block + tool_text + "It is 42.<eos>"
    assert [t for t, m in zip(e.ids, e.mask) if m] == kept + sampled[1]
    assert (e.turns, e.tool_calls, e.tool_failures, e.truncated) == (2, 1, 0, False)
    assert e.segments[0]["text"] == block  # what rewards and samples.jsonl see of the turn


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


# ------------------------------------------------------------------------------- the units mutation testing reaches
ADD = {"type": "function", "function": {"name": "add", "description": " Add two integers. ", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
SAY = {"type": "function", "function": {"name": "say", "description": "Say it.", "parameters": {
    "properties": {"text": {"type": "string"}, "loud": {"type": "boolean"}, "how": {}}}}}


def test_the_system_texts_are_exactly_what_the_model_reads():
    listed = json.dumps(ADD, separators=(",", ":")) + "\n" + json.dumps(SAY, separators=(",", ":"))
    assert FORMATS["hermes"]("user").system_text([ADD, SAY]) == (
        "You may call tools. Their JSON schemas are inside <tools></tools>:\n<tools>\n" + listed +
        "\n</tools>\nTo call one, reply with a JSON object inside <tool_call>"
        '</tool_call> tags:\n<tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call>\n'
        "The result comes back inside <tool_response></tool_response> tags.")
    assert FORMATS["pythonic"]("user").system_text([ADD, SAY]) == (
        "You can call these Python functions:\nadd(a: int, b: int): Add two integers.\nsay(text: str, loud: bool, "
        "how: object): Say it.\nTo call one, reply with the call alone, for example add(a, b). Its result comes back "
        "in the next message.")
    assert "for example tool(argument)." in FORMATS["pythonic"]("user").system_text([])
    assert "\nping(): \nadd(a: int, b: int): Add two integers.\nTo call one, reply with the call alone, for example " \
        "ping()." in FORMATS["pythonic"]("user").system_text([{"function": {"name": "ping"}}, ADD])  # no parameters
    assert FORMATS["code"]("user").system_text([ADD, SAY]) == (
        "You can run code blocks:\nadd: Add two integers.\nsay: Say it.\nTo run one, write it inside ```add and ```; "
        "what it prints comes back inside ```output and ```.")
    assert "inside ```python and ```" in FORMATS["code"]("user").system_text([])
    assert FORMATS["code"]("user").system_text([{"function": {"name": "python"}}]).startswith(
        "You can run code blocks:\npython: \nTo run one")  # a tool without a description
    from grpo.rollout.episodes.formats import _PY_TYPES, _signature

    assert _PY_TYPES == {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "array": "list",
                         "object": "dict"}
    assert _signature({"function": {"name": "f"}}) == "f(): "


def test_the_base_format_declares_the_interface_and_registering_names_a_class():
    from grpo.rollout.episodes.formats import ToolFormat, of, register_format

    base = ToolFormat()
    assert (base.role, base.schemas, base.name) == ("tool", (), "")
    assert base.template_tools([ADD]) is None and base.system_text([ADD]) is None and base.call_end("x") is None
    with pytest.raises(NotImplementedError):
        base.parse("x", None)
    with pytest.raises(NotImplementedError):
        base.results([], [])
    assert ToolFormat("user", [ADD]).schemas == (ADD,)
    assert [(n, c.name) for n, c in FORMATS.items()] == [(n, n) for n in ("template", "hermes", "pythonic", "code")]
    try:
        @register_format("mine")
        class Mine(ToolFormat):
            pass
        assert FORMATS["mine"] is Mine and Mine.name == "mine"
    finally:
        FORMATS.pop("mine", None)
    made = of(SimpleNamespace(tool_format="pythonic", result_role="user", schemas=(ADD,)))
    assert type(made) is FORMATS["pythonic"] and (made.role, made.schemas) == ("user", (ADD,))
    from grpo.rollout.episodes.chat import ToolCall

    assert FORMATS["template"]("tool").parse('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
                                             None) == [ToolCall("add", {"a": 1})]


def test_pythonic_arguments_escapes_and_errors():
    fmt = FORMATS["pythonic"]("tool", [ADD, SAY])
    got = lambda text: [(c.name, c.arguments, c.error) for c in fmt.parse(text, None)]  # noqa: E731
    assert got("say('it\\'s (fine)', loud=True)") == [("say", {"text": "it's (fine)", "loud": True}, None)]
    assert got("say(text=5)") == [("say", {"text": "5"}, None)]  # a string parameter: the literal as written
    assert got("say(loud=x)")[0][2] == "the argument loud of 'say(loud=x)' is not a Python literal"
    assert got("add(1, b=)") == [("", {}, "the call 'add(1, b=)' is not valid Python")]
    assert got("add ((1), 2)") == [("add", {"a": 1, "b": 2}, None)]  # nested parentheses, a space
    assert got("add(1, 2)") == [("add", {"a": 1, "b": 2}, None)] and got("add(b=2)") == [("add", {"b": 2}, None)]
    assert got("add(1, ") == [("", {}, "the call to add is not closed: write add(...) with a closing parenthesis")]
    assert FORMATS["pythonic"]("tool").parse("add(1, 2)", None) == [] and FORMATS["pythonic"]("tool").call_end(
        "add(1, 2)") is None
    assert fmt.call_end("add(1, 2) and add(3, 4)") == len("add(1, 2)")
    assert fmt.call_end("[add(1, 2)]!") == len("[add(1, 2)]")
    assert fmt.call_end("say(')') rest") == len("say(')')") and fmt.call_end("print(1) add(2, 3)") == len(
        "print(1) add(2, 3)")


def test_pythonic_and_code_results_for_each_role():
    from grpo.rollout.episodes.chat import ToolCall

    calls = [ToolCall("add", {}), ToolCall("say", {})]
    py, code = FORMATS["pythonic"], FORMATS["code"]
    assert py("tool").results(calls, ["1", "2"]) == [{"role": "tool", "name": "add", "content": "1"},
                                                     {"role": "tool", "name": "say", "content": "2"}]
    assert py("user").results(calls, ["1", "2"]) == [{"role": "user", "content": "1\n2"}]
    assert py(None).results(calls, ["1", "2"]) == [{"role": "user", "content": "\n1\n2\n"}]
    assert code("user").results(calls[:1], ["408"]) == [{"role": "user", "content": "```output\n408\n```"}]
    assert code(None).results(calls[:1], ["408"]) == [{"role": "user", "content": "\n```output\n408\n```\n"}]


def test_code_blocks_of_a_tool_without_one_argument_and_of_several_tools():
    fmt = FORMATS["code"]("tool", [ADD, SAY])
    calls = fmt.parse("```add\n1 2\n```\n```\nuntagged\n```\n```say\n  hi  \n```", None)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        (n, {}, f"{n} does not take one argument; call it in another format") for n in ("add", "say")]  # untagged: none
    one = FORMATS["code"]("tool", [{"function": {"name": "py", "parameters": {"properties": {"src": {}}}}}])
    assert [c.arguments for c in one.parse("```py \n  x = 1  \n```", None)] == [{"src": "x = 1"}]
    assert one.call_end("no block") is None and one.call_end("```py\nx\n``` after") == len("```py\nx\n```")
    assert FORMATS["code"]("tool", [{"function": {"name": "py"}}]).parse("```py\nx\n```", None)[0].error


def test_choose_refuses_the_template_format_where_no_template_shows_tools_and_says_what_it_chose(schemas):
    with pytest.raises(ConfigError, match=r"^rollout.tool_format=template needs the model's chat template"):
        choose("template", schemas, _tok(TEMPLATE), False)
    tok = _tok(GENERIC)
    tok.name_or_path = "my/model"
    with pytest.raises(ConfigError, match=r"^rollout.tool_format=template: the chat template of my/model has no "):
        choose("template", schemas, tok, True)
    fmt, note = choose("template", schemas, _tok(TEMPLATE), True)
    assert (fmt.name, fmt.role, fmt.schemas) == ("template", "tool", tuple(schemas))
    assert note.endswith("(as configured): tools shown by the chat template, results as tool turns")
    _, note = choose("auto", schemas, tok, True)
    assert note == "rollout.tool_format=hermes (the chat template of my/model shows no tools): tools described in " \
                   "the system prompt, results as tool turns"
    _, note = choose("pythonic", schemas, _tok(STRIPS), True)
    assert note.endswith("results as user turns")
    fmt, note = choose("code", schemas, _tok(None), False)
    assert fmt.role is None and note.endswith("results as plain text")
    nameless = _tok(GENERIC)
    nameless.name_or_path = ""
    assert "the chat template of the model shows no tools" in choose("auto", schemas, nameless, True)[1]
    bare = SimpleNamespace(apply_chat_template=_tok(GENERIC).apply_chat_template)  # a tokenizer without the attribute
    assert "the chat template of the model shows no tools" in choose("auto", schemas, bare, True)[1]
    assert choose("auto", schemas, _tok(None), False)[1] == "rollout.tool_format=hermes (the prompts use no chat " \
        "template): tools described in the system prompt, results as plain text"


def test_hermes_tool_turns_carry_each_calls_name_and_the_template_format_asks_the_tokenizers_parser():
    from grpo.rollout.episodes.chat import ToolCall

    calls = [ToolCall("add", {}), ToolCall("mul", {})]
    assert FORMATS["hermes"]("tool").results(calls, ["1", "2"]) == [
        {"role": "tool", "name": "add", "content": "<tool_response>\n1\n</tool_response>"},
        {"role": "tool", "name": "mul", "content": "<tool_response>\n2\n</tool_response>"}]

    class Parsing:  # a tokenizer with a response schema (transformers' parse_response)
        response_template = "{...}"

        def parse_response(self, text, prefix=""):
            return {"tool_calls": [{"function": {"name": "add", "arguments": {"a": len(text)}}}]}

    assert FORMATS["template"]("tool").parse("abc", Parsing()) == [ToolCall("add", {"a": 3})]


def test_pythonic_calls_of_tools_without_parameters_or_with_unknown_keywords():
    ping = {"type": "function", "function": {"name": "ping"}}  # no parameters at all
    bare = {"type": "function", "function": {"name": "bare", "parameters": {"type": "object"}}}  # no properties
    fmt = FORMATS["pythonic"]("tool", [ADD, ping, bare])
    got = lambda text: [(c.name, c.arguments, c.error) for c in fmt.parse(text, None)]  # noqa: E731
    assert got("ping()") == [("ping", {}, None)] and got("bare(x=1)") == [("bare", {"x": 1}, None)]
    assert got("add(c=1)") == [("add", {"c": 1}, None)]  # the tool itself says what it does not take
    assert got("add(1, 2, 3)") == [("add", {}, "add takes 2 argument(s), the call gives 3")]
    assert got("add(X, 1)") == [("add", {}, "the argument a of 'add(X, 1)' is not a Python literal")]
    assert FORMATS["pythonic"]("tool").call_end("see (1) or (2)") is None  # no tools: nothing is a call


# validates its turns as real templates do (roles, string contents, a tool turn's name); shows tools
STRICT = ("{% if tools %}[tools]{% for t in tools %}{{ t.function.name }};{% endfor %}<eos>{% endif %}"
          "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
          "{{ raise_exception('unknown role') }}{% endif %}{% if m.content is not string %}"
          "{{ raise_exception('a content must be a string') }}{% endif %}"
          "{% if m.role == 'tool' and m.name is not string %}{{ raise_exception('a tool turn needs its name') }}"
          "{% endif %}[{{ m.role }}]{{ m.content }}<eos>{% endfor %}"
          "{% if add_generation_prompt %}[assistant]{% endif %}")
# shows tools, but raises on a tool turn
NO_TOOL_ROLE = ("{% if tools %}[tools]{% for t in tools %}{{ t.function.name }};{% endfor %}<eos>{% endif %}"
                "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
                "[{{ m.role }}]{{ m.content }}<eos>{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def test_the_template_probes_send_turns_a_strict_template_accepts(schemas):
    """A probe turn a template rejects (a misspelt role or key, no tool name) would read as "no support"."""
    from grpo.rollout.episodes.formats import renders_tool_role, shows_tools

    tok = _tok(STRICT)
    assert shows_tools(tok, schemas) and renders_tool_role(tok)
    assert not shows_tools(tok, []) and not renders_tool_role(_tok(NO_TOOL_ROLE))
    fmt, note = choose("auto", schemas, tok, True)
    assert (fmt.name, fmt.role) == ("template", "tool") and note.endswith("results as tool turns")


def test_the_template_format_answers_with_tool_turns_even_where_the_template_renders_none(schemas):
    """The template format always writes its results as ``tool`` turns (`TemplateFormat.results`): the role and the
    note say so, even where the probe finds the template raising on that role."""
    for requested in ("template", "auto"):
        fmt, note = choose(requested, schemas, _tok(NO_TOOL_ROLE), True)
        assert (fmt.name, fmt.role) == ("template", "tool") and note.endswith("results as tool turns")
        assert fmt.results([SimpleNamespace(name="add")], ["42"])[0]["role"] == fmt.role
