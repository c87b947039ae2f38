"""Multi-turn episodes: tool specs checked at start, tool calls parsed, the turn loop over a scripted backend (ids,
masks, metrics), failing and hanging tools, environments (tool methods, the plain-text protocol, reward())."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

# imported at collection so that mutmut's fork server holds it (each mutant's first tokenizer imports it: 0.8 s)
from transformers import PreTrainedTokenizerFast  # noqa: F401

from grpo.errors import ConfigError, SetupError
from grpo.models import char_tokenizer
from grpo.rollout.base import Completions, Sampling
from grpo.rollout.episodes.chat import after_turn, parse_tool_calls
from grpo.rollout.episodes.spec import build_toolset, choose_format
from grpo.rollout.episodes.turns import EpisodeSettings, TurnLoop, episode_metrics
from grpo.rollout.episodes.worker import CallResult, ToolWorker, as_text
from grpo.rollout.hf import flatten, regroup

F = "tests.tool_fixtures"
# a minimal chat template with tool support (Hermes-like: tools listed in the system turn, results as tool turns)
TEMPLATE = ("{% if tools %}[tools]{% for t in tools %}{{ t.function.name }};{% endfor %}<eos>{% endif %}"
            "{% for m in messages %}[{{ m.role }}]{{ m.content }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture
def tok():
    t = char_tokenizer()
    t.chat_template = TEMPLATE
    return t


# ------------------------------------------------------------------------------- start-up checks
@pytest.mark.parametrize("tools,env,message", [
    ([f"{F}:nope"], None, "has no 'nope'"),
    (["no_such_module_xyz:f"], None, "cannot import module 'no_such_module_xyz'"),
    ([f"{F}:undocumented"], None, "has no docstring"),
    ([f"{F}:untyped"], None, "cannot be shown to the model"),
    ([f"{F}:add", f"{F}:add"], None, "a second tool named 'add'"),
    ([], f"{F}:NoReset", "has no reset(row)"),
    ([], f"{F}:NeedsArgs", "must be callable without arguments"),
    ([f"{F}:add"], f"{F}:Echo", "plain-text protocol"),
])
def test_bad_tools_fail_at_start_with_one_line(tools, env, message):
    with pytest.raises(ConfigError) as e:
        build_toolset(tools, env)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_template_without_tool_support_is_refused_for_the_template_format(tok):
    ts = build_toolset([f"{F}:add"], None)
    assert choose_format(ts, "template", tok, True)[0].tool_format == "template"  # the test template shows tools
    plain = char_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ConfigError, match="has no tool support.*rollout.tool_format=hermes"):
        choose_format(ts, "template", plain, True)
    with pytest.raises(ConfigError, match="needs the model's chat template"):
        choose_format(ts, "template", char_tokenizer(), True)
    echo = build_toolset([], f"{F}:Echo")
    assert choose_format(echo, "template", char_tokenizer(), False) == (echo, None)  # text protocol: no format


def test_environment_methods_are_its_tools():
    ts = build_toolset([f"{F}:add"], f"{F}:Counter")
    assert ts.protocol == "tools" and ts.methods == ("increment",) and ts.env_name == "Counter" and ts.env_reward
    assert [s["function"]["name"] for s in ts.schemas] == ["add", "increment"]
    assert build_toolset([], f"{F}:Echo").protocol == "text"


def test_config_keys_are_checked(cfg_factory):
    assert cfg_factory({"rollout": {"tools": [f"{F}:add"], "max_turns": 3}}).rollout.tools == [f"{F}:add"]
    for key, value, message in [("tools", ["no_colon"], "rollout.tools"), ("environment", "x", "rollout.environment"),
                                ("max_turns", 0, "rollout.max_turns"), ("tool_timeout_s", 0, "rollout.tool_timeout_s")]:
        with pytest.raises(ConfigError, match=message):
            cfg_factory({"rollout": {key: value}})


# ------------------------------------------------------------------------------- parsing and rendering
def test_parse_tool_calls():
    one = parse_tool_calls('sure <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in one] == [("add", {"a": 1, "b": 2}, None)]
    two = parse_tool_calls('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"x": 1}}]'
                           '</tool_call>')
    assert [(c.name, c.arguments) for c in two] == [("a", {}), ("b", {"x": 1})]
    assert [c.name for c in parse_tool_calls('[TOOL_CALLS][{"name": "m", "arguments": "{\\"k\\": 2}"}]')] == ["m"]
    unclosed = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert unclosed[0].name == "add"
    bad = parse_tool_calls("<tool_call>{not json}</tool_call>")
    assert bad[0].error.startswith("the tool call is not valid JSON")
    assert parse_tool_calls("The answer is 42.") == []


def test_after_turn_renders_the_template_between_turns(tok):
    text = after_turn(tok, [{"role": "tool", "name": "add", "content": "3"}], chat=True, tools=None,
                      ended_with="<eos>")
    assert text == "[tool]3<eos>[assistant]"
    assert after_turn(tok, [{"role": "user", "content": "obs"}], chat=False, tools=None, ended_with=None) == "obs"


def test_long_tool_output_is_cut(tok):
    from grpo.rollout.episodes.chat import clip_tokens

    assert clip_tokens(tok, "x" * 50, 10) == "x" * 10 + " ...[cut]"
    assert clip_tokens(tok, "short", 10) == "short"


# ------------------------------------------------------------------------------- the turn loop
class Scripted:
    """A rollout backend whose model turns are scripted text: ``script(context_text, turn) -> reply``."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def __call__(self, prompt_ids, group_size, sampling, seed=None, suffixes=None):
        if suffixes is None:
            self.calls.append((len(prompt_ids), group_size))
            return self._replies(prompt_ids, group_size, sampling)
        self.calls.append(("suffixes", [len(s) for s in suffixes]))  # later turns: each prompt + suffix, one sample
        out = self._replies(flatten(prompt_ids, suffixes), 1, sampling)
        return Completions(*(regroup([g[0] for g in x], suffixes) for x in (out.ids, out.truncated)))

    def _replies(self, prompt_ids, group_size, sampling):
        ids, cut = [], []
        for p in prompt_ids:
            group, flags = [], []
            for j in range(group_size):
                reply = self.script(self.tok.decode(p), j)
                t = self.tok(reply, add_special_tokens=False)["input_ids"]
                truncated = len(t) > sampling.max_new_tokens
                group.append(t[:sampling.max_new_tokens] if truncated else t + [self.tok.eos_token_id])
                flags.append(truncated)
            ids.append(group)
            cut.append(flags)
        return Completions(ids, cut)


def _loop(tok, script, tools, env=None, max_turns=3, timeout=5.0, chat=True, settings=None, toolset=None):
    ts = toolset or build_toolset(tools, env)
    worker = ToolWorker(ts.environment, timeout)
    backend = Scripted(tok, script)

    def prompt_for(row, text):
        p = row["prompt"] + text
        return p, tok(p, add_special_tokens=False)["input_ids"]

    loop = TurnLoop(backend, tok, ts, worker, settings or EpisodeSettings(max_turns, 200, chat), prompt_for=prompt_for)
    return loop, backend, worker


def _run(rows, group_size, max_new_tokens, *loop_args, **loop_kw):
    """A turn loop built by `_loop` run over ``rows`` (its tool worker killed after): the episodes, the backend."""
    loop, backend, worker = _loop(*loop_args, **loop_kw)
    try:
        return loop.run(rows, [r["prompt_ids"] for r in rows], group_size, Sampling(max_new_tokens)), backend
    finally:
        worker.kill()


def _rows(tok, *prompts, **cols):
    return [{"prompt": p, "prompt_ids": tok(p, add_special_tokens=False)["input_ids"], **cols} for p in prompts]


def test_a_tool_call_runs_and_its_result_is_masked(tok):
    call = '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>'

    def script(context, j):
        return ("The answer is 42." if "[tool]42" in context else call) if j == 0 else "I know: 42."

    rows = _rows(tok, "[user]What is 20+22?<eos>[assistant]")
    eps, backend = _run(rows, 2, 80, tok, script, [f"{F}:add"])
    first, second = eps.groups[0]
    assert backend.calls == [(1, 2), ("suffixes", [1])]  # turn 1: the group from one prompt; turn 2: its live episode
    text = tok.decode(first.ids)
    assert text == call + "<eos>[tool]42<eos>[assistant]The answer is 42.<eos>"
    n = lambda t: len(tok(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    tool_part = "[tool]42<eos>[assistant]"
    assert first.mask == [1] * n(call + "<eos>") + [0] * n(tool_part) + [1] * n("The answer is 42.<eos>")
    assert (first.turns, first.tool_calls, first.tool_failures, first.hit_max_turns) == (2, 1, 0, False)
    assert (second.turns, second.tool_calls, second.mask) == (1, 0, [1] * len(second.ids))
    assert [s["role"] for s in first.segments] == ["assistant", "tool", "assistant"]
    m = episode_metrics(eps.sums())
    assert m["episode/turns_mean"] == 1.5 and m["episode/tool_use_rate"] == 0.5
    assert m["episode/tool_tokens_mean"] == n(tool_part) / 2


def test_failing_unknown_and_hanging_tools_become_messages(tok):
    calls = {0: '<tool_call>{"name": "broken", "arguments": {"x": 7}}</tool_call>',
             1: '<tool_call>{"name": "nosuch", "arguments": {}}</tool_call>',
             2: '<tool_call>{"name": "slow", "arguments": {"seconds": 30}}</tool_call>',
             3: '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'}

    def script(context, j):
        if "[tool]" in context:
            return "done"
        return calls[int(context.split("#")[1][0])]

    rows = _rows(tok, *[f"[user]#{k}<eos>[assistant]" for k in range(4)])
    eps, _ = _run(rows, 1, 80, tok, script, [f"{F}:add", f"{F}:broken", f"{F}:slow"], timeout=1.0)
    texts = [tok.decode(g[0].ids) for g in eps.groups]
    assert "[tool]Error: ValueError: cannot handle 7<eos>" in texts[0]
    assert "Error: there is no tool named 'nosuch'; the tools are: add, broken, slow" in texts[1]
    assert "[tool]Error: tool slow timed out after 1 s<eos>" in texts[2]
    assert "[tool]2<eos>" in texts[3]  # the worker came back after the kill
    assert [g[0].tool_failures for g in eps.groups] == [1, 1, 1, 0]
    assert [g[0].tool_timeouts for g in eps.groups] == [0, 0, 1, 0]
    assert all(g[0].turns == 2 and g[0].ids[-1] == tok.eos_token_id for g in eps.groups)
    assert 1.0 <= eps.groups[2][0].tool_time < 10


def test_max_turns_and_truncation_end_episodes(tok):
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    rows = _rows(tok, "[user]go<eos>[assistant]")
    eps, _ = _run(rows, 2, 80, tok, lambda c, j: call if j == 0 else "x" * 100, [f"{F}:add"], max_turns=3)
    looping, long = eps.groups[0]
    assert (looping.turns, looping.tool_calls, looping.hit_max_turns, looping.truncated) == (3, 2, True, False)
    assert looping.mask[-1] == 1  # the episode ends on the model's turn: its last call is not run
    assert (long.turns, long.truncated, long.hit_max_turns) == (1, True, False)
    assert episode_metrics(eps.sums())["episode/max_turns_frac"] == 0.5


def test_environment_tools_keep_state_and_reward(tok):
    call = '<tool_call>{"name": "increment", "arguments": {"by": %d}}</tool_call>'

    def script(context, j):  # episode 0 adds 5 once; episode 1 adds 6 twice
        if "[tool]" not in context:
            return call % (5 + j)
        return "stop" if context.count("[tool]") >= 1 + ('"by": 6' in context) else call % 6

    rows = _rows(tok, "[user]count<eos>", start=10)
    eps, _ = _run(rows, 2, 80, tok, script, [], env=f"{F}:Counter", max_turns=4)
    assert eps.prompts[0] == "[user]count<eos>The counter starts at 10."  # reset's text joins the prompt
    a, b = eps.groups[0]
    assert (a.tool_calls, a.env_reward, b.tool_calls, b.env_reward) == (1, 15.0, 2, 22.0)  # one instance each
    assert "[tool]16<eos>" in tok.decode(b.ids) and "[tool]22<eos>" in tok.decode(b.ids)


def test_text_protocol_with_observations(tok):
    def script(context, j):
        if "#r" in context and "obs" not in context and "Error" not in context:
            return "RAISE"
        return "a long turn" if "#c" in context else "hello"

    rows = _rows(tok, "p#a") + _rows(tok, "p#b", stop_at=1) + _rows(tok, "p#r") + _rows(tok, "p#c", stop_at=9)
    eps, _ = _run(rows, 1, 6, tok, script, [], env=f"{F}:Echo", chat=False, max_turns=5)
    a, b, r, c = (g[0] for g in eps.groups)
    # turns cut at max_new_tokens still go to step(): the environment decides; max_turns ends the episode
    assert tok.decode(c.ids).startswith("a long\nobs1: 6\na long\nobs2: 6\n")
    assert (c.turns, c.truncated, c.hit_max_turns, c.mask[-1]) == (5, True, True, 1)
    assert tok.decode(a.ids) == "hello<eos>\nobs1: 5\nhello<eos>\nobs2: 5\nhello<eos>"
    assert (a.turns, a.tool_calls, a.env_reward) == (3, 2, 3.0)
    assert (b.turns, b.tool_calls, b.mask) == (1, 0, [1] * len(b.ids))
    assert r.tool_failures == 1 and "Error: RuntimeError: step failed" in tok.decode(r.ids)


def test_a_hanging_step_is_killed_and_the_other_environments_survive(tok):
    rows = _rows(tok, "p#a") + _rows(tok, "p#s")
    eps, _ = _run(rows, 1, 80, tok, lambda c, j: "SLEEP" if "#s" in c and "Error" not in c else "hi", [],
                  env=f"{F}:Echo", chat=False, max_turns=4, timeout=1.0)
    a, s = (g[0] for g in eps.groups)
    # episode a's environment was replayed into the restarted worker: its turn count goes on from where it was
    assert tok.decode(a.ids) == "hi<eos>\nobs1: 2\nhi<eos>\nobs2: 2\nhi<eos>" and a.env_reward == 3.0
    assert s.tool_timeouts == 1 and "Error: step() timed out after 1 s" in tok.decode(s.ids)


def test_reset_text_must_be_the_same_for_a_group(tok, monkeypatch):
    loop, _, worker = _loop(tok, lambda c, j: "x", [], env=f"{F}:Counter")
    counter = iter(range(100))
    monkeypatch.setattr(worker, "reset", lambda key, row: f"t{next(counter)}")
    rows = _rows(tok, "p")
    with pytest.raises(SetupError, match="returned different text"):
        loop.run(rows, [r["prompt_ids"] for r in rows], 2, Sampling(8))
    worker.kill()


def test_sampler_logprobs_are_padded_with_zeros_for_tool_tokens(tok):
    from grpo.rollout.episodes.turns import Episode, Episodes

    e = Episode()
    e.add([5, 6], True, torch.tensor([-1.0, -2.0]))
    e.add([7, 8, 9], False, None)
    e.add([10], True, torch.tensor([-3.0]))
    got = Episodes([[1]], ["p"], [[e]]).sampling_logps[0][0]
    assert torch.equal(got, torch.tensor([-1.0, -2.0, 0.0, 0.0, 0.0, -3.0])) and e.mask == [1, 1, 0, 0, 0, 1]
    e.add([11], True, None)  # the hf backend has no log-probs of its own
    assert Episodes([[1]], ["p"], [[e]]).sampling_logps is None


def test_episodes_stay_within_the_planned_length(tok):
    """Tool text that would take an episode past `max_completion_tokens` (what the update's micro-batches were sized
    for) ends the episode instead: two calls per turn overrun a cap planned for one result per turn."""
    from types import SimpleNamespace

    from grpo.rollout.episodes.spec import max_completion_tokens

    call = '<tool_call>[{"name": "slow", "arguments": {"seconds": 0}}, {"name": "slow", "arguments": {"seconds": 0}}]'
    settings = EpisodeSettings(3, 2, True, max_new_tokens=120, overhead=2)
    rows = _rows(tok, "[user]go<eos>[assistant]")
    eps, _ = _run(rows, 1, 120, tok, lambda c, j: call + "</tool_call>", [f"{F}:slow"], settings=settings)
    e = eps.groups[0][0]
    cap = max_completion_tokens(SimpleNamespace(tools=["x"], environment=None, max_new_tokens=120, max_turns=3,
                                                max_tool_tokens=2), overhead=2)
    assert e.over_length and e.done and len(e.ids) <= cap and e.turns < 3
    assert episode_metrics(eps.sums())["episode/over_length_frac"] == 1.0


def test_text_reset_adds_is_counted_against_the_micro_batch(tok):
    """The start-up check (grpo/trainer/budget.py) cannot see the text reset(row) adds to a prompt; the turn loop counts
    it: an episode ends (over_length) before its next turn could pass engine.max_tokens_per_micro_batch beside the grown
    prompt, and a prompt that leaves no room for one turn stops with one line."""
    def run(brief, max_tokens):
        settings = EpisodeSettings(3, 8, False, max_new_tokens=10, overhead=0, max_tokens=max_tokens)
        rows = _rows(tok, "go", brief=brief)
        return _run(rows, 1, 10, tok, lambda c, j: "abc", [], f"{F}:Briefing", settings=settings)[0]

    free = run("x" * 40, 0)  # no budget given: three turns of 4 tokens with "ok" (2 tokens) between them
    assert free.groups[0][0].turns == 3 and len(free.prompt_ids[0]) == 42
    eps = run("x" * 40, 60)
    e = eps.groups[0][0]
    assert (e.turns, e.over_length, e.done) == (2, True, True)  # a third turn could reach 42 + 12 + 10 > 60
    assert len(eps.prompt_ids[0]) + len(e.ids) <= 60
    with pytest.raises(SetupError, match="a prompt is 57 tokens.*max_tokens_per_micro_batch=60") as err:
        run("x" * 55, 60)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------- the turn loop, in one process
# (a scripted backend and an in-process worker: what mutation testing runs; the tests above go through the real
# tool worker process)
class Worker:
    """The `ToolWorker` interface in this process: tools and environments called directly, every call taking
    ``seconds``; a tool named ``slow`` times out."""

    def __init__(self, environment=None, seconds=0.25):
        self.environment, self.seconds, self.envs, self.log, self.dropped = environment, seconds, {}, [], 0

    def reset(self, key, row):
        from grpo.objects import load_object

        self.log.append(("reset", key))
        self.envs[key] = load_object(self.environment, "env")()
        out = self.envs[key].reset(row)
        return None if out is None else str(out)

    def call(self, key, name, arguments, function):
        from grpo.objects import load_object

        self.log.append(("call", key, name, arguments, function))
        if name == "slow":
            return CallResult("Error: tool slow timed out after 1 s", False, 1.5, True)
        fn = load_object(function, "tool") if function is not None else getattr(self.envs[key], name)
        try:
            return CallResult(as_text(fn(**arguments)), True, self.seconds)
        except Exception as e:  # noqa: BLE001
            return CallResult(f"Error: {type(e).__name__}: {e}", False, self.seconds)

    def step(self, key, text):
        self.log.append(("step", key, text))
        try:
            out = self.envs[key].step(text)
        except Exception as e:  # noqa: BLE001
            return CallResult(f"Error: {type(e).__name__}: {e}", False, self.seconds)
        return CallResult(None if out is None else str(out), True, self.seconds)

    def reward(self, key):
        self.log.append(("reward", key))
        fn = getattr(self.envs.get(key), "reward", None)
        return None if fn is None else float(fn())

    def drop_all(self):
        self.dropped += 1
        self.envs.clear()


class Backend(Scripted):
    """`Scripted`, recording each call's prompts (as text), group size, seed and suffixes; with ``logps`` each
    sampled token's log-prob is -(its position in the turn + 1) / 10 (float64, as a sampler may give them); with
    ``stop`` a turn that is not cut ends with that text's tokens instead of EOS (a stop string, a stop token that is
    no special token)."""

    def __init__(self, tok, script, logps=False, stop=None):
        super().__init__(tok, script)
        self.logps, self.asked, self.stop = logps, [], stop

    def __call__(self, prompt_ids, group_size, sampling, seed=None, suffixes=None):
        self.asked.append(([self.tok.decode(p) for p in prompt_ids], group_size, seed,
                           None if suffixes is None else [[self.tok.decode(s) for s in ss] for ss in suffixes]))
        out = super().__call__(prompt_ids, group_size, sampling, seed, suffixes)
        if self.stop is not None:
            stop = self.tok(self.stop, add_special_tokens=False)["input_ids"]
            out.ids = [[t[:-1] + stop if not c else t for t, c in zip(g, cs)] for g, cs in zip(out.ids, out.truncated)]
        if self.logps:
            out.logprobs = [[-(torch.arange(len(t), dtype=torch.float64) + 1) / 10 for t in g] for g in out.ids]
        return out


def _in_process(tok, script, tools=(), env=None, settings=None, logps=False, tool_format="template", stop=None,
                **loop_kw):
    ts = build_toolset(list(tools), env)
    if tool_format != "template":
        ts = replace(ts, tool_format=tool_format, result_role="tool")
    backend, worker = Backend(tok, script, logps, stop), Worker(ts.environment)

    def prompt_for(row, text):
        p = row["prompt"] + text
        return p, tok(p, add_special_tokens=False)["input_ids"]

    loop = TurnLoop(backend, tok, ts, worker, settings or EpisodeSettings(3, 200, True), prompt_for=prompt_for,
                    **loop_kw)
    return loop, backend, worker


def _go(loop, tok, rows, group_size=1, max_new_tokens=80, **sampling):
    return loop.run(rows, [r["prompt_ids"] for r in rows], group_size, Sampling(max_new_tokens, **sampling))


ADD = '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>'


def test_later_turns_continue_the_live_episodes_with_stand_ins_for_the_other_processes(tok):
    """Turn 1 samples each group from its prompt; later turns pass the open groups' prompts with their live
    episodes as suffixes, one sample each, padded with stand-in prompts to the most groups any process has open;
    each turn has its own seed; the stand-ins' samples are dropped."""
    def script(context, j):
        if "#1" in context and "[tool]" not in context and j == 0:
            return ADD
        return "done"

    rows = _rows(tok, "[user]#0<eos>[assistant]", "[user]#1<eos>[assistant]")
    loop, backend, worker = _in_process(tok, script, [f"{F}:add"], most=lambda n: n + 1, seed_for=lambda t: 100 + t)
    tok.pad_token_id = 7
    eps = _go(loop, tok, rows, group_size=2)
    assert backend.asked[0] == ([r["prompt"] for r in rows], 2, 101, None)
    pad = tok.decode([7])
    assert backend.asked[1] == (["[user]#1<eos>[assistant]", pad], 1, 102, [[ADD + "<eos>[tool]42<eos>[assistant]"],
                                                                          [pad]])
    assert [[e.turns for e in g] for g in eps.groups] == [[1, 1], [2, 1]] and len(backend.asked) == 3
    assert backend.asked[2] == ([pad], 1, 103, [[pad]])  # nothing open here: stand-ins only, while another is live
    assert tok.decode(eps.groups[1][0].ids) == ADD + "<eos>[tool]42<eos>[assistant]done<eos>"
    assert worker.dropped == 1 and [e.env_reward for g in eps.groups for e in g] == [None] * 4
    assert ("reward", (0, 0)) not in worker.log
    tok.pad_token_id = None
    loop, backend, _ = _in_process(tok, script, [f"{F}:add"], most=lambda n: n + 1)
    _go(loop, tok, rows[1:])
    assert backend.asked[1][0][1] == tok.decode([0]) and backend.asked[1][2] is None


def test_the_loop_stops_when_no_process_has_an_open_group_and_greedy_samples_one(tok):
    rows = _rows(tok, "[user]a<eos>[assistant]", "[user]b<eos>[assistant]")
    loop, backend, worker = _in_process(tok, lambda c, j: "done", [f"{F}:add"])
    eps = _go(loop, tok, rows, group_size=3)
    assert len(backend.asked) == 1 and [len(g) for g in eps.groups] == [3, 3] and worker.dropped == 1
    loop, backend, _ = _in_process(tok, lambda c, j: "done", [f"{F}:add"])
    eps = _go(loop, tok, rows, group_size=3, greedy=True)
    assert backend.asked[0][1] == 1 and [len(g) for g in eps.groups] == [1, 1]
    assert eps.prompt_ids == [r["prompt_ids"] for r in rows] and eps.prompts == [r["prompt"] for r in rows]
    assert eps.added == [None, None]


def test_the_worker_forgets_every_episode_even_when_a_turn_fails(tok):
    def script(context, j):
        raise RuntimeError("backend failed")

    loop, _, worker = _in_process(tok, script, [f"{F}:add"])
    with pytest.raises(RuntimeError, match="backend failed"):
        _go(loop, tok, _rows(tok, "[user]a<eos>[assistant]"))
    assert worker.dropped == 1


def test_sampler_logprobs_follow_every_turn_and_tool_tokens_get_zeros(tok):
    def script(context, j):
        return "ok" if "[tool]" in context else ADD

    rows = _rows(tok, "[user]a<eos>[assistant]", "[user]b<eos>[assistant]")
    loop, _, _ = _in_process(tok, script, [f"{F}:add"], logps=True)
    eps = _go(loop, tok, rows)
    lps = eps.sampling_logps
    assert [[t.dtype for t in g] for g in lps] == [[torch.float32], [torch.float32]]
    n_call, n_tool = len(ADD) + 1, len(tok("[tool]42<eos>[assistant]", add_special_tokens=False)["input_ids"])
    for g in range(2):
        want = torch.cat([-(torch.arange(n_call) + 1) / 10, torch.zeros(n_tool), -(torch.arange(3) + 1) / 10])
        assert torch.allclose(lps[g][0], want.float())
    loop, _, _ = _in_process(tok, script, [f"{F}:add"])
    assert _go(loop, tok, rows).sampling_logps is None


def test_reset_text_joins_its_groups_prompt_and_must_fit_the_micro_batch(tok):
    rows = _rows(tok, "go", brief="xyz") + _rows(tok, "on", brief="")
    ids = [r["prompt_ids"] for r in rows]
    loop, backend, worker = _in_process(tok, lambda c, j: "abc", env=f"{F}:Briefing",
                                        settings=EpisodeSettings(1, 8, False))
    eps = loop.run(rows, ids, 2, Sampling(10))
    assert eps.prompts == ["goxyz", "on"] and eps.added == ["xyz", None]
    assert eps.prompt_ids == [tok("goxyz", add_special_tokens=False)["input_ids"], ids[1]]
    assert ids == [r["prompt_ids"] for r in rows]  # the caller's list is not changed
    assert backend.asked[0][0] == ["goxyz", "on"]
    assert [k for what, k, *_ in worker.log if what == "reset"] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    loop.prompt_for = None  # no way to render it: the prompts stay as they are
    assert loop.run(rows, ids, 1, Sampling(10)).added == [None, None]
    for limit, fits in ((15, True), (14, False)):  # a prompt of 5 tokens and 10 new tokens
        loop, _, _ = _in_process(tok, lambda c, j: "abc", env=f"{F}:Briefing",
                                 settings=EpisodeSettings(1, 8, False, max_new_tokens=10, max_tokens=limit))
        if fits:
            assert loop.run(rows, ids, 1, Sampling(10)).prompts[0] == "goxyz"
        else:
            with pytest.raises(SetupError, match="a prompt is 5 tokens"):
                loop.run(rows, ids, 1, Sampling(10))
    loop, _, worker = _in_process(tok, lambda c, j: "abc", env=f"{F}:Briefing")
    worker.reset = lambda key, row: (_ for _ in ()).throw(RuntimeError("Briefing reset(row) failed: KeyError"))
    with pytest.raises(SetupError, match=r"^rollout.environment: Briefing reset\(row\) failed: KeyError$"):
        loop.run(rows, ids, 1, Sampling(10))


def test_the_text_protocol_sends_each_turn_without_its_stop_token_and_ends_when_step_says(tok):
    rows = _rows(tok, "p#a") + _rows(tok, "p#c", stop_at=2) + _rows(tok, "p#r")

    def script(context, j):
        if "#r" in context and "Erro" not in context:
            return "RAISE"
        return "a long turn" if "#c" in context else "hello"

    settings = EpisodeSettings(5, 4, False)
    loop, _, worker = _in_process(tok, script, env=f"{F}:Echo", settings=settings)
    a, c, r = (g[0] for g in _go(loop, tok, rows, max_new_tokens=6).groups)
    steps = [(k, text) for what, k, *text in worker.log if what == "step" for text in text]
    assert steps[:3] == [((0, 0), "hello"), ((1, 0), "a long"), ((2, 0), "RAISE")]  # a cut turn is sent whole
    assert tok.decode(a.ids) == "hello<eos>\nobs ...[cut]hello<eos>\nobs ...[cut]hello<eos>"  # 4 tokens a result
    assert a.segments == [{"role": "assistant", "text": "hello"}, {"role": "user", "text": "\nobs ...[cut]"},
                          {"role": "assistant", "text": "hello"}, {"role": "user", "text": "\nobs ...[cut]"},
                          {"role": "assistant", "text": "hello"}]
    assert (a.turns, a.tool_calls, a.tool_failures, a.done, a.truncated, a.hit_max_turns) == (3, 2, 0, True, False,
                                                                                              False)
    assert a.tool_time == 0.75  # the step that ended the episode took its time too, but is no call
    assert (c.turns, c.tool_calls, c.truncated) == (2, 1, True) and c.mask[-1] == 1
    assert (r.tool_failures, r.tool_calls, r.turns) == (1, 2, 3) and "RAISE<eos>Erro ...[cut]hello" in tok.decode(r.ids)
    assert worker.log[-3:] == [("reward", (0, 0)), ("reward", (1, 0)), ("reward", (2, 0))]
    assert (a.env_reward, c.env_reward) == (3.0, 2.0)


def test_each_call_of_a_turn_is_answered_and_counted(tok, monkeypatch):
    """Functions run with their spec, environment methods without; a call that did not parse and an unknown tool are
    answered with an error (no worker call, no time); failures, timeouts and the workers' seconds are counted; the
    results (clipped to max_tool_tokens) are tool turns with the call's name; the template is shown the tools."""
    from grpo.rollout.episodes import turns

    shown, real = [], turns.after_turn
    monkeypatch.setattr(turns, "after_turn", lambda *a, **k: shown.append(k["tools"]) or real(*a, **k))
    first = ('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "nosuch", "arguments": {}}]'
             '</tool_call><tool_call>{bad}</tool_call><tool_call>{"name": "increment", "arguments": {"by": 2}}'
             '</tool_call><tool_call>{"name": "slow", "arguments": {"seconds": 9}}</tool_call>'
             '<tool_call>{"name": "slow", "arguments": {"seconds": 8}}</tool_call>')

    def script(context, j):
        return "fine" if "[tool]" in context else first

    rows = _rows(tok, "[user]go<eos>[assistant]", start=5)
    loop, _, worker = _in_process(tok, script, [f"{F}:add", f"{F}:slow"], env=f"{F}:Counter",
                                  settings=EpisodeSettings(3, 12, True))
    e = _go(loop, tok, rows, max_new_tokens=400).groups[0][0]
    calls = [c[1:] for c in worker.log if c[0] == "call"]
    assert calls == [((0, 0), "add", {"a": 1, "b": 2}, f"{F}:add"), ((0, 0), "increment", {"by": 2}, None),
                     ((0, 0), "slow", {"seconds": 9}, f"{F}:slow"), ((0, 0), "slow", {"seconds": 8}, f"{F}:slow")]
    assert (e.tool_calls, e.tool_failures, e.tool_timeouts, e.tool_time, e.turns) == (6, 4, 2, 3.5, 2)

    def clip(text):  # one token a character: max_tool_tokens=12
        return text[:12] + " ...[cut]" if len(text) > 12 else text

    assert [(s["role"], s.get("name"), s["text"]) for s in e.segments[1:6]] == [
        ("tool", "add", "3"), ("tool", "nosuch", clip("Error: there is no tool named 'nosuch'")),
        ("tool", "", clip("Error: the tool call is not valid JSON")), ("tool", "increment", "7"),
        ("tool", "slow", clip("Error: tool slow timed out after 1 s"))]
    assert e.env_reward == 7.0 and shown == [list(loop.toolset.schemas)]
    unknown = TurnLoop._call(loop, (0, 0), parse_tool_calls('<tool_call>{"name": "x"}</tool_call>')[0])
    assert (unknown.text, unknown.ok, unknown.seconds) == (
        "Error: there is no tool named 'x'; the tools are: add, slow, increment", False, 0.0)
    bad = TurnLoop._call(loop, (0, 0), parse_tool_calls("<tool_call>{bad}</tool_call>")[0])
    assert (bad.text, bad.ok, bad.seconds, bad.timed_out) == (
        "Error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at character 1)",
        False, 0.0, False)
    hermes, _, _ = _in_process(tok, script, [f"{F}:add"], tool_format="hermes")
    _go(hermes, tok, rows, max_new_tokens=400)
    assert len(shown) == 2 and shown[-1] is None  # hermes describes the tools in the system prompt


def test_a_cut_or_a_last_turn_ends_the_episode_without_running_its_call(tok):
    rows = _rows(tok, "[user]go<eos>[assistant]")
    loop, _, worker = _in_process(tok, lambda c, j: ADD if j == 0 else ADD + "x" * 50, [f"{F}:add"],
                                  settings=EpisodeSettings(2, 200, True))
    looping, cut = _go(loop, tok, rows, group_size=2, max_new_tokens=len(ADD) + 10).groups[0]
    assert [c[1] for c in worker.log if c[0] == "call"] == [(0, 0)]  # the last turn's call is not run
    assert (looping.turns, looping.tool_calls, looping.hit_max_turns, looping.done, looping.mask[-1]) == \
        (2, 1, True, True, 1)
    assert (cut.turns, cut.tool_calls, cut.truncated, cut.hit_max_turns, cut.done) == (1, 0, True, False, True)
    answered, _, _ = _in_process(tok, lambda c, j: "no call", [f"{F}:add"])
    e = _go(answered, tok, rows).groups[0][0]
    assert (e.turns, e.done, e.hit_max_turns, e.truncated, e.segments) == (
        1, True, False, False, [{"role": "assistant", "text": "no call"}])


def test_a_format_that_stops_at_its_call_keeps_the_turn_up_to_the_call(tok):
    """pythonic's first complete call ends the turn (what the model wrote after it is dropped, with its
    log-probs): no stop token ended it, so the tool text follows the call directly; a cut turn whose call is complete
    is not truncated: the call runs."""
    call = "add(a=1, b=2)"
    rows = _rows(tok, "[user]go<eos>[assistant]")
    loop, _, _ = _in_process(tok, lambda c, j: "fine" if "[tool]" in c else call + " and more", [f"{F}:add"],
                             tool_format="pythonic", logps=True)
    e = _go(loop, tok, rows).groups[0][0]
    assert tok.decode(e.ids) == call + "<eos>[tool]3<eos>[assistant]fine<eos>"
    assert e.mask[:len(call) + 1] == [1] * len(call) + [0] and e.segments[0] == {"role": "assistant", "text": call}
    assert torch.allclose(torch.cat(e.logps)[:len(call)].float(), -(torch.arange(len(call)) + 1).float() / 10)
    assert len(torch.cat(e.logps)) == len(e.ids)
    loop, _, _ = _in_process(tok, lambda c, j: "fine" if "[tool]" in c else call + "xx", [f"{F}:add"],
                             tool_format="pythonic")
    e = _go(loop, tok, rows, max_new_tokens=len(call)).groups[0][0]
    assert (e.turns, e.tool_calls, e.truncated) == (2, 1, False) and tok.decode(e.ids).startswith(call + "<eos>[tool]3")
    loop, _, _ = _in_process(tok, lambda c, j: "fine" if "[tool]" in c else call + "xx", [f"{F}:add"],
                             tool_format="pythonic", settings=EpisodeSettings(1, 200, True))
    e = _go(loop, tok, rows).groups[0][0]  # the last turn is kept whole: its call is not run
    assert tok.decode(e.ids) == call + "xx<eos>" and e.hit_max_turns


def test_tool_text_that_would_pass_the_planned_length_ends_the_episode_at_the_bound(tok):
    rows = _rows(tok, "[user]go<eos>[assistant]")
    first = len(ADD) + 1 + len(tok("[tool]42<eos>[assistant]", add_special_tokens=False)["input_ids"])

    def run(**k):
        loop, _, _ = _in_process(tok, lambda c, j: "ok" if "[tool]" in c else ADD, [f"{F}:add"],
                                 settings=EpisodeSettings(3, 2, True, **k))
        return _go(loop, tok, rows, max_new_tokens=80).groups[0][0]

    # turn 1's cap: 1 * (max_new_tokens + max_tool_tokens + overhead)
    assert not run(max_new_tokens=80, overhead=first - 82).over_length
    e = run(max_new_tokens=80, overhead=first - 83)
    assert (e.over_length, e.done, e.turns, len(e.ids), e.segments[-1]["role"]) == (True, True, 1, len(ADD) + 1,
                                                                                    "assistant")
    assert not run(max_new_tokens=0, overhead=0).over_length  # no plan: no cap
    # with engine.max_tokens_per_micro_batch: the prompt and the next turn beside the episode
    prompt = len(rows[0]["prompt_ids"])
    assert not run(max_new_tokens=80, max_tokens=first + prompt + 80).over_length
    assert run(max_new_tokens=80, max_tokens=first + prompt + 79).over_length
    assert not run(max_new_tokens=80, overhead=first - 82, max_tokens=10 ** 6).over_length


def test_sums_and_metrics_of_every_counter():
    def ep(**k):
        return Episode(**k)

    from grpo.rollout.episodes.turns import Episode, Episodes

    groups = [[ep(turns=2, tool_calls=3, tool_failures=1, tool_timeouts=1, tool_time=0.5, hit_max_turns=True,
                  mask=[1, 0, 0, 1]), ep(turns=1, mask=[1])],
              [ep(turns=4, tool_calls=1, tool_time=0.25, over_length=True, mask=[1, 0, 1], truncated=True)]]
    eps = Episodes([[1], [2]], ["p", "q"], groups)
    sums = eps.sums()
    assert sums == {"episodes": 3.0, "turns": 7.0, "tool_calls": 4.0, "tool_failures": 1.0, "tool_timeouts": 1.0,
                    "tool_time": 0.75, "used_tool": 2.0, "hit_max_turns": 1.0, "over_length": 1.0, "tool_tokens": 3.0}
    assert all(type(v) is float for v in sums.values())
    m = episode_metrics(sums, prefix="x/")
    assert m == {"x/turns_mean": 7 / 3, "x/tool_calls_mean": 4 / 3, "x/tool_use_rate": 2 / 3, "x/tool_failures": 1,
                 "x/tool_timeouts": 1, "x/tool_time_s": 0.75, "x/max_turns_frac": 1 / 3, "x/over_length_frac": 1 / 3,
                 "x/tool_tokens_mean": 1.0}
    assert type(m["x/tool_failures"]) is int and type(m["x/tool_timeouts"]) is int
    assert episode_metrics(Episodes([], [], []).sums())["episode/turns_mean"] == 0.0  # no episode: no division by 0
    assert episode_metrics({**sums, "episodes": 0.5})["episode/turns_mean"] == 7.0
    assert eps.completion_ids == [[[], []], [[]]] and eps.masks == [[[1, 0, 0, 1], [1]], [[1, 0, 1]]]
    assert eps.truncated == [[False, False], [True]]
    e = Episode()
    e.add([1, 2], True, torch.tensor([-1.0, -2.0], dtype=torch.float64))
    assert Episodes([[1]], ["p"], [[e, Episode()]]).sampling_logps[0][1].shape == (0,)
    assert Episodes([[1]], ["p"], [[e]]).sampling_logps[0][0].dtype == torch.float32
    e.add([3], False, torch.tensor([-9.0]))  # a tool's tokens get zeros whatever is passed
    assert torch.equal(torch.cat(e.logps), torch.tensor([-1.0, -2.0, 0.0], dtype=torch.float64))
    assert e.mask == [1, 1, 0] and e.ids == [1, 2, 3]
    none = Episode(logps=None)
    none.add([1], True, torch.tensor([-1.0]))
    assert none.logps is None and none.mask == [1]


def test_what_the_environment_and_the_parsers_read_of_a_turn(tok):
    """step() reads the turn without the token it stopped at and without special tokens; the text protocol's
    observations are user turns; a tool format parses the turn with its special tokens (Qwen's <tool_call> is one),
    asking the tokenizer's own parser first; the text between turns is tokenized without special tokens."""
    from tokenizers import processors

    rows = _rows(tok, "p")
    loop, _, worker = _in_process(tok, lambda c, j: "he<bos>llo", env=f"{F}:Echo", stop="\n",
                                  settings=EpisodeSettings(2, 50, False))
    e = _go(loop, tok, rows).groups[0][0]
    assert [text for what, _, *text in worker.log if what == "step" for text in text] == ["hello", "hello"]
    assert e.segments[0] == {"role": "assistant", "text": "hello\n"}
    loop, _, _ = _in_process(tok, lambda c, j: "hello <<<", env=f"{F}:Echo", settings=EpisodeSettings(2, 50, True))
    e = _go(loop, tok, rows, max_new_tokens=7).groups[0][0]  # cut after "<": no stop token to take from the text
    assert tok.decode(e.ids) == "hello <<eos>[user]\nobs1: 7\n<eos>[assistant]hello <" and e.ids[7] == tok.eos_token_id
    assert e.segments[1] == {"role": "user", "text": "\nobs1: 7\n"}

    special = char_tokenizer()
    special.chat_template = TEMPLATE
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    special._tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    loop, _, worker = _in_process(special, lambda c, j: "ok" if "[tool]" in c else ADD, [f"{F}:add"])
    e = _go(loop, special, _rows(special, "[user]go<eos>[assistant]")).groups[0][0]
    assert e.tool_calls == 1 and special.decode(e.ids) == ADD + "<eos>[tool]42<eos>[assistant]ok<eos>"
    assert special.bos_token_id not in e.ids  # the tool text has no BOS of its own

    own = char_tokenizer()
    own.chat_template = TEMPLATE
    own.response_template = {"x": 1}
    own.parse_response = lambda text, prefix="": {"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 1}}]
                                                  if text == "CALL" else []}
    loop, _, _ = _in_process(own, lambda c, j: "ok" if "[tool]" in c else "CALL", [f"{F}:add"])
    assert own.decode(_go(loop, own, _rows(own, "[user]go<eos>[assistant]")).groups[0][0].ids) == \
        "CALL<eos>[tool]2<eos>[assistant]ok<eos>"


def test_the_end_of_a_call_is_found_in_the_turns_tokens(tok):
    """pythonic's call end is a position in the turn's text with its special tokens; the turn is kept up to the
    first token that reaches it (one token may hold the whole call); a turn that is exactly the call, ended by a
    stop string (no stop token kept), is kept whole."""
    call = "add(a=1, b=2)"
    rows = _rows(tok, "[user]go<eos>[assistant]")

    def run(t, reply, **k):
        loop, _, _ = _in_process(t, lambda c, j: "fine" if "[tool]" in c else reply, [f"{F}:add"],
                                 tool_format="pythonic", **k)
        return _go(loop, t, rows).groups[0][0]

    e = run(tok, "<bos>" + call + " more")
    assert tok.decode(e.ids).startswith("<bos>" + call + "<eos>[tool]3<eos>") and e.tool_calls == 1
    whole = char_tokenizer()
    whole.chat_template = TEMPLATE
    whole.add_tokens([call])
    e = run(whole, call + " more")
    assert e.ids[0] == whole.convert_tokens_to_ids(call) and e.mask[:2] == [1, 0] and e.tool_calls == 1
    e = run(tok, call, stop="")
    assert tok.decode(e.ids).startswith(call + "<eos>[tool]3<eos>") and e.tool_calls == 1
