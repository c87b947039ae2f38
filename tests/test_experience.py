"""grpo/experience.py: collect(run) with a backend injected in the run (no module global patched): the batch's
rewards are those of the completions the backend returned, its advantages group-normalised."""
import torch

from grpo.experience import collect
from grpo.rollout.base import Completions
from grpo.trainer.build import build_run, close_run


class FixedBackend:
    """Every group gets the same completions: the digit strings in ``texts``, tokenized."""
    name = "hf"

    def __init__(self, tokenizer, texts):
        self.ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        self.calls = 0

    def generate(self, prompt_ids, group_size, sampling, seed=None, suffixes=None):
        self.calls += 1
        return Completions([[list(c) for c in self.ids[:group_size]] for _ in prompt_ids],
                           [[False] * group_size for _ in prompt_ids])

    def sync_weights(self, model):
        pass

    def sleep(self):
        pass

    def close(self):
        pass


def test_collect_scores_what_the_injected_backend_returned(cfg_factory):
    run = build_run(cfg_factory({"reward": {"functions": {"format": {"fn": "number_only", "weight": 1.0},
                                                          "accuracy": {"fn": "arithmetic", "weight": 0.0}}}}))
    try:
        run.rollout.backend = fake = FixedBackend(run.tokenizer, ["1", "x", "22", "yy"])
        batch = collect(run)
        assert fake.calls == 1 and batch.group_sizes == [4, 4]
        assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0] * 2  # number_only: bare numbers score 1
        assert torch.allclose(batch.advantages[:4].sum(), torch.tensor(0.0), atol=1e-5)
        assert batch.advantages[0] > 0 > batch.advantages[1]
    finally:
        close_run(run)
