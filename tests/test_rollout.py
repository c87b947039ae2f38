import pytest
import torch

from grpo.models import char_tokenizer, tiny_model
from grpo.rollout import _cut_at_eos, generate


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_shared_prompt_prefill_samples_identical_tokens(family):
    tok = char_tokenizer()
    model = tiny_model(family, len(tok), seed=0)
    prompts = [tok("What is 12 + 7?")["input_ids"], tok("Hi")["input_ids"], tok("3+4=")["input_ids"]]
    out = []
    for share in (True, False):
        torch.manual_seed(1)
        out.append(generate(model, tok, prompts, group_size=4, max_new_tokens=10, batch_size=2, progress=False,
                            share_prompt=share))
    assert out[0] == out[1]
    comps, trunc = out[0]
    assert [len(g) for g in comps] == [4, 4, 4]
    assert len({tuple(c) for c in comps[0]}) > 1  # samples differ inside a group


def test_greedy_is_deterministic_and_one_per_prompt():
    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=0)
    prompts = [tok("abc")["input_ids"], tok("hello there")["input_ids"]]
    a = generate(model, tok, prompts, group_size=4, max_new_tokens=6, greedy=True, progress=False)
    b = generate(model, tok, prompts, group_size=4, max_new_tokens=6, greedy=True, progress=False)
    assert a == b and [len(g) for g in a[0]] == [1, 1]


def test_cut_at_eos_keeps_eos_and_flags_truncation():
    assert _cut_at_eos([5, 6, 2, 0, 0], [2], 5) == ([5, 6, 2], False)
    assert _cut_at_eos([5, 6, 7], [2], 3) == ([5, 6, 7], True)


def test_checkpoint_generation_config_does_not_change_sampling():
    """A generation_config.json with a repetition penalty must not make the rollout off-policy."""
    tok = char_tokenizer()
    model = tiny_model("llama", len(tok), seed=0)
    prompts = [tok("What is 12 + 7?")["input_ids"]]
    outs = []
    for penalty in (None, 50.0):
        if penalty:
            model.generation_config.repetition_penalty = penalty
            model.generation_config.no_repeat_ngram_size = 2
        torch.manual_seed(3)
        outs.append(generate(model, tok, prompts, group_size=4, max_new_tokens=12, progress=False))
    assert outs[0] == outs[1]
