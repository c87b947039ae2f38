"""grpo/engine/vision_logprobs.py over stand-ins (a vision-language model whose tower, language model and head are
known functions; prompts built by hand): the image slots and positions of the packed row, the checks and their
messages, what the language model is handed in the shared layout and the model in the standard one, the log-probs
and entropies both return (equal to the stand-in's own per-sequence forward), micro-batches, and the image side's
gradients. tests/engine/test_vision_logprobs.py runs the tiny models of every family."""
import dataclasses
import types

import pytest
import torch

from grpo.engine import plan_micro_batches
from grpo.engine import vision_families as vf
from grpo.engine import vision_logprobs as vl
from grpo.engine.layout import ACTIVE, build_layout
from grpo.engine.prefix_attention import ATTN_NAME, LAYOUT_KWARG
from grpo.vision.images import ImagePrompt

H, V, D = 6, 20, 4  # hidden size, vocabulary, pixel features
QIMG = 7  # Qwen's image token: inside the vocabulary (a completion may sample it)
GIMG = V  # Gemma 3's: past the vocabulary, as the real one may be
K = 2  # Gemma 3's tokens per image
SCALE = 0.5  # the head's logit scale (Cohere's transform: the language model's config says it)


class StandInAttention(torch.nn.Module):
    """What the shared layout's feature check reads: one attention layer through transformers' interface."""

    layer_idx = 0

    def forward(self, x):
        return "ALL_ATTENTION_FUNCTIONS", x


class Text(torch.nn.Module):
    """A language model of one layer: each token's input embedding plus, per rotary axis, a table's row at its
    position, plus every deepstack feature at the masked slots, then plus the mean of that over the tokens it sees
    (causal; in the shared layout its own segment and its prompt's). It counts one attention call into the layout
    it is handed (as our attention does per layer) and records what it was handed and what attention was on."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(model_type="cohere", logit_scale=SCALE, num_hidden_layers=1,
                                            num_attention_heads=1, _attn_implementation="sdpa")
        self.embed = torch.nn.Embedding(V, H)
        self.table = torch.nn.Parameter(torch.randn(3, 40, H))
        self.attn = StandInAttention()
        self.seen, self.counts = [], True

    def forward(self, inputs_embeds, position_ids, attention_mask, use_cache, visual_pos_masks=None,
                deepstack_visual_embeds=None, **layout):
        assert set(layout) <= {LAYOUT_KWARG}
        self.seen.append({"embeds": inputs_embeds, "positions": position_ids, "mask": attention_mask,
                          "use_cache": use_cache, "visual": visual_pos_masks, "deep": deepstack_visual_embeds,
                          "layout": layout.get(LAYOUT_KWARG), "attn": self.config._attn_implementation,
                          "active": ACTIVE.get()})
        if layout and self.counts:
            layout[LAYOUT_KWARG].calls += 1
        axes = position_ids if position_ids.dim() == 3 else position_ids[None]  # (axes, rows, T)
        x = inputs_embeds + sum(self.table[a][axes[a]] for a in range(len(axes)))
        for d in deepstack_visual_embeds or []:  # (masked_scatter refuses features of another dtype)
            x = x + torch.zeros_like(x).masked_scatter(visual_pos_masks[..., None], d)
        T = x.shape[1]
        seen = torch.ones(T, T, dtype=torch.bool).tril()
        if layout:  # the shared layout: a token sees its own segment and its prompt's
            seg, pseg = layout[LAYOUT_KWARG].segment, layout[LAYOUT_KWARG].prompt_segment
            seen = seen & ((seg[None, :] == seg[:, None]) | (seg[None, :] == pseg[:, None]))
        return types.SimpleNamespace(last_hidden_state=x + (seen / seen.sum(-1, keepdim=True)) @ x)


class Tower(torch.nn.Module):
    """float64 (not the embeddings' dtype): features the engine must cast."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(D, H, dtype=torch.float64)
        self.deep = torch.nn.Linear(D, H, dtype=torch.float64)


class Core(torch.nn.Module):
    """The multimodal core (``model.model``): its tower under the family's name, its language model, the family's
    image features and (Qwen) rope index, and its own forward (what the standard layout calls), which puts the
    features at the tokens its kinds mark (at the image ids when the family takes no kinds)."""

    def __init__(self, config, deepstack):
        super().__init__()
        self.config, self.deepstack = config, deepstack
        self.language_model = Text()
        setattr(self, vf.FAMILIES[config.model_type].tower, Tower())
        self.asked, self.calls = [], []

    def get_input_embeddings(self):
        return self.language_model.embed

    def tower(self):
        return getattr(self, vf.family_of(self).tower)

    def get_image_features(self, pixel_values, grid=None, return_dict=False):
        self.asked.append((pixel_values, grid, return_dict))
        feats, deep = self.tower().proj(pixel_values), self.tower().deep(pixel_values)
        if grid is None:  # Gemma 3: (images, tokens, hidden)
            return types.SimpleNamespace(pooler_output=feats)
        split = [int(g.prod()) for g in grid]  # Qwen: one tensor per image
        layers = [list(deep.split(split)), list((2 * deep).split(split))] if self.deepstack else None
        return types.SimpleNamespace(pooler_output=list(feats.split(split)), deepstack_features=layers)

    def get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw):
        """(3, rows, L): text positions one after the other, each image on its (t, h, w) grid from there, the text
        after it from the largest position + 1."""
        out = torch.zeros(3, *input_ids.shape, dtype=torch.long)
        grids = iter(image_grid_thw.tolist())
        for n, kinds in enumerate(mm_token_type_ids.tolist()):
            cur, j = 0, 0
            while j < len(kinds):
                if kinds[j]:
                    t, h, w = next(grids)
                    for q in range(t * h * w):
                        out[:, n, j + q] = torch.tensor([cur + q // (h * w), cur + q // w % h, cur + q % w])
                    j += t * h * w
                    cur = int(out[:, n, :j].max()) + 1
                else:
                    out[:, n, j], cur, j = cur, cur + 1, j + 1
        return out, None

    def forward(self, input_ids, attention_mask, use_cache, **kw):
        self.calls.append({"ids": input_ids, "mask": attention_mask, "use_cache": use_cache, **kw})
        family = vf.family_of(self)
        marked = (kw[family.kinds_kwarg] if family.kinds_kwarg else input_ids == self.config.image_token_id).bool()
        embeds = self.get_input_embeddings()(input_ids.masked_fill(marked, 0))
        extra = {}
        if "pixel_values" in kw:
            out = self.get_image_features(kw["pixel_values"], kw.get("image_grid_thw"), return_dict=True)
            feats = torch.cat(out.pooler_output) if isinstance(out.pooler_output, list) else out.pooler_output
            embeds = embeds.masked_scatter(marked[..., None], feats.flatten(0, -2).to(embeds.dtype))
            if getattr(out, "deepstack_features", None):
                extra = {"visual_pos_masks": marked,
                         "deepstack_visual_embeds": [torch.cat(f).float() for f in out.deepstack_features]}
        if family.axes == 3:
            positions = self.get_rope_index(input_ids, marked.int(), kw.get("image_grid_thw", torch.zeros(0, 3)))[0]
        else:
            positions = torch.arange(input_ids.shape[1]).expand(len(input_ids), -1)
        return self.language_model(inputs_embeds=embeds, position_ids=positions, attention_mask=attention_mask,
                                   use_cache=use_cache, **extra)


class VLM(torch.nn.Module):
    def __init__(self, model_type, deepstack=False):
        super().__init__()
        image = GIMG if model_type == "gemma3" else QIMG
        self.config = types.SimpleNamespace(model_type=model_type, image_token_id=image, mm_tokens_per_image=K,
                                            vision_config=types.SimpleNamespace(spatial_merge_size=1))
        self.model = Core(self.config, deepstack)
        self.lm_head = torch.nn.Linear(H, V, bias=False)

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def get_output_embeddings(self):
        return self.lm_head


def model(model_type="gemma3", deepstack=False):
    torch.manual_seed(0)
    return VLM(model_type, deepstack)


def pixels(n, *shape):
    return torch.randn(n, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(n))


def qwen_prompt(ids, grids):
    grid = torch.tensor(grids, dtype=torch.long).view(-1, 3)
    return ImagePrompt(ids, pixels(int(grid.prod(-1).sum()), D), grid)


def gemma_prompt(ids):
    n = ids.count(GIMG) // K
    return ImagePrompt(ids, pixels(n, K, D)) if n else ImagePrompt(ids)


Q = QIMG
QWEN = [qwen_prompt([1, Q, Q, Q, Q, 2], [[1, 2, 2]]),  # an image of 2 x 2 patches
        qwen_prompt([3, Q, Q, 4, Q, Q, Q, 5, 6], [[1, 1, 2], [1, 3, 1]]),  # two images
        ImagePrompt([8, 9, 10])]  # text only
G = GIMG
GEMMA = [gemma_prompt([1, 2, G, G, 3]), gemma_prompt([4, G, G, 5, G, G, 6, 7]), gemma_prompt([8, 9])]
COMPS = [[[3, Q, 5], [9]], [[Q, 2, 11, 4], [], [6]], [[1, 2]]]  # ragged, an image token sampled, an empty one


def prompts_of(m):
    return GEMMA if m.config.model_type == "gemma3" else QWEN


def own_forward(m, p, r, temperature=1.0):
    """The stand-in's own forward on the one row [P; R]: (log-probs, entropies) of R."""
    family = vf.family_of(m)
    ids = torch.tensor([p.ids + r])
    kinds = torch.zeros_like(ids, dtype=torch.int)
    kinds[0, :len(p.ids)] = torch.tensor(p.ids) == m.config.image_token_id
    inputs = family.image_inputs([p]) if p.n_images else {}
    h = m.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                **({family.kinds_kwarg: kinds} if family.kinds_kwarg else {}), **inputs).last_hidden_state[0]
    logp = torch.log_softmax(m.lm_head(h[len(p.ids) - 1:-1]) * SCALE / temperature, -1)
    return logp.gather(-1, torch.tensor(r)[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def reference(m, prompts, comps, temperature=1.0):
    with torch.no_grad():
        both = [[own_forward(m, p, r, temperature) for r in cs] for p, cs in zip(prompts, comps)]
    return [[lp for lp, _ in g] for g in both], [[e for _, e in g] for g in both]


def assert_close(got, want):
    assert [[len(x) for x in g] for g in got] == [[len(x) for x in g] for g in want]
    for xs, ys in zip(got, want):
        for x, y in zip(xs, ys):
            assert x.dtype == torch.float32 and torch.allclose(x, y, atol=1e-5), (x, y)


# --------------------------------------------------------------------------------------------- pure functions
def test_image_slots_are_the_prompts_image_tokens_in_the_packed_row_never_a_completions():
    layout = build_layout([[1, 9, 9, 2], [9, 3]], [[[9, 4], [5]], [[9]]], "cpu")
    assert layout.input_ids[0].tolist() == [1, 9, 9, 2, 9, 4, 5, 9, 3, 9]
    got = vl.image_slots(layout, 9)
    assert got.tolist() == [1, 2, 7] and got.dtype == torch.long
    one = vl.image_slots(build_layout([[1, 9]], [[[9]]], "cpu"), 9)
    assert one.shape == (1,) and one.tolist() == [1]


def test_completion_positions_run_from_start_in_every_axis():
    assert vl.completion_positions(5, 3).tolist() == [[5, 6, 7]] * 3
    assert vl.completion_positions(5, 3, 1).tolist() == [[5, 6, 7]]
    assert vl.completion_positions(2, 0).shape == (3, 0)


def test_packed_positions_in_one_axis_restart_every_completion_after_its_prompt():
    m = model("gemma3")
    got = vl.packed_positions(m.model, GEMMA[::2], [[[1, 2], [3]], [[4, 5, 6]]], GIMG)
    assert got.shape == (1, 13) and got.tolist() == [[0, 1, 2, 3, 4, 5, 6, 5, 0, 1, 2, 3, 4]]


def test_qwen_prompt_positions_are_the_rope_index_and_completions_start_after_the_largest():
    m = model("qwen2_vl")
    p = qwen_prompt([1, Q, Q, Q, Q, Q, Q], [[1, 2, 3]])  # ends with its image: the axes' largest positions differ
    want = [[0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 2, 2, 2], [0, 1, 2, 3, 1, 2, 3]]
    assert vl.prompt_positions(m.model, p, Q).tolist() == want
    got = vl.packed_positions(m.model, [p, QWEN[2]], [[[5, 6], [7]], [[8]]], Q)
    assert got.shape == (3, 1, 7 + 3 + 3 + 1)
    assert got[:, 0].tolist() == [row + [4, 5, 4, 0, 1, 2, 3] for row in want]


# --------------------------------------------------------------------------------------------- the checks
def test_the_checks_refuse_in_one_line_each_and_return_the_core():
    m = model("gemma3")
    served = ", ".join(vl.VISION_FAMILIES)
    assert vl._check(m, GEMMA, COMPS, 1e-3) is m.model
    for bad, message in [
            ("lfm2_vl", f"lfm2_vl is not served: {vl.NOT_SERVED['lfm2_vl']}; served: {served}"),
            ("llama", f"vision_token_logprobs serves {served} models, not 'llama'")]:
        m.config.model_type = bad
        with pytest.raises(ValueError) as e:
            vl._check(m, GEMMA, COMPS, 1.0)
        assert str(e.value) == message
    del m.config.model_type
    with pytest.raises(ValueError, match=f"serves {served} models, not None$"):
        vl._check(m, GEMMA, COMPS, 1.0)
    m.config.model_type = "gemma3"
    with pytest.raises(ValueError, match="^3 prompts but 2 completion groups$"):
        vl._check(m, GEMMA, COMPS[:2], 1.0)
    for t in (0, -1.0):
        with pytest.raises(ValueError, match=f"^temperature must be > 0, got {t}$"):
            vl._check(m, GEMMA, COMPS, t)


def test_a_prompt_whose_image_tokens_are_not_its_images_or_an_empty_one_is_refused():
    m, p = model("gemma3"), GEMMA[1]
    short = ImagePrompt(p.ids[:-3], p.pixel_values)  # one image token dropped: 3 for 2 images of 2
    with pytest.raises(ValueError) as e:
        vl.vision_token_logprobs(m, [GEMMA[0], short], [[[1]], [[1]]])
    assert str(e.value) == "group 1: the prompt has 3 image tokens but its images make 4"
    with pytest.raises(ValueError) as e:
        vl.vision_token_logprobs(m, [ImagePrompt([])], [[[1]]])
    assert str(e.value) == "group 0: the prompt has 0 image tokens but its images make 0 (the prompt is empty)"
    q = model("qwen2_vl")
    with pytest.raises(ValueError, match="group 0: the prompt has 4 image tokens but its images make 6$"):
        vl.vision_token_logprobs(q, [qwen_prompt(QWEN[0].ids, [[1, 2, 3]])], [[[1]]])


def test_a_language_model_the_shared_layout_cannot_serve_is_refused_and_the_standard_layout_serves_it():
    m = model("gemma3")
    m.model.language_model.attn.gradient_checkpointing = True  # and no function of transformers' to wrap
    with pytest.raises(ValueError) as e:
        vl.vision_token_logprobs(m, GEMMA, COMPS)
    assert str(e.value) == ("the shared layout cannot serve this model's language model (gradient checkpointing is "
                            "applied by a mechanism the engine cannot follow); call with shared_prefix=False")
    assert_close(vl.vision_token_logprobs(m, GEMMA, COMPS, shared_prefix=False), reference(m, GEMMA, COMPS)[0])


def test_a_layer_that_bypasses_our_attention_is_caught_after_the_forward():
    m = model("gemma3")
    m.model.language_model.counts = False
    with pytest.raises(RuntimeError, match="only 0 of 1 attention layers"):
        vl.vision_token_logprobs(m, GEMMA, COMPS)


# --------------------------------------------------------------------------------------------- the shared layout
@pytest.mark.parametrize("kind", ["gemma3", "qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_shared_layout_is_the_per_sequence_forward(kind, temperature):
    m = model(kind, deepstack=kind == "qwen3_vl")
    prompts = prompts_of(m)
    want_lp, want_ent = reference(m, prompts, COMPS, temperature)
    m.model.language_model.seen.clear()
    with torch.no_grad():
        lp, ent = vl.vision_token_logprobs(m, prompts, COMPS, temperature=temperature, return_entropy=True)
    assert_close(lp, want_lp)
    assert_close(ent, want_ent)
    assert len(m.model.language_model.seen) == 1


def test_the_language_model_is_handed_the_packed_row_its_positions_and_our_attention():
    m = model("qwen3_vl", deepstack=True)
    text, image = m.model.language_model, QIMG
    with torch.no_grad():
        vl.vision_token_logprobs(m, QWEN, COMPS)
    seen = text.seen[0]
    layout = seen["layout"]
    assert seen["attn"] == ATTN_NAME and seen["active"] is layout and text.config._attn_implementation == "sdpa"
    assert seen["use_cache"] is False and seen["mask"].shape == (1, 1, 1, 0)
    assert layout.calls == 1 and layout.blocks is None  # Qwen: causal throughout
    assert torch.equal(seen["positions"], vl.packed_positions(m.model, QWEN, COMPS, image))
    row = layout.input_ids[0]
    slots = vl.image_slots(layout, image)
    assert len(slots) == 4 + 5 and (row == image).sum() == 9 + 2  # two sampled image tokens stay text
    feats = m.model.visual.proj(torch.cat([p.pixel_values for p in QWEN[:2]])).float()
    want = text.embed(row.masked_fill(row == image, 0))
    want[slots] = feats
    sampled = row == image
    sampled[slots] = False
    want[sampled] = text.embed.weight[image]
    assert seen["embeds"].shape == (1, len(row), H) and torch.allclose(seen["embeds"][0], want)
    assert seen["visual"].tolist() == [[j in slots.tolist() for j in range(len(row))]]
    deep = m.model.visual.deep(torch.cat([p.pixel_values for p in QWEN[:2]]))
    assert [d.dtype for d in seen["deep"]] == [torch.float32] * 2
    assert torch.allclose(seen["deep"][0], deep.float()) and torch.allclose(seen["deep"][1], 2 * deep.float())


def test_gemmas_image_blocks_reach_the_layout_and_its_tower_runs_once_per_prompt():
    m = model("gemma3")
    with torch.no_grad():
        vl.vision_token_logprobs(m, GEMMA, COMPS)
    layout = m.model.language_model.seen[0]["layout"]
    starts = [0, 5 + 4, 5 + 4 + 8 + 5]  # each prompt's place in the row
    runs = [(starts[0] + 2, starts[0] + 4), (starts[1] + 1, starts[1] + 3), (starts[1] + 4, starts[1] + 6)]
    want = [-1] * layout.n_tokens
    for n, (s, e) in enumerate(runs):
        want[s:e] = [n] * (e - s)
    assert layout.blocks.tolist() == want
    (pixel_values, grid, return_dict), = m.model.asked
    assert torch.equal(pixel_values, torch.cat([GEMMA[0].pixel_values, GEMMA[1].pixel_values])) and return_dict


def test_prompts_as_token_lists_and_completions_as_tensors_are_taken():
    m = model("qwen2_vl")
    got = vl.vision_token_logprobs(m, [[8, 9, 10]], [[torch.tensor([3, 4]), [5]]])
    assert_close(got, reference(m, [ImagePrompt([8, 9, 10])], [[[3, 4], [5]]])[0])


def test_the_defaults_are_the_shared_layout_at_temperature_one_without_entropy():
    m = model("gemma3")
    got = vl.vision_token_logprobs(m, GEMMA, COMPS)
    assert isinstance(got, list) and m.model.calls == [] and m.model.language_model.seen[0]["layout"] is not None
    assert_close(got, reference(m, GEMMA, COMPS)[0])


@pytest.mark.parametrize("shared", [True, False])
def test_nothing_to_score_runs_no_forward(shared):
    m = model("gemma3")
    lp, ent = vl.vision_token_logprobs(m, GEMMA, [[[]], [[], []], []], shared_prefix=shared, return_entropy=True)
    assert [[x.tolist() for x in g] for g in lp] == [[[]], [[], []], []] == [[x.tolist() for x in g] for g in ent]
    assert m.model.calls == [] and m.model.language_model.seen == [] and m.model.asked == []


# --------------------------------------------------------------------------------------------- the standard layout
@pytest.mark.parametrize("kind", ["gemma3", "qwen3_vl"])
def test_the_standard_layout_is_the_per_sequence_forward_each_row_with_its_own_pixels(kind):
    m = model(kind, deepstack=True)
    prompts, image = prompts_of(m), m.config.image_token_id
    want_lp, want_ent = reference(m, prompts, COMPS, 0.7)
    m.model.calls.clear()
    with torch.no_grad():
        lp, ent = vl.vision_token_logprobs(m, prompts, COMPS, shared_prefix=False, temperature=0.7,
                                           return_entropy=True)
    assert_close(lp, want_lp)
    assert_close(ent, want_ent)
    call, = m.model.calls
    rows = [(p, r) for p, cs in zip(prompts, COMPS) for r in cs if r]
    L = max(len(p) + len(r) for p, r in rows)
    assert call["ids"].tolist() == [p.ids + r + [0] * (L - len(p) - len(r)) for p, r in rows]
    assert call["mask"].tolist() == [[1] * (len(p) + len(r)) + [0] * (L - len(p) - len(r)) for p, r in rows]
    assert call["ids"].dtype == call["mask"].dtype == torch.long and call["use_cache"] is False
    kinds = call[vf.family_of(m).kinds_kwarg]
    assert kinds.dtype == torch.int32
    assert kinds.tolist() == [[int(t == image) for t in p.ids] + [0] * (L - len(p)) for p, r in rows]
    family = vf.family_of(m)
    images = family.image_inputs([p for p, _ in rows if p.n_images])
    assert call.keys() == {"ids", "mask", "use_cache", family.kinds_kwarg, *images}
    assert all(torch.equal(call[k], v) for k, v in images.items())


def test_a_family_without_token_kinds_is_not_handed_any_and_its_language_model_is_its_own():
    m = model("gemma3")
    m.model.text_model = m.model.language_model
    plain = dataclasses.replace(vf.FAMILIES["gemma3"], kinds_kwarg=None, text="text_model")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(vf.FAMILIES, "gemma3", plain)
        got = vl.vision_token_logprobs(m, GEMMA[:1], [[[3, 4]]], shared_prefix=False)
        assert m.model.calls[0].keys() == {"ids", "mask", "use_cache", "pixel_values"}
        assert_close(got, reference(m, GEMMA[:1], [[[3, 4]]])[0])


@pytest.mark.parametrize("kind", ["gemma3", "qwen2_vl"])
def test_a_micro_batch_of_text_prompts_hands_the_standard_forward_no_image_inputs(kind, monkeypatch):
    m = model(kind)
    prompts = prompts_of(m)[2:]
    family = vf.family_of(m)
    asked = []
    monkeypatch.setitem(vf.FAMILIES, kind, dataclasses.replace(
        family, image_inputs=lambda ps: asked.append(ps) or family.image_inputs(ps)))
    got = vl.vision_token_logprobs(m, prompts, COMPS[2:], shared_prefix=False)
    assert asked == [] and m.model.calls[0].keys() == {"ids", "mask", "use_cache", family.kinds_kwarg}
    assert_close(got, reference(m, prompts, COMPS[2:])[0])


# --------------------------------------------------------------------------------------------- micro-batches
@pytest.mark.parametrize("shared", [True, False])
def test_micro_batches_give_the_same_log_probs(shared):
    m = model("qwen3_vl", deepstack=True)
    want = reference(m, QWEN, COMPS)[0]
    m.model.calls.clear()
    text = m.model.language_model
    text.seen.clear()
    budget = 18
    lens = [len(p) for p in QWEN], [[len(r) for r in cs] for cs in COMPS]
    plan = plan_micro_batches(*lens, budget, shared_prefix=shared)
    assert len(plan) != len(plan_micro_batches(*lens, budget, shared_prefix=not shared))
    with torch.no_grad():
        got = vl.vision_token_logprobs(m, QWEN, COMPS, shared_prefix=shared, max_tokens_per_micro_batch=budget)
    assert_close(got, want)
    forwards = sum(any(r for g, sl in mb for r in COMPS[g][sl]) for mb in plan)  # none for an empty one
    assert len(text.seen) == forwards and len(m.model.calls) == (0 if shared else forwards)


def test_the_standard_layout_cuts_micro_batches_by_its_own_token_count(monkeypatch):
    """Every row carries its prompt there: the budget counts P + S_i per completion, not P once per group."""
    m, budget = model("qwen2_vl"), 18
    lens = [len(p) for p in QWEN], [[len(r) for r in cs] for cs in COMPS]
    want = [[COMPS[g][sl] for g, sl in mb] for mb in plan_micro_batches(*lens, budget, shared_prefix=False)]
    assert want != [[COMPS[g][sl] for g, sl in mb] for mb in plan_micro_batches(*lens, budget)]
    handed, standard = [], vl._forward_standard
    monkeypatch.setattr(vl, "_forward_standard", lambda vlm, core, prompts, comps, *rest: handed.append(comps)
                        or standard(vlm, core, prompts, comps, *rest))
    with torch.no_grad():
        vl.vision_token_logprobs(m, QWEN, COMPS, shared_prefix=False, max_tokens_per_micro_batch=budget)
    assert handed == want


# --------------------------------------------------------------------------------------------- the image side
def test_the_image_side_gets_a_gradient_of_zero_from_a_micro_batch_without_images():
    m = model("gemma3")
    tower = m.model.vision_tower
    zero = vl.image_side_zero(m.model)
    assert zero.item() == 0 and zero.requires_grad
    lp = vl.vision_token_logprobs(m, GEMMA[2:], COMPS[2:])
    assert_close(lp, reference(m, GEMMA[2:], COMPS[2:])[0])
    sum(x.sum() for g in lp for x in g).backward()
    assert all(p.grad is not None and not p.grad.any() for p in tower.parameters())
    assert m.lm_head.weight.grad.any()
    tower.requires_grad_(False)  # frozen: nothing on the image side to reach
    assert vl.image_side_zero(m.model) == 0.0 and not isinstance(vl.image_side_zero(m.model), torch.Tensor)
    assert_close(vl.vision_token_logprobs(m, GEMMA[2:], COMPS[2:]), reference(m, GEMMA[2:], COMPS[2:])[0])


def test_the_tower_trains_through_the_shared_layout_and_the_zero_is_only_where_needed(monkeypatch):
    m = model("gemma3")
    asked = []
    zero = vl.image_side_zero
    monkeypatch.setattr(vl, "image_side_zero", lambda core: asked.append(core) or zero(core))
    lp = vl.vision_token_logprobs(m, GEMMA[:2], COMPS[:2])
    sum(x.sum() for g in lp for x in g).backward()
    assert m.model.vision_tower.proj.weight.grad.abs().sum() > 0 and asked == []
    with torch.no_grad():
        vl.vision_token_logprobs(m, GEMMA, COMPS)
    assert asked == []
    vl.vision_token_logprobs(m, GEMMA, COMPS, max_tokens_per_micro_batch=13)  # one group each
    assert asked == [m.model]
