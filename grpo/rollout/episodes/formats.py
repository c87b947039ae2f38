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

    def __init__(self, role: str | None = "tool"):
        self.role = role

    def template_tools(self, schemas: list[dict]) -> list[dict] | None:
        """What ``apply_chat_template(tools=)`` receives (None: the template is not shown tools)."""
        return None

    def system_text(self, schemas: list[dict]) -> str | None:
        """Text added to the prompt's system turn (None: nothing)."""
        return None

    def parse(self, text: str, tokenizer) -> list[ToolCall]:
        raise NotImplementedError

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
    fmt = FORMATS[requested](role)
    where = "shown by the chat template" if fmt.template_tools([{}]) else "described in the system prompt"
    results = {"tool": "tool turns", "user": "user turns", None: "plain text"}[role]
    return fmt, (f"rollout.tool_format={requested} ({why}): tools {where}, results as {results}")


def of(toolset) -> ToolFormat:
    """The format a built `grpo.rollout.episodes.spec.Toolset` was given (``tool_format``, ``result_role``)."""
    return FORMATS[toolset.tool_format](toolset.result_role)
