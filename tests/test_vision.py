"""grpo.vision: the tiny vision-language models (Qwen2.5-VL, Qwen2-VL, Gemma 3, Idefics3) and their processors built
offline, and image prompts from every image form."""
import io

import pytest
import torch
from PIL import Image

from grpo.errors import DataError, ModelError
from grpo.models import load_image_processor, load_tokenizer, tiny_model
from grpo.tasks.shapes import draw
from grpo.vision.images import encode, load_image


def _messages(n_images, text="How many?"):
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def tok_proc():
    return load_tokenizer("tiny:qwen2_5_vl"), load_image_processor("tiny:qwen2_5_vl")


def test_tiny_vlm_is_seeded_and_has_3d_rotary(tok_proc):
    tok, _ = tok_proc
    a, b, c = (tiny_model("qwen2_5_vl", len(tok), seed=s) for s in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    assert a.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") < len(tok)
    wide = tiny_model("qwen2_5_vl", len(tok), hidden_size=96, num_attention_heads=4)
    assert sum(wide.config.text_config.rope_parameters["mrope_section"]) == 96 // 4 // 2
    with pytest.raises(ModelError, match="tiny:llava is not a known family; choose one of: .*qwen2_5_vl"):
        tiny_model("llava", len(tok))


def test_image_tokens_expand_per_image_in_order(tok_proc, tmp_path):
    tok, proc = tok_proc
    img = Image.new("RGB", (32, 24), "red")
    p = encode(_messages(2), [img, Image.new("RGB", (16, 16), "blue")], tok, proc)
    assert p.image_grid_thw.tolist() == [[1, 6, 8], [1, 4, 4]]
    text = tok.decode(p.ids)
    assert text.startswith("user: <|vision_start|>" + "<|image_pad|>" * 12 + "<|vision_end|><|vision_start|>"
                           + "<|image_pad|>" * 4 + "<|vision_end|>How many?")
    assert text.endswith("\nassistant: ")
    assert p.pixel_values.shape == (6 * 8 + 4 * 4, 3 * 2 * 4 * 4)


def test_every_image_form_gives_the_same_pixels(tok_proc, tmp_path):
    tok, proc = tok_proc
    import random
    img = draw(random.Random(0), 32, [("red", "square")])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    path = tmp_path / "a.png"
    path.write_bytes(buf.getvalue())
    forms = [img, str(path), buf.getvalue(), {"bytes": buf.getvalue(), "path": None},
             {"bytes": None, "path": str(path)}]
    pixels = [encode(_messages(1), [f], tok, proc).pixel_values for f in forms]
    assert all(torch.equal(pixels[0], x) for x in pixels[1:])
    assert load_image(Image.new("L", (8, 8))).mode == "RGB"


def test_bad_images_get_one_line(tok_proc, tmp_path):
    tok, proc = tok_proc
    img = Image.new("RGB", (16, 16))
    with pytest.raises(DataError, match="row 3: image file '/nope.png' not found"):
        encode(_messages(1), ["/nope.png"], tok, proc, where="row 3")
    with pytest.raises(DataError, match="unreadable image"):
        encode(_messages(1), [b"not a png"], tok, proc)
    with pytest.raises(DataError, match="must be a PIL image, a path, bytes"):
        encode(_messages(1), [42], tok, proc)
    with pytest.raises(DataError, match="2 image part\\(s\\) but the row has 1 image"):
        encode(_messages(2), [img], tok, proc)
    tok2 = load_tokenizer("tiny:qwen2_5_vl")
    tok2.chat_template = "{% for m in messages %}{{ m['content'][-1]['text'] }}{% endfor %}"  # drops image parts
    with pytest.raises(DataError, match="rendered 0 image placeholder\\(s\\) for 1 image"):
        encode(_messages(1), [img], tok2, proc)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "idefics3"])
def test_rows_of_three_formats_from_jsonl_and_parquet(family, tmp_path):
    """TRL's parts with image paths (JSONL), verl's <image> markers with {"bytes"} images (Parquet), a PIL column
    (a built-in task): the same picture and question give the same prompt (Idefics3 too, whose image token is
    verl's marker)."""
    import json

    import datasets

    from grpo.tasks import get_task
    from grpo.vision.images import encode_row

    tok, proc = load_tokenizer(f"tiny:{family}"), load_image_processor(f"tiny:{family}")
    row = get_task("shapes")(1, seed=0)[0]
    question = row["prompt"][0]["content"][1]["text"]
    path = tmp_path / "a.png"
    row["images"][0].save(path)
    trl = tmp_path / "trl.jsonl"
    trl.write_text(json.dumps({"prompt": row["prompt"], "images": [str(path)], "answer": row["answer"]}) + "\n")
    verl = tmp_path / "verl.parquet"
    datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "<image>" + question}],
                                 "images": [{"bytes": path.read_bytes(), "path": None}]}]).to_parquet(str(verl))
    from_trl = dict(datasets.load_dataset("json", data_files=str(trl), split="train")[0])
    from_verl = dict(datasets.load_dataset("parquet", data_files=str(verl), split="train")[0])
    got = [encode_row(r, "prompt", "images", tok, proc) for r in (row, from_trl, from_verl)]
    assert got[0].ids == got[1].ids == got[2].ids and got[0].n_images == 1
    assert all(torch.equal(got[0].pixel_values, g.pixel_values) for g in got[1:])
    with pytest.raises(DataError, match="row 0 has no image column 'image'; its columns are: prompt, images, answer"):
        encode_row(from_trl, "prompt", "image", tok, proc, where="row 0")


def test_a_text_model_or_a_text_only_backend_given_images_is_one_line(tok_proc, monkeypatch):

    from omegaconf import OmegaConf

    from grpo import data
    from grpo.config.schema import load
    from grpo.errors import SetupError
    from grpo.rollout import registry
    from grpo.tasks import get_task
    from tests.helpers import compose_recipe

    tok, proc = tok_proc
    overrides = ["rollout.backend=server", "rollout.server.urls=[http://127.0.0.1:9]", "trainer.output_dir=unused"]
    cfg = load(OmegaConf.to_container(compose_recipe("vlm-smoke", overrides), resolve=True))
    rows = get_task("shapes")(2, seed=0)
    with pytest.raises(DataError, match="data row 0 has images in data.image_column='images' but the model is a text"):
        data.prepare(rows, cfg.data, tok, image_processor=None)
    prepared, dropped = data.prepare(rows, cfg.data, tok, image_processor=proc)
    assert dropped == 0 and prepared[0]["prompt_ids"].n_images == 1
    assert prepared[0]["prompt"].startswith("user: <|vision_start|><|image_pad|><|vision_end|>How many")
    registry.check_images(cfg.rollout.backend, "server", prepared, rollout=cfg.rollout)  # the servers take them
    no_images = registry.Capabilities(remote=True)  # a backend registered without images
    monkeypatch.setattr(registry, "capabilities", lambda name: no_images if name == "server" else
                        registry.backend(name).capabilities)
    with pytest.raises(SetupError, match="rollout.backend=server \\(server\\) does not take images yet; .* need "
                                         "rollout.backend=vllm or hf or server "):
        registry.check_images(cfg.rollout.backend, registry.resolve(cfg.rollout.backend, "cpu"), prepared)
    with pytest.raises(SetupError, match="prompts with images are not supported under ZeRO-3 yet"):
        registry.check_images("hf", "hf", prepared, zero3=True)
    registry.check_images("hf", "hf", prepared)  # hf takes them in one process
    registry.check_images("server", "server", [{"prompt_ids": [1, 2]}], zero3=True)  # text prompts: nothing to say


def test_held_out_pictures_are_told_apart_by_their_pixels(tok_proc):
    """builtin:shapes asks 9 distinct questions: the train/held-out split compares the pictures too, so a train row
    is dropped only when its picture and question are a held-out one's."""
    from omegaconf import OmegaConf

    from grpo import data
    from grpo.config.schema import load
    from tests.helpers import compose_recipe

    tok, proc = tok_proc
    cfg = load(OmegaConf.to_container(compose_recipe("vlm-smoke", ["trainer.output_dir=unused", "data.num_train=20",
                                                                   "data.num_eval=4"]), resolve=True))
    splits = data.build(cfg.data, tok, image_processor=proc)
    asked = {r["prompt"] for r in splits.eval}
    by_text = [r for r in splits.train if r["prompt"] not in asked]  # what comparing the text alone would keep
    assert len(splits.eval) == 4 and len(splits.train) >= 18 > len(by_text)  # an empty picture may repeat


def test_tiny_qwen2_vl_is_seeded_with_its_own_tower():
    from grpo.vision.models import TINY_VLM_FAMILIES

    tok = load_tokenizer("tiny:qwen2_vl")
    a, b = (tiny_model("qwen2_vl", len(tok), seed=0) for _ in range(2))
    assert "qwen2_vl" in TINY_VLM_FAMILIES and a.config.model_type == "qwen2_vl"
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.config.vision_config.hidden_size == a.config.text_config.hidden_size == 64  # the tower's output width
    assert sum(a.config.text_config.rope_parameters["mrope_section"]) == 64 // 4 // 2


def test_freeze_vision_tower_key_freezes_the_tower_and_refuses_a_text_model():
    from grpo.config.schema import ModelConfig
    from grpo.models import char_tokenizer, load_model

    vocab = len(load_tokenizer("tiny:qwen2_vl"))
    model = load_model(ModelConfig(name_or_path="tiny:qwen2_vl", freeze_vision_tower=True), vocab)
    assert not any(p.requires_grad for p in model.model.visual.parameters())
    assert all(p.requires_grad for p in model.model.language_model.parameters())
    assert all(p.requires_grad for p in load_model(ModelConfig(name_or_path="tiny:qwen2_vl"), vocab).parameters())
    with pytest.raises(ModelError, match="model.freeze_vision_tower=true but 'tiny:llama' has no vision tower"):
        load_model(ModelConfig(name_or_path="tiny:llama", freeze_vision_tower=True), len(char_tokenizer()))


def test_tiny_gemma3_prompts_are_its_processors_and_its_tower_is_seeded():
    """tiny:gemma3: an image part becomes Gemma3Processor's full image sequence ("\\n\\n<start_of_image>", 16 image
    tokens, "<end_of_image>\\n\\n"), pixels one (3, 32, 32) per image whatever its size; seeded, its projection not
    Gemma's zeros; model.freeze_vision_tower freezes SigLIP and leaves the multi-modal projector training."""
    from grpo.config.schema import ModelConfig
    from grpo.models import load_model

    tok, proc = load_tokenizer("tiny:gemma3"), load_image_processor("tiny:gemma3")
    p = encode(_messages(2), [Image.new("RGB", (40, 24), "red"), Image.new("RGB", (16, 16), "blue")], tok, proc)
    image = "\n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\n"
    assert tok.decode(p.ids) == "user: " + image * 2 + "How many?\nassistant: "
    assert p.n_images == 2 and p.image_grid_thw is None and p.pixel_values.shape == (2, 3, 32, 32)
    a, b = (tiny_model("gemma3", len(tok), seed=0) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.config.image_token_id == tok.convert_tokens_to_ids("<image_soft_token>") < len(tok)
    assert a.model.multi_modal_projector.mm_input_projection_weight.abs().min() > 0
    frozen = load_model(ModelConfig(name_or_path="tiny:gemma3", freeze_vision_tower=True), len(tok))
    assert not any(q.requires_grad for q in frozen.model.vision_tower.parameters())
    assert all(q.requires_grad for q in frozen.model.multi_modal_projector.parameters())


def test_image_side_params_are_the_trainable_ones_outside_the_language_model():
    """What grpo/runtime/deepspeed.py reduces in parameter order and the engine's zero term reaches: Qwen-VL's tower
    (its merger inside), Gemma 3's tower and projector; nothing for a text model, a frozen tower or LoRA."""
    from grpo.config.schema import LoraConfig, ModelConfig
    from grpo.engine.unwrap import unwrap_model
    from grpo.models import char_tokenizer, load_model
    from grpo.vision.models import image_side_params

    def names(model):
        ids = {id(p) for p in image_side_params(model)}
        return {n.split(".")[1] if n.startswith("model.") else n for n, p in model.named_parameters() if id(p) in ids}

    vocab = len(load_tokenizer("tiny:qwen2_5_vl"))
    qwen = load_model(ModelConfig(name_or_path="tiny:qwen2_5_vl"), vocab)
    assert names(qwen) == {"visual"}
    assert len(image_side_params(qwen)) == len(list(qwen.model.visual.parameters()))
    assert image_side_params(qwen.model) == image_side_params(qwen)  # the core, as the engine passes it
    gemma = load_model(ModelConfig(name_or_path="tiny:gemma3"), len(load_tokenizer("tiny:gemma3")))
    assert names(gemma) == {"vision_tower", "multi_modal_projector"}
    frozen = load_model(ModelConfig(name_or_path="tiny:gemma3", freeze_vision_tower=True),
                        len(load_tokenizer("tiny:gemma3")))
    assert names(frozen) == {"multi_modal_projector"}  # the projector still trains
    idefics = load_model(ModelConfig(name_or_path="tiny:idefics3"), len(load_tokenizer("tiny:idefics3")))
    assert names(idefics) == {"vision_model", "connector"}
    assert image_side_params(load_model(ModelConfig(name_or_path="tiny:qwen2_5_vl", freeze_vision_tower=True),
                                        vocab)) == []
    lora = load_model(ModelConfig(name_or_path="tiny:qwen2_5_vl", lora=LoraConfig(enabled=True)), vocab)
    assert image_side_params(unwrap_model(lora)) == [] and any(p.requires_grad for p in lora.parameters())
    assert image_side_params(load_model(ModelConfig(name_or_path="tiny:llama"), len(char_tokenizer()))) == []


def _idefics3_processor(tok, proc):
    """transformers' own Idefics3Processor on the tiny tokenizer and image processor: the reference expansion."""
    from transformers import Idefics3Processor

    return Idefics3Processor(image_processor=proc, tokenizer=tok, image_seq_len=proc.image_seq_len)


@pytest.mark.parametrize("split", [True, False])
def test_tiny_idefics3_prompts_are_idefics3_processors(split):
    """tiny:idefics3: an image part becomes what Idefics3Processor writes, each tile's <fake_token_around_image>,
    <row_r_col_c> and 4 image tokens, a newline a row, then the global image (without splitting, the global image
    alone); the same ids, tiles and pixel masks as the processor's, a square picture 2x2 tiles + 1 and a 40x16 one
    1x2 + 1."""
    tok, proc = load_tokenizer("tiny:idefics3"), load_image_processor("tiny:idefics3")
    assert proc.do_image_splitting and proc.image_seq_len == 4
    if not split:
        proc.do_image_splitting = False
    images = [Image.new("RGB", (24, 24), "red"), Image.new("RGB", (40, 16), "blue")]
    p = encode(_messages(2), images, tok, proc)
    text = tok.apply_chat_template(_messages(2), tokenize=False, add_generation_prompt=True)
    ref = _idefics3_processor(tok, proc)(text=[text], images=[images], return_tensors="pt")
    assert p.ids == ref["input_ids"][0].tolist()
    assert torch.equal(p.pixel_values, ref["pixel_values"][0])
    assert torch.equal(p.pixel_attention_mask, ref["pixel_attention_mask"][0])
    tile = "<image>" * 4
    if split:
        assert p.tiles.tolist() == [[2, 2], [1, 2]] and p.pixel_values.shape == (5 + 3, 3, 16, 16)
        wide = "<fake_token_around_image><row_1_col_1>" + tile + "<fake_token_around_image><row_1_col_2>" + tile
        assert tok.decode(p.ids).startswith("user: " + wide + "\n" + wide.replace("row_1", "row_2") + "\n\n"
                                            + "<fake_token_around_image><global-img>" + tile)
    else:
        assert p.tiles.tolist() == [[0, 0], [0, 0]] and p.pixel_values.shape == (2, 3, 16, 16)
        assert tok.decode(p.ids) == "user: " + ("<fake_token_around_image><global-img>" + tile
                                                + "<fake_token_around_image>") * 2 + "How many?\nassistant: "
    assert p.n_images == 2
    import pickle

    back = pickle.loads(pickle.dumps(p))  # in-flight batches and spawned generators carry it pickled
    assert back.ids == p.ids and torch.equal(back.tiles, p.tiles) and back.n_images == 2
    assert torch.equal(back.pixel_attention_mask, p.pixel_attention_mask)


def test_idefics3_tiles_pad_as_its_processor_pads_a_batch():
    """The engine's batch of several prompts' tiles (grpo.engine.vision_families.pad_tiles) is the image processor's
    own batch of those prompts: zero tiles with zero masks after a prompt's fewer tiles."""
    from grpo.engine.vision_families import pad_tiles

    tok, proc = load_tokenizer("tiny:idefics3"), load_image_processor("tiny:idefics3")
    per_prompt = [[Image.new("RGB", (40, 16), "red")], [Image.new("RGB", (32, 32), "blue"), Image.new("RGB", (8, 20))]]
    prompts = [encode(_messages(len(imgs)), imgs, tok, proc) for imgs in per_prompt]
    ref = proc(images=per_prompt, return_tensors="pt")
    got = pad_tiles(prompts)
    assert got["pixel_values"].shape == ref["pixel_values"].shape == (2, 8, 3, 16, 16)
    assert torch.equal(got["pixel_values"], ref["pixel_values"])
    assert torch.equal(got["pixel_attention_mask"], ref["pixel_attention_mask"])
    assert got["pixel_attention_mask"][0, 3:].sum() == 0  # the first prompt's 3 tiles, then padding


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_tiny_idefics3_is_seeded_and_its_frozen_tower_leaves_the_connector_training(family):
    from grpo.config.schema import ModelConfig
    from grpo.models import load_model

    tok = load_tokenizer(f"tiny:{family}")
    a, b = (tiny_model(family, len(tok), seed=0) for _ in range(2))
    assert a.config.model_type == family
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.config.image_token_id == tok.convert_tokens_to_ids("<image>") < len(tok)
    assert a.config.text_config.model_type == "llama" and a.config.scale_factor == 2
    assert a.config.vision_config.num_hidden_layers == 2 and a.config.text_config.hidden_size == 64
    frozen = load_model(ModelConfig(name_or_path=f"tiny:{family}", freeze_vision_tower=True), len(tok))
    assert not any(q.requires_grad for q in frozen.model.vision_model.parameters())
    assert all(q.requires_grad for q in frozen.model.connector.parameters())


def test_grpo_serve_refuses_idefics3_in_one_line():
    """vLLM takes images for Qwen2.5-VL only here: grpo-serve refuses tiny:idefics3 before any model loads, naming
    the rollout that serves it."""
    from grpo.errors import SetupError
    from grpo.serve import vision

    assert vision("tiny:qwen2_5_vl") and not vision("tiny:qwen2")
    with pytest.raises(SetupError, match="grpo-serve takes images for qwen2_5_vl only .*tiny:idefics3.*; use "
                                         "rollout.backend=hf for this model"):
        vision("tiny:idefics3")


def test_tiny_smolvlm_prompts_are_smolvlm_processors():
    """tiny:smolvlm: each image's text is what SmolVLMProcessor writes for its rows and columns (its module's own
    get_image_prompt_string; the processor itself wants a video processor), its pixels and masks its image
    processor's."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    tok, proc = load_tokenizer("tiny:smolvlm"), load_image_processor("tiny:smolvlm")
    images = [Image.new("RGB", (16, 40), "red"), Image.new("RGB", (32, 32), "blue")]
    p = encode(_messages(2), images, tok, proc)
    assert p.tiles.tolist() == [[2, 1], [2, 2]] and p.pixel_values.shape == (3 + 5, 3, 16, 16)
    ref = proc(images=[images], return_tensors="pt")
    assert torch.equal(p.pixel_values, ref["pixel_values"][0])
    assert torch.equal(p.pixel_attention_mask, ref["pixel_attention_mask"][0])
    text = "".join(get_image_prompt_string(r, c, proc.image_seq_len, "<fake_token_around_image>", "<image>",
                                           "<global-img>") for r, c in p.tiles.tolist())
    assert tok.decode(p.ids) == "user: " + text + "How many?\nassistant: "


# ---- unit tests of grpo/vision/images.py (tokenizers and stand-in processors built once; what `make mutate` runs).
# The image processor modules and Idefics3Processor are imported here, at collection, so that no mutant's fork pays
# for transformers' lazy imports again.
import pickle  # noqa: E402
from dataclasses import dataclass as _dataclass  # noqa: E402

import transformers.models.gemma3.image_processing_pil_gemma3  # noqa: E402, F401
import transformers.models.idefics3.image_processing_pil_idefics3  # noqa: E402, F401
import transformers.models.idefics3.processing_idefics3  # noqa: E402, F401
import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl  # noqa: E402, F401
import transformers.models.smolvlm.image_processing_pil_smolvlm  # noqa: E402, F401
import transformers.models.smolvlm.processing_smolvlm  # noqa: E402, F401

from grpo.vision import images as vi  # noqa: E402

QWEN_TOK = load_tokenizer("tiny:qwen2_5_vl")


class _QwenProc:
    """A stand-in for Qwen's image processor: a (1, 2, 2) patch grid per image (one merged token), kwargs kept."""
    merge_size = 2

    def __init__(self):
        self.calls = []

    def __call__(self, images, **kw):
        self.calls.append((len(images), kw))
        return {"pixel_values": torch.arange(len(images) * 4.0).reshape(len(images) * 4, 1),
                "image_grid_thw": torch.tensor([[1, 2, 2]] * len(images))}


_QwenProc.__name__ = "Qwen2VLImageProcessorPil"


def test_an_image_prompt_is_its_ids_counts_its_images_and_pickles_whole():
    assert vi.ImagePrompt([3, 4]).ids == [3, 4] and vi.ImagePrompt([3]).n_images == 0
    assert vi.ImagePrompt([1], image_grid_thw=torch.ones(3, 3), pixel_values=torch.ones(7, 2)).n_images == 3
    assert vi.ImagePrompt([1], tiles=torch.ones(2, 2), pixel_values=torch.ones(8, 3)).n_images == 2
    assert vi.ImagePrompt([1], pixel_values=torch.ones(4, 3, 2, 2)).n_images == 4
    p = vi.ImagePrompt([5, 6], pixel_values=torch.ones(1), image_grid_thw=torch.zeros(1, 3), images=["a"],
                       pixel_attention_mask=torch.ones(2), tiles=torch.zeros(1, 2))
    back = pickle.loads(pickle.dumps(p))
    assert type(back) is vi.ImagePrompt and back.ids == [5, 6] and back.images == ["a"]
    for name in ("pixel_values", "image_grid_thw", "pixel_attention_mask", "tiles"):
        assert torch.equal(getattr(back, name), getattr(p, name)), name


def test_load_image_takes_every_form_and_names_where_it_failed(tmp_path):
    red, blue = Image.new("RGB", (2, 2), "red"), Image.new("RGB", (3, 3), "blue")
    buf = io.BytesIO()
    red.save(buf, format="PNG")
    blue.save(tmp_path / "b.png")
    assert vi.load_image({"bytes": buf.getvalue(), "path": str(tmp_path / "b.png")}).size == (2, 2)  # bytes first
    assert vi.load_image({"bytes": None, "path": tmp_path / "b.png"}).size == (3, 3)
    assert vi.load_image(bytearray(buf.getvalue())).getpixel((0, 0)) == (255, 0, 0)
    assert vi.load_image(Image.new("L", (1, 1))).mode == "RGB"
    with pytest.raises(DataError, match=r"^row 2: image file '.*none.png' not found$"):
        vi.load_image(tmp_path / "none.png", "row 2")
    with pytest.raises(DataError, match=r"^row 1: unreadable image \(cannot identify"):
        vi.load_image(b"xx", "row 1")
    with pytest.raises(DataError, match=r"^data row: an image must be .*; got int$"):
        vi.load_image(3)


def test_image_parts_asks_for_images_and_verls_markers():
    msgs = [{"role": "system", "content": "<image> in a string"},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "image"}]}]
    assert vi.image_parts(msgs) == 2
    assert vi.asks_for_images("<image>a<image>") == 2 and vi.asks_for_images(None) == 0
    assert vi.asks_for_images([{"role": "user"}]) == 0 and vi.asks_for_images(["text"]) == 0
    assert vi.asks_for_images(({"role": "user", "content": "<image>x<image>"},)) == 2
    assert vi.asks_for_images(msgs) == 3
    out = vi.as_parts([{"role": "user", "content": "<image>a<image><image>b", "x": 1},
                       {"role": "user", "content": "a<image>"}, {"role": "assistant", "content": "plain"}])
    assert out == [{"role": "user", "x": 1, "content": [{"type": "image"}, {"type": "text", "text": "a"},
                                                          {"type": "image"}, {"type": "image"},
                                                          {"type": "text", "text": "b"}]},
                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
                   {"role": "assistant", "content": "plain"}]


def test_images_first_go_before_the_first_user_turns_text_only():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "user", "content": "r"}]
    assert vi.images_first(msgs, 2) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "q"}]},
        {"role": "user", "content": "r"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "q"}]}]
    want = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}]
    assert vi.images_first(parts, 1) == want


def test_the_forms_token_counts_and_strings():
    form = vi.ImageForm("<p>", "<t>", before="[", after="]")
    qwen = type("P", (), {"merge_size": 2})()
    out = {"image_grid_thw": torch.tensor([[1, 4, 6], [2, 2, 2]])}
    assert form.tokens(qwen, out) == [6, 2] and form.strings(qwen, out) == ["[" + "<t>" * 6 + "]", "[<t><t>]"]
    fixed = type("P", (), {"image_seq_length": 3})()
    assert form.tokens(fixed, {"pixel_values": torch.ones(2, 3, 4, 4)}) == [3, 3]
    fields = form.fields({"pixel_values": 1, "image_grid_thw": 2, "other": 3})
    assert fields == {"pixel_values": 1, "image_grid_thw": 2}
    assert form.fields({"pixel_values": 1})["image_grid_thw"] is None
    tiled = vi.TiledForm("<image>", "<i>", before="<f>")
    assert tiled.image(2, 0, 0) == "<f><global-img><i><i><f>"
    assert tiled.image(1, 1, 2) == "<f><row_1_col_1><i><f><row_1_col_2><i>\n\n<f><global-img><i><f>"
    assert tiled.image(1, 2, 1) == "<f><row_1_col_1><i>\n<f><row_2_col_1><i>\n\n<f><global-img><i><f>"
    proc = type("P", (), {"image_seq_len": 1})()
    assert tiled.strings(proc, {"rows": [[0, 1]], "cols": [[0, 2]]}) == [tiled.image(1, 0, 0), tiled.image(1, 1, 2)]
    got = tiled.fields({"rows": [[1, 0]], "cols": [[2, 0]], "pixel_values": torch.ones(1, 4, 3),
                        "pixel_attention_mask": torch.zeros(1, 4, 2)})
    assert got["tiles"].tolist() == [[1, 2], [0, 0]] and got["tiles"].dtype == torch.long
    assert got["pixel_values"].shape == (4, 3) and got["pixel_attention_mask"].shape == (4, 2)
    assert vi.FORMS["Idefics3ImageProcessorPil"].kwargs == (("return_row_col_info", True),)


def test_encode_expands_each_placeholder_in_order_and_refuses_what_it_cannot_place():
    proc, img = _QwenProc(), Image.new("RGB", (4, 4))
    p = encode(_messages(2), [img, img], QWEN_TOK, proc)
    one = "<|vision_start|><|image_pad|><|vision_end|>"
    assert QWEN_TOK.decode(p.ids) == "user: " + one * 2 + "How many?\nassistant: "
    assert proc.calls == [(2, {"return_tensors": "pt"})] and p.n_images == 2 and p.images[0].mode == "RGB"
    assert torch.equal(p.pixel_values, torch.arange(8.0).reshape(8, 1))
    text = encode([{"role": "user", "content": "1 + 1"}], [], QWEN_TOK, None)
    assert text.ids == QWEN_TOK("user: 1 + 1\nassistant: ")["input_ids"] and text.images is None
    assert text.pixel_values is None and text.n_images == 0
    with pytest.raises(DataError, match=r"^row 4: the prompt has 1 image part\(s\) but the row has 2 image\(s\); "):
        encode(_messages(1), [img, img], QWEN_TOK, proc, where="row 4")
    with pytest.raises(DataError, match=r"^image processor object is not supported; supported: Qwen2VLImageProcessor"):
        encode(_messages(1), [img], QWEN_TOK, object())
    with pytest.raises(DataError, match=r"^row 5: the chat template rendered 2 image placeholder\(s\) for 1 image"):
        encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "<|image_pad|>"}]}], [img],
               QWEN_TOK, proc, where="row 5")


def test_encode_row_takes_one_image_a_list_or_none_and_places_a_texts_images_first():
    proc, img = _QwenProc(), Image.new("RGB", (4, 4))
    one = "<|vision_start|><|image_pad|><|vision_end|>"
    for images, n in ((img, 1), ([img, img], 2), ((img,), 1)):
        p = vi.encode_row({"q": "hi", "im": images}, "q", "im", QWEN_TOK, proc)
        assert QWEN_TOK.decode(p.ids) == "user: " + one * n + "hi\nassistant: " and p.n_images == n
    marked = vi.encode_row({"q": [{"role": "user", "content": "a<image>b"}], "im": [img]}, "q", "im", QWEN_TOK, proc)
    assert QWEN_TOK.decode(marked.ids) == "user: a" + one + "b\nassistant: "
    none = vi.encode_row({"q": "hi", "im": None}, "q", "im", QWEN_TOK, proc)
    assert none.n_images == 0 and QWEN_TOK.decode(none.ids) == "user: hi\nassistant: "
    with pytest.raises(DataError, match=r"^row 1 has no image column 'img'; its columns are: q, im$"):
        vi.encode_row({"q": "hi", "im": None}, "q", "img", QWEN_TOK, proc, where="row 1")


class _Recording:
    """The tiny tokenizer, keeping what it is called with."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def apply_chat_template(self, *a, **kw):
        return self.tok.apply_chat_template(*a, **kw)

    def __call__(self, text, **kw):
        self.calls.append(kw)
        return self.tok(text, **kw)


def test_a_prompt_is_tokenized_without_special_tokens_and_each_refusal_names_its_row():
    tok, proc, img = _Recording(QWEN_TOK), _QwenProc(), Image.new("RGB", (4, 4))
    encode(_messages(1), [img], tok, proc)
    assert tok.calls == [{"add_special_tokens": False}]  # the template wrote them (Gemma 3's <bos> would be doubled)
    two = [{"role": "user", "content": "<image><image>"}]
    for call, where in ((lambda w: encode(_messages(2), [img], QWEN_TOK, proc, *w), "data row"),
                        (lambda w: vi.encode_row({"q": two, "im": img}, "q", "im", QWEN_TOK, proc, *w), "data row"),
                        (lambda w: vi.image_row({"q": two, "im": [img]}, _Data(), QWEN_TOK, proc, *w), "data row"),
                        (lambda w: vi.encode_row({"q": two, "im": img}, "q", "im", QWEN_TOK, proc, *w), "row 9"),
                        (lambda w: vi.image_row({"q": two, "im": [img]}, _Data(), QWEN_TOK, proc, *w), "row 9")):
        with pytest.raises(DataError, match=rf"^{where}: the prompt has 2 image part\(s\) but the row has 1 image"):
            call([] if where == "data row" else [where])
    with pytest.raises(DataError, match=r"^data row has no image column 'x'"):
        vi.encode_row({"q": "hi"}, "q", "x", QWEN_TOK, proc)
    with pytest.raises(DataError, match=r"^data row has images in data.image_column='im' but the model is a text"):
        vi.image_row({"q": "hi", "im": img}, _Data(), QWEN_TOK, None)
    row = vi.image_row({"q": "hi", "im": img}, _Data(answer_column="sol"), QWEN_TOK, proc)  # no such column: no answer
    assert "answer" not in row and "sol" not in row


@_dataclass
class _Data:
    prompt_column: str = "q"
    image_column: str = "im"
    answer_column: str = "answer"
    system_prompt: str | None = None


def test_image_row_is_a_prepared_row_with_its_system_prompt_and_answer():
    proc, img = _QwenProc(), Image.new("RGB", (4, 4))
    one = "<|vision_start|><|image_pad|><|vision_end|>"
    row = vi.image_row({"q": "hi", "im": img, "sol": "7", "answer": "x"},
                       _Data(answer_column="sol", system_prompt="S"), QWEN_TOK, proc)
    assert row["prompt"] == "system: S\nuser: " + one + "hi\nassistant: " and row["answer"] == "7"
    assert row["sol"] == "7" and row["im"] is img and "q" not in row
    assert QWEN_TOK.decode(row["prompt_ids"].ids) == row["prompt"] and row["prompt_ids"].n_images == 1
    assert row["prompt_messages"] == [{"role": "system", "content": "S"},
                                      {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    two = vi.image_row({"q": [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}],
                        "im": [img, img], "answer": "x"}, _Data(system_prompt="S"), QWEN_TOK, proc)
    assert two["prompt"] == "system: mine\nuser: " + one * 2 + "hi\nassistant: " and two["answer"] == "x"
    placed = vi.image_row({"q": "a<image>b", "im": [img]}, _Data(), QWEN_TOK, proc)
    assert placed["prompt"] == "user: a" + one + "b\nassistant: " and "answer" not in placed
    with pytest.raises(DataError, match=r"^row 3 has images in data.image_column='im' but the model is a text model"):
        vi.image_row({"q": "hi", "im": img}, _Data(), QWEN_TOK, None, where="row 3")


# ---- unit tests of grpo/vision/models.py: each family's config as built (a tiny model builds in about 20 ms once its
# classes are imported, which happens here, at collection, not in every mutant's fork)
import transformers  # noqa: E402

from grpo.models import SIZES, SPECIAL_IDS, char_tokenizer  # noqa: E402
from grpo.tiny_models import HYBRID_FAMILIES  # noqa: E402
from grpo.vision import models as vm  # noqa: E402

for _cls in ("Qwen2_5_VL", "Qwen2VL", "Qwen3VL", "Qwen3VLMoe", "Qwen3_5", "Gemma3", "Idefics3", "SmolVLM"):
    getattr(transformers, f"{_cls}ForConditionalGeneration"), getattr(transformers, f"{_cls}Config")
TOKS = {f: load_tokenizer(f"tiny:{f}") for f in ("qwen2_5_vl", "gemma3", "idefics3")}
TOKS.update(dict.fromkeys(("qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"), TOKS["qwen2_5_vl"]),
            smolvlm=TOKS["idefics3"])


def _text(**over):
    return {**SIZES, **SPECIAL_IDS, "vocab_size": len(TOKS["idefics3"]), "tie_word_embeddings": False, **over}


_QWEN_VISION = {"qwen2_5_vl": dict(hidden_size=32, intermediate_size=64, window_size=16, fullatt_block_indexes=[1],
                                   out_hidden_size=64),
                "qwen2_vl": dict(embed_dim=32, mlp_ratio=2, hidden_size=64),
                "qwen3_vl": dict(hidden_size=32, intermediate_size=64, num_position_embeddings=64,
                                 deepstack_visual_indexes=[0], out_hidden_size=64),
                "qwen3_5": dict(hidden_size=32, intermediate_size=64, num_position_embeddings=64, out_hidden_size=64)}
_QWEN_VISION["qwen3_vl_moe"] = _QWEN_VISION["qwen3_vl"]


@pytest.mark.parametrize("family", list(_QWEN_VISION))
def test_each_qwen_families_config_is_the_documented_one(family):
    tok = TOKS[family]
    with torch.device("meta"):  # the config is what is checked: no weights (a mutant's default-size model is cheap)
        model = vm.tiny_vlm(family, tok, _text(), seed=0)
    cfg, text, vision = model.config, model.config.text_config, model.config.vision_config
    assert type(model).__name__ == vm._FAMILIES[family][1] and cfg.model_type == family
    for name, token in zip(("vision_start", "image", "vision_end", "video"), vm.VISION_TOKENS):
        assert getattr(cfg, f"{name}_token_id") == tok.convert_tokens_to_ids(token), name
    interleaved = family in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5")
    rope = {k: v for k, v in text.rope_parameters.items() if k != "partial_rotary_factor"}  # Qwen3.5's own default
    assert rope == {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                    **({"mrope_interleaved": True} if interleaved else {})}
    sizes = (text.hidden_size, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads)
    assert sizes == (64, 2, 4, 2)
    if interleaved:
        assert text.head_dim == 16
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size, vision.depth,
            vision.num_heads) == (4, 2, 2, 2, 2)
    for key, value in _QWEN_VISION[family].items():
        assert getattr(vision, key) == value, key
    if family == "qwen3_vl_moe":
        assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (4, 2, 16)
    if family == "qwen3_5":
        own = {k: v for k, v in HYBRID_FAMILIES["qwen3_5_text"].items() if k.startswith("linear_")}
        assert own and all(getattr(text, k) == v for k, v in own.items())
        assert text.layer_types == ["linear_attention", "full_attention"]
        with torch.device("meta"):
            four = vm.tiny_vlm(family, tok, _text(num_hidden_layers=4, linear_num_key_heads=4)).config.text_config
            mine = vm.tiny_vlm(family, tok, _text(layer_types=["full_attention"] * 2), seed=0).config.text_config
        assert four.layer_types == ["linear_attention", "full_attention"] * 2 and four.linear_num_key_heads == 4
        assert mine.layer_types == ["full_attention"] * 2


def test_a_tiny_vlm_is_seeded_and_leaves_the_generator_as_it_was():
    tok, state = TOKS["qwen2_5_vl"], torch.random.get_rng_state()
    a, b, c = (vm.tiny_vlm("qwen2_5_vl", tok, _text(), seed=s) for s in (3, 3, 4))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight) and not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert torch.equal(vm.tiny_vlm("qwen2_5_vl", tok, _text()).lm_head.weight,
                       vm.tiny_vlm("qwen2_5_vl", tok, _text(), seed=0).lm_head.weight)  # seed 0 unless given
    with torch.device("meta"):
        wide = vm.tiny_vlm("qwen2_5_vl", tok, _text(hidden_size=128), seed=0).config
    section = wide.text_config.rope_parameters["mrope_section"]
    assert section == [4, 6, 6] and all(type(n) is int for n in section) and wide.vision_config.out_hidden_size == 128
    with pytest.raises(ModelError, match=r"^model.tiny=\{'hidden_size': 64, .* does not make a valid qwen2_5_vl "
                                         r"model: hidden_size must be divisible by num_heads"):
        vm.tiny_vlm("qwen2_5_vl", tok, _text(num_attention_heads=5))
    with pytest.raises(ModelError, match=r"^tiny:llava is not a vision-language family; choose one of: qwen2_5_vl, "):
        vm.tiny_vlm("llava", tok, _text())


def test_seeded_builds_under_its_seed_and_a_refused_config_is_one_line():
    state = torch.random.get_rng_state()
    assert torch.equal(vm._seeded("f", {}, 5, lambda: torch.rand(3)), torch.manual_seed(5) and torch.rand(3))
    torch.random.set_rng_state(state)
    for error in (ValueError, TypeError):
        def build(error=error):
            raise error("  bad size\nsecond")

        with pytest.raises(ModelError) as e:
            vm._seeded("fam", {"hidden_size": 3}, 0, build)
        assert str(e.value) == "model.tiny={'hidden_size': 3} does not make a valid fam model: bad size"
    for error, reason in ((ValueError(), "ValueError"), (TypeError("wrapped:\n  ValueError: why\n"), "why"),
                          (TypeError("wrapped:\n  in ValueError: why TypeError: more"), "why TypeError: more"),
                          (ValueError("v" * 300), "v" * 200)):
        def build(error=error):
            raise error

        with pytest.raises(ModelError, match=f"^model.tiny={{}} does not make a valid f model: {reason}$"):
            vm._seeded("f", {}, 0, build)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_tiny_gemma3s_config_and_its_seeded_projection():
    tok = TOKS["gemma3"]
    with torch.device("meta"):  # the config first, without weights (a mutant's default-size model is cheap there)
        meta = vm.tiny_vlm("gemma3", tok, _text(), seed=0)
    cfg, text, vision = meta.config, meta.config.text_config, meta.config.vision_config
    assert type(meta) is transformers.Gemma3ForConditionalGeneration
    assert (cfg.boi_token_index, cfg.image_token_index, cfg.eoi_token_index) == tuple(
        tok.convert_tokens_to_ids(t) for t in vm.GEMMA3_TOKENS)
    assert cfg.mm_tokens_per_image == 16 and cfg.tie_word_embeddings is False
    assert (text.head_dim, text.query_pre_attn_scalar, text.sliding_window) == (16, 24, 8)
    assert text.layer_types == ["sliding_attention", "full_attention"] and text.hidden_size == 64
    assert text.rope_parameters == {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                       "rope_theta": 1_000_000.0}}
    assert (vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers, vision.num_attention_heads,
            vision.image_size, vision.patch_size) == (32, 64, 2, 2, 32, 4)
    model = vm.tiny_vlm("gemma3", tok, _text(), seed=0)
    w = model.model.multi_modal_projector.mm_input_projection_weight
    assert 0.04 < w.std().item() < 0.06 and abs(w.mean().item()) < 0.01  # normal(0, 0.05), not Gemma's zeros
    again = vm.tiny_vlm("gemma3", tok, _text(num_hidden_layers=3, head_dim=8), seed=0).config.text_config
    assert again.layer_types == ["sliding_attention", "full_attention", "sliding_attention"] and again.head_dim == 8
    other = vm.tiny_vlm("gemma3", tok, _text(), seed=1).model.multi_modal_projector.mm_input_projection_weight
    assert torch.equal(vm.tiny_vlm("gemma3", tok, _text(), seed=0).model.multi_modal_projector
                       .mm_input_projection_weight, w) and not torch.equal(other, w)
    with pytest.raises(ModelError, match=r"^model.tiny=\{'head_dim': 12, .* does not make a valid gemma3 model: The "
                                         r"hidden size \(64\) "
                                         r"is not a multiple of the number of attention heads \(5\).$"):
        vm.tiny_vlm("gemma3", tok, _text(num_attention_heads=5), seed=0)


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_tiny_idefics3s_config(family):
    tok = TOKS[family]
    with torch.device("meta"):  # the config first, without weights (a mutant's default-size model is cheap there)
        meta = vm.tiny_vlm(family, tok, _text(), seed=0)
    cfg, text, vision = meta.config, meta.config.text_config, meta.config.vision_config
    assert type(meta).__name__ == vm._TILED[family][1] and cfg.model_type == family
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<image>") and cfg.scale_factor == 2
    assert cfg.tie_word_embeddings is False and text.model_type == "llama" and text.hidden_size == 64
    assert (vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers, vision.num_attention_heads,
            vision.image_size, vision.patch_size) == (32, 64, 2, 2, 16, 4)
    model = vm.tiny_vlm(family, tok, _text(), seed=0)
    a, b = (vm.tiny_vlm(family, tok, _text(), seed=s).lm_head.weight for s in (0, 1))
    assert torch.equal(a, model.lm_head.weight) and not torch.equal(a, b)
    with pytest.raises(ModelError, match=rf"^model.tiny=\{{'hidden_size': 64, .* does not make a valid {family} "):
        vm.tiny_vlm(family, tok, _text(num_attention_heads=5), seed=0)


def test_with_vision_tokens_adds_each_familys_tokens_and_template():
    base = len(char_tokenizer())
    for family, tokens, template in (("qwen2_5_vl", vm.VISION_TOKENS, vm.CHAT_TEMPLATE),
                                     ("gemma3", vm.GEMMA3_TOKENS, vm.GEMMA3_CHAT_TEMPLATE),
                                     ("smolvlm", vm.IDEFICS3_TOKENS, vm.IDEFICS3_CHAT_TEMPLATE)):
        tok = vm.with_vision_tokens(char_tokenizer(), family)
        assert tok.chat_template == template and len(tok) == base + len(tokens), family
        assert [tok.convert_tokens_to_ids(t) for t in tokens] == list(range(base, base + len(tokens)))
        assert tok("a" + tokens[0])["input_ids"][-1] == base  # a special token: never split into characters
    assert vm.with_vision_tokens(char_tokenizer()).chat_template == vm.CHAT_TEMPLATE
    assert vm.IDEFICS3_CHAT_TEMPLATE != vm.CHAT_TEMPLATE != vm.GEMMA3_CHAT_TEMPLATE


def test_each_familys_image_processor_at_the_tiny_sizes():
    qwen = vm.image_processor()
    assert type(qwen).__name__ == "Qwen2VLImageProcessorPil"
    assert (qwen.patch_size, qwen.merge_size, qwen.temporal_patch_size) == (4, 2, 2)
    assert (qwen.size.shortest_edge, qwen.size.longest_edge) == (256, 4096)  # the pixel bounds, as kept
    small = vm.image_processor("qwen2_vl", min_pixels=64, max_pixels=512)
    assert (small.size.shortest_edge, small.size.longest_edge) == (64, 512)
    gemma = vm.image_processor("gemma3")
    assert type(gemma).__name__ == "Gemma3ImageProcessorPil" and gemma.size == {"height": 32, "width": 32}
    assert gemma.do_pan_and_scan is False and gemma.image_seq_length == 16
    for family, cls in (("idefics3", "Idefics3ImageProcessorPil"), ("smolvlm", "SmolVLMImageProcessorPil")):
        proc = vm.image_processor(family)
        assert type(proc).__name__ == cls and proc.do_image_splitting is True and proc.image_seq_len == 4
        assert proc.size == {"longest_edge": 32} and proc.max_image_size == {"longest_edge": 16}


class _Core(torch.nn.Module):
    def __init__(self, tower: str | None, **extra):
        super().__init__()
        self.language_model = torch.nn.Module()
        self.language_model.embed_tokens = torch.nn.Embedding(4, 2)
        self.language_model.layer = torch.nn.Linear(2, 2)
        for name in vm.TOWERS:
            setattr(self, name, None)
        if tower:
            setattr(self, tower, torch.nn.Linear(2, 3))
        for name, module in extra.items():
            setattr(self, name, module)

    def get_input_embeddings(self):
        return self.language_model.embed_tokens


def _wrapped(core):
    model = torch.nn.Module()
    model.model = core
    return model


@pytest.mark.parametrize("tower", vm.TOWERS)
def test_the_vision_tower_its_freezing_and_the_image_side_parameters(tower):
    core = _Core(tower, projector=torch.nn.Linear(3, 2))
    model = _wrapped(core)
    assert vm.vision_tower(model) is getattr(core, tower)
    side = {id(p) for p in vm.image_side_params(model)}
    assert side == {id(p) for m in (getattr(core, tower), core.projector) for p in m.parameters()}
    assert [id(p) for p in vm.image_side_params(core)] == [id(p) for p in vm.image_side_params(model)]
    vm.freeze_vision_tower(model)
    assert not any(p.requires_grad for p in getattr(core, tower).parameters())
    assert all(p.requires_grad for p in core.projector.parameters())
    assert all(p.requires_grad for p in core.language_model.parameters())
    assert {id(p) for p in vm.image_side_params(model)} == {id(p) for p in core.projector.parameters()}


def test_a_text_model_has_no_tower_nor_image_side_parameters():
    text = _wrapped(_Core(None, projector=torch.nn.Linear(3, 2)))
    assert vm.vision_tower(text) is None and vm.vision_tower(torch.nn.Linear(1, 1)) is None
    assert vm.image_side_params(text) == [] and vm.image_side_params(torch.nn.Linear(1, 1)) == []
    with pytest.raises(ModelError, match=r"^model.freeze_vision_tower=true but 'x' has no vision tower \(a text"):
        vm.freeze_vision_tower(text, "'x'")
    with pytest.raises(ModelError, match=r"^model.freeze_vision_tower=true but the model has no vision tower"):
        vm.freeze_vision_tower(text)
