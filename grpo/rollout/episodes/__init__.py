"""Multi-turn episodes: tools and environments (docs/tools-and-environments.md).

`spec`: what ``rollout.tools`` / ``rollout.environment`` name, resolved and checked at start; `worker`: the process
the calls run in (hard-killed on a timeout); `formats`: how tools are shown, calls read and results written
(``rollout.tool_format``); `chat`: tool calls parsed from a turn and the chat template's tool message rendered as
tokens; `episodes`: the turn loop over any rollout backend, and the loss mask it produces.
"""
