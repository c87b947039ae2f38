"""ZeRO-3 with LoRA on two CPU processes (gloo), against one process with the same global batch.

One launch of `tests/e2e/test_distributed.py`'s worker (``cli``, then ``resume``; the one-process reference runs in
the test process): the fixed-batch update checks that the adapter's update equals the one-process LoRA update
(the reference being the base model with the adapter disabled: equal KL), that only the adapter moves and that
every weight, the base's included, is partitioned over the ranks; the real command line checks the adapter-only
checkpoints, the merged final model (gathered layer by layer, merged by peft on rank 0) against a merge computed
here from the gathered weights, and that a resumed run loads the adapter back (the adapter it saves equals the
one it resumed from); a third phase runs the fixed-batch update for a hybrid family (tiny:qwen3_5_text).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.e2e.test_distributed import BUDGET, SMOKE, ZERO3, _check_updates, _max_diff, one_process, worker
from tests.helpers import THEN

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="distributed tests need deepspeed (pip install 'grpo[deepspeed]')")

R, ALPHA = 4, 8
LORA = ["model.lora.enabled=true", f"model.lora.r={R}", f"model.lora.alpha={ALPHA}"]
# a hybrid family (Gated DeltaNet layers, three to one attention layer), adapters on both kinds of layer
HYBRID = ["model.name_or_path=tiny:qwen3_5_text", "model.lora.target_modules=[q_proj,v_proj,in_proj_qkv,out_proj]"]


def _is_lora(name: str) -> bool:
    return "lora_" in name


def merged(params: dict) -> dict:
    """The Hugging Face state dict of a LoRA model merged by hand: W + alpha / r * B @ A for every adapted
    projection, every other weight as it is, names without peft's prefixes (independent of peft's merge)."""
    out = {}
    for name, w in params.items():
        if _is_lora(name):
            continue
        stem = name.removesuffix(".base_layer.weight")
        if stem != name:
            w = w + ALPHA / R * params[f"{stem}.lora_B.default.weight"] @ params[f"{stem}.lora_A.default.weight"]
            name = stem + ".weight"
        out[name.removeprefix("base_model.model.")] = w
    return out


def _check_update_record(out: Path) -> None:
    ranks = [torch.load(out / f"update_rank{r}.pt", weights_only=False) for r in (0, 1)]
    params = ranks[0]["params"]
    lora = [n for n in params[0] if _is_lora(n)]
    assert lora and len(lora) < len(params[0])
    for k in (1, 2):
        assert all(torch.equal(params[k][n], params[0][n]) for n in params[0] if not _is_lora(n))  # base frozen
    assert any(not torch.equal(params[2][n], params[0][n]) for n in lora if "lora_B" in n)         # adapter trained
    for r in ranks:  # every weight, the frozen base's too, is split over the two ranks
        for name, (held, full) in r["held"].items():
            assert held < full <= 2 * held, (name, held, full)


def _check_checkpoint(ckpt: Path) -> None:
    """The checkpoint holds the adapter only: DeepSpeed's model states list no base weight and no rank keeps a
    fragment of the frozen base (the optimizer's partitions only ever hold the trainable adapter)."""
    assert (ckpt / "COMPLETE").exists()
    for r in (0, 1):
        states = torch.load(ckpt / "deepspeed" / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", weights_only=False)
        assert states["module"] and all(_is_lora(n) for n in states["module"])
        assert not states.get("frozen_param_fragments")


@pytest.mark.slow
def test_zero3_lora_two_processes_equal_one_process(tmp_path):
    ref = one_process(tmp_path / "one", *LORA)
    out, resumed = tmp_path / "run", tmp_path / "resumed"
    common = [*SMOKE, *ZERO3, *LORA, "trainer.save_every=1", "data.num_eval=0",
              f"engine.max_tokens_per_micro_batch={BUDGET}"]
    # one launch: the fixed batch and the real command line; then the run's directory, copied without its final/
    # (a run stopped after its last checkpoint), resumed at max_steps: the final model is saved from the last
    # checkpoint, here as the adapter alone
    p = worker("cli", tmp_path / "update", *common, f"trainer.output_dir={out}",
               THEN, "resume", out, *common, f"trainer.output_dir={resumed}", "trainer.resume=auto",
               "model.lora.merge_on_save=false", "trainer.force_resume=true",
               THEN, "update", tmp_path / "hybrid", *ZERO3, *LORA, *HYBRID, cwd=tmp_path)
    # the adapter's updates (gradient norm, loss, KL to the adapter-disabled reference, parameters) equal one
    # process's; the skipped NaN step leaves them put
    _check_updates(tmp_path / "update", ref)
    _check_update_record(tmp_path / "update")

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    p0, p1 = (torch.load(out / f"params_rank{r}.pt") for r in (0, 1))
    assert _max_diff(p0, p1) == 0.0
    _check_checkpoint(out / "checkpoints" / "step_1")
    _check_checkpoint(out / "checkpoints" / "step_2")
    # final/: an ordinary Hugging Face model, the adapter merged into the gathered base weights
    from safetensors.torch import load_file

    final = out / "final"
    assert not (final / "adapter_config.json").exists()
    got, want = load_file(str(final / "model.safetensors")), merged(p0)
    assert got.keys() == want.keys()
    assert max(float((got[k] - want[k]).abs().max()) for k in got) < 1e-6
    base = {k: p0.get(f"base_model.model.{k}", p0.get(f"base_model.model.{k[:-7]}.base_layer.weight")) for k in want}
    moved = [k for k in want if not torch.equal(want[k], base[k])]
    assert moved and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in moved)

    # the resumed run's adapter equals the one the first run ended with: the resume loaded the adapter back
    assert "saving it from the last checkpoint" in p.stderr
    final = resumed / "final"
    trained = {n.replace(".default", ""): t for n, t in p0.items() if _is_lora(n)}
    assert (final / "adapter_config.json").exists() and not (final / "model.safetensors").exists()
    adapter = load_file(str(final / "adapter_model.safetensors"))
    assert adapter.keys() == trained.keys()
    assert all(torch.equal(adapter[n], trained[n]) for n in adapter)

    # the hybrid family in the same launch: ZeRO-3 + LoRA equals one process, through the shared layout (the prompt's
    # recurrent and convolution states handed to each completion), the adapters of both layer kinds trained
    _check_updates(tmp_path / "hybrid", one_process(tmp_path / "one-hybrid", *LORA, *HYBRID))
    _check_update_record(tmp_path / "hybrid")
    params = torch.load(tmp_path / "hybrid" / "update_rank0.pt", weights_only=False)["params"]
    assert any(not torch.equal(params[2][n], params[0][n]) for n in params[0] if "linear_attn" in n and "lora_B" in n)
    assert "standard layout" not in p.stderr  # no rank fell back from the shared layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_holding_merges_like_the_model_it_copies(dtype):
    """`grpo.runtime.base.holding` (the ZeRO-3 merge path, here without DeepSpeed): a meta-built copy holding a
    state dict merges to the same weights as the model itself, tied embeddings included, no tensor copied."""
    from peft import LoraConfig, get_peft_model

    from grpo.models import tiny_model
    from grpo.runtime.base import holding

    model = tiny_model("llama", 40, seed=3).to(dtype)  # tiny models are untied: tie them here
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # a trained adapter (B starts at zero)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    copy = holding(model, state)
    assert all(p.device.type == "cpu" for p in copy.parameters())
    held = dict(copy.named_parameters())
    assert all(held[k].data_ptr() == state[k].data_ptr() for k in held)  # the state's own tensors
    got = copy.merge_and_unload().state_dict()
    want = model.merge_and_unload().state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert got["lm_head.weight"].data_ptr() == got["model.embed_tokens.weight"].data_ptr()  # still tied
