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
