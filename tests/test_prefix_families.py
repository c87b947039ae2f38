"""Every decoder family the engine is tested on shares the prefix exactly: log-probs and gradients of the shared
layout against each prompt + completion run alone through the model's own forward (tiny random configs from
``AutoConfig.for_model``, tests/prefix_families.py), eager and sdpa, ragged prompts and completions, G in {1, 2, 5},
and sliding windows shorter than the sequences."""

import warnings

import pytest
import torch

from grpo.engine import token_logprobs
from grpo.engine.features import model_features
from tests.prefix_families import EAGER_ONLY, FAMILIES, VOCAB, WINDOW, tiny_model
from tests.test_prefix_engine import assert_grads_close, grads, max_err, reference_with_grads

torch.set_num_threads(1)
PROMPT_LENS = [1, 9, 4]
COMPLETION_LENS = [[3], [5, 1], [2, 7, 1, 4, 3]]  # G = 1, 2, 5; every sequence but the first longer than WINDOW
CASES = [(f, impl) for f in FAMILIES for impl in ("eager", "sdpa") if impl == "eager" or f not in EAGER_ONLY]


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    return [tok(p) for p in PROMPT_LENS], [[tok(s) for s in ss] for ss in COMPLETION_LENS]


@pytest.mark.parametrize("family,impl", CASES)
def test_family_shares_the_prefix_exactly(family, impl):
    model = tiny_model(family, impl)
    assert model_features(model)[1] is None
    prompts, comps = _data()
    assert max(len(p) + len(r) for p, cs in zip(prompts, comps) for r in cs) > WINDOW
    ref, w, ref_grads = reference_with_grads(model, prompts, comps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shared layout must really be taken, no fallback
        out = token_logprobs(model, prompts, comps)
    assert max_err(out, ref) <= 2e-5
    assert_grads_close(grads(model, out, w), ref_grads, rel=1e-3)
    assert model.config._attn_implementation == impl
