"""Tool formats (``rollout.tool_format``): how the tools are shown to the model, how its calls are read, and how their
results are written back (docs/tools-and-environments.md#tool-formats).

- ``template``: the model's chat template shows the tools (``apply_chat_template(tools=...)``) and renders results
  as its ``tool`` turns; calls are parsed the ways templates write them (`grpo.rollout.episodes.chat.parse_tool_calls`).
- ``hermes``: the Hermes / Qwen convention written into the prompt, for any model: the tools' JSON schemas in a
  ``<tools></tools>`` block of the system prompt, calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  results inside ``<tool_response></tool_response>`` as a ``tool`` turn when the template renders one, else a user
  turn (plain text without a chat template).
- ``auto``: ``template`` when the chat template shows tools, else ``hermes`` (`choose`).

A format is a class registered with `register_format`; `FORMATS` maps names to classes.
"""
from __future__ import annotations

import ast
import json
import re

from grpo.errors import ConfigError
from grpo.rollout.episodes.chat import ToolCall, calls_from_blocks, parse_tool_calls

FORMATS: dict[str, type] = {}
_PROBE = "\u2063GRPO-TOOL-PROBE\u2063"


def register_format(name: str):
    def deco(cls):
        cls.name = name
        FORMATS[name] = cls
        return cls
    return deco


class ToolFormat:
    """The interface. ``role``: the role results are written as (``tool`` | ``user``; None without a chat template)."""

    name = ""

    def __init__(self, role: str | None = "tool", schemas: tuple[dict, ...] | list[dict] = ()):
        self.role, self.schemas = role, tuple(schemas)   # the tools' schemas (a parser may need their names)

    def template_tools(self, schemas: list[dict]) -> list[dict] | None:
        """What ``apply_chat_template(tools=)`` receives (None: the template is not shown tools)."""
        return None

    def system_text(self, schemas: list[dict]) -> str | None:
        """Text added to the prompt's system turn (None: nothing)."""
        return None

    def parse(self, text: str, tokenizer) -> list[ToolCall]:
        raise NotImplementedError

    def call_end(self, text: str) -> int | None:
        """Where the turn stops when it is not the last (the end of its first complete call, as a sampler's stop
        string would: what the model writes after a call is dropped); None: the whole turn is kept."""
        return None

    def results(self, calls: list[ToolCall], texts: list[str]) -> list[dict]:
        """The messages that answer a turn's calls (rendered by `grpo.rollout.episodes.chat.after_turn`)."""
        raise NotImplementedError


@register_format("template")
class TemplateFormat(ToolFormat):
    def template_tools(self, schemas):
        return list(schemas) or None

    def parse(self, text, tokenizer):
        return parse_tool_calls(text, tokenizer)

    def results(self, calls, texts):
        return [{"role": "tool", "name": c.name, "content": t} for c, t in zip(calls, texts)]


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@register_format("hermes")
class HermesFormat(ToolFormat):
    def system_text(self, schemas):
        listed = "\n".join(json.dumps(s, separators=(",", ":")) for s in schemas)
        return ("You may call tools. Their JSON schemas are inside <tools></tools>:\n"
                f"<tools>\n{listed}\n</tools>\n"
                "To call one, reply with a JSON object inside <tool_call></tool_call> tags:\n"
                '<tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call>\n'
                "The result comes back inside <tool_response></tool_response> tags.")

    def parse(self, text, tokenizer):
        return calls_from_blocks([m.group(1) for m in _HERMES_CALL.finditer(text)])

    def results(self, calls, texts):
        wrapped = [f"<tool_response>\n{t}\n</tool_response>" for t in texts]
        if self.role == "tool":
            return [{"role": "tool", "name": c.name, "content": w} for c, w in zip(calls, wrapped)]
        if self.role is None:  # no chat template: the text follows the turn as it is
            return [{"role": "user", "content": "\n" + "\n".join(wrapped) + "\n"}]
        return [{"role": "user", "content": "\n".join(wrapped)}]  # one user turn (templates that alternate roles)


@register_format("pythonic")
class PythonicFormat(ToolFormat):
    """Calls written as Python function calls, ``calculate("12 * 34")`` (the convention of vLLM's ``pythonic`` tool
    parser, Llama 3.2/4, where they sit in a list: ``[calculate(expression="12 * 34")]``; the list is optional here),
    keyword or positional arguments in the schema's order; an argument that is not a Python literal is passed as
    its source text when the parameter is a string (``calculate(12 * 34)``). Only the tools' own names are calls
    (``print(...)`` is not). Results come back as they are, as a ``tool`` turn (else a user turn)."""

    def system_text(self, schemas):
        listed = "\n".join(_signature(s) for s in schemas)
        example = _example(schemas[0]) if schemas else "tool(argument)"
        return (f"You can call these Python functions:\n{listed}\nTo call one, reply with the call alone, for example "
                f"{example}. Its result comes back in the next message.")

    def parse(self, text, tokenizer):
        params = {s["function"]["name"]: s["function"].get("parameters", {}) for s in self.schemas}
        if not params:
            return []
        found = re.finditer(r"(?<![\w.])(" + "|".join(map(re.escape, params)) + r")\s*\(", text)
        return [_python_call(text, m.start(), m.group(1), params[m.group(1)]) for m in found]

    def call_end(self, text):
        names = "|".join(re.escape(s["function"]["name"]) for s in self.schemas)
        for m in re.finditer(r"(?<![\w.])(" + names + r")\s*\(", text) if names else ():
            end = _closing(text, m.start())
            if end is not None:
                return end + 1 if text[end:end + 1] == "]" else end
        return None

    def results(self, calls, texts):
        if self.role == "tool":
            return [{"role": "tool", "name": c.name, "content": t} for c, t in zip(calls, texts)]
        if self.role is None:
            return [{"role": "user", "content": "\n" + "\n".join(texts) + "\n"}]
        return [{"role": "user", "content": "\n".join(texts)}]


_FENCE = re.compile(r"```([\w+-]*):?[ \t]*\n(.*?)(```|$)", re.DOTALL)


@register_format("code")
class CodeFormat(ToolFormat):
    """Calls written as fenced code blocks, the tool-integrated reasoning convention (ToRL, SimpleTIR, Qwen's code
    interpreter): a block tagged with a tool's name (```python ... ```) calls that tool with the block's text as its
    one string argument; an untagged block calls the only tool when there is one. Results come back inside
    ```output ... ``` as a ``tool`` turn (else a user turn). For tools that take one string (code, a query)."""

    def system_text(self, schemas):
        listed = "\n".join(f"{s['function']['name']}: {s['function'].get('description', '').strip()}" for s in schemas)
        first = schemas[0]["function"]["name"] if schemas else "python"
        return (f"You can run code blocks:\n{listed}\nTo run one, write it inside ```{first} and ```; what it prints"
                " comes back inside ```output and ```.")

    def parse(self, text, tokenizer):
        params = {s["function"]["name"]: list(s["function"].get("parameters", {}).get("properties", {}))
                  for s in self.schemas}
        calls = []
        for m in self._blocks(text):
            tag = self._tag(m)
            if len(params[tag]) != 1:
                calls.append(ToolCall(tag, {}, f"{tag} does not take one argument; call it in another format"))
            else:
                calls.append(ToolCall(tag, {params[tag][0]: m.group(2).strip()}))
        return calls

    def _tag(self, m) -> str:
        names = [s["function"]["name"] for s in self.schemas]
        return m.group(1) or (names[0] if len(names) == 1 else "")

    def _blocks(self, text: str):
        """The fenced blocks that call a tool (not ```output blocks, not other languages)."""
        names = {s["function"]["name"] for s in self.schemas}
        return [m for m in _FENCE.finditer(text) if self._tag(m) in names]

    def call_end(self, text):
        blocks = self._blocks(text)
        return blocks[0].end() if blocks and blocks[0].group(3) else None

    def results(self, calls, texts):
        return PythonicFormat.results(self, calls, [f"```output\n{t}\n```" for t in texts])


def _signature(schema: dict) -> str:
    fn = schema["function"]
    props = fn.get("parameters", {}).get("properties", {})
    args = ", ".join(f"{k}: {_PY_TYPES.get(v.get('type'), 'object')}" for k, v in props.items())
    return f"{fn['name']}({args}): {fn.get('description', '').strip()}"


def _example(schema: dict) -> str:
    fn = schema["function"]
    props = fn.get("parameters", {}).get("properties", {})
    return f"{fn['name']}({', '.join(k for k in props)})"


_PY_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "array": "list",
             "object": "dict"}


def _closing(text: str, start: int) -> int | None:
    """The index after the parenthesis that closes the first one at or after ``start`` (None: it is not closed)."""
    depth, quote = 0, None
    for k in range(text.index("(", start), len(text)):
        ch = text[k]
        if quote:
            quote = None if ch == quote and text[k - 1] != "\\" else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return k + 1
    return None


def _python_call(text: str, start: int, name: str, parameters: dict) -> ToolCall:
    """The call that starts at ``text[start]`` (its name, then a parenthesis): its arguments by parameter name."""
    end = _closing(text, start)
    if end is None:
        return ToolCall("", {}, f"the call to {name} is not closed: write {name}(...) with a closing parenthesis")
    source = text[start:end]
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        return ToolCall("", {}, f"the call {source!r} is not valid Python")
    names = list(parameters.get("properties", {}))
    if len(node.args) > len(names):
        return ToolCall(name, {}, f"{name} takes {len(names)} argument(s), the call gives {len(node.args)}")
    pairs = [*zip(names, node.args), *((kw.arg, kw.value) for kw in node.keywords)]
    args = {}
    for key, value in pairs:
        string = parameters.get("properties", {}).get(key, {}).get("type") == "string"
        try:
            args[key] = ast.literal_eval(value)
        except ValueError:
            if not string:
                return ToolCall(name, {}, f"the argument {key} of {source!r} is not a Python literal")
        if string and not isinstance(args.get(key), str):  # calculate(12 * 34): the expression as written
            args[key] = ast.get_source_segment(source, value)
    return ToolCall(name, args)


def shows_tools(tokenizer, schemas: list[dict]) -> bool:
    """Whether the chat template renders ``schemas`` (rendering with and without them differs)."""
    turns = [{"role": "user", "content": "hi"}]
    plain = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    shown = tokenizer.apply_chat_template(turns, tools=list(schemas), tokenize=False, add_generation_prompt=True)
    return plain != shown


def renders_tool_role(tokenizer) -> bool:
    """Whether the chat template renders a ``tool`` turn after an assistant turn (with its content)."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
             {"role": "tool", "name": "t", "content": _PROBE}]
    try:
        return _PROBE in tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that raises on the role (role alternation checks) has none
        return False


def choose(requested: str, schemas: list[dict], tokenizer, chat: bool) -> tuple[ToolFormat, str]:
    """(the format for a run's tools, a line saying why). ``chat``: prompts go through the tokenizer's chat template.
    ``template`` on a template that shows no tools is refused with one line (the model would never see them)."""
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    shown = chat and shows_tools(tokenizer, schemas)
    if requested == "template":
        if not chat:
            raise ConfigError("rollout.tool_format=template needs the model's chat template (data.chat_template=true "
                              "and a tokenizer with one); use rollout.tool_format=hermes (or auto) to describe the "
                              "tools in the prompt instead")
        if not shown:
            raise ConfigError(f"rollout.tool_format=template: the chat template of {name} has no tool support (tools do"
                              " not appear in the prompt); use rollout.tool_format=hermes (or auto) to describe them "
                              "in the system prompt")
    if requested == "auto":
        requested = "template" if shown else "hermes"
        why = (f"the chat template of {name} shows tools" if shown else
               f"the chat template of {name} shows no tools" if chat else "the prompts use no chat template")
    else:
        why = "as configured"
    role = "tool" if requested == "template" else ("tool" if renders_tool_role(tokenizer) else "user") if chat else None
    fmt = FORMATS[requested](role, schemas)
    where = "shown by the chat template" if fmt.template_tools([{}]) else "described in the system prompt"
    results = {"tool": "tool turns", "user": "user turns", None: "plain text"}[role]
    return fmt, (f"rollout.tool_format={requested} ({why}): tools {where}, results as {results}")


def of(toolset) -> ToolFormat:
    """The format a built `grpo.rollout.episodes.spec.Toolset` was given (``tool_format``, ``result_role``)."""
    return FORMATS[toolset.tool_format](toolset.result_role, toolset.schemas)
