"""``rollout.tools`` and ``rollout.environment`` resolved and checked before any model loads.

A tool is a plain function with type hints and a docstring (its JSON schema, as the chat template shows it, comes
from `transformers.utils.get_json_schema`). An environment is a class with ``reset(row)``; its public methods are
its tools, ``reward()`` (optional) scores the finished episode. An environment with ``step(text)`` speaks the
plain-text protocol instead (no tools: each model turn goes to ``step``, whose text comes back as the next user
turn, until it returns None).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

from grpo.errors import ConfigError
from grpo.objects import load_object

RESERVED = ("reset", "reward", "step")


@dataclass(frozen=True)
class Toolset:
    """What the turn loop needs to know about the configured tools/environment (picklable: no live objects)."""

    protocol: str                                        # "tools" (the chat template's tool calls) | "text" (step)
    functions: dict[str, str] = field(default_factory=dict)   # tool name -> 'module:function'
    methods: tuple[str, ...] = ()                        # the environment's tool methods
    schemas: tuple[dict, ...] = ()                       # JSON schemas shown through apply_chat_template(tools=)
    environment: str | None = None                       # 'module:Class'
    env_name: str | None = None                          # the class name (reward/<ClassName>)
    env_reward: bool = False                             # the environment defines reward()
    tool_format: str = "template"                        # `episodes.formats`: chosen once the tokenizer is known
    result_role: str | None = "tool"                     # the role tool results are written as (None: plain text)


def tool_schema(fn, key: str) -> dict:
    """The function's JSON schema (what the chat template shows); a one-line error without a docstring, a type
    hint on every argument, or an ``Args:`` line per argument."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__qualname__", repr(fn))
    if not (fn.__doc__ or "").strip():
        raise ConfigError(f"{key}: tool {name} has no docstring; the model is shown its docstring (a summary line "
                          "and an 'Args:' line per argument)")
    try:
        return get_json_schema(fn)
    except Exception as e:  # TypeHintParsingException, DocstringParsingException
        raise ConfigError(f"{key}: tool {name} cannot be shown to the model: {str(e).splitlines()[0]}") from None


def env_methods(cls) -> list[str]:
    return [n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_") and n not in RESERVED]


def build_toolset(tools: list[str], environment: str | None) -> Toolset | None:
    """None for a single-turn run; else the checked `Toolset`."""
    if not tools and environment is None:
        return None
    functions, schemas = {}, []
    for i, spec in enumerate(tools):
        fn = load_object(spec, f"rollout.tools[{i}]")
        if not callable(fn) or inspect.isclass(fn):
            raise ConfigError(f"rollout.tools[{i}]={spec!r} is not a function")
        schema = tool_schema(fn, f"rollout.tools[{i}]={spec!r}")
        name = schema["function"]["name"]
        if name in functions:
            raise ConfigError(f"rollout.tools[{i}]={spec!r}: a second tool named {name!r}")
        functions[name] = spec
        schemas.append(schema)
    if environment is None:
        return Toolset("tools", functions, (), tuple(schemas))
    cls = load_object(environment, "rollout.environment")
    key = f"rollout.environment={environment!r}"
    if not inspect.isclass(cls):
        raise ConfigError(f"{key} is not a class")
    if not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"{key}: {cls.__name__} has no reset(row) method (it starts each episode)")
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise ConfigError(f"{key}: {cls.__name__}() must be callable without arguments (one instance per sample; "
                          "reset(row) receives the sample's data row)") from None
    reward = callable(getattr(cls, "reward", None))
    if callable(getattr(cls, "step", None)):
        if tools:
            raise ConfigError(f"{key} speaks the plain-text protocol (it has step()); rollout.tools cannot be "
                              "combined with it: give the environment the tools' work, or drop step()")
        return Toolset("text", environment=environment, env_name=cls.__name__, env_reward=reward)
    methods = env_methods(cls)
    if not methods and not tools:
        raise ConfigError(f"{key}: {cls.__name__} has neither public tool methods nor step(text); give it one")
    for m in methods:
        schema = tool_schema(getattr(cls, m), f"{key} method {m}")
        if schema["function"]["name"] in functions:
            raise ConfigError(f"{key}: method {m!r} has the name of a tool in rollout.tools")
        schemas.append(schema)
    return Toolset("tools", functions, tuple(methods), tuple(schemas), environment, cls.__name__, reward)


def choose_format(toolset: Toolset, requested: str, tokenizer, use_chat_template: bool) -> tuple[Toolset, str | None]:
    """``toolset`` with its tool format chosen (``rollout.tool_format``, `episodes.formats.choose`) and the line
    that says which; the plain-text protocol needs none (the toolset as it is, None)."""
    if toolset.protocol != "tools":
        return toolset, None
    from grpo.rollout.episodes.formats import choose

    chat = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
    fmt, note = choose(requested, list(toolset.schemas), tokenizer, chat)
    return replace(toolset, tool_format=fmt.name, result_role=fmt.role), note


def multi_turn(rollout) -> bool:
    return bool(rollout.tools) or rollout.environment is not None


def max_sampled_tokens(rollout) -> int:
    """The most tokens the policy samples in one completion: ``max_new_tokens`` per turn (dr_grpo's constant)."""
    return rollout.max_new_tokens * (rollout.max_turns if multi_turn(rollout) else 1)


def max_completion_tokens(rollout, overhead: int = 32) -> int:
    """The longest a completion can get: every turn's sampled tokens, plus between turns a tool result of at most
    ``max_tool_tokens`` and ``overhead`` tokens of the chat template's framing."""
    if not multi_turn(rollout):
        return rollout.max_new_tokens
    return max_sampled_tokens(rollout) + (rollout.max_turns - 1) * (rollout.max_tool_tokens + overhead)
