"""Multi-turn episodes: tool specs checked at start, tool calls parsed, the turn loop over a scripted backend (ids,
masks, metrics), failing and hanging tools, environments (tool methods, the plain-text protocol, reward())."""
from __future__ import annotations

import pytest
import torch

from grpo.errors import ConfigError, SetupError
from grpo.models import char_tokenizer
from grpo.rollout.base import Completions, Sampling
from grpo.rollout.episodes.chat import after_turn, parse_tool_calls
from grpo.rollout.episodes.spec import build_toolset, choose_format
from grpo.rollout.episodes.turns import EpisodeSettings, TurnLoop, episode_metrics
from grpo.rollout.episodes.worker import ToolWorker
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
