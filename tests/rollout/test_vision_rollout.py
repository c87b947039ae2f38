"""generate_with_images on every served family: each prompt prefilled once with its images, G rows decoded from
the forked cache at the right 3-D positions: its log-probs are the trainer's, its greedy tokens HF generate's."""
import pytest
import torch

from grpo.engine.vision_logprobs import VISION_FAMILIES, vision_token_logprobs
from grpo.models import load_image_processor, load_tokenizer, tiny_model
from grpo.rollout import vision as rv
from grpo.rollout.base import Sampling
from grpo.rollout.vision import generate_with_images
from grpo.tasks import get_task
from grpo.vision.images import encode


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
    handle = model.model.visual.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
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


def test_greedy_matches_hf_generate_and_eos_stops(setup):
    model, prompts = setup
    out = generate_with_images(model, prompts[:1], 3, Sampling(max_new_tokens=8, greedy=True), eos=[2])
    p = prompts[0]
    ids = torch.tensor([p.ids])
    ref = model.generate(input_ids=ids, pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw,
                         mm_token_type_ids=(ids == model.config.image_token_id).int(), max_new_tokens=8,
                         do_sample=False)
    assert out.ids == [[ref[0, len(p.ids):].tolist()]]
    stop = out.ids[0][0][2]
    cut = generate_with_images(model, prompts[:1], 1, Sampling(max_new_tokens=8, greedy=True), eos=[stop])
    assert cut.ids[0][0] == out.ids[0][0][:3] and cut.truncated == [[False]] and len(cut.logprobs[0][0]) == 3


def test_a_wrong_decode_position_is_caught(setup, monkeypatch):
    """Planted bug: decoding from len(prompt) (1-D positions) instead of max(3-D prompt positions) + 1."""
    model, prompts = setup
    monkeypatch.setattr(rv, "prompt_positions", lambda core, p, image_id: torch.arange(len(p.ids))[None].expand(3, -1))
    out = generate_with_images(model, prompts[:2], 2, Sampling(max_new_tokens=6), eos=[2], seed=0)
    with torch.no_grad():
        assert _diff(vision_token_logprobs(model, prompts[:2], out.ids), out.logprobs) > 1e-3


def test_truncated_sampling_is_refused(setup):
    model, prompts = setup
    with pytest.raises(ValueError, match="rollout.top_p=1.0"):
        generate_with_images(model, prompts, 2, Sampling(max_new_tokens=4, top_p=0.9), eos=[2])
