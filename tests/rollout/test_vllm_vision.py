"""The in-process vLLM backend with image prompts (tiny:qwen2_5_vl): vLLM receives each prompt's images as
multimodal inputs (the trainer's tower's features, grpo/rollout/vllm_images.py), expands the placeholders as the
trainer's processor does, and samples with the log-probs the trainer computes (grpo/engine/vision_logprobs.py), after
weight syncs too.

Real vLLM, one engine for the module; skipped where vLLM does not import (``make test-vllm`` runs it)."""
import pytest
import torch

from grpo.rollout.base import Sampling
from tests.helpers import VLLM_TINY, vllm_problem

pytestmark = pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))


@pytest.fixture(scope="module")
def setup():
    from grpo.engine.vision_logprobs import vision_token_logprobs  # noqa: F401 - fails early if the engine breaks
    from grpo.rollout.vllm import VLLMBackend
    from tests.helpers import vision_setup

    model, tok, proc, prompts = vision_setup(VLLM_TINY)
    engine = VLLMBackend(model, eos_ids=[tok.eos_token_id], max_model_len=256, seed=0, tokenizer=tok,
                         image_processor=proc)
    yield model, prompts, engine
    engine.close()


def _worst(model, prompts, out):
    from grpo.engine.vision_logprobs import vision_token_logprobs

    with torch.no_grad():
        ours = vision_token_logprobs(model, prompts, out.ids)
    return max(float((a - b).abs().max()) for ga, gb in zip(ours, out.logprobs) for a, b in zip(ga, gb))


def test_vllm_samples_from_the_prompts_images(setup):
    model, prompts, engine = setup
    out = engine.generate(prompts, 3, Sampling(max_new_tokens=8), seed=1)
    assert [len(g) for g in out.ids] == [3] * len(prompts) and all(len(r) for g in out.ids for r in g)
    assert _worst(model, prompts, out) < 1e-4


def test_dropped_or_swapped_images_are_caught(setup, monkeypatch):
    """Planted bugs: the images not sent (the expanded ids as text), or each prompt sent the next prompt's
    picture: vLLM's log-probs then differ from the trainer's."""
    import grpo.rollout.vllm as rv
    from grpo.rollout.vllm_images import vllm_prompt

    model, prompts, engine = setup
    monkeypatch.setattr(rv, "vllm_prompt", lambda p, image_id, feats: {"prompt_token_ids": list(p)})
    dropped = engine.generate(prompts[:3], 2, Sampling(max_new_tokens=6), seed=1)
    assert _worst(model, prompts[:3], dropped) > 1e-3
    nxt = {id(p): q for p, q in zip(prompts[:3], prompts[1:3] + prompts[:1])}  # 32x32 pictures: same token count

    def swapped(p, image_id, feats):
        return {**vllm_prompt(p, image_id, feats), "multi_modal_data": vllm_prompt(nxt[id(p)], image_id, feats)[
            "multi_modal_data"]}

    monkeypatch.setattr(rv, "vllm_prompt", swapped)
    out = engine.generate(prompts[:3], 2, Sampling(max_new_tokens=6), seed=1)
    assert _worst(model, prompts[:3], out) > 1e-3


def test_the_vision_towers_updates_reach_the_rollout(setup):
    model, prompts, engine = setup
    with torch.no_grad():
        for p in model.model.visual.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.sync_weights(model)
    out = engine.generate(prompts[:2], 2, Sampling(max_new_tokens=6), seed=2)
    assert _worst(model, prompts[:2], out) < 1e-4


VLM_VLLM = ["rollout.backend=vllm", "model.tiny={hidden_size: 128, intermediate_size: 256, num_attention_heads: 2, "
            "num_key_value_heads: 1}"]  # vLLM's CPU attention needs head_dim >= 32


def test_vlm_smoke_trains_with_vllm(setup, tmp_path):
    """docs/vision-language.md's command: vlm-smoke with rollout.backend=vllm; each step's sampled log-probs are the
    trainer's (the weights synced into vLLM and the images given as its inputs). Last in this module: it closes the
    module's engine first (one vLLM engine alive at a time)."""
    import json

    from omegaconf import OmegaConf

    from grpo.config.schema import load
    from grpo.trainer.loop import fit
    from tests.helpers import compose_recipe

    setup[2].close()
    out = tmp_path / "run"
    cfg = compose_recipe("vlm-smoke", [f"trainer.output_dir={out}", *VLM_VLLM])
    fit(load(OmegaConf.to_container(cfg, resolve=True)))
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 for r in rows)
    assert all(r["rollout_is/logp_diff_abs_max"] < 1e-4 for r in rows)
