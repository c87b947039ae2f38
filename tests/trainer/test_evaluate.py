"""grpo/trainer/evaluate.py: held-out evaluation through the run's explicit greedy backend."""
from grpo.rollout.base import Completions
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
