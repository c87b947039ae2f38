"""Two CPU processes (gloo) through DeepSpeed ZeRO-2 with prompts that hold images (docs/vision-language.md).

The worker is tests/e2e/test_distributed.py's, on the ``vlm-smoke`` recipe (a tiny Qwen2.5-VL, one 32x32 picture per
prompt): the fixed global batch of 4 prompts x 4 completions split over the two ranks, three updates, equal to one
process with the whole batch (the vision tower's gradients included, as every rank sends its own prompts' pictures
through it); the same with both of rank 1's groups filtered out (rank 1 runs idle micro-batches only, its tower
untouched); then the real command line, whose final model is an ordinary vision-language checkpoint, and the same
with the generator sampling a step ahead (``rollout.max_staleness=1``: each rank's generator process gets its prompts
with their pixels).
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.e2e.test_distributed import _check_updates, _max_diff, one_process, worker
from tests.helpers import THEN

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="distributed tests need deepspeed (pip install 'grpo[deepspeed]')")]

# prompts of about 105 tokens (16 of them image tokens): rank 0's two groups (completions of 12-16 tokens) need
# a micro-batch each, rank 1's (2 tokens) share one
VLM = ["recipe=vlm-smoke", "engine.max_tokens_per_micro_batch=240"]
SMOKE = ["recipe=vlm-smoke", "logging.sample_every=0", "data.num_eval=0"]
RANK1_EMPTY = ["algorithm.loss_agg=dr_grpo", "drop=2,3"]


def _tower(params: dict) -> dict:
    return {k: v for k, v in params.items() if ".visual." in k or k.startswith("visual.")}


def test_zero2_with_images_equals_one_process(tmp_path):
    out, ahead = tmp_path / "run", tmp_path / "async"
    worker("update", tmp_path / "update", *VLM, "distributed=zero2",
           THEN, "update", tmp_path / "rank1-empty", *VLM, "distributed=zero2", *RANK1_EMPTY,
           THEN, "train", out, *SMOKE, "distributed=zero2", f"trainer.output_dir={out}", "trainer.save_every=1",
           THEN, "train", ahead, *SMOKE, "distributed=zero2", f"trainer.output_dir={ahead}", "rollout.max_staleness=1",
           cwd=tmp_path)
    for name, extra in (("update", ()), ("rank1-empty", RANK1_EMPTY)):
        ref = one_process(tmp_path / f"one-{name}", *VLM, *extra)
        _check_updates(tmp_path / name, ref, rank1_groups=name != "rank1-empty")
        got = torch.load(tmp_path / name / "update_rank0.pt", weights_only=False)
        tower = _tower(ref["params"][1])
        assert tower and _max_diff(tower, _tower(ref["params"][0])) > 5e-4  # the tower learns from the pictures
        assert _max_diff(_tower(got["params"][1]), tower) < 1e-5            # and equally on two processes
    for run in (out, ahead):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "loss" in r] == [1, 2]
        assert all(r["grad_norm"] > 0 and not r["skipped"] for r in rows if "loss" in r)
        p0, p1 = (torch.load(run / f"params_rank{r}.pt") for r in (0, 1))
        assert _max_diff(p0, p1) == 0.0  # every rank holds the same parameters, vision tower included
        assert _max_diff(_tower(p0), _tower(torch.load(tmp_path / "update" / "update_rank0.pt",
                                                       weights_only=False)["params"][0])) > 0  # it trained
    from transformers import AutoModelForImageTextToText

    final = AutoModelForImageTextToText.from_pretrained(out / "final")
    assert type(final).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert (out / "checkpoints" / "step_2" / "COMPLETE").exists()
