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


# --------------------------------------------------------------------------------------------- over a stand-in
# The tests below build no model: a stand-in vision-language model whose next-token logits are a fixed function of
# the token fed and its position, recording what each forward is given (`make mutate` runs these; the tests above
# run every family's real model).
V, IMAGE = 7, 6


def _logits(token: int, position: int) -> torch.Tensor:
    """The stand-in's next-token logits after ``token`` at ``position``: both matter."""
    g = torch.Generator().manual_seed(1000 * token + position)
    return torch.randn(V, generator=g) * 2


class _Cache:
    def __init__(self):
        self.reorders = []

    def reorder_cache(self, index):
        assert index.dtype == torch.long  # an index (a float one is refused by index_select)
        self.reorders.append(index.tolist())


class _StandIn(torch.nn.Module):
    def __init__(self, model_type, cache_name="cache", fail_at=None):
        super().__init__()
        self.config = type("Config", (), {"model_type": model_type, "image_token_id": IMAGE})()
        self.model = type("Core", (), {"config": self.config})()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.cache, self.cache_name, self.fail_at, self.calls = _Cache(), cache_name, fail_at, []

    @property
    def device(self):
        return self.weight.device

    def forward(self, input_ids, **kw):
        kinds = {"input_ids": torch.long, "position_ids": torch.long, "attention_mask": torch.long,
                 "mm_token_type_ids": torch.int32}  # as the model's own processor gives them
        assert all(v.dtype == kinds[k] for k, v in {"input_ids": input_ids, **kw}.items() if k in kinds)
        self.calls.append({"input_ids": input_ids.tolist(), "training": self.training,
                           **{k: v.tolist() if torch.is_tensor(v) else v for k, v in kw.items()}})
        if len(self.calls) == self.fail_at:
            raise RuntimeError("the forward failed")
        if "position_ids" in kw:  # a decoding step: one token per row, at the position given (first axis)
            pos = kw["position_ids"].reshape(-1, input_ids.shape[0]).T[:, :1]
        else:  # the prefill: 0..P-1 (the stand-in's own)
            pos = torch.arange(input_ids.shape[1])[None].expand(input_ids.shape[0], -1)
        logits = torch.stack([torch.stack([_logits(int(t), int(p)) for t, p in zip(r, q)])
                              for r, q in zip(input_ids, pos)])
        return type("Out", (), {"logits": logits, self.cache_name: self.cache})()


def _family(monkeypatch, name, axes, kinds, start):
    """A family entry whose pixel arguments are the prompt's own (recorded) and whose prompt positions end at
    ``start - 1``."""
    seen = []

    def image_inputs(prompts):
        seen.append([p.ids for p in prompts])
        return {"pixel_values": torch.cat([p.pixel_values for p in prompts])}

    def positions(core, prompt, image_id):
        seen.append(("positions", core, image_id))
        return torch.arange(start - len(prompt.ids), start)[None].expand(axes, -1)

    monkeypatch.setitem(vf.FAMILIES, name, dataclasses.replace(vf.FAMILIES["qwen2_vl"], axes=axes, kinds_kwarg=kinds,
                                                                 image_inputs=image_inputs, positions=positions))
    return seen


def _reference(prompt, tokens, start, temperature=1.0):
    """The log-prob of each token under softmax(logits / T) of the stand-in, fed the prompt's last token then each
    token at ``start + k``."""
    fed = [(prompt[-1], len(prompt) - 1)] + [(t, start + k) for k, t in enumerate(tokens[:-1])]
    return torch.stack([torch.log_softmax(_logits(t, p) / temperature, -1)[x] for (t, p), x in zip(fed, tokens)])


def _close(got, want):
    """``got`` is ``want`` (float32, one value per token) to float rounding; torch.allclose, not
    torch.testing.assert_close, whose first call imports torch.distributed.tensor (seconds, in every mutant's run)."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)


def _image_prompt():
    from grpo.vision.images import ImagePrompt

    return ImagePrompt([3, IMAGE, IMAGE, 4], pixel_values=torch.arange(10.0).view(2, 5),
                       image_grid_thw=torch.tensor([[1, 2, 4]]))


def test_each_prompt_is_prefilled_once_with_its_pixels_and_kinds_and_decoded_at_its_text_positions(monkeypatch):
    """Qwen-VL's way: the token kinds under its name, 3 position axes from max(prompt positions) + 1; the cache forked
    to the G rows once; each decoding step's mask one column longer; a prompt without images passes no pixels."""
    seen = _family(monkeypatch, "stand_in_3d", 3, "mm_token_type_ids", start=20)
    model = _StandIn("stand_in_3d")
    prompts = [_image_prompt(), [5, 1]]
    out = rv.generate_with_images(model, prompts, 2, Sampling(max_new_tokens=4, temperature=0.5), eos=[-1], seed=3)
    assert seen == [[[3, IMAGE, IMAGE, 4]], ("positions", model.model, IMAGE), ("positions", model.model, IMAGE)]
    prefill, *steps = model.calls[:4]
    assert prefill == {"input_ids": [[3, IMAGE, IMAGE, 4]], "training": False, "use_cache": True,
                       "mm_token_type_ids": [[0, 1, 1, 0]], "pixel_values": torch.arange(10.0).view(2, 5).tolist()}
    assert model.calls[4] == {"input_ids": [[5, 1]], "training": False, "use_cache": True,
                              "mm_token_type_ids": [[0, 0]]}
    rows = out.ids[0]
    for k, step in enumerate(steps):
        assert step == {"input_ids": [[r[k]] for r in rows], "training": False, "use_cache": True,
                        "cache": model.cache, "position_ids": [[[20 + k]] * 2] * 3,
                        "attention_mask": [[1] * (5 + k)] * 2}
    assert len(model.calls) == 8 and model.cache.reorders == [[0, 0], [0, 0]]
    assert [len(g) for g in out.ids] == [2, 2] and all(len(r) == 4 for g in out.ids for r in g)
    assert out.truncated == [[True, True], [True, True]]
    assert all(lp.dtype == torch.float32 for g in out.logprobs for lp in g)
    for p, rows, lps in zip(prompts, out.ids, out.logprobs):
        for r, lp in zip(rows, lps):
            _close(lp, _reference(p, r, 20, temperature=0.5))


def test_a_one_axis_family_without_kinds_and_a_cache_named_past_key_values(monkeypatch):
    """Idefics3's way: no token kinds, one position axis; transformers releases that return ``past_key_values``."""
    _family(monkeypatch, "stand_in_1d", 1, None, start=9)
    model = _StandIn("stand_in_1d", cache_name="past_key_values")
    out = rv.generate_with_images(model, [_image_prompt()], 3, Sampling(max_new_tokens=3), eos=[-1], seed=0)
    assert "mm_token_type_ids" not in model.calls[0] and model.cache.reorders == [[0, 0, 0]]
    assert [c["position_ids"] for c in model.calls[1:]] == [[[9]] * 3, [[10]] * 3]
    assert [c["cache"] for c in model.calls[1:]] == [model.cache] * 2
    for r, lp in zip(out.ids[0], out.logprobs[0]):
        _close(lp, _reference(_image_prompt(), r, 9))


def test_greedy_decodes_one_argmax_row_and_eos_ends_it_kept(monkeypatch):
    _family(monkeypatch, "stand_in_3d", 3, "mm_token_type_ids", start=20)
    model = _StandIn("stand_in_3d")
    greedy = Sampling(max_new_tokens=5, greedy=True)
    out = rv.generate_with_images(model, [[5, 1]], 4, greedy, eos=[-1])
    (row,) = out.ids[0]
    want, fed = [], (1, 1)
    for k in range(5):
        want.append(int(_logits(*fed).argmax()))
        fed = (want[-1], 20 + k)
    assert row == want and out.truncated == [[True]] and model.cache.reorders == [[0]]
    _close(out.logprobs[0][0], _reference([5, 1], want, 20))
    k = next(k for k, t in enumerate(want) if k and t not in want[:k])  # a token not decoded before
    model.calls.clear()
    cut = rv.generate_with_images(model, [[5, 1]], 1, greedy, eos=[want[k], 99])
    assert cut.ids == [[want[: k + 1]]] and cut.truncated == [[False]] and len(cut.logprobs[0][0]) == k + 1
    assert len(model.calls) == 1 + k  # the loop ends at the step every row has said EOS


def test_rows_that_said_eos_are_cut_there_while_the_others_decode_on(monkeypatch):
    _family(monkeypatch, "stand_in_3d", 3, "mm_token_type_ids", start=20)
    model = _StandIn("stand_in_3d")
    out = rv.generate_with_images(model, [[5, 1]], 6, Sampling(max_new_tokens=6), eos=[0, 3], seed=7)
    assert any(not c for c in out.truncated[0]) and any(len(r) > 1 for r in out.ids[0])
    steps = 0
    for r, c, lp in zip(out.ids[0], out.truncated[0], out.logprobs[0]):
        assert c == (r[-1] not in (0, 3)) and not set(r[:-1]) & {0, 3} and len(lp) == len(r)
        _close(lp, _reference([5, 1], r, 20))
        steps = max(steps, len(r))
    assert len(model.calls) == steps  # the prefill, then a step for each token after the first


def test_a_seed_draws_the_same_rows_from_its_own_generator_and_none_the_processs(monkeypatch):
    _family(monkeypatch, "stand_in_3d", 3, "mm_token_type_ids", start=20)
    model = _StandIn("stand_in_3d")
    sampling = Sampling(max_new_tokens=6)
    draw = lambda seed: rv.generate_with_images(model, [[5, 1]], 4, sampling, eos=[-1], seed=seed).ids  # noqa: E731
    a = draw(1)
    torch.rand(3)
    assert draw(1) == a and draw(2) != a and len({tuple(r) for r in a[0]}) > 1
    torch.manual_seed(5)
    b = draw(None)
    torch.manual_seed(5)
    assert draw(None) == b and draw(None) != b


def test_the_sampling_settings_reach_the_sampler_and_only_sampling_warns(monkeypatch):
    _family(monkeypatch, "stand_in_3d", 3, "mm_token_type_ids", start=20)
    model = _StandIn("stand_in_3d")
    warned, picked = [], []
    monkeypatch.setattr(rv, "warn_truncated_sampling", lambda top_p, top_k: warned.append((top_p, top_k)))

    def pick(logits, **kw):
        picked.append(kw)
        return logits.argmax(-1)

    monkeypatch.setattr(rv, "sample_tokens", pick)
    sampling = Sampling(max_new_tokens=2, temperature=0.7, top_p=0.9, top_k=3)
    out = rv.generate_with_images(model, [[5, 1]], 2, sampling, eos=[-1], seed=4)
    assert warned == [(0.9, 3)] and len(picked) == 2
    assert [(k["temperature"], k["top_p"], k["top_k"], k["generator"].initial_seed()) for k in picked] == [
        (0.7, 0.9, 3, 4)] * 2
    _close(out.logprobs[0][0], _reference([5, 1], out.ids[0][0], 20, temperature=0.7))
    rv.generate_with_images(model, [[5, 1]], 2, Sampling(max_new_tokens=2, top_k=3, greedy=True), eos=[-1])
    assert warned == [(0.9, 3)] and len(picked) == 2


def test_sampling_runs_in_eval_mode_and_puts_back_the_mode_even_when_a_forward_fails(monkeypatch):
    _family(monkeypatch, "stand_in_3d", 3, "mm_token_type_ids", start=20)
    for training in (True, False):
        model = _StandIn("stand_in_3d")
        model.train(training)
        rv.generate_with_images(model, [[5, 1]], 2, Sampling(max_new_tokens=2), eos=[-1], seed=0)
        assert [c["training"] for c in model.calls] == [False, False] and model.training is training
    model = _StandIn("stand_in_3d", fail_at=2)
    model.train()
    with pytest.raises(RuntimeError, match="the forward failed"):
        rv.generate_with_images(model, [[5, 1]], 2, Sampling(max_new_tokens=3), eos=[-1], seed=0)
    assert model.training


def test_the_loop_ends_at_the_step_the_last_row_says_eos_and_each_row_is_cut_at_its_own(monkeypatch):
    """A scripted sampler: row r says EOS at step r, the others 1. Rows that said EOS earlier count as done."""
    _family(monkeypatch, "stand_in_3d", 3, "mm_token_type_ids", start=20)
    model = _StandIn("stand_in_3d")
    steps = []

    def pick(logits, **kw):
        steps.append(len(steps))
        return torch.tensor([0 if r == steps[-1] else 1 for r in range(3)])

    monkeypatch.setattr(rv, "sample_tokens", pick)
    out = rv.generate_with_images(model, [[5, 1]], 3, Sampling(max_new_tokens=8), eos=[0], seed=0)
    assert out.ids == [[[0], [1, 0], [1, 1, 0]]] and out.truncated == [[False] * 3]
    assert steps == [0, 1, 2] and len(model.calls) == 3
    for r, lp in zip(out.ids[0], out.logprobs[0]):
        _close(lp, _reference([5, 1], r, 20))
