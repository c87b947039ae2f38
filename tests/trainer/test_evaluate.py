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
