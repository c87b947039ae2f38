"""A checkpoint folder of every served vision-language family (``model.name_or_path=<dir>``, as a hub id resolves to
one) loads as that family's model with its tokenizer, chat template and PIL image processor, and gives the same tokens,
pixels and log-probs on an image prompt as the in-memory tiny model it was written from; other multimodal families are
refused in one line before any weight loads; a text model's folder still loads as a causal LM."""
import json
import random

import pytest
import torch

from grpo.config.schema import LoraConfig, ModelConfig
from grpo.engine.vision_logprobs import VISION_FAMILIES
from grpo.errors import ModelError
from grpo.models import check_name, load_image_processor, load_model, load_reference, load_tokenizer, tiny_model
from grpo.tasks.shapes import draw
from grpo.vision.images import encode
from grpo.vision.models import vision_tower
from tests.helpers import own_image_logprobs, save_tiny_vlm


def _prompts(tok, proc):
    rng = random.Random(0)
    pictures = [draw(rng, size, [("red", "square"), ("blue", "circle")]) for size in (32, 24, 40)]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    return [encode(one, pictures[:1], tok, proc), encode(two, pictures[1:], tok, proc)]


@pytest.fixture(scope="module", params=VISION_FAMILIES)
def saved(request, tmp_path_factory):
    family = request.param
    return family, save_tiny_vlm(family, tmp_path_factory.mktemp(family) / "ckpt")


def test_a_checkpoint_loads_as_its_family_with_the_same_tokens_pixels_and_logprobs(saved):
    family, path = saved
    name = f"tiny:{family}"
    tok, proc = load_tokenizer(name), load_image_processor(name)
    start = tiny_model(family, len(tok), seed=0).eval()
    loaded_tok = load_tokenizer(str(path))
    loaded_proc = load_image_processor(str(path), loaded_tok)
    model = load_model(ModelConfig(name_or_path=str(path)), len(loaded_tok)).eval()
    assert type(model) is type(start) and model.config.model_type == family  # ForConditionalGeneration, not causal
    assert type(loaded_proc).__name__.endswith("Pil") and loaded_tok.chat_template == tok.chat_template
    completion = [5, 17, 40, 9]
    for mine, theirs in zip(_prompts(tok, proc), _prompts(loaded_tok, loaded_proc)):
        assert mine.ids == theirs.ids and mine.n_images == theirs.n_images
        assert torch.equal(mine.pixel_values, theirs.pixel_values)
        a, b = own_image_logprobs(start, mine, completion), own_image_logprobs(model, theirs, completion)
        assert (a - b).abs().max().item() < 1e-6
    # the image token the prompts carry is the one the model reads image features into
    assert sum(t == model.config.image_token_id for t in _prompts(loaded_tok, loaded_proc)[0].ids) > 0


def test_a_checkpoint_trains_as_a_tiny_one(saved):
    """gradient checkpointing, a frozen tower, LoRA on the language model (the tower excluded), the reference."""
    family, path = saved
    tok = load_tokenizer(str(path))
    frozen = load_model(ModelConfig(name_or_path=str(path), gradient_checkpointing=True, freeze_vision_tower=True),
                        len(tok))
    tower = vision_tower(frozen)
    assert tower is not None and not any(p.requires_grad for p in tower.parameters())
    assert frozen.is_gradient_checkpointing and frozen.dtype == torch.float32
    lora = load_model(ModelConfig(name_or_path=str(path), lora=LoraConfig(enabled=True)), len(tok))
    adapted = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert adapted and all("lora_" in n and (".language_model." in n or ".text_model." in n) for n in adapted)
    cfg = ModelConfig(name_or_path=str(path))
    policy = load_model(cfg, len(tok))
    ref = load_reference(cfg, policy, len(tok))
    assert not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), ref.state_dict().values()))


def test_a_checkpoint_loads_in_the_requested_dtype(tmp_path):
    path = save_tiny_vlm("qwen2_5_vl", tmp_path / "ckpt")
    model = load_model(ModelConfig(name_or_path=str(path), dtype="bfloat16", attn_implementation="eager"), 104)
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"


def _edit(path, name, **changes):
    data = json.loads((path / name).read_text())
    data.update(changes)
    (path / name).write_text(json.dumps(data))


@pytest.mark.parametrize("kind", ["Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast"])
def test_a_hub_style_qwen_preprocessor_config_loads_as_pil_with_its_pixel_bounds(tmp_path, kind):
    """Qwen2.5-VL's hub folders write min_pixels/max_pixels (Qwen3-VL's name the fast, torchvision class): the PIL
    processor is loaded, with those bounds (a 64x64 picture capped at 32x32 pixels: an 8x8 patch grid)."""
    path = save_tiny_vlm("qwen2_5_vl", tmp_path / "ckpt")
    (path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 256, "max_pixels": 1024, "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "image_processor_type": kind,
        "processor_class": "Qwen2_5_VLProcessor"}))
    proc = load_image_processor(str(path), load_tokenizer(str(path)))
    assert type(proc).__name__ == "Qwen2VLImageProcessorPil"
    picture = draw(random.Random(0), 64, [("red", "square")])
    assert proc(images=[picture], return_tensors="pt")["image_grid_thw"].tolist() == [[1, 8, 8]]


def test_an_image_processor_that_does_not_fit_the_tower_is_refused_in_one_line(tmp_path):
    path = save_tiny_vlm("qwen2_5_vl", tmp_path / "ckpt")
    _edit(path, "preprocessor_config.json", patch_size=14)
    with pytest.raises(ModelError, match=r"patch_size=14 but the vision tower .* takes 4$"):
        load_image_processor(str(path))


def test_a_tokenizer_whose_image_token_is_not_the_configs_is_refused(tmp_path):
    path = save_tiny_vlm("gemma3", tmp_path / "ckpt")
    _edit(path, "config.json", image_token_index=3, image_token_id=3)
    with pytest.raises(ModelError, match=r"<image_soft_token> is id \d+ but config.json's image_token_id is 3"):
        load_image_processor(str(path), load_tokenizer(str(path)))


def test_gemma3_takes_its_image_tokens_per_image_from_the_config_and_no_crops(tmp_path):
    """Gemma 3's hub folders keep image_seq_length in processor_config.json, not preprocessor_config.json: the count
    the prompt expands to is the config's mm_tokens_per_image, the one the engine checks; pan-and-scan crops (not
    served) stay off."""
    path = save_tiny_vlm("gemma3", tmp_path / "ckpt")
    data = json.loads((path / "preprocessor_config.json").read_text())
    del data["image_seq_length"]
    (path / "preprocessor_config.json").write_text(json.dumps({**data, "do_pan_and_scan": True}))
    proc = load_image_processor(str(path))
    assert proc.image_seq_length == 16 and not proc.do_pan_and_scan
    tok = load_tokenizer(str(path))
    picture = draw(random.Random(0), 64, [("red", "square")])
    prompt = encode([{"role": "user", "content": [{"type": "image"}]}], [picture], tok, proc)
    assert prompt.n_images == 1 and prompt.count(tok.convert_tokens_to_ids("<image_soft_token>")) == 16


@pytest.mark.parametrize("text_only", [None, "{{ messages[0]['content'] }}"])
def test_the_processors_chat_template_is_the_one_taken(tmp_path, text_only):
    """A hub folder with the processor's template in the older chat_template.json, and the tokenizer's in
    tokenizer_config.json missing or text-only: the prompt renders with the processor's (image parts included)."""
    path = save_tiny_vlm("qwen2_5_vl", tmp_path / "ckpt")
    template = (path / "chat_template.jinja").read_text()
    (path / "chat_template.jinja").unlink()
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    if text_only:
        _edit(path, "tokenizer_config.json", chat_template=text_only)
    assert load_tokenizer(str(path)).chat_template == template


def test_gemma3_image_tokens_per_image_disagreeing_with_the_processor_are_refused(tmp_path):
    path = save_tiny_vlm("gemma3", tmp_path / "ckpt")
    (path / "processor_config.json").write_text(json.dumps({"image_seq_length": 256}))
    with pytest.raises(ModelError, match="image_seq_length=256 but config.json's mm_tokens_per_image is 16$"):
        load_image_processor(str(path))


@pytest.mark.parametrize("family", ["llava", "lfm2_vl"])
def test_an_unserved_multimodal_family_is_refused_in_one_line_before_it_loads(tmp_path, family):
    from transformers import AutoConfig

    AutoConfig.for_model(family).save_pretrained(tmp_path)  # a config and no weights: refused before any load
    for call in (lambda: check_name(str(tmp_path)), lambda: load_model(ModelConfig(name_or_path=str(tmp_path)), 10)):
        with pytest.raises(ModelError) as e:
            call()
        line = str(e.value)
        assert "\n" not in line and f"is a {family} vision-language model" in line
        assert line.endswith("served: " + ", ".join(VISION_FAMILIES))


def test_a_hub_id_of_an_unserved_family_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    """A hub id (here from an offline hub cache): its config.json, read before the weights, refuses it in one line."""
    from transformers import AutoConfig

    from tests.helpers import in_hub_cache

    repo = in_hub_cache("qwen2_5_vl", "llava-hf/llava-1.5-7b-hf", tmp_path / "hub", monkeypatch)
    snapshot = tmp_path / "hub" / "models--llava-hf--llava-1.5-7b-hf" / "snapshots" / ("0" * 40)
    (snapshot / "model.safetensors").unlink()  # no weights: nothing may try to load them
    AutoConfig.for_model("llava").save_pretrained(snapshot)
    check_name(repo)  # a hub id: nothing read yet
    for call in (lambda: load_tokenizer(repo), lambda: load_image_processor(repo),
                 lambda: load_model(ModelConfig(name_or_path=repo), 10)):
        with pytest.raises(ModelError, match=r"^model.name_or_path='llava-hf/llava-1.5-7b-hf' is a llava "
                                             r"vision-language model, which is not served; served: qwen2_5_vl, "):
            call()


def test_a_folder_whose_config_is_not_json_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"its config.json is not JSON \(Expecting property name"):
        check_name(str(tmp_path))


def test_a_text_model_folder_still_loads_as_a_causal_lm(tmp_path):
    from grpo.models import char_tokenizer

    tok = char_tokenizer()
    tiny_model("qwen2", len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    check_name(str(tmp_path))
    model = load_model(ModelConfig(name_or_path=str(tmp_path)), len(tok))
    assert type(model).__name__ == "Qwen2ForCausalLM" and load_image_processor(str(tmp_path)) is None
    text = "user: How many?\nassistant: 12"  # its tokenizer.json as written (transformers' Qwen2Tokenizer would not)
    assert load_tokenizer(str(tmp_path))(text)["input_ids"] == tok(text)["input_ids"]


def test_a_checkpoint_folder_tells_its_head_size_and_whether_grpo_serve_takes_its_images(tmp_path):
    """vLLM's CPU head-size check reads the language model's config; grpo-serve takes a Qwen2.5-VL folder's images
    and refuses another family's in one line (as for the tiny: names)."""
    from grpo.errors import SetupError
    from grpo.models import head_dim
    from grpo.serve import vision

    qwen, gemma = save_tiny_vlm("qwen2_5_vl", tmp_path / "qwen"), save_tiny_vlm("gemma3", tmp_path / "gemma")
    assert head_dim(str(qwen), {}) == 16 and head_dim(str(gemma), {}) == 16
    assert vision(str(qwen)) is True
    with pytest.raises(SetupError, match="grpo-serve takes images for qwen2_5_vl only"):
        vision(str(gemma))
    tiny_model("qwen2", 100).save_pretrained(tmp_path / "text")
    assert vision(str(tmp_path / "text")) is False and vision("tiny:qwen2") is False and vision("tiny:qwen2_5_vl")


def test_the_served_families_are_the_engines():
    """A checkpoint is loaded for exactly the families the engine has an entry for (grpo/engine/vision_families.py)."""
    from grpo.engine.vision_families import FAMILIES
    from grpo.vision.models import NOT_SERVED, TINY_VLM_FAMILIES

    assert tuple(FAMILIES) == TINY_VLM_FAMILIES and not set(NOT_SERVED) & set(FAMILIES)


# ---- unit tests of grpo/vision/checkpoint.py over fakes (no model, no processor built: what `make mutate` runs)
# transformers' auto classes and cached_file are imported here, at collection, so that no mutant's fork pays for the
# lazy import again
import transformers.utils  # noqa: E402
from transformers import AutoImageProcessor, AutoModelForImageTextToText  # noqa: E402

from grpo.vision import checkpoint as ck  # noqa: E402


def test_read_json_reads_a_folders_file_and_none_where_it_has_none(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp_path / "other.json").mkdir()  # a folder of that name is not the file
    assert ck.read_config(str(tmp_path)) == {"model_type": "qwen2"}
    assert ck.read_json(str(tmp_path), "other.json") is None and ck.read_json(str(tmp_path), "none.json") is None
    monkeypatch.setenv("HOME", str(tmp_path.parent))
    assert ck.read_config(f"~/{tmp_path.name}") == {"model_type": "qwen2"}  # ~ is the home folder
    (tmp_path / "bad.json").write_text("[1,")
    with pytest.raises(ModelError, match=r"^model.name_or_path='.*': its bad.json is not JSON \(Expecting"):
        ck.read_json(str(tmp_path), "bad.json")


def test_a_hub_id_is_read_from_the_hub_cache_and_a_failure_is_none(tmp_path, monkeypatch):
    calls = []
    (tmp_path / "cached.json").write_text('{"a": 1}')

    def cached_file(repo, filename, **kw):
        calls.append((repo, filename, kw))
        if repo == "org/broken":
            raise OSError("offline")
        return str(tmp_path / "cached.json") if repo == "org/model" else None

    monkeypatch.setattr(transformers.utils, "cached_file", cached_file)
    assert ck.read_json("org/model", "x.json") == {"a": 1}
    assert ck.read_json("org/missing", "x.json") is None and ck.read_json("org/broken", "x.json") is None
    assert calls[0] == ("org/model", "x.json", {"_raise_exceptions_for_missing_entries": False,
                                                "_raise_exceptions_for_connection_errors": False})


def test_is_multimodal_by_the_vision_config_or_the_image_text_to_text_types():
    assert ck.is_multimodal({"vision_config": {}}) and ck.is_multimodal({"model_type": "llava"})
    assert not ck.is_multimodal({"model_type": "qwen2"}) and not ck.is_multimodal({})


def test_family_of_config_served_text_and_refused_with_its_reason(tmp_path):
    served, why = ("qwen2_5_vl", "gemma3"), {"lfm2_vl": "no masks"}
    assert ck.family_of_config(None, "x", served, why) is None
    assert ck.family_of_config({"model_type": "qwen2"}, "x", served, why) is None
    assert ck.family_of_config({"model_type": "gemma3", "vision_config": {}}, "x", served, why) == "gemma3"
    with pytest.raises(ModelError) as e:
        ck.family_of_config({"model_type": "lfm2_vl", "vision_config": {}}, "m", served, why)
    assert str(e.value) == ("model.name_or_path='m' is a lfm2_vl vision-language model, which is not served "
                            "(no masks); served: qwen2_5_vl, gemma3")
    with pytest.raises(ModelError) as e:
        ck.family_of_config({"model_type": "llava"}, "m", served, why)
    assert str(e.value).endswith("llava vision-language model, which is not served; served: qwen2_5_vl, gemma3")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "vision_config": {}}))
    assert ck.vision_family(str(tmp_path), served, why) == "gemma3"
    assert ck.vision_family(str(tmp_path / "none"), served, why) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "lfm2_vl", "vision_config": {}}))
    with pytest.raises(ModelError) as e:
        ck.vision_family(str(tmp_path), served, why)
    assert str(e.value).startswith(f"model.name_or_path={str(tmp_path)!r} is a lfm2_vl")
    assert "(no masks)" in str(e.value)


def test_load_vlm_asks_for_the_image_text_to_text_class_and_a_failure_is_one_line(monkeypatch):
    calls = []

    def from_pretrained(path, **kw):
        calls.append((path, kw))
        if path == "bad":
            raise OSError("no weights\nsecond line")
        return "model"

    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", from_pretrained)
    assert ck.load_vlm("p", "name", torch.bfloat16, "eager") == "model"
    assert calls == [("p", {"dtype": torch.bfloat16, "attn_implementation": "eager"})]
    with pytest.raises(ModelError) as e:
        ck.load_vlm("bad", "n", torch.float32, "sdpa")
    assert str(e.value) == "model.name_or_path='n': no vision-language model could be loaded (no weights)"


def test_processor_chat_template_jinja_first_then_json_else_none(tmp_path):
    assert ck.processor_chat_template(str(tmp_path)) is None
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert ck.processor_chat_template(str(tmp_path)) == "from json"
    (tmp_path / "chat_template.jinja").write_text("from jinja")
    assert ck.processor_chat_template(str(tmp_path)) == "from jinja"


class Qwen2VLImageProcessorPil:  # a stand-in of the class name FORMS knows
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


class Gemma3ImageProcessorPil(Qwen2VLImageProcessorPil):
    pass


class _Tokenizer:
    def __init__(self, ids):
        self.ids, self.asked = ids, []

    def convert_tokens_to_ids(self, token):
        self.asked.append(token)
        return self.ids


def _serve(monkeypatch, proc):
    calls = []

    def from_pretrained(path, **kw):
        calls.append((path, kw))
        if isinstance(proc, Exception):
            raise proc
        return proc

    monkeypatch.setattr(AutoImageProcessor, "from_pretrained", from_pretrained)
    return calls


def test_load_image_processor_loads_the_pil_one_and_checks_it(tmp_path, monkeypatch):
    proc = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, do_pan_and_scan=True)
    calls = _serve(monkeypatch, proc)
    config = {"vision_config": {"patch_size": 4, "spatial_merge_size": 2}, "image_token_id": 7}
    tok = _Tokenizer(7)
    assert ck.load_image_processor(str(tmp_path), "n", config, tok) is proc
    assert calls == [(str(tmp_path), {"backend": "pil"})] and proc.do_pan_and_scan is False
    assert tok.asked == ["<|image_pad|>"] and not hasattr(proc, "image_seq_length")
    with pytest.raises(ModelError, match=r"^model.name_or_path='n': the tokenizer's <\|image_pad\|> is id 8 but "
                                         "config.json's image_token_id is 7; "):
        ck.load_image_processor(str(tmp_path), "n", config, _Tokenizer(8))
    proc.patch_size = 14
    with pytest.raises(ModelError, match=r"^model.name_or_path='n': preprocessor_config.json has patch_size=14 but the "
                                         r"vision tower \(config.json vision_config.patch_size"):
        ck.load_image_processor(str(tmp_path), "n", config)
    bare = Qwen2VLImageProcessorPil()  # no pan-and-scan setting at all (Qwen's)
    _serve(monkeypatch, bare)
    assert ck.load_image_processor(str(tmp_path), "n", config) is bare and not hasattr(bare, "do_pan_and_scan")
    _serve(monkeypatch, OSError("missing\nmore"))
    with pytest.raises(ModelError, match=r"^model.name_or_path='n': no image processor could be loaded \(missing\); "):
        ck.load_image_processor(str(tmp_path), "n", config)


def test_gemma3s_image_tokens_per_image_are_the_configs_and_the_processors_must_agree(tmp_path, monkeypatch):
    proc = Gemma3ImageProcessorPil(image_seq_length=256, do_pan_and_scan=False)
    _serve(monkeypatch, proc)
    config = {"mm_tokens_per_image": "16"}
    assert ck.load_image_processor(str(tmp_path), "n", config).image_seq_length == 16
    assert proc.do_pan_and_scan is False
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": "16"}))
    assert ck.load_image_processor(str(tmp_path), "n", config).image_seq_length == 16
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 64}))
    with pytest.raises(ModelError, match="image_seq_length=64 but config.json's mm_tokens_per_image is 16$"):
        ck.load_image_processor(str(tmp_path), "n", config)


def test_check_image_processor_refuses_an_unknown_class_and_each_size_that_differs():
    class Other:
        pass

    with pytest.raises(ModelError, match=r"image processor Other is not supported; supported: Qwen2VLImageProcessor"):
        ck.check_image_processor(Other(), {}, "n")
    vision = {"patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
    ck.check_image_processor(Qwen2VLImageProcessorPil(), {"vision_config": vision}, "n")  # no sizes: nothing to check
    ck.check_image_processor(Qwen2VLImageProcessorPil(patch_size=9), {}, "n")  # no vision config: nothing to check
    ck.check_image_processor(Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2),
                             {"vision_config": vision}, "n")
    for attr, key in (("merge_size", "spatial_merge_size"), ("temporal_patch_size", "temporal_patch_size")):
        with pytest.raises(ModelError, match=rf"has {attr}=3 but the vision tower \(config.json vision_config.{key}\) "
                                             "takes 2$"):
            ck.check_image_processor(Qwen2VLImageProcessorPil(**{attr: 3}), {"vision_config": vision}, "n")


def test_image_token_id_from_either_key_and_check_image_token_without_one():
    assert ck.image_token_id({"image_token_id": "5", "image_token_index": 6}) == 5
    assert ck.image_token_id({"image_token_index": 6}) == 6 and ck.image_token_id({}) is None
    tok = _Tokenizer(99)
    ck.check_image_token(tok, Gemma3ImageProcessorPil(), {}, "n")  # the config names no id: nothing to check
    assert tok.asked == ["<image_soft_token>"]
    ck.check_image_token(tok, Gemma3ImageProcessorPil(), {"image_token_index": 99}, "n")


def test_first_line_of_an_error():
    assert ck._first_line(ValueError("  a\nb ")) == "a" and ck._first_line(KeyError()) == "KeyError"
    assert ck._first_line(ValueError("x" * 300)) == "x" * 200
