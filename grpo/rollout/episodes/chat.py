"""The chat side of a multi-turn episode: tool calls parsed from a model turn, and the text that follows a turn
(tool results or an observation, then the next assistant header) rendered by the model's own chat template.

Parsing: the tokenizer's ``response_template`` when it has one (`transformers` ``parse_response``), else the
formats chat templates use: ``<tool_call>{json}</tool_call>`` (Hermes, Qwen 2.5/3, SmolLM3; a JSON list inside
is several calls) and Mistral's ``[TOOL_CALLS][...]``; arguments under ``arguments`` or ``parameters``.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_MARK = "\u2063GRPO-TURN-END\u2063"


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None    # the call could not be parsed: what the model is told instead of a result


def parse_tool_calls(text: str, tokenizer=None) -> list[ToolCall]:
    """Every tool call in a model turn (empty: the model answered without one)."""
    if getattr(tokenizer, "response_template", None) is not None:
        try:
            message = tokenizer.parse_response(text, prefix="")
            return [_from_dict(c.get("function", c)) for c in message.get("tool_calls") or []]
        except Exception:  # noqa: BLE001 - fall back to the common formats
            pass
    blocks = [m.group(1) for m in _TAGGED.finditer(text)]
    if not blocks and text.lstrip().startswith("[TOOL_CALLS]"):
        blocks = [text.lstrip()[len("[TOOL_CALLS]"):]]
    return calls_from_blocks(blocks)


def calls_from_blocks(blocks: list[str]) -> list[ToolCall]:
    """The calls in JSON blocks (each one call or a list of calls); a block that does not parse is an error call."""
    calls = []
    for block in blocks:
        try:
            value = json.loads(block.strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            continue
        for item in value if isinstance(value, list) else [value]:
            calls.append(_from_dict(item))
    return calls


def _from_dict(item) -> ToolCall:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return ToolCall("", {}, 'a tool call must be {"name": ..., "arguments": {...}}')
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(item["name"], {}, "the tool call's arguments are not valid JSON")
    if not isinstance(args, dict):
        return ToolCall(item["name"], {}, "the tool call's arguments must be a JSON object")
    return ToolCall(item["name"], args)


def after_turn(tokenizer, messages: list[dict], *, chat: bool, tools: list[dict] | None,
               ended_with: str | None) -> str:
    """The text that follows a model turn: ``messages`` (tool results, or a user observation) as the chat template
    renders them after an assistant turn, up to and including the next assistant header. ``ended_with``: the text
    of the stop token the turn ended with (already in the episode, so not repeated). Without a chat template the
    messages' contents are added as they are."""
    if not chat:
        return "".join(m["content"] for m in messages)
    turns = [{"role": "user", "content": "."}, {"role": "assistant", "content": _MARK}, *messages]
    full = tokenizer.apply_chat_template(turns, tools=tools or None, tokenize=False, add_generation_prompt=True)
    rest = full[full.index(_MARK) + len(_MARK):]
    if ended_with and rest.startswith(ended_with):
        rest = rest[len(ended_with):]
    return rest


def clip_tokens(tokenizer, text: str, limit: int) -> str:
    """``text`` cut to ``limit`` tokens (marked), so that one verbose tool cannot fill the context."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= limit:
        return text
    return tokenizer.decode(ids[:limit]) + " ...[cut]"
