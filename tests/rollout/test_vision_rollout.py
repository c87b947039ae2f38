"""generate_with_images on every served family: each prompt prefilled once with its images, G rows decoded from
the forked cache at the right positions: its log-probs are the trainer's, its greedy tokens and first logits HF
generate's (Gemma 3: with its bidirectional image blocks, which a prefill without token_type_ids loses; Idefics3:
its tiles and their pixel mask, no token kinds)."""
import dataclasses

import pytest
import torch

from grpo.engine import vision_families as vf
from grpo.engine.vision_logprobs import VISION_FAMILIES, vision_token_logprobs
from grpo.models import load_image_processor, load_tokenizer, tiny_model
from grpo.rollout import vision as rv
from grpo.rollout.base import Sampling
from grpo.rollout.vision import generate_with_images
from grpo.tasks import get_task
from grpo.vision.images import encode
from grpo.vision.models import vision_tower
from tests.helpers import own_image_logprobs


@pytest.fixture(scope="module", params=VISION_FAMILIES)
def setup(request):
    tok, proc = load_tokenizer(f"tiny:{request.param}"), load_image_processor(f"tiny:{request.param}")
    model = tiny_model(request.param, len(tok), seed=0)
    rows = get_task("shapes")(2, seed=0)
    prompts = [encode(r["prompt"], r["images"], tok, proc) for r in rows]
    prompts.append(encode([{"role": "user", "content": "text only"}], [], tok, proc))
    return model, prompts


def _diff(a, b):
    return max((x - y).abs().max().item() for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_sampled_logprobs_are_the_trainers_and_the_tower_runs_once_per_prompt(setup):
    model, prompts = setup
    seen = []
    handle = vision_tower(model).register_forward_hook(  # Qwen's tower takes the pixels by position, SigLIP by name
        lambda m, args, kwargs, out: seen.append((args[0] if args else kwargs["pixel_values"]).shape[0]),
        with_kwargs=True)
    try:
        out = generate_with_images(model, prompts, 3, Sampling(max_new_tokens=10), eos=[2], seed=1)
    finally:
        handle.remove()
    assert seen == [p.pixel_values.shape[0] for p in prompts if p.n_images]
    assert [len(g) for g in out.ids] == [3, 3, 3] and all(len(r) == 10 for g in out.ids for r in g)
    assert len({tuple(r) for r in out.ids[0]}) == 3  # the rows sample apart
    with torch.no_grad():
        assert _diff(vision_token_logprobs(model, prompts, out.ids), out.logprobs) < 2e-5
    again = generate_with_images(model, prompts, 3, Sampling(max_new_tokens=10), eos=[2], seed=1)
    assert again.ids == out.ids


def _generate(model, p, max_new_tokens):
    """HF ``generate`` (greedy) with the inputs the family's transformers processor returns."""
    ids = torch.tensor([p.ids])
    kinds = (ids == model.config.image_token_id).long()
    if model.config.model_type in ("idefics3", "smolvlm"):  # a batch of one prompt: its tiles and their pixel mask
        inputs = {"pixel_values": p.pixel_values[None], "pixel_attention_mask": p.pixel_attention_mask[None]}
    elif model.config.model_type == "gemma3":
        inputs = {"pixel_values": p.pixel_values, "token_type_ids": kinds}
    else:
        inputs = {"pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw, "mm_token_type_ids": kinds.int()}
    return model.generate(input_ids=ids, **inputs, max_new_tokens=max_new_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)


def _first_logits(model, prompts):
    """The logits our rollout samples its first token from (the prefill's last position)."""
    seen = []
    handle = model.register_forward_hook(lambda m, args, out: seen.append(out.logits[0, -1].float()))
    try:
        generate_with_images(model, prompts, 1, Sampling(max_new_tokens=1, greedy=True), eos=[2])
    finally:
        handle.remove()
    return seen[0]


def test_greedy_matches_hf_generate_and_eos_stops(setup):
    model, prompts = setup
    out = generate_with_images(model, prompts[:1], 3, Sampling(max_new_tokens=8, greedy=True), eos=[2])
    p = prompts[0]
    ref = _generate(model, p, 8)
    assert out.ids == [[ref.sequences[0, len(p.ids):].tolist()]]
    assert torch.allclose(_first_logits(model, prompts[:1]), ref.logits[0][0].float(), atol=1e-5)
    toks = out.ids[0][0]
    k = next(k for k, t in enumerate(toks) if k and t not in toks[:k])  # a token it has not sampled before
    cut = generate_with_images(model, prompts[:1], 1, Sampling(max_new_tokens=8, greedy=True), eos=[toks[k]])
    assert cut.ids[0][0] == toks[: k + 1] and cut.truncated == [[False]] and len(cut.logprobs[0][0]) == k + 1


def _one_position_per_image(core, p, image_id):
    """Planted bug for 1-D families (Gemma 3, Idefics3, SmolVLM2): an image counted as one position (its tokens
    collapsed, as a placeholder is before the processor expands it), so decoding starts too early."""
    n = sum(1 for t in p.ids if t != image_id) + p.n_images
    return torch.arange(n)[None]


def test_a_wrong_decode_position_is_caught(setup, monkeypatch):
    """Planted bug: decoding from len(prompt) (1-D positions) instead of max(3-D prompt positions) + 1; for a 1-D
    family, from a prompt length that counts each image as one position."""
    model, prompts = setup
    bug = (_one_position_per_image if vf.family_of(model).axes == 1
           else lambda core, p, image_id: torch.arange(len(p.ids))[None].expand(3, -1))
    monkeypatch.setattr(rv, "prompt_positions", bug)
    out = generate_with_images(model, prompts[:2], 2, Sampling(max_new_tokens=6), eos=[2], seed=0)
    with torch.no_grad():  # 5x the tolerance the right positions meet (2e-5, above)
        assert _diff(vision_token_logprobs(model, prompts[:2], out.ids), out.logprobs) > 1e-4


def test_top_k_and_top_p_restrict_the_samples_and_report_the_trainers_logprobs(setup):
    """top_k=1 (or a top_p below the most likely token's mass) samples the argmax: the greedy completion, G times;
    top_k=3 samples among the 3 most likely tokens of the trainer's own logits at every step, with log-probs still
    the full softmax's (the trainer's), and a one-time note that the rollout is off-policy."""
    import warnings

    import grpo.rollout.hf as hf

    model, prompts = setup
    greedy = generate_with_images(model, prompts[:2], 1, Sampling(max_new_tokens=6, greedy=True), eos=[-1])
    hf._warned_truncated = False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for cut in (Sampling(max_new_tokens=6, top_k=1), Sampling(max_new_tokens=6, top_p=1e-6)):
            out = generate_with_images(model, prompts[:2], 3, cut, eos=[-1], seed=0)
            assert out.ids == [g * 3 for g in greedy.ids]
    assert sum("off-policy" in str(w.message) or "top_p" in str(w.message) for w in seen) == 1
    out = generate_with_images(model, prompts[:2], 4, Sampling(max_new_tokens=6, top_k=3), eos=[-1], seed=0)
    with torch.no_grad():
        assert _diff(vision_token_logprobs(model, prompts[:2], out.ids), out.logprobs) < 2e-5
        for p, rows in zip(prompts[:2], out.ids):
            for r in rows:  # each sampled token is among the 3 most likely: at most 2 tokens are more likely
                full = own_image_logprobs(model, p, r, full=True)
                chosen = full.gather(-1, torch.tensor(r)[:, None])
                assert int((full > chosen + 1e-6).sum(-1).max()) <= 2
    assert len({tuple(r) for g in out.ids for r in g}) > 2  # it still samples


def test_the_rollout_samples_in_eval_mode_and_restores_training_mode(setup):
    """No dropout while sampling (and Idefics3 with gradient checkpointing keeps a cache only outside training mode);
    the model is in training mode again afterwards."""
    model, prompts = setup
    modes = []
    handle = model.register_forward_hook(lambda m, args, out: modes.append(m.training))
    model.train()
    try:
        generate_with_images(model, prompts[:1], 2, Sampling(max_new_tokens=3), eos=[-1], seed=0)
    finally:
        handle.remove()
        restored = model.training
        model.eval()
    assert modes and not any(modes) and restored


def test_a_gemma3_prefill_without_its_image_blocks_is_caught(monkeypatch):
    """Planted bug: the prefill passes the token kinds under Qwen's name, which Gemma 3's forward does not read, so
    its image tokens attend causally: the first logits are no longer HF generate's."""
    tok, proc = load_tokenizer("tiny:gemma3"), load_image_processor("tiny:gemma3")
    model = tiny_model("gemma3", len(tok), seed=0)
    prompts = [encode(r["prompt"], r["images"], tok, proc) for r in get_task("shapes")(1, seed=0)]
    ref = _generate(model, prompts[0], 1).logits[0][0].float()
    assert torch.allclose(_first_logits(model, prompts), ref, atol=1e-5)
    monkeypatch.setitem(vf.FAMILIES, "gemma3", dataclasses.replace(vf.FAMILIES["gemma3"],
                                                                   kinds_kwarg="mm_token_type_ids"))
    assert (_first_logits(model, prompts) - ref).abs().max() > 1e-3
