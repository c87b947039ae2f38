"""grpo/trainer/evaluate.py: held-out evaluation through the run's explicit greedy backend; below, `evaluate_rows` and
its parts over stand-ins (no model, no run: the unit tests `make mutate` selects)."""
from types import SimpleNamespace

import pytest

from grpo.errors import SetupError
from grpo.rollout.base import Completions, Sampling
from grpo.trainer import evaluate as ev
from grpo.trainer.build import build_run
from grpo.trainer.evaluate import evaluate


class Greedy:
    name = "hf"

    def __init__(self, tokenizer):
        self.tok, self.asked = tokenizer, []

    def generate(self, prompt_ids, group_size, sampling, seed=None, suffixes=None):
        self.asked.append((len(prompt_ids), group_size, sampling.greedy, sampling.max_new_tokens))
        ids = self.tok("7", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return Completions([[list(ids)] for _ in prompt_ids], [[False] for _ in prompt_ids])


def test_every_held_out_prompt_once_greedy_and_scored(cfg_factory, capsys):
    run = build_run(cfg_factory({"data": {"num_eval": 3}, "trainer": {"eval_max_new_tokens": 5}}))
    try:
        run.eval_backend = fake = Greedy(run.tokenizer)
        out = evaluate(run, "before")
        assert fake.asked == [(3, 1, True, 5)]
        assert out["format"] == 1.0 and set(out) >= {"reward_mean", "completion_len_mean", "accuracy", "format"}
        assert "held-out accuracy (before, 3 prompts, greedy)" in capsys.readouterr().err
    finally:
        run.close()


class Crafted:
    """Through the backend interface, as any backend (vLLM included) is called: for a prompt "What is X + Y?" the four
    samples answer (a = X+Y) a, a+1, a+1, no number when a is even; a, a, a+1, no number when it is odd."""
    name = "vllm"

    def __init__(self, tokenizer):
        self.tok, self.asked = tokenizer, []

    def generate(self, prompt_ids, group_size, sampling, seed=None, suffixes=None):
        import re

        self.asked.append((len(prompt_ids), group_size, sampling.greedy, sampling.temperature, seed))
        out = []
        for ids in prompt_ids:
            x, y = map(int, re.findall(r"\d+", self.tok.decode(ids))[:2])
            a = x + y
            texts = [str(a), str(a + 1), str(a + 1), "none"] if a % 2 == 0 else [str(a), str(a), str(a + 1), "none"]
            out.append([self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for t in texts])
        return Completions(out, [[False] * 4 for _ in prompt_ids])


def test_sampled_metrics_of_every_set_by_hand(cfg_factory, capsys):
    """n=4 at temperature 0.8. Even a (one right, the majority wrong): pass@1 = 1/4, pass@2 = 1 - C(3,2) / C(4,2) = 1/2,
    pass@4 = 1; maj@1 = 1/4, maj@2 = (2 ties worth 1/2 + right with no answer) / 6 = 1/3, maj@4 = 0; mean@4 = 1/4.
    Odd a (two right): pass@1 = 1/2, pass@2 = 1 - 1/6, pass@4 = 1; maj@1 = 1/2, maj@2 = (1 + 2 ties of 1/2 + 2) / 6,
    maj@4 = 1; mean@4 = 1/2. Each set averages its prompts; the held-out split keeps its names, the set has its own."""
    from grpo.trainer.evaluate import set_seed

    run = build_run(cfg_factory({"data": {"num_eval": 3}, "evaluation": {
        "n": 4, "temperature": 0.8, "k": [1, 2, 4], "sets": [{"name": "more", "source": "builtin:arithmetic",
                                                              "num": 3, "seed": 3}]}}))
    try:
        run.eval_backend = fake = Crafted(run.tokenizer)
        out = evaluate(run, "before")
        even = {"mean@4": 1 / 4, "pass@1": 1 / 4, "pass@2": 1 / 2, "pass@4": 1.0, "maj@1": 1 / 4, "maj@2": 1 / 3,
                "maj@4": 0.0, "accuracy": 1 / 4}
        odd = {"mean@4": 1 / 2, "pass@1": 1 / 2, "pass@2": 5 / 6, "pass@4": 1.0, "maj@1": 1 / 2, "maj@2": 2 / 3,
               "maj@4": 1.0, "accuracy": 1 / 2}
        for prefix, rows in (("", run.splits.eval), ("more/", run.splits.sets["more"])):
            tables = [odd if int(r["answer"]) % 2 else even for r in rows]
            assert even in tables and odd in tables, "the test needs both kinds of prompt"
            for k in even:
                want = sum(t[k] for t in tables) / len(tables)
                assert abs(out[prefix + k] - want) < 1e-9, (prefix + k, out[prefix + k], want)
        assert fake.asked == [(3, 4, False, 0.8, set_seed(0, 0, name)) for name in ("held-out", "more")]
        evaluate(run, "after")
        assert fake.asked[2:] == fake.asked[:2]  # the same prompts and seeds at every evaluation
        err = capsys.readouterr().err
        assert "held-out accuracy (before, 3 prompts, n=4 at temperature 0.8): " in err
        assert "more accuracy (before, 3 prompts, n=4 at temperature 0.8)" in err
    finally:
        run.close()


def test_maj_at_k_absent_where_the_reward_has_no_answer(cfg_factory):
    run = build_run(cfg_factory({"data": {"num_eval": 2}, "evaluation": {
        "n": 4, "temperature": 0.8, "correct_reward": "format", "threshold": 0.9}}))
    try:
        run.eval_backend = Crafted(run.tokenizer)
        out = evaluate(run, "before")
        assert out["pass@1"] == 0.75 and out["pass@4"] == 1.0 and not any(k.startswith("maj@") for k in out)
        assert out["mean@4"] == out["format"] and out["accuracy"] < out["mean@4"]  # mean@n of the correct reward
    finally:
        run.close()


# ---- over stand-ins (no model, no run): what `evaluate_rows` asks of the backend, the scoring and the runtime -------


class Backend:
    desc = None

    def __init__(self):
        self.asked = []

    def generate(self, prompt_ids, n, sampling, seed=None):
        self.asked.append((self.desc, list(prompt_ids), n, sampling, seed))
        return Completions([[[p[0], 9]] * n for p in prompt_ids], [[p[0] % 2 == 1] * n for p in prompt_ids])


class Runtime:
    def __init__(self, rank=0, world_size=1):
        self.rank, self.world_size, self.is_main, self.reduced = rank, world_size, rank == 0, []

    def all_reduce(self, sums):
        self.reduced.append(dict(sums))
        return {k: v * self.world_size for k, v in sums.items()}


def _run(rows, rank=0, world_size=1, sampling=None, n=1, sets=None, rewards=("accuracy", "format"), **evaluation):
    s = SimpleNamespace(sampling=sampling, max_new_tokens=5, seed=7, n=n, ks=[1, 2], threshold=0.5,
                        correct_reward=None, **evaluation)
    return SimpleNamespace(settings=SimpleNamespace(evaluation=s), runtime=Runtime(rank, world_size),
                           eval_backend=Backend(), splits=SimpleNamespace(eval=rows, sets=sets or {}),
                           sampler=SimpleNamespace(turn_loop=None, rewards=[
                               SimpleNamespace(name=r, spec=r, kwargs={"mark": "!"}) for r in rewards]),
                           tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: f"{ids[0]}" + (
                               "" if skip_special_tokens is True else "<eos>")))


class Calls(list):
    samplers: list

    def __init__(self):
        super().__init__()
        self.samplers = []


@pytest.fixture
def scored(monkeypatch):
    """score_groups and score_stats as stand-ins: what was scored, and the sums' stats as they were reduced."""
    got = Calls()

    def score_groups(sampler, rows, comps, trunc, extra):
        got.append((rows, comps, trunc, extra))
        got.samplers.append(sampler)
        n = sum(len(g) for g in comps)
        scores = [{"accuracy": float(g[0][0] % 3 == 0), "format": 1.0} for g in comps for _ in g]
        return None, scores, {"n": float(n), "len": 2.0 * n}

    monkeypatch.setattr(ev, "score_groups", score_groups)
    monkeypatch.setattr(ev, "score_stats", lambda sums: {"reward_mean": sums["n"], "completion_len_mean": sums["len"],
                                                          "reward/accuracy": 0.25, "reward/format": None, "x": 1})
    return got


def _rows(n):
    return [{"prompt_ids": [i], "answer": str(i)} for i in range(n)]


def test_each_rank_decodes_its_share_padded_to_the_longest_and_scores_only_its_own(scored, capsys):
    rows = _rows(5)
    run = _run(rows, rank=1, world_size=2)
    out = ev.evaluate_rows(run, rows, "before", "held-out")
    (desc, prompts, n, sampling, seed), = run.eval_backend.asked
    assert (desc, prompts, n, sampling, seed) == ("eval before", [[1], [3], [3]], 1, Sampling(5, greedy=True), None)
    (shard, comps, trunc, extra), = scored
    assert shard == [rows[1], rows[3]] and comps == [[[1, 9]], [[3, 9]]] and trunc == [[True], [True]]
    assert extra is None and scored.samplers == [run.sampler]  # no turn loop: no per-sample columns of episodes
    assert run.runtime.reduced == [{"n": 2.0, "len": 4.0}]
    assert out == {"reward_mean": 4.0, "completion_len_mean": 8.0, "accuracy": 0.25, "format": None}
    assert capsys.readouterr().err == ""  # rank 1 says nothing
    run = _run(rows[:2], rank=0, world_size=2)
    ev.evaluate_rows(run, rows[:2], "after", "held-out")  # as many prompts as ranks: one each, no padding
    assert run.eval_backend.asked[0][1] == [[0]]
    with pytest.raises(SetupError, match="evaluation set held-out has 1 prompts"):
        ev.evaluate_rows(_run(rows[:1], world_size=2), rows[:1], "after", "held-out")


def test_the_main_rank_says_what_it_evaluates_and_the_result(scored, capsys):
    rows = _rows(3)
    ev.evaluate_rows(_run(rows), rows, "step 4", "held-out")
    assert capsys.readouterr().err == (
        "[grpo] held-out evaluation (step 4): 3 prompts, greedy, up to 5 new tokens\n"
        "[grpo] held-out accuracy (step 4, 3 prompts, greedy): 0.250\n")
    run = _run(rows, sampling=Sampling(6, temperature=0.5), n=2)
    ev.evaluate_rows(run, rows, "after", "mine")
    assert run.eval_backend.asked[0][0] == "eval mine after"
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[grpo] evaluation set mine (after): 3 prompts, 2 samples each, up to 6 new tokens"
    assert err[1] == ("[grpo] mine accuracy (after, 3 prompts, n=2 at temperature 0.5): 0.250; mean@2 0.333, pass@1 "
                      "0.333, pass@2 0.333")


def test_sampled_evaluation_is_seeded_per_set_and_rank_and_averages_every_ranks_prompts(scored, monkeypatch):
    asked = []

    def prompt_metrics(got, answers, ks, threshold):
        asked.append((got, answers, ks, threshold))
        return {"pass@1": got[0], "maj@1": float(len(answers or []))}

    monkeypatch.setattr(ev, "prompt_metrics", prompt_metrics)
    monkeypatch.setattr(ev, "vote_key", lambda spec, kwargs: spec == "accuracy" and (
        lambda text: f"<{text}{kwargs['mark']}>"))
    rows = _rows(6)
    sampling = Sampling(6, temperature=0.5)
    run = _run(rows, rank=1, world_size=2, sampling=sampling, n=2)
    out = ev.evaluate_rows(run, rows, "after", "mine")
    (_, prompts, n, got_sampling, seed), = run.eval_backend.asked
    assert (prompts, n, got_sampling, seed) == ([[1], [3], [5]], 2, sampling, ev.set_seed(7, 1, "mine"))
    assert asked == [([0.0, 0.0], ["<1!>", "<1!>"], [1, 2], 0.5), ([1.0, 1.0], ["<3!>", "<3!>"], [1, 2], 0.5),
                     ([0.0, 0.0], ["<5!>", "<5!>"], [1, 2], 0.5)]
    assert run.runtime.reduced[-1] == {"prompts": 3.0, "pass@1": 1.0, "maj@1": 6.0}
    assert out["pass@1"] == 1 / 3 and out["maj@1"] == 2.0 and "prompts" not in out
    asked.clear()
    run = _run(rows, sampling=sampling, n=2, rewards=("format", "accuracy"))
    run.settings.evaluation.correct_reward = "format"  # a reward without an answer: no vote
    ev.evaluate_rows(run, rows, "after", "mine")
    assert [a[1] for a in asked] == [None] * 6 and [a[0] for a in asked] == [[1.0, 1.0]] * 6


def test_the_set_seed_is_evaluations_seed_the_rank_and_the_sets_name_in_31_bits():
    seeds = {ev.set_seed(s, r, n) for s in (0, 1) for r in (0, 1) for n in ("held-out", "more")}
    assert len(seeds) == 8 and all(0 <= x < 2 ** 31 for x in seeds)
    assert ev.set_seed(0, 0, "held-out") == ev.set_seed(0, 0, "held-out") == 105852665
    assert ev.set_seed(3, 1, "more") == 2089287614


def test_the_correct_reward_is_the_named_one_else_accuracy_else_the_first():
    run = _run([], rewards=("format", "accuracy", "len"))
    assert ev.correct_reward(run).name == "accuracy"
    run.settings.evaluation.correct_reward = "len"
    assert ev.correct_reward(run).name == "len"
    run = _run([], rewards=("format", "len"))
    assert ev.correct_reward(run).name == "format"


def test_the_line_heads_with_accuracy_else_the_reward_mean_and_lists_the_at_k_metrics():
    run = _run([])
    assert ev._line(run, {"reward_mean": 0.5, "accuracy": None}, "before", "held-out", 3) == (
        "held-out accuracy (before, 3 prompts, greedy): n/a (no sample scored)")
    run.settings.evaluation.sampling, run.settings.evaluation.n = Sampling(4, temperature=0.75), 3
    assert ev._line(run, {"reward_mean": 0.5, "pass@1": 0.25, "maj@2": 1.0, "x": 2.0}, "after", "s", 2) == (
        "s reward_mean (after, 2 prompts, n=3 at temperature 0.75): 0.500; pass@1 0.250, maj@2 1.000")


def test_evaluate_names_each_sets_metrics_and_skips_an_empty_held_out_split(monkeypatch):
    asked = []
    monkeypatch.setattr(ev, "evaluate_rows", lambda r, rows, label, name: asked.append((r, rows, label, name)) or {
        "acc": len(rows)})
    run = _run([], sets={"a": [1], "b": [1, 2]})
    assert ev.evaluate(run, "before") == {"a/acc": 1, "b/acc": 2}
    run.splits.eval = [7, 8, 9]
    assert ev.evaluate(run, "after") == {"acc": 3, "a/acc": 1, "b/acc": 2}
    assert asked == [(run, [1], "before", "a"), (run, [1, 2], "before", "b"), (run, [7, 8, 9], "after", "held-out"),
                     (run, [1], "after", "a"), (run, [1, 2], "after", "b")]


def test_a_turn_loop_runs_the_padded_prompts_and_scores_the_shards_episodes(scored, monkeypatch):
    """The same turn loop as training (seeded per turn when sampled), the padding's episodes dropped."""
    made = []

    class Episodes:
        def __init__(self, n):
            self.groups, self.prompt_ids = [[f"e{i}"] for i in range(n)], [[i] for i in range(n)]
            self.completion_ids, self.truncated = [[[1, 9]]], [[False]]

        def sums(self):
            return {"turns": 3.0}

    class Loop:
        def __init__(self, generate, seed_for):
            made.append((generate, seed_for))

        def run(self, rows, prompt_ids, n, sampling):
            self.asked = (rows, prompt_ids, n, sampling)
            made.append(self.asked)
            return Episodes(len(rows))

    monkeypatch.setattr(ev, "episode_columns", lambda eps: {"groups": list(eps.groups)})
    monkeypatch.setattr(ev, "seen_rows", lambda shard, eps: [{"seen": r, "ids": eps.prompt_ids} for r in shard])
    monkeypatch.setattr(ev, "episode_metrics", lambda sums, prefix: {f"{prefix}turns_mean": sums["turns"]})
    rows = _rows(3)
    run = _run(rows, rank=1, world_size=2)
    run.sampler.turn_loop = Loop
    out = ev.evaluate_rows(run, rows, "before", "held-out")
    (generate, seed_for), (loop_rows, prompt_ids, n, sampling) = made
    assert generate == run.eval_backend.generate and seed_for(2) is None
    assert loop_rows == [rows[1], rows[1]] and prompt_ids == [[1], [1]]
    assert (n, sampling) == (1, Sampling(5, greedy=True))
    (shard, comps, trunc, extra), = scored
    assert shard == [{"seen": rows[1], "ids": [[0]]}] and extra == {"groups": [["e0"]]}
    assert (comps, trunc) == ([[[1, 9]]], [[False]])
    assert out["turns_mean"] == 6.0 and run.runtime.reduced[0] == {"turns": 3.0}
    made.clear()
    run = _run(rows, sampling=Sampling(5, temperature=0.5), n=1)
    run.sampler.turn_loop = Loop
    ev.evaluate_rows(run, rows, "before", "held-out")
    assert made[0][1](2) == ev.set_seed(7, 0, "held-out") + 2


def test_check_sets_reads_each_set_and_refuses_one_without_the_answer_a_reward_reads(monkeypatch):
    read = []
    tables = {"a": [{"q": 1, "answer": 2}], "b": [{"question": 1, "solution": 2}]}
    monkeypatch.setattr(ev.data, "set_rows", lambda spec, dcfg: read.append((spec["name"], dcfg)) or
                        tables[spec["name"]])

    def set_source(spec, dcfg):
        assert dcfg == "data section"
        return SimpleNamespace(answer_column=spec.get("col", "answer"))

    monkeypatch.setattr(ev.data, "set_source", set_source)

    def reads(prompts, completions, answer):
        return []

    def fmt(prompts, completions):
        return []

    rewards = [SimpleNamespace(name="format", fn=fmt), SimpleNamespace(name="accuracy", fn=reads)]
    ev.check_sets([{"name": "a"}, {"name": "b", "col": "solution"}], "data section", rewards)
    assert read == [("a", "data section"), ("b", "data section")]
    with pytest.raises(ev.DataError) as e:
        ev.check_sets([{"name": "a"}, {"name": "b"}], "data section", rewards + [SimpleNamespace(name="x", fn=reads)])
    assert str(e.value) == ("evaluation.sets b: no answer column 'answer' (answer_column), which reward 'accuracy' "
                            "reads; its columns are: question, solution")
    ev.check_sets([{"name": "b"}], "data section", rewards[:1])  # no reward reads the answer


def test_each_line_is_flushed_at_once(scored, monkeypatch):
    """The console is the run's log (`logger.run_log` tees it into train.log): each line is written through."""
    calls = []
    monkeypatch.setattr(ev.sys, "stderr", SimpleNamespace(write=lambda t: calls.append(t), flush=lambda: calls.append(
        "flush")))
    rows = _rows(2)
    ev.evaluate_rows(_run(rows), rows, "before", "held-out")
    lines = "".join(c for c in calls if c != "flush").splitlines()
    assert len(lines) == 2 and calls.count("flush") == 2 and calls[-1] == "flush"
    assert calls[calls.index("flush") - 1] == "\n"  # the first line flushed before the evaluation's result
