"""grpo/engine/vision_families.py over stand-ins (image prompts built by hand, a core that records what its vision
tower and rope index are asked): each family's image-token count, pixel inputs, features, positions and bidirectional
spans, and which entry a model type gets. tests/engine/test_vision_logprobs.py runs the tiny models of every family."""
import types

import pytest
import torch

from grpo.engine import vision_families as vf
from grpo.vision.images import ImagePrompt

IMG = 9


def qwen_config(merge=2):
    return types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=merge))


def qwen_prompt(grids, ids=(1, 2)):
    grid = torch.tensor(grids, dtype=torch.long).view(-1, 3)
    patches = int(grid.prod(-1).sum())
    pixels = torch.arange(patches * 2, dtype=torch.float32).view(patches, 2) + 100 * len(grids)
    return ImagePrompt(list(ids), pixels, grid)


class Core:
    """A multimodal core: its input embeddings (for the device), a tower that answers with one feature per row of
    pixels, the rope index of a prompt with images."""

    def __init__(self, model_type="qwen2_vl", deepstack=False):
        self.config = types.SimpleNamespace(model_type=model_type)
        self.emb = torch.nn.Embedding(3, 2)
        self.language_model, self.text_model = "the language model", "the text model"
        self.asked, self.deepstack = [], deepstack

    def get_input_embeddings(self):
        return self.emb

    def get_image_features(self, pixels, *rest, return_dict):
        self.asked.append((pixels, *rest, return_dict))
        per = [pixels[:2], pixels[2:]]
        deep = [[p + 1 for p in per], [p + 2 for p in per]] if self.deepstack else None
        return types.SimpleNamespace(pooler_output=per if self.config.model_type != "gemma3" else pixels[:, None],
                                     deepstack_features=deep)

    def get_rope_index(self, ids, mm_token_type_ids, image_grid_thw):
        self.asked.append((ids, mm_token_type_ids, image_grid_thw))
        P = ids.shape[1]
        return torch.arange(3 * 2 * P).view(3, 2, P), None


def test_qwens_image_tokens_are_its_patches_over_the_merge_squared():
    got = vf._qwen_image_tokens(qwen_config(2), qwen_prompt([[1, 4, 6], [1, 2, 2]]))
    assert got == (24 + 4) // 4 and type(got) is int
    assert vf._qwen_image_tokens(qwen_config(1), qwen_prompt([[1, 2, 3]])) == 6
    assert vf._qwen_image_tokens(qwen_config(2), ImagePrompt([1, 2])) == 0


def test_qwens_inputs_are_every_prompts_pixels_and_grids_in_order():
    a, b = qwen_prompt([[1, 2, 2]]), qwen_prompt([[1, 2, 1], [1, 1, 2]])
    got = vf._qwen_image_inputs([a, b])
    assert got.keys() == {"pixel_values", "image_grid_thw"}
    assert torch.equal(got["pixel_values"], torch.cat([a.pixel_values, b.pixel_values]))
    assert got["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 1], [1, 1, 2]]


@pytest.mark.parametrize("deepstack", [False, True])
def test_qwens_features_are_the_towers_merged_ones_and_its_deepstack(deepstack):
    core = Core(deepstack=deepstack)
    a, b = qwen_prompt([[1, 2, 2]]), qwen_prompt([[1, 2, 1]])
    feats, deep = vf._qwen_features(core, [a, b])
    pixels, grid, return_dict = core.asked[0]
    assert torch.equal(pixels, torch.cat([a.pixel_values, b.pixel_values])) and return_dict is True
    assert grid.tolist() == [[1, 2, 2], [1, 2, 1]]
    assert torch.equal(feats, pixels)  # the tower's per-image outputs joined
    if deepstack:
        assert [d.tolist() for d in deep] == [(pixels + 1).tolist(), (pixels + 2).tolist()]
    else:
        assert deep is None


def test_qwen2s_tower_has_no_deepstack_features():
    core = Core()
    core.get_image_features = lambda pixels, grid, return_dict: types.SimpleNamespace(pooler_output=[pixels])
    p = qwen_prompt([[1, 2, 2]])
    feats, deep = vf._qwen_features(core, [p])
    assert torch.equal(feats, p.pixel_values) and deep is None


def test_the_tiles_of_one_prompt_and_of_prompts_of_other_sizes_pad_into_one_batch():
    one = tiled(2, 3, 5, 1)
    got = vf.pad_tiles([one])
    assert torch.equal(got["pixel_values"], one.pixel_values[None])
    assert torch.equal(got["pixel_attention_mask"], one.pixel_attention_mask[None])
    got = vf.pad_tiles([one, tiled(1, 4, 2, 2)])
    assert got["pixel_values"].shape == (2, 2, 3, 4, 5) and got["pixel_attention_mask"].shape == (2, 2, 4, 5)
    assert got["pixel_attention_mask"][0, :, :3, :].all() and not got["pixel_attention_mask"][0, :, 3:].any()
    assert got["pixel_attention_mask"][1, 0, :, :2].all() and not got["pixel_attention_mask"][1, 0, :, 2:].any()
    assert got["pixel_values"][1, 0, :, :, :2].eq(2).all() and got["pixel_values"][1, 1].eq(0).all()


def test_qwens_positions_are_the_rope_index_with_images_and_text_positions_without():
    core = Core()
    ids = [1, IMG, IMG, 2, 3]
    p = qwen_prompt([[1, 2, 4]], ids)
    got = vf._qwen_positions(core, p, IMG)
    asked_ids, kinds, grid = core.asked[0]
    assert asked_ids.tolist() == [ids] and asked_ids.dtype == torch.long
    assert kinds.tolist() == [[0, 1, 1, 0, 0]] and kinds.dtype == torch.int32
    assert grid.tolist() == [[1, 2, 4]] and grid.device.type == "cpu"
    assert got.tolist() == torch.arange(30).view(3, 2, 5)[:, 0, :].tolist()  # the first (only) row's
    text = vf._qwen_positions(core, ImagePrompt([4, 5, 6]), IMG)
    assert text.shape == (3, 3) and text.tolist() == [[0, 1, 2]] * 3 and len(core.asked) == 1


def test_gemma3s_tokens_inputs_and_features():
    config = types.SimpleNamespace(mm_tokens_per_image=5)
    pixels = torch.arange(4 * 3 * 2 * 2, dtype=torch.float32).view(4, 3, 2, 2)
    a, b = ImagePrompt([1], pixels[:1]), ImagePrompt([2], pixels[1:])
    assert vf._gemma3_image_tokens(config, b) == 15 and vf._gemma3_image_tokens(config, ImagePrompt([1])) == 0
    assert torch.equal(vf._gemma3_image_inputs([a, b])["pixel_values"], pixels)
    core = Core("gemma3")
    feats, deep = vf._gemma3_features(core, [a, b])
    assert torch.equal(core.asked[0][0], pixels) and core.asked[0][-1] is True and deep is None
    assert feats.shape == (4, 3, 2, 2) and torch.equal(feats, pixels)  # (images, 1, ...) flattened over images


def test_text_positions_and_image_runs():
    assert vf.text_positions(None, ImagePrompt([5, 6, 7]), IMG).tolist() == [[0, 1, 2]]
    assert vf.image_runs([IMG, IMG, 1, IMG, 2, IMG, IMG, IMG], IMG) == [(0, 2), (3, 4), (5, 8)]
    assert vf.image_runs([1, 2], IMG) == [] and vf.image_runs([], IMG) == []
    assert vf.image_runs([1, IMG], IMG) == [(1, 2)]


def test_idefics3s_tokens_are_each_tiles_patches_shuffled():
    config = types.SimpleNamespace(vision_config=types.SimpleNamespace(patch_size=4), scale_factor=2)
    p = ImagePrompt([1], torch.zeros(3, 3, 16, 8), tiles=torch.tensor([[1, 2]]))
    assert vf._idefics3_image_tokens(config, p) == 3 * 4 * 2 // 4 and type(vf._idefics3_image_tokens(config, p)) is int
    odd = ImagePrompt([1], torch.zeros(3, 3, 18, 9), tiles=torch.tensor([[1, 2]]))  # the tower's patches: whole ones
    assert vf._idefics3_image_tokens(config, odd) == 3 * 4 * 2 // 4
    assert vf._idefics3_image_tokens(config, ImagePrompt([1])) == 0


def tiled(n, h, w, value):
    return ImagePrompt([1], torch.full((n, 3, h, w), float(value)), tiles=torch.tensor([[0, 0]]),
                       pixel_attention_mask=torch.ones(n, h, w, dtype=torch.bool))


def test_idefics3s_features_pad_the_tiles_and_join_the_towers_outputs():
    core = Core("idefics3")
    a, b = tiled(1, 2, 2, 1), tiled(3, 2, 2, 2)
    feats, deep = vf._idefics3_features(core, [a, b])
    pixels, mask, return_dict = core.asked[0]
    assert pixels.shape == (2, 3, 3, 2, 2) and mask.shape == (2, 3, 2, 2) and return_dict is True
    assert mask[0].flatten(1).all(-1).tolist() == [True, False, False] and mask[1].all()
    assert deep is None and torch.equal(feats, pixels)


def test_each_model_type_gets_its_entry_and_its_language_model():
    assert set(vf.FAMILIES) == {"qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "gemma3", "idefics3",
                                "smolvlm"}
    assert {vf.FAMILIES[t].tower for t in ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")} == {
        "visual"}
    qwen, gemma, idefics = vf.FAMILIES["qwen2_vl"], vf.FAMILIES["gemma3"], vf.FAMILIES["idefics3"]
    assert (qwen.tower, qwen.kinds_kwarg, qwen.axes, qwen.text) == ("visual", "mm_token_type_ids", 3, "language_model")
    assert (gemma.tower, gemma.kinds_kwarg, gemma.axes, gemma.text) == ("vision_tower", "token_type_ids", 1,
                                                                        "language_model")
    assert (idefics.tower, idefics.kinds_kwarg, idefics.axes, idefics.text) == ("vision_model", None, 1, "text_model")
    assert vf.FAMILIES["smolvlm"] is idefics and gemma.bidirectional is vf.image_runs
    assert qwen.bidirectional([IMG, IMG], IMG) == () == idefics.bidirectional([IMG], IMG)  # causal throughout
    assert qwen.positions is vf._qwen_positions and gemma.positions is vf.text_positions is idefics.positions
    assert (idefics.image_inputs, idefics.features, idefics.image_tokens) == (
        vf.pad_tiles, vf._idefics3_features, vf._idefics3_image_tokens)
    assert (gemma.image_inputs, gemma.features, gemma.image_tokens) == (
        vf._gemma3_image_inputs, vf._gemma3_features, vf._gemma3_image_tokens)
    assert (qwen.image_inputs, qwen.features, qwen.image_tokens) == (
        vf._qwen_image_inputs, vf._qwen_features, vf._qwen_image_tokens)
    assert vf.family_of(Core("gemma3")) is gemma
    assert vf.language_model(Core("qwen3_vl")) == "the language model"
    assert vf.language_model(Core("smolvlm")) == "the text model"
    with pytest.raises(KeyError):
        vf.family_of(Core("llama"))
