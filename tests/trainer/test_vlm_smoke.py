"""`grpo-train recipe=vlm-smoke`, in process: a tiny Qwen2.5-VL trains on the shapes pictures, each prompt's images
through the vision tower once per group in the rollout and in the update, and the tower's weights learn."""
import json

import pytest
import torch
from omegaconf import OmegaConf

from grpo.config.schema import load
from grpo.engine.vision_logprobs import VISION_FAMILIES
from grpo.models import tiny_model
from grpo.trainer.loop import fit
from tests.helpers import compose_recipe, count_tower_patches, in_hub_cache, own_image_logprobs, save_tiny_vlm


def test_vlm_smoke_trains_and_evaluates_with_each_prompts_images_encoded_once(tmp_path, monkeypatch):
    patches = count_tower_patches(monkeypatch)
    out = tmp_path / "run"
    cfg = compose_recipe("vlm-smoke", [f"trainer.output_dir={out}", "data.num_eval=2"])
    summary = fit(load(OmegaConf.to_container(cfg, resolve=True)))
    assert summary["eval_before"]["completion_len_mean"] > 0 and "accuracy" in summary["eval_after"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 0 and r["completion_len_mean"] > 0 for r in rows)
    assert rows[0]["kl"] < 1e-6 < rows[1]["kl"]  # policy == reference at step 1, apart after one step
    # one 32x32 picture is 64 patches: the rollout encodes each prompt once (64; 2 steps x 2 prompts, and the 2
    # held-out prompts before and after), every engine forward (policy, reference) encodes both prompts of the
    # step once (128), never G = 4 copies
    assert set(patches) == {64, 128} and patches.count(64) == 2 * 2 + 2 * 2
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all("How many" in s["prompt"] for s in samples)
    # the vision tower trained: its weights moved from their seeded start
    from transformers import Qwen2_5_VLForConditionalGeneration

    final = Qwen2_5_VLForConditionalGeneration.from_pretrained(out / "final")
    start = tiny_model("qwen2_5_vl", final.config.text_config.vocab_size, seed=cfg.trainer.seed)
    name = "model.visual.blocks.0.mlp.up_proj.weight"
    moved = (final.state_dict()[name] - start.state_dict()[name]).abs().max().item()
    assert 0 < moved < 0.01  # two Adam steps of lr 1e-3 from the same start


def test_vlm_smoke_with_lora_trains_the_language_model_and_leaves_the_tower(tmp_path):
    """model.lora.enabled=true: adapters on the language model's attention (the tower's layers are named qkv/proj),
    the reference is the adapter switched off, and the merged model's tower is the seeded one."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    out = tmp_path / "run"
    cfg = compose_recipe("vlm-smoke", [f"trainer.output_dir={out}", "model.lora.enabled=true"])
    fit(load(OmegaConf.to_container(cfg, resolve=True)))
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["kl"] > 0
    final = Qwen2_5_VLForConditionalGeneration.from_pretrained(out / "final").state_dict()
    start = tiny_model("qwen2_5_vl", 104, seed=cfg.trainer.seed).state_dict()
    assert torch.equal(final["model.visual.blocks.0.attn.qkv.weight"], start["model.visual.blocks.0.attn.qkv.weight"])
    assert not torch.equal(final["model.language_model.layers.0.self_attn.q_proj.weight"],
                           start["model.language_model.layers.0.self_attn.q_proj.weight"])


def test_vlm_smoke_trains_qwen3_5_with_a_frozen_tower(tmp_path):
    """`grpo-train recipe=vlm-smoke model.name_or_path=tiny:qwen3_5 model.freeze_vision_tower=true`: Qwen3.5 with
    vision (a hybrid language model) trains through the image rollout and engine; the tower stays as seeded."""
    from transformers import Qwen3_5ForConditionalGeneration

    out = tmp_path / "run"
    cfg = compose_recipe("vlm-smoke", [f"trainer.output_dir={out}", "model.name_or_path=tiny:qwen3_5",
                                       "model.freeze_vision_tower=true", "trainer.max_steps=1"])
    fit(load(OmegaConf.to_container(cfg, resolve=True)))
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1] and rows[0]["grad_norm"] > 0
    final = Qwen3_5ForConditionalGeneration.from_pretrained(out / "final").state_dict()
    start = tiny_model("qwen3_5", 104, seed=cfg.trainer.seed).state_dict()
    tower = [n for n in start if ".visual." in n]
    assert tower and all(torch.equal(final[n], start[n]) for n in tower)
    assert not torch.equal(final["model.language_model.layers.1.self_attn.q_proj.weight"],
                           start["model.language_model.layers.1.self_attn.q_proj.weight"])


def test_vlm_smoke_samples_ahead_with_images(tmp_path):
    """rollout.max_staleness=1 with images on the hf backend: the generator process receives the image prompts
    (pickled with their pixels) and samples one version behind from step 2 on; at step 1 (the same version) its
    log-probs are the trainer's, so the images reached it."""
    out = tmp_path / "run"
    cfg = compose_recipe("vlm-smoke", [f"trainer.output_dir={out}", "rollout.max_staleness=1", "trainer.max_steps=3"])
    fit(load(OmegaConf.to_container(cfg, resolve=True)))
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert rows[0]["rollout_is/logp_diff_abs_max"] < 1e-4 < rows[1]["rollout_is/logp_diff_abs_max"]
    assert all(r["grad_norm"] > 0 for r in rows)


def test_vlm_smoke_trains_gemma3_with_its_images_encoded_once(tmp_path, monkeypatch):
    """`grpo-train recipe=vlm-smoke model.name_or_path=tiny:gemma3`: Gemma 3 (bidirectional image blocks, sliding
    and global layers) trains through the image rollout and engine; the SigLIP tower sees each prompt's picture
    once per forward (rollout: 1 image; update, policy and reference: the step's 2 prompts), and it learns."""
    from transformers import Gemma3ForConditionalGeneration
    from transformers.models.siglip import modeling_siglip as s

    images: list[int] = []
    forward = s.SiglipVisionModel.forward
    monkeypatch.setattr(s.SiglipVisionModel, "forward",
                        lambda self, pixel_values, **kw: images.append(len(pixel_values)) or forward(
                            self, pixel_values, **kw))
    out = tmp_path / "run"
    cfg = compose_recipe("vlm-smoke", [f"trainer.output_dir={out}", "model.name_or_path=tiny:gemma3",
                                       "trainer.max_steps=1"])
    fit(load(OmegaConf.to_container(cfg, resolve=True)))
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1] and rows[0]["grad_norm"] > 0
    assert set(images) == {1, 2} and images.count(1) == 2  # never G = 4 copies of a picture
    final = Gemma3ForConditionalGeneration.from_pretrained(out / "final").state_dict()
    start = tiny_model("gemma3", final["lm_head.weight"].shape[0], seed=cfg.trainer.seed).state_dict()
    for name in ("model.vision_tower.encoder.layers.0.mlp.fc1.weight",
                 "model.multi_modal_projector.mm_input_projection_weight"):
        assert not torch.equal(final[name], start[name]), name


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_vlm_smoke_trains_idefics3_with_its_tiles_encoded_once(tmp_path, monkeypatch, family):
    """`grpo-train recipe=vlm-smoke model.name_or_path=tiny:idefics3` (and `tiny:smolvlm`, SmolVLM2's classes):
    Idefics3 (SmolVLM's architecture: pictures split into tiles plus the global image) trains through the image
    rollout and engine; its tower sees each prompt's 5 tiles once per forward (rollout: 5; update, policy and
    reference: the step's 2 prompts, 10), and it learns, the connector too."""
    import transformers

    prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[family]
    tiles: list[int] = []
    tower_cls = getattr(transformers, f"{prefix}VisionTransformer")
    forward = tower_cls.forward
    monkeypatch.setattr(tower_cls, "forward",
                        lambda self, pixel_values, **kw: tiles.append(len(pixel_values)) or forward(
                            self, pixel_values, **kw))
    out = tmp_path / "run"
    cfg = compose_recipe("vlm-smoke", [f"trainer.output_dir={out}", f"model.name_or_path=tiny:{family}",
                                       "trainer.max_steps=1"])
    fit(load(OmegaConf.to_container(cfg, resolve=True)))
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1] and rows[0]["grad_norm"] > 0
    assert set(tiles) == {5, 10} and tiles.count(5) == 2  # never G = 4 copies of a picture's tiles
    final = getattr(transformers, f"{prefix}ForConditionalGeneration").from_pretrained(out / "final").state_dict()
    start = tiny_model(family, final["lm_head.weight"].shape[0], seed=cfg.trainer.seed).state_dict()
    for name in ("model.vision_model.encoder.layers.0.mlp.fc1.weight",
                 "model.connector.modality_projection.proj.weight"):
        assert not torch.equal(final[name], start[name]), name


@pytest.mark.parametrize("family,extra", [(f, []) for f in VISION_FAMILIES] + [("gemma3", ["model.lora.enabled=true"])])
def test_vlm_smoke_trains_a_checkpoint_folder_and_its_final_model_loads_again(tmp_path, monkeypatch, family, extra):
    """`grpo-train recipe=vlm-smoke model.name_or_path=Qwen/Qwen2.5-VL-3B-Instruct model.dtype=bfloat16
    model.gradient_checkpointing=true` (docs/vision-language.md) scaled down: a tiny checkpoint folder of the family
    in place of the hub id (which resolves to one), one step. The run loads the folder's model, tokenizer and image
    processor, trains, and writes a final/ that is a model.name_or_path again (config, weights, tokenizer,
    preprocessor_config.json): loaded from there, an image prompt gets the same tokens, pixels and log-probs (the
    model's own forward) as in the run's trained model (with LoRA: the adapter merged into it)."""
    import grpo.trainer.loop as loop
    from grpo.config.schema import ModelConfig
    from grpo.models import load_image_processor, load_model, load_tokenizer
    from grpo.tasks import get_task
    from grpo.vision.images import encode

    ckpt = save_tiny_vlm(family, tmp_path / "ckpt")
    runs = []
    save_final = loop.save_final
    monkeypatch.setattr(loop, "save_final", lambda run, cfg: runs.append(run) or save_final(run, cfg))
    out = tmp_path / "run"
    cfg = compose_recipe("vlm-smoke", [f"model.name_or_path={ckpt}", "model.dtype=bfloat16",
                                       "model.gradient_checkpointing=true", f"trainer.output_dir={out}",
                                       "trainer.max_steps=1", *extra])
    fit(load(OmegaConf.to_container(cfg, resolve=True)))
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1] and rows[0]["grad_norm"] > 0
    final = out / "final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= {
        p.name for p in final.iterdir()}
    run = runs[-1]
    written = run.runtime.unwrap().eval()
    tok = load_tokenizer(str(final))
    loaded = load_model(ModelConfig(name_or_path=str(final), dtype="bfloat16"), len(tok)).eval()
    base = written.get_base_model() if extra else written  # LoRA: the policy is peft's wrapper around the family's
    assert type(loaded) is type(base) and base.dtype == loaded.dtype == torch.bfloat16
    row = get_task("shapes")(1, seed=3)[0]
    mine = encode(row["prompt"], row["images"], run.tokenizer, run.image_processor)
    theirs = encode(row["prompt"], row["images"], tok, load_image_processor(str(final), tok))
    assert mine.ids == theirs.ids and mine.n_images == 1 and torch.equal(mine.pixel_values, theirs.pixel_values)
    completion = tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    a, b = own_image_logprobs(written, mine, completion), own_image_logprobs(loaded, theirs, completion)
    assert (a - b).abs().max().item() < 1e-6
    start = load_model(ModelConfig(name_or_path=str(ckpt), dtype="bfloat16"), len(tok)).eval()
    assert (own_image_logprobs(start, theirs, completion) - b).abs().max().item() > 1e-6  # it trained


def test_the_docs_hub_command_trains_a_qwen2_5_vl_from_the_hub_cache(tmp_path, monkeypatch):
    """docs/vision-language.md's command as written, `grpo-train recipe=vlm-smoke
    model.name_or_path=Qwen/Qwen2.5-VL-3B-Instruct model.dtype=bfloat16 model.gradient_checkpointing=true`, with a tiny
    Qwen2.5-VL as that hub id's snapshot in an offline hub cache (what a download leaves), one step: the hub id loads
    as Qwen2.5-VL with its tokenizer and PIL image processor, trains, and its final/ holds the image processor."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    repo = in_hub_cache("qwen2_5_vl", "Qwen/Qwen2.5-VL-3B-Instruct", tmp_path / "hub", monkeypatch)
    out = tmp_path / "run"
    cfg = compose_recipe("vlm-smoke", [f"model.name_or_path={repo}", "model.dtype=bfloat16",
                                       "model.gradient_checkpointing=true", f"trainer.output_dir={out}",
                                       "trainer.max_steps=1"])
    fit(load(OmegaConf.to_container(cfg, resolve=True)))
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert [r["step"] for r in rows] == [1] and rows[0]["grad_norm"] > 0
    assert (out / "final" / "preprocessor_config.json").is_file()
    final = Qwen2_5_VLForConditionalGeneration.from_pretrained(out / "final")
    assert final.config.vision_config.patch_size == 4  # the snapshot's tiny tower, not a default one


def test_a_checkpoint_folder_run_resumes_from_its_step_checkpoint_exactly(tmp_path):
    """A run of a checkpoint folder writes checkpoints/step_N (its trainable weights and state on top of
    model.name_or_path, as for text models); resumed from step 1, its step 2 is the uninterrupted run's step 2."""
    ckpt = save_tiny_vlm("qwen2_5_vl", tmp_path / "ckpt")

    def train(out, *extra):
        cfg = compose_recipe("vlm-smoke", [f"model.name_or_path={ckpt}", f"trainer.output_dir={out}",
                                           "trainer.save_every=1", *extra])
        fit(load(OmegaConf.to_container(cfg, resolve=True)))
        return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    whole = train(tmp_path / "whole")
    train(tmp_path / "cut", "trainer.max_steps=1")
    assert (tmp_path / "cut" / "checkpoints" / "step_1").is_dir()
    resumed = train(tmp_path / "cut", "trainer.resume=auto")
    assert [r["step"] for r in resumed] == [1, 2]
    for key in ("loss", "grad_norm", "kl", "reward_mean", "completion_len_mean"):
        assert resumed[1][key] == pytest.approx(whole[1][key], rel=1e-5, abs=1e-7), key
