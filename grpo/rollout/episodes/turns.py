"""The turn loop: G episodes per prompt, each alternating model turns and tool results until the model answers
without a call (or the environment's ``step`` returns None), a turn is cut at ``max_new_tokens``, or
``rollout.max_turns`` model turns have run.

Every model turn is one call of the rollout backend's ``generate`` (`grpo.rollout.base`), so the hf decode loop and
vLLM serve it alike. The first turn samples the G completions of each prompt from one prefill of the prompt (the
backend shares it); later turns continue every live episode from its own context (prompt + episode so far), one
sample each, passed as the prompt and its live episodes as suffixes (hf prefills each prompt once and each episode
only its own tokens; vLLM's prefix cache does the same). An episode's tokens after the prompt are its completion;
``mask`` marks the ones the policy sampled (1) and the ones a tool or the environment wrote (0), which carry no
loss, KL or entropy and are not counted by any loss normaliser.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from grpo.errors import SetupError
from grpo.rollout.base import Sampling
from grpo.rollout.episodes import formats
from grpo.rollout.episodes.chat import after_turn, clip_tokens
from grpo.rollout.episodes.spec import Toolset
from grpo.rollout.episodes.worker import CallResult, ToolWorker


@dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int
    max_tool_tokens: int
    chat: bool                 # turns are rendered by the chat template (else tool text is added as it is)
    max_new_tokens: int = 0    # > 0: keep every episode within `spec.max_completion_tokens` (what the update planned
                               # micro-batches for): tool text that would pass it ends the episode instead
    overhead: int = 32         # template tokens allowed around each tool result (`spec.max_completion_tokens`)
    max_tokens: int = 0        # > 0: engine.max_tokens_per_micro_batch; the prompt, with the text reset(row) added
                               # (unknown when it was planned), and the episode must fit in it


@dataclass
class Episode:
    ids: list[int] = field(default_factory=list)     # every token after the prompt
    mask: list[int] = field(default_factory=list)    # 1: sampled by the policy; 0: written by a tool/environment
    logps: list | None = field(default_factory=list)  # the sampler's own log-probs (vLLM), 0 for tool tokens
    segments: list[dict] = field(default_factory=list)  # [{"role": "assistant" | "tool" | "user", "text": ...}]
    truncated: bool = False
    done: bool = False
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    tool_timeouts: int = 0
    tool_time: float = 0.0
    hit_max_turns: bool = False
    over_length: bool = False                        # ended because the next tool text would pass the length cap
    env_reward: float | None = None

    def add(self, ids: list[int], sampled: bool, logps: torch.Tensor | None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        if self.logps is not None:
            if sampled and logps is None:
                self.logps = None
            else:
                self.logps.append(logps if sampled else torch.zeros(len(ids)))


@dataclass
class Episodes:
    prompt_ids: list[list[int]]          # per group (reset(row) may have added text)
    prompts: list[str]                   # the prompt text per group
    groups: list[list[Episode]]
    added: list[str | None] = field(default_factory=list)  # per group: the text reset(row) added (None: nothing)

    @property
    def completion_ids(self):
        return [[e.ids for e in g] for g in self.groups]

    @property
    def masks(self):
        return [[e.mask for e in g] for g in self.groups]

    @property
    def truncated(self):
        return [[e.truncated for e in g] for g in self.groups]

    def _sampling_logps(self):
        if any(e.logps is None for g in self.groups for e in g):
            return None
        return [[torch.cat(e.logps).float() if e.logps else torch.zeros(0) for e in g] for g in self.groups]

    # a property by a call, not as a decorator: mutmut (`make mutate`) does not mutate a decorated function
    sampling_logps = property(_sampling_logps)

    def sums(self) -> dict[str, float]:
        """Sums over this process's episodes (all-reduce them, then divide by ``episodes``)."""
        eps = [e for g in self.groups for e in g]
        return {"episodes": float(len(eps)), "turns": float(sum(e.turns for e in eps)),
                "tool_calls": float(sum(e.tool_calls for e in eps)),
                "tool_failures": float(sum(e.tool_failures for e in eps)),
                "tool_timeouts": float(sum(e.tool_timeouts for e in eps)),
                "tool_time": float(sum(e.tool_time for e in eps)),
                "used_tool": float(sum(e.tool_calls > 0 for e in eps)),
                "hit_max_turns": float(sum(e.hit_max_turns for e in eps)),
                "over_length": float(sum(e.over_length for e in eps)),
                "tool_tokens": float(sum(len(e.mask) - sum(e.mask) for e in eps))}


def episode_metrics(sums: dict[str, float], prefix: str = "episode/") -> dict[str, float]:
    """The logged metrics from all-reduced `Episodes.sums`."""
    n = max(sums["episodes"], 1.0)
    return {f"{prefix}turns_mean": sums["turns"] / n, f"{prefix}tool_calls_mean": sums["tool_calls"] / n,
            f"{prefix}tool_use_rate": sums["used_tool"] / n, f"{prefix}tool_failures": int(sums["tool_failures"]),
            f"{prefix}tool_timeouts": int(sums["tool_timeouts"]), f"{prefix}tool_time_s": sums["tool_time"],
            f"{prefix}max_turns_frac": sums["hit_max_turns"] / n, f"{prefix}over_length_frac": sums["over_length"] / n,
            f"{prefix}tool_tokens_mean": sums["tool_tokens"] / n}


@dataclass
class TurnLoop:
    """Runs episodes. ``generate``: a rollout backend's ``generate(prompt_ids, group_size, sampling, seed, suffixes)``;
    ``most(n)``: the largest ``n`` over every process (each process calls ``generate`` once per turn while any
    has a live episode, with stand-in prompts when it has fewer open groups, since ZeRO-3 decodes in lockstep);
    ``seed_for(turn)``: the sampling seed of a turn (None: the process's generator); ``prompt_for(row, text)``:
    (prompt text, ids) with ``text`` (what reset(row) returned) added to the row's last user turn."""

    generate: Callable
    tokenizer: object
    toolset: Toolset
    worker: ToolWorker
    settings: EpisodeSettings
    most: Callable[[int], int] = lambda n: n
    seed_for: Callable[[int], int | None] = lambda turn: None
    prompt_for: Callable | None = None

    def run(self, rows: list[dict], prompt_ids: list[list[int]], group_size: int, sampling: Sampling) -> Episodes:
        G = 1 if sampling.greedy else group_size
        prompts, prompt_ids, added = self._reset(rows, prompt_ids, G)
        groups = [[Episode() for _ in range(G)] for _ in rows]
        try:
            for turn in range(1, self.settings.max_turns + 1):
                if turn == 1:
                    out = self.generate(prompt_ids, G, sampling, self.seed_for(turn))
                    live = [(g, j) for g in range(len(rows)) for j in range(G)]
                    ids = [out.ids[g][j] for g, j in live]
                    cut = [out.truncated[g][j] for g, j in live]
                    lps = [out.logprobs[g][j] if out.logprobs is not None else None for g, j in live]
                else:  # each prompt with its live episodes as suffixes: the backend prefills the prompt once
                    live = [(g, j) for g in range(len(rows)) for j in range(G) if not groups[g][j].done]
                    open_ = sorted({g for g, _ in live})
                    width = self.most(len(open_))
                    if width == 0:
                        break
                    stand_in = [self.tokenizer.pad_token_id or 0]
                    suffixes = [[groups[g][j].ids for j in range(G) if not groups[g][j].done] for g in open_]
                    out = self.generate([prompt_ids[g] for g in open_] + [stand_in] * (width - len(open_)), 1, sampling,
                                        self.seed_for(turn), suffixes=suffixes + [[stand_in]] * (width - len(open_)))
                    ids = [t for group in out.ids for t in group][:len(live)]
                    cut = [c for group in out.truncated for c in group][:len(live)]
                    lps = [lp for group in out.logprobs for lp in group][:len(live)] if out.logprobs is not None \
                        else [None] * len(live)
                for (g, j), t_ids, t_cut, t_lp in zip(live, ids, cut, lps):
                    self._turn(groups[g][j], (g, j), t_ids, t_cut, t_lp, turn, len(prompt_ids[g]))
            if self.toolset.env_reward:
                for g, group in enumerate(groups):
                    for j, e in enumerate(group):
                        e.env_reward = self.worker.reward((g, j))
        finally:
            self.worker.drop_all()
        return Episodes(prompt_ids, prompts, groups, added)

    def _reset(self, rows, prompt_ids, G):
        """One environment per episode; the text reset(row) returns joins the group's prompt (it must be the same
        for the G episodes of a row: they share one prompt)."""
        prompts, added = [r["prompt"] for r in rows], [None] * len(rows)
        if self.toolset.environment is None:
            return prompts, prompt_ids, added
        prompt_ids = list(prompt_ids)
        for g, row in enumerate(rows):
            try:
                texts = {self.worker.reset((g, j), row) for j in range(G)}
            except RuntimeError as e:
                raise SetupError(f"rollout.environment: {e}") from None
            if len(texts) > 1:
                raise SetupError(f"rollout.environment={self.toolset.environment!r}: reset(row) returned different "
                                 "text for the episodes of one row; the G episodes of a prompt share it (draw any "
                                 "randomness from the row, not from a fresh random state)")
            text = texts.pop()
            if text and self.prompt_for is not None:
                prompts[g], prompt_ids[g] = self.prompt_for(row, text)
                added[g] = text
                st, n = self.settings, len(prompt_ids[g])
                if st.max_tokens and n + st.max_new_tokens > st.max_tokens:
                    raise SetupError(f"rollout.environment={self.toolset.environment!r}: with the text reset(row) "
                                     f"added, a prompt is {n} tokens; with rollout.max_new_tokens={st.max_new_tokens} "
                                     f"it does not fit engine.max_tokens_per_micro_batch={st.max_tokens} (planned at "
                                     "start, before any reset(row) ran): raise it, or return less text from reset(row)")
        return prompts, prompt_ids, added

    def _turn(self, e: Episode, key, ids: list[int], cut: bool, logps, turn: int, prompt_len: int) -> None:
        """One model turn of episode ``e``: append it, then end the episode or append what answers it. A turn cut at
        max_new_tokens ends a tool episode (its call cannot be trusted); a text-protocol environment still gets it
        and decides. ``truncated``: the episode's last turn was cut."""
        tok, ts, last = self.tokenizer, self.toolset, turn == self.settings.max_turns
        stopped = False
        if ts.protocol == "tools" and not last:
            ids, cut, logps, stopped = self._stop_at_call(ids, cut, logps)
        e.add(ids, True, logps)
        e.turns += 1
        e.truncated = cut
        body = ids if cut or stopped else ids[:-1]  # without the stop token the turn ended with
        e.segments.append({"role": "assistant", "text": tok.decode(ids, skip_special_tokens=True)})
        if ts.protocol == "text":
            res = self.worker.step(key, tok.decode(body, skip_special_tokens=True))
            if res.ok and res.text is None:  # the environment ends the episode: no observation, no call counted
                e.tool_time += res.seconds
                e.done = True
                return
            self._count(e, [res])
            messages = [{"role": "user", "content": clip_tokens(tok, res.text, self.settings.max_tool_tokens)}]
        else:
            fmt = formats.of(ts)
            calls = fmt.parse(tok.decode(body, skip_special_tokens=False), tok)
            if not calls or cut:
                e.done = True
                return
            if not last:  # on the last turn the call is not run: the episode ends on the model's turn
                results = [self._call(key, c) for c in calls]
                self._count(e, results)
                limit = self.settings.max_tool_tokens
                messages = fmt.results(calls, [clip_tokens(tok, r.text, limit) for r in results])
        if last:
            e.done, e.hit_max_turns = True, True
            return
        shown = formats.of(ts).template_tools(list(ts.schemas)) if ts.protocol == "tools" else None
        text = after_turn(tok, messages, chat=self.settings.chat, tools=shown,
                          ended_with=None if cut or stopped else tok.decode(ids[-1:], skip_special_tokens=False))
        written = tok(text, add_special_tokens=False)["input_ids"]
        st = self.settings
        cap = turn * (st.max_new_tokens + st.max_tool_tokens + st.overhead)  # within spec.max_completion_tokens
        if st.max_tokens:  # and the next turn within one micro-batch beside the prompt (reset(row) may have grown it)
            cap = min(cap, st.max_tokens - prompt_len - st.max_new_tokens)
        if st.max_new_tokens and len(e.ids) + len(written) > cap:
            e.done, e.over_length = True, True
            return
        e.add(written, False, None)
        role = "tool" if ts.protocol == "tools" else "user"  # hermes may render results as user turns: still tool text
        e.segments += [{"role": role, "text": m["content"], **({"name": m["name"]} if "name" in m else {})}
                       for m in messages]

    def _stop_at_call(self, ids: list[int], cut: bool, logps):
        """A format that stops at its first complete call (`formats.ToolFormat.call_end`, like a sampler's stop
        string): the turn's tokens up to the one that completes the call, the rest dropped (never trained on: the
        kept tokens are exactly what was sampled). Returns (ids, cut, logps, stopped)."""
        tok = self.tokenizer
        end = formats.of(self.toolset).call_end(tok.decode(ids, skip_special_tokens=False))
        if end is None:
            return ids, cut, logps, False
        k = next(k for k in range(1, len(ids) + 1) if len(tok.decode(ids[:k], skip_special_tokens=False)) >= end)
        if k == len(ids) and not cut:  # the call is the whole turn (then the stop token? none: no EOS after it)
            return ids, cut, logps, True
        return ids[:k], False, logps[:k] if logps is not None else None, True

    def _call(self, key, call) -> CallResult:
        if call.error is not None:
            return CallResult(f"Error: {call.error}", False, 0.0)
        ts = self.toolset
        if call.name in ts.functions:
            return self.worker.call(key, call.name, call.arguments, ts.functions[call.name])
        if call.name in ts.methods:
            return self.worker.call(key, call.name, call.arguments, None)
        known = ", ".join([*ts.functions, *ts.methods])
        return CallResult(f"Error: there is no tool named {call.name!r}; the tools are: {known}", False, 0.0)

    @staticmethod
    def _count(e: Episode, results: list[CallResult]) -> None:
        for r in results:
            e.tool_calls += 1
            e.tool_failures += int(not r.ok)
            e.tool_timeouts += int(r.timed_out)
            e.tool_time += r.seconds
