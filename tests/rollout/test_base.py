"""grpo/rollout/base.py: what a backend is asked (Sampling, frozen) and returns (Completions)."""
import dataclasses

import pytest

from grpo.rollout.base import Completions, Sampling


def test_sampling_means_the_same_for_every_backend_and_is_frozen():
    s = Sampling(16)
    assert (s.temperature, s.top_p, s.top_k, s.greedy) == (1.0, 1.0, 0, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_new_tokens = 3
    assert Completions([[[1, 2]]], [[False]]).logprobs is None  # the trainer's own log-probs


def _model_and_tokenizer(gen_eos, tok_eos):
    from types import SimpleNamespace

    gen = None if gen_eos == "no config" else SimpleNamespace(eos_token_id=gen_eos)
    return SimpleNamespace(generation_config=gen), SimpleNamespace(eos_token_id=tok_eos)


@pytest.mark.parametrize("gen_eos,tok_eos,expected", [
    (7, 2, [7, 2]),              # one id in the generation config, the tokenizer's added
    ([7, 8], 8, [7, 8]),         # a list (Llama 3's several EOS), the tokenizer's already in it
    (None, 2, [2]),              # none in the generation config
    ("no config", 2, [2]),       # a model without a generation config
    ([7], None, [7]),            # a tokenizer without one
])
def test_eos_ids_join_the_generation_configs_and_the_tokenizers(gen_eos, tok_eos, expected):
    from grpo.rollout.base import eos_ids

    assert eos_ids(*_model_and_tokenizer(gen_eos, tok_eos)) == expected


def test_cut_at_eos_keeps_the_first_eos_of_several_and_cuts_runs_at_the_budget():
    from grpo.rollout.base import cut_at_eos

    assert cut_at_eos([3, 9, 4, 8, 1], [8, 9], 5) == ([3, 9], False)  # the first of any EOS id
    assert cut_at_eos([8, 3], [8], 2) == ([8], False)                   # an EOS as the first token
    assert cut_at_eos([3, 4, 5, 6], [8], 2) == ([3, 4], True)          # no EOS: the budget's tokens, truncated
    assert cut_at_eos([], [8], 2) == ([], True)


def test_trainer_logprobs_are_each_next_tokens_log_softmax_at_temperature_one():
    import torch

    from grpo.rollout.base import trainer_logprobs

    class Model(torch.nn.Module):
        """logits of position t: (t, 2t, ..., 5t) of the input's token ids, in bfloat16 (cast to float)."""

        def forward(self, input_ids):
            assert input_ids.shape == (1, 4)
            x = input_ids[0].float()[:, None] * torch.arange(1.0, 6.0)
            return type("Out", (), {"logits": (x / 4)[None].to(torch.bfloat16)})()

    ids = [1, 3, 0, 4]
    got = trainer_logprobs(Model(), ids)
    logits = (torch.tensor(ids, dtype=torch.float32)[:, None] * torch.arange(1.0, 6.0) / 4).to(torch.bfloat16).float()
    want = torch.tensor([torch.log_softmax(logits[t], -1)[ids[t + 1]] for t in range(3)])
    assert got.shape == (3,) and got.dtype == torch.float32 and torch.allclose(got, want)
    assert not got.requires_grad
