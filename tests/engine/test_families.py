"""Every decoder family the engine is tested on shares the prefix exactly: log-probs and gradients of the shared
layout against each prompt + completion run alone through the model's own forward (tiny random configs from
``AutoConfig.for_model``, tests/prefix_families.py), eager and sdpa, ragged prompts and completions, G in {1, 2, 5},
and sliding windows shorter than the sequences."""

import warnings

import pytest
import torch

from grpo.engine import token_logprobs
from grpo.engine.features import model_features
from tests.engine.test_logprobs import assert_grads_close, grads, max_err, reference_with_grads
from tests.prefix_families import EAGER_ONLY, FAMILIES, VOCAB, WINDOW, tiny_model

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


def test_bench_families_quick_runs(capsys):
    """scripts/bench_families.py (docs/benchmarks.md), scaled down: a table row per family and for the reward model,
    each with its two timings and speed-ups."""
    import importlib.util

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location("bench_families", ROOT / "scripts" / "bench_families.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--repeats", "1"]) == 0
    assert bench.main(["--quick", "--repeats", "1", "--reward"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    rows = [r for r in rows if r[0].strip() != "model" and not r[0].startswith("---")]
    assert [r[0].strip() for r in rows] == ["qwen3_moe", "gemma3_text", "reward model"]
    for r in rows:
        assert float(r[4]) > 0 and float(r[5]) > 0 and r[6].strip().endswith("x")


@pytest.mark.parametrize("family,feature", [("jamba", "layers of type linear_attention"),
                                            ("llama4_text", "layers of type chunked_attention"),
                                            ("bloom", "attention that does not go through transformers' Attention")])
def test_families_with_an_unimplemented_feature_are_refused_naming_it(family, feature):
    """What the shared layout cannot do exactly is found on the model (grpo/engine/features.py), not by its name."""
    import transformers

    config = transformers.AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    served, missing = model_features(model)
    assert missing is not None and missing.startswith(feature) and served == []
