"""grpo/rollout/episodes/wiring.py: the columns episodes give the rewards, the rows as the model saw them, and the
environment's reward() as a reward function."""
from types import SimpleNamespace

from grpo.rollout.episodes.spec import Toolset
from grpo.rollout.episodes.turns import Episode, Episodes, EpisodeSettings
from grpo.rollout.episodes.wiring import (
    environment_reward,
    episode_columns,
    episode_records,
    seen_rows,
    turn_loop_maker,
    uses_chat,
)


def _episodes():
    a = Episode(ids=[1, 2], mask=[1, 0], segments=[{"role": "assistant", "text": "hi"}], turns=2, tool_calls=1,
                env_reward=0.5)
    b = Episode(ids=[3], mask=[1], turns=1)
    return Episodes(prompt_ids=[[9, 9, 7]], prompts=["P + seen"], groups=[[a, b]], added=["seen"])


def test_columns_and_records_follow_the_flat_order():
    eps = _episodes()
    cols = episode_columns(eps)
    assert cols["turns"] == [2, 1] and cols["tool_calls"] == [1, 0] and cols["env_reward"] == [0.5, None]
    assert episode_records(eps)[0][0]["turns"] == [{"role": "assistant", "text": "hi"}]


def test_rows_show_the_text_reset_added_and_the_environment_reward_is_passed_through():
    rows = seen_rows([{"prompt": "P", "prompt_ids": [9, 9], "answer": 1}], _episodes())
    assert rows == [{"prompt": "P + seen", "prompt_ids": [9, 9, 7], "answer": 1}]
    rf = environment_reward(Toolset("text", environment="m:Env", env_name="Env", env_reward=True))
    assert rf.name == "Env" and rf.weight == 1.0
    assert rf.fn(None, ["a", "b"], env_reward=[0.5, None]) == [0.5, None] and rf.fn(None, ["a"]) == [None]


class Tok:
    """A tokenizer with a chat template: ``[role]content|`` per turn, ``tools=N|`` first; one id per character, a BOS
    (id 1) first when asked for special tokens. What the template was shown is recorded."""

    chat_template = "x"
    pad_token_id = 0

    def __init__(self):
        self.shown = []

    def apply_chat_template(self, turns, tools=None, tokenize=True, add_generation_prompt=False):
        self.shown.append(tools)
        text = (f"tools={len(tools)}|" if tools else "") + "".join(f"[{m['role']}]{m['content']}|" for m in turns)
        return text + ("[assistant]" * add_generation_prompt) if not tokenize else None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] * add_special_tokens + [ord(c) for c in text]}


class Runtime:
    def __init__(self):
        self.asked = []

    def all_max(self, values):
        self.asked.append(values)
        return {k: v + 2.0 for k, v in values.items()}


SCHEMA = {"type": "function", "function": {"name": "f"}}


def test_uses_chat_needs_the_setting_and_a_template():
    assert uses_chat(SimpleNamespace(chat_template=True), Tok()) is True
    assert uses_chat(SimpleNamespace(chat_template=False), Tok()) is False
    assert uses_chat(SimpleNamespace(chat_template=True), SimpleNamespace(chat_template=None)) is False
    assert uses_chat(SimpleNamespace(chat_template=True), SimpleNamespace()) is False


def test_the_turn_loop_maker_renders_reset_text_into_the_prompt_and_asks_every_process_for_the_most():
    tok, runtime, settings, worker = Tok(), Runtime(), EpisodeSettings(3, 10, True), object()
    ts = Toolset("tools", {"f": "m:f"}, (), (SCHEMA,), tool_format="template")
    make = turn_loop_maker(settings, tok, ts, worker, SimpleNamespace(chat_template=True), runtime)
    generate = lambda *a, **k: None  # noqa: E731
    loop = make(generate)
    assert (loop.generate, loop.tokenizer, loop.toolset, loop.worker, loop.settings) == (generate, tok, ts, worker,
                                                                                         settings)
    assert loop.seed_for(1) is None and loop.seed_for(2) is None and make(generate, lambda t: 10 + t).seed_for(2) == 12
    got = loop.most(3)
    assert got == 5 and type(got) is int and runtime.asked == [{"n": 3.0}] and type(runtime.asked[0]["n"]) is float
    row = {"prompt_turns": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                            {"role": "user", "content": "go"}]}
    prompt, ids = loop.prompt_for(row, "seen")
    assert prompt == "tools=1|[user]Q|[assistant]A|[user]go\n\nseen|[assistant]" and ids == [ord(c) for c in prompt]
    assert tok.shown == [[SCHEMA]]
    hermes = Toolset("tools", {"f": "m:f"}, (), (SCHEMA,), tool_format="hermes", result_role="user")
    text = Toolset("text", environment="m:E", env_name="E")
    for other in (hermes, text):
        turn_loop_maker(settings, tok, other, worker, SimpleNamespace(chat_template=True), runtime)(generate) \
            .prompt_for(row, "seen")
    assert tok.shown == [[SCHEMA], None, None]  # hermes describes its tools in the system prompt
    plain = turn_loop_maker(settings, tok, ts, worker, SimpleNamespace(chat_template=False), runtime)(generate)
    assert plain.prompt_for(row, "x")[0] == "Q\n\nA\n\ngo\n\nx"


def test_seen_rows_change_only_the_rows_reset_added_text_to():
    eps = Episodes(prompt_ids=[[1, 2], [3, 4, 5], [6]], prompts=["a", "b + t", "c + u"], groups=[[], [], []],
                   added=[None, "t", "u"])
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "b"}]
    rows = [{"prompt": "a", "prompt_ids": [1, 2]}, {"prompt": "b", "prompt_ids": [3], "prompt_messages": messages},
            {"prompt": "c", "prompt_ids": [6], "prompt_messages": None}]
    out = seen_rows(rows, eps)
    assert out[0] is rows[0] and rows[1]["prompt"] == "b" and rows[1]["prompt_messages"] is messages
    assert out[1] == {"prompt": "b + t", "prompt_ids": [3, 4, 5], "prompt_messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "b\n\nt"}]}
    assert out[2] == {"prompt": "c + u", "prompt_ids": [6], "prompt_messages": None}
    empty = Episodes(prompt_ids=[[1]], prompts=["other"], groups=[[]], added=[""])
    assert seen_rows(rows[:1], empty)[0] is rows[0]
    assert seen_rows(rows[:1], Episodes(prompt_ids=[[1]], prompts=["other"], groups=[[]]))[0] is rows[0]


def test_every_column_and_record_of_every_episode():
    a = Episode(ids=[1], segments=[{"role": "assistant", "text": "a"}], turns=2, tool_calls=1, tool_failures=1,
                hit_max_turns=True, env_reward=0.5)
    b = Episode(turns=1)
    c = Episode(segments=[{"role": "assistant", "text": "c"}], turns=3, tool_calls=2, tool_failures=0)
    eps = Episodes(prompt_ids=[[1], [2]], prompts=["p", "q"], groups=[[a, b], [c]])
    assert episode_columns(eps) == {"turns": [2, 1, 3], "tool_calls": [1, 0, 2], "tool_failures": [1, 0, 0],
                                    "hit_max_turns": [True, False, False],
                                    "episode": [a.segments, [], c.segments], "env_reward": [0.5, None, None]}
    assert episode_records(eps) == [
        [{"turns": a.segments, "tool_calls": 1, "tool_failures": 1, "hit_max_turns": True},
         {"turns": [], "tool_calls": 0, "tool_failures": 0, "hit_max_turns": False}],
        [{"turns": c.segments, "tool_calls": 2, "tool_failures": 0, "hit_max_turns": False}]]


def test_the_environment_reward_names_its_class_and_method():
    rf = environment_reward(Toolset("text", environment="pkg.mod:Env", env_name="Env", env_reward=True))
    assert (rf.name, rf.weight, rf.spec, rf.kwargs, rf.timeout_s) == ("Env", 1.0, "pkg.mod:Env.reward", {}, 0.0)
    assert rf.fn(["p"], ["c", "d"], env_reward=(1.0, 0.0), turns=[1, 2]) == [1.0, 0.0]
