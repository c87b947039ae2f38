"""grpo/engine/batch_logprobs.py: a Batch's log-probs without grad, micro-batched, equal to one whole forward."""
import torch

from grpo.batch import Batch
from grpo.config.schema import EngineConfig
from grpo.engine import token_logprobs
from grpo.engine.batch_logprobs import nested_logprobs, plan
from grpo.models import tiny_model
from grpo.runtime.local import LocalRuntime


def test_micro_batched_log_probs_equal_the_whole_batch_forward():
    model = tiny_model("llama", 50, seed=1)
    prompts, comps = [[5, 6, 7], [8, 9]], [[[1, 2], [3]], [[4, 4, 4], [2], [1, 1]]]
    batch = Batch([{}, {}], prompts, comps, [[False] * 2, [False] * 3], torch.zeros(5), torch.zeros(5))
    small = EngineConfig(max_tokens_per_micro_batch=8, attention_kernel="grouped")
    assert len(plan(batch, small)) > 1
    got = nested_logprobs(LocalRuntime("cpu"), model, batch, small, temperature=1.0)
    with torch.no_grad():
        want = token_logprobs(model, prompts, comps, attention_kernel="grouped")
    for g in range(2):
        for j in range(len(comps[g])):
            assert not got[g][j].requires_grad
            torch.testing.assert_close(got[g][j], want[g][j], rtol=1e-5, atol=1e-6)


def test_every_forward_uses_the_configured_engine_settings_and_temperature(monkeypatch):
    """The log-probs of a temperature-0.7 rollout are those of softmax(logits / 0.7); the engine section's
    shared_prefix and attention_kernel (a user's choice of kernel: speed, or a kernel bug to avoid) reach the
    engine."""
    import grpo.engine.batch_logprobs as bl

    model = tiny_model("llama", 50, seed=1)
    prompts, comps = [[5, 6, 7]], [[[1, 2], [3]]]
    batch = Batch([{}], prompts, comps, [[False] * 2], torch.zeros(2), torch.zeros(2))
    ecfg = EngineConfig(max_tokens_per_micro_batch=64, shared_prefix=False, attention_kernel="flex")
    seen, real = [], bl.token_logprobs
    monkeypatch.setattr(bl, "token_logprobs", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    got = nested_logprobs(LocalRuntime("cpu"), model, batch, ecfg, temperature=0.7)
    assert seen == [{"shared_prefix": False, "temperature": 0.7, "attention_kernel": "flex"}]
    with torch.no_grad():
        want = real(model, prompts, comps, temperature=0.7)
    for j in range(2):
        torch.testing.assert_close(got[0][j], want[0][j], rtol=1e-5, atol=1e-6)


def test_an_auto_budget_is_sized_for_the_model_within_the_engines_memory_limit():
    """``auto`` outside a built run: sized for the model passed, under the section's memory_limit_gib (a limit
    leaving room for about 6 tokens splits the batch; without a limit the machine's free memory holds it whole);
    without a model it says what it needs. The section's shared_prefix decides how tokens are counted."""
    import pytest

    from grpo.engine.memory import MARGIN, estimate
    from grpo.engine.micro_batches import plan_micro_batches

    model = tiny_model("llama", 50, seed=1)
    prompts, comps = [[5, 6, 7], [8, 9]], [[[1, 2], [3]], [[4, 4, 4], [2], [1, 1]]]
    batch = Batch([{}, {}], prompts, comps, [[False] * 2, [False] * 3], torch.zeros(5), torch.zeros(5))
    limit = (estimate(model).bytes_for(6) / MARGIN + 1) / 2**30
    tokens = estimate(model).tokens_within(int(limit * 2**30))
    assert 4 <= tokens <= 6
    tight = plan(batch, EngineConfig(max_tokens_per_micro_batch="auto", memory_limit_gib=limit), model)
    assert tight == plan_micro_batches([3, 2], [[2, 1], [3, 1, 2]], tokens, shared_prefix=True) and len(tight) > 2
    assert len(plan(batch, EngineConfig(max_tokens_per_micro_batch="auto"), model)) == 1
    # the standard layout counts each completion's own copy of the prompt: 4 micro-batches of 8 tokens, not 2
    standard = plan(batch, EngineConfig(max_tokens_per_micro_batch=8, shared_prefix=False))
    assert standard == plan_micro_batches([3, 2], [[2, 1], [3, 1, 2]], 8, shared_prefix=False)
    assert len(standard) == 4 and len(plan(batch, EngineConfig(max_tokens_per_micro_batch=8))) == 2
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=auto needs the model"):
        plan(batch, EngineConfig(max_tokens_per_micro_batch="auto"))
