"""vision_token_logprobs on every served family (vision_logprobs.VISION_FAMILIES, each a tiny: model): log-probs and
gradients (vision tower included, trainable or frozen; LoRA on the language model) equal the model's own
per-sequence forward, in the shared layout (each prompt's images encoded once) and the standard one; planted bugs
(completion positions not restarting, 1-D positions, image features at per-row slots, deepstack dropped, Gemma 3's
image block made causal, Idefics3's image tokens made bidirectional or its tiles' pixel masks misplaced) fail."""
import dataclasses
import random

import pytest
import torch

from grpo.engine import plan_micro_batches, token_logprobs
from grpo.engine import vision_families as vf
from grpo.engine import vision_logprobs as vl
from grpo.engine.vision_logprobs import vision_token_logprobs
from grpo.models import load_image_processor, load_tokenizer, tiny_model
from grpo.tasks.shapes import draw
from grpo.vision.images import encode
from grpo.vision.models import vision_tower

ATOL_LP, ATOL_GRAD = 2e-5, 5e-5


FAMILIES = vl.VISION_FAMILIES
TILED = ("idefics3", "smolvlm")  # pictures split into tiles (SmolVLM2's classes are Idefics3's architecture)


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request):
    return _build(request.param)


def _build(family):
    tok, proc = load_tokenizer(f"tiny:{family}"), load_image_processor(f"tiny:{family}")
    model = tiny_model(family, len(tok), seed=0)
    assert model.config.model_type == family
    rng = random.Random(0)

    def picture(size):
        return draw(rng, size, [("red", "square"), ("blue", "circle")])

    def user(n_images, text):
        return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]

    last = picture(40)
    if family in TILED:  # a wide picture: its tiles are 1x2, not 2x2 as a square one's
        last = last.crop((0, 12, 40, 28))
    prompts = [  # ragged: one image, two images of other sizes (Idefics3: 5 tiles, then 5 and 3), none
        encode(user(1, "How many?"), [picture(32)], tok, proc),
        encode(user(2, "Count them"), [picture(24), last], tok, proc),
        encode([{"role": "user", "content": "no picture"}], [], tok, proc),
    ]
    return model, prompts


def _completions(sizes, seed=0):
    rng = random.Random(seed)
    return [[[rng.randrange(3, 100) for _ in range(rng.randint(1, 7))] for _ in range(G)] for G in sizes]


def _model_inputs(model, p, ids):
    """What the family's own forward takes beside the ids, as its transformers processor returns it: Qwen-VL's
    ``mm_token_type_ids``, pixels and grids; Gemma 3's ``token_type_ids`` (its bidirectional image blocks) and
    pixels; Idefics3's tiles and their pixel mask, a batch of one prompt."""
    kinds = (ids == model.config.image_token_id).long()
    if model.config.model_type in TILED:
        return {} if not p.n_images else {"pixel_values": p.pixel_values[None],
                                          "pixel_attention_mask": p.pixel_attention_mask[None]}
    if model.config.model_type == "gemma3":
        return {"token_type_ids": kinds, **({"pixel_values": p.pixel_values} if p.n_images else {})}
    images = {} if not p.n_images else {"pixel_values": p.pixel_values, "image_grid_thw": p.image_grid_thw}
    return {"mm_token_type_ids": kinds.int(), **images}


def _tower_name(model) -> str:
    return "." + vf.family_of(model).tower + "."


def _reference(model, prompts, comps):
    """Every prompt + completion alone through the model's own forward (logits, log-softmax)."""
    out = []
    for p, cs in zip(prompts, comps):
        row = []
        for r in cs:
            ids = torch.tensor([p.ids + r])
            logits = model(input_ids=ids, **_model_inputs(model, p, ids)).logits[0].float()
            row.append(torch.log_softmax(logits, -1)[len(p.ids) - 1:-1].gather(-1, torch.tensor(r)[:, None])[:, 0])
        out.append(row)
    return out


def _max_diff(a, b):
    return max((x - y).abs().max().item() for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def _grads(model, logps, weights):
    model.zero_grad()
    sum((w * lp).sum() for ws, lps in zip(weights, logps) for w, lp in zip(ws, lps)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_grads(model, prompts, comps, shared, tower_trains=True):
    weights = [[torch.randn(len(r), generator=torch.Generator().manual_seed(len(r))) for r in cs] for cs in comps]
    ref = _reference(model, prompts, comps)
    g_ref = _grads(model, ref, weights)
    got = vision_token_logprobs(model, prompts, comps, shared_prefix=shared)
    assert _max_diff(got, ref) < ATOL_LP
    g_got = _grads(model, got, weights)
    assert set(g_got) == set(g_ref) and g_got
    assert any(_tower_name(model) in n for n in g_got) == tower_trains  # the tower trains too, unless frozen
    for n in g_ref:
        assert torch.allclose(g_got[n], g_ref[n], atol=ATOL_GRAD), n


@pytest.mark.parametrize("sizes", [(1, 1, 1), (2, 2, 2), (5, 2, 5)])
@pytest.mark.parametrize("shared", [True, False])
def test_logprobs_and_gradients_equal_the_per_sequence_forward(setup, sizes, shared):
    model, prompts = setup
    _check_grads(model, prompts, _completions(sizes), shared)


def test_a_frozen_tower_gets_no_gradient_and_the_rest_stays_exact(setup):
    """model.freeze_vision_tower: the tower's grads are None, an optimizer step leaves it unchanged, and the
    language model's gradients still equal the per-sequence forward's."""
    from grpo.vision.models import freeze_vision_tower

    model, prompts = setup
    visual = vision_tower(model)
    try:
        freeze_vision_tower(model)
        _check_grads(model, prompts, _completions((2, 5, 1)), shared=True, tower_trains=False)
        tower = {n: p.detach().clone() for n, p in visual.named_parameters()}
        assert all(p.grad is None for p in visual.parameters())
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        opt.step()
        assert all(torch.equal(p, tower[n]) for n, p in visual.named_parameters())
    finally:
        model.zero_grad(set_to_none=True)
        visual.requires_grad_(True)


def test_lora_on_the_language_model_is_exact(setup):
    """LoRA adapters on the language model's attention (the tower's layers are named qkv/proj, so it keeps its full
    weights; Gemma 3's SigLIP tower, whose attention is named q_proj/k_proj/v_proj too, is excluded by name): the
    adapters' gradients equal the per-sequence forward's through the peft model."""
    import copy

    from grpo.config.schema import LoraConfig
    from grpo.models import apply_lora

    model, prompts = setup
    peft_model = apply_lora(copy.deepcopy(model), LoraConfig(enabled=True, r=4, alpha=8))
    for n, p in peft_model.named_parameters():  # B starts at zero: make the adapters matter
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    assert any("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)
    assert not any("lora_" in n and _tower_name(model) in n for n, _ in peft_model.named_parameters())
    _check_grads(peft_model, prompts, _completions((2, 1, 5)), shared=True, tower_trains=False)


def test_micro_batches_and_entropy(setup):
    model, prompts = setup
    comps = _completions((2, 3, 1), seed=1)
    budget = max(75, len(prompts[1].ids) + 8)  # Gemma 3's two images make a longer prompt
    plan = plan_micro_batches([len(p.ids) for p in prompts], [[len(r) for r in cs] for cs in comps], budget)
    assert len(plan) >= 3 and any(g == 1 for g, _ in plan[1])  # the two-image group is cut in two
    with torch.no_grad():
        ref = _reference(model, prompts, comps)
        got, ent = vision_token_logprobs(model, prompts, comps, max_tokens_per_micro_batch=budget, return_entropy=True)
    assert _max_diff(got, ref) < ATOL_LP
    assert all(e.shape == lp.shape and (e > 0).all() for es, lps in zip(ent, got) for e, lp in zip(es, lps))


def test_vision_tower_runs_once_per_prompt_in_the_shared_layout(setup):
    model, prompts = setup
    comps = _completions((3, 2, 3))
    seen = []
    handle = vision_tower(model).register_forward_hook(  # Qwen's tower takes the pixels by position, SigLIP by name
        lambda m, args, kwargs, out: seen.append((args[0] if args else kwargs["pixel_values"]).shape[0]),
        with_kwargs=True)
    try:
        with torch.no_grad():
            vision_token_logprobs(model, prompts, comps, shared_prefix=True)
            vision_token_logprobs(model, prompts, comps, shared_prefix=False)
    finally:
        handle.remove()
    patches = [p.pixel_values.shape[0] if p.n_images else 0 for p in prompts]
    assert seen == [sum(patches), sum(n * len(cs) for n, cs in zip(patches, comps))]


def _cumulative(core, prompts, comps, image_token_id):
    """Planted bug: the second completion continues after the first instead of restarting."""
    parts = []
    for p, cs in zip(prompts, comps):
        pos = vl.prompt_positions(core, p, image_token_id)
        parts.append(pos)
        start = int(pos.max()) + 1
        for r in cs:
            parts.append(vl.completion_positions(start, len(r), len(pos)))
            start += len(r)
    pos = torch.cat(parts, dim=1)
    return pos if len(pos) == 1 else pos[:, None, :]


def _one_dimensional(core, prompts, comps, image_token_id):
    """Planted bug: 1-D text positions everywhere (the images' 3-D grid positions ignored)."""
    parts = []
    for p, cs in zip(prompts, comps):
        parts.append(torch.arange(len(p.ids))[None].expand(3, -1))
        parts.extend(vl.completion_positions(len(p.ids), len(r)) for r in cs)
    return torch.cat(parts, dim=1)[:, None, :]


def _per_row_slots(layout, prompts, image_token_id):
    """Planted bug: each prompt's image features put at its image tokens' positions in its own row (as a per-row
    encoder would), not at their positions in the packed row."""
    return torch.cat([torch.nonzero(torch.tensor(p.ids) == image_token_id).squeeze(-1) for p in prompts])


@pytest.mark.parametrize("bug", [_cumulative, _one_dimensional, _per_row_slots])
def test_a_wrong_position_restart_is_caught(setup, monkeypatch, bug):
    model, prompts = setup
    if bug is _one_dimensional and vf.family_of(model).axes == 1:
        pytest.skip("1-D rotary positions are this family's own (Gemma 3, Idefics3, SmolVLM2)")
    comps = _completions((3, 2, 3))
    with torch.no_grad():
        ref = _reference(model, prompts, comps)
        assert _max_diff(vision_token_logprobs(model, prompts, comps), ref) < ATOL_LP
        if bug is _per_row_slots:
            monkeypatch.setattr(vl, "image_slots", lambda layout, image_token_id: bug(layout, prompts, image_token_id))
        else:
            monkeypatch.setattr(vl, "packed_positions", bug)
        try:
            diff = _max_diff(vision_token_logprobs(model, prompts, comps), ref)
        except RuntimeError as e:  # Qwen3-VL's deepstack: the collided slots are fewer than the features
            assert "must match the size" in str(e)
            diff = float("inf")
        assert diff > 1e-3


def test_bad_inputs_say_what_is_wrong(setup):
    model, prompts = setup
    image, p = model.config.image_token_id, prompts[0]
    fewer = [t for i, t in enumerate(p.ids) if t != image or i % 2]  # some image tokens dropped
    broken = type(p)(fewer, pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw,
                     pixel_attention_mask=p.pixel_attention_mask, tiles=p.tiles)
    n, expected = fewer.count(image), p.ids.count(image)
    assert 0 < n < expected and expected == (20 if model.config.model_type in TILED else 16)
    with pytest.raises(ValueError, match=f"the prompt has {n} image tokens but its images make {expected}"):
        vision_token_logprobs(model, [broken], [[[5]]])
    with pytest.raises(ValueError, match="1 prompts but 2 completion groups"):
        vision_token_logprobs(model, prompts[:1], [[[5]], [[6]]])
    from grpo.models import char_tokenizer, tiny_model
    text_model = tiny_model("qwen2", len(char_tokenizer()))
    served = ", ".join(FAMILIES)
    with pytest.raises(ValueError, match=f"serves {served} models, not 'qwen2'"):
        vision_token_logprobs(text_model, prompts[:1], [[[5]]])


def test_a_family_the_engine_cannot_serve_exactly_is_refused_in_one_line(setup):
    model, prompts = setup
    model.config.model_type = "lfm2_vl"  # what the check reads: the family's name
    try:
        with pytest.raises(ValueError, match="lfm2_vl is not served: its NaViT tower takes pixel masks and spatial "
                                             f"shapes.*; served: {', '.join(FAMILIES)}$"):
            vision_token_logprobs(model, prompts[:1], [[[5]]])
        with pytest.raises(ValueError, match="lfm2_vl is not served"):  # the trainer's entry point refuses it too
            token_logprobs(model, prompts[:1], [[[5]]])
    finally:
        model.config.model_type = type(model.config).model_type


def test_dropping_qwen3_vl_deepstack_features_is_caught(monkeypatch):
    """Qwen3-VL adds the tower's intermediate features to the image tokens after its first language layers: a shared
    forward that passes only the final features is wrong."""
    model, prompts = _build("qwen3_vl")
    comps = _completions((2, 1, 2))
    embeddings = vl._embeddings
    with torch.no_grad():
        ref = _reference(model, prompts, comps)
        monkeypatch.setattr(vl, "_embeddings", lambda *a: (embeddings(*a)[0], {}))
        assert _max_diff(vision_token_logprobs(model, prompts, comps), ref) > 1e-3


def _causal(ids, image_token_id):
    """Planted bug: Gemma 3's image tokens attend causally, like text (no bidirectional block)."""
    return ()


def _with_edges(ids, image_token_id):
    """Planted bug: each block also holds the image's begin- and end-of-image tokens (token_type_ids is 1 at the
    image tokens only)."""
    return [(max(0, s - 1), min(len(ids), e + 1)) for s, e in vf.image_runs(ids, image_token_id)]


@pytest.mark.parametrize("bug", [_causal, _with_edges])
def test_gemma3_image_blocks_are_bidirectional_exactly(monkeypatch, bug):
    """Gemma 3: the tokens of one image attend to each other both ways (within the sliding window's reach behind,
    all of the block ahead), text and the begin/end-of-image tokens causally; the tiny model's image blocks (16
    tokens) are longer than its window (8), so both layer kinds see the rule."""
    model, prompts = _build("gemma3")
    text = model.config.text_config
    assert text.sliding_window < model.config.mm_tokens_per_image and set(text.layer_types) == {
        "sliding_attention", "full_attention"}
    comps = _completions((2, 1, 2))
    with torch.no_grad():
        ref = _reference(model, prompts, comps)
        assert _max_diff(vision_token_logprobs(model, prompts, comps), ref) < ATOL_LP
        monkeypatch.setitem(vf.FAMILIES, "gemma3", dataclasses.replace(vf.FAMILIES["gemma3"], bidirectional=bug))
        assert _max_diff(vision_token_logprobs(model, prompts, comps), ref) > 1e-3


def test_idefics3_image_tokens_are_causal():
    """Idefics3's language model is causal throughout (no token kinds reach its forward): image tokens made to attend
    to each other both ways, as Gemma 3's do, give other log-probs than its own forward."""
    model, prompts = _build("idefics3")
    comps = _completions((2, 1, 2))
    with torch.no_grad():
        ref = _reference(model, prompts, comps)
        assert _max_diff(vision_token_logprobs(model, prompts, comps), ref) < ATOL_LP
    bidirectional = dataclasses.replace(vf.FAMILIES["idefics3"], bidirectional=vf.image_runs)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setitem(vf.FAMILIES, "idefics3", bidirectional)
        assert _max_diff(vision_token_logprobs(model, prompts, comps), ref) > 10 * ATOL_LP  # ~5e-4: a random tower


def _masks_first(prompts):
    """Planted bug: the padding's zero masks put before a prompt's own (its last real tiles read as padding)."""
    out = vf.pad_tiles(prompts)
    mask = out["pixel_attention_mask"]
    for b, p in enumerate(prompts):
        mask[b] = mask[b].roll(mask.shape[1] - len(p.pixel_values), dims=0)
    return out


def _no_mask(prompts):
    """Planted bug: every tile's pixel mask all zeros, as a mask lost on its way to the tower would read."""
    out = vf.pad_tiles(prompts)
    return {**out, "pixel_attention_mask": torch.zeros_like(out["pixel_attention_mask"])}


@pytest.mark.parametrize("bug", [_masks_first, _no_mask])
@pytest.mark.parametrize("shared", [True, False])
def test_idefics3_tiles_with_a_wrong_pixel_mask_are_caught(monkeypatch, bug, shared):
    """The micro-batch's tiles go to the tower padded into one batch (5 and 10 tiles here), each prompt's pixel mask
    with its tiles: masks misplaced onto other tiles, or lost, change the features (every layout)."""
    model, prompts = _build("idefics3")
    assert [p.tiles.tolist() if p.tiles is not None else None for p in prompts] == [[[2, 2]], [[2, 2], [1, 2]], None]
    comps = _completions((2, 1, 2))
    with torch.no_grad():
        ref = _reference(model, prompts, comps)
        assert _max_diff(vision_token_logprobs(model, prompts, comps, shared_prefix=shared), ref) < ATOL_LP
        monkeypatch.setitem(vf.FAMILIES, "idefics3", dataclasses.replace(
            vf.FAMILIES["idefics3"], image_inputs=bug, features=_features_through(bug)))
        diff = _max_diff(vision_token_logprobs(model, prompts, comps, shared_prefix=shared), ref)
        assert not diff < 1e-3  # (a tile with no valid pixel may make NaN)


def _features_through(pad):
    """Idefics3's shared-layout features with the tiles padded by ``pad``."""
    def features(core, prompts):
        inputs = pad(prompts)
        out = core.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"], return_dict=True)
        return torch.cat(out.pooler_output), None
    return features
