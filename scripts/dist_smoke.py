"""The distributed smoke of `scripts/bench_gpu.sh dist`: `grpo.train` under a launcher, then checks that the run
took the path it was meant to prove and ended well.

    python -m torch.distributed.run --standalone --nproc_per_node 1 scripts/dist_smoke.py \\
        --expect-backend nccl --json out.json recipe=smoke distributed=zero3 distributed.bf16=true ...

Every argument after the options is a `grpo.train` override (trainer.output_dir is required). While the run is
live (just before its final model is saved) every rank notes the process group's backend, the world size, the
ZeRO stage, the dtype its engine computes in and whether the weights are partitioned; afterwards rank 0 checks
them against ``--expect-backend`` / ``--expect-dtype``, and checks the run's files: one metrics line per step with
a finite loss and gradient norm and no skipped step, a complete checkpoint of the last step, and a `final/` that
transformers loads, in the training dtype. It prints one JSON line (and writes it to ``--json``) with the times
per step and the peak GPU memory. Exit code 0 only when every check holds.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _observe(record: dict):
    """Wraps grpo.trainer.loop.save_final so that it notes what the live run is made of."""
    import grpo.trainer.loop

    original = grpo.trainer.loop.save_final

    def save_final(run, cfg):
        rt = run.runtime
        params = list(rt.unwrap().parameters())
        record.update(
            backend=torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            world_size=rt.world_size, rank=rt.rank, zero_stage=getattr(rt, "stage", 0), device=str(rt.device),
            dtype=str(params[0].dtype).removeprefix("torch."),
            partitioned=all(hasattr(p, "ds_id") and p.numel() == 0 for p in params),
            output_dir=cfg.trainer.output_dir, max_steps=cfg.trainer.max_steps)
        return original(run, cfg)

    grpo.trainer.loop.save_final = save_final


def check(record: dict, expect_backend: str, expect_dtype: str) -> list[str]:
    """What is wrong with the run (empty: nothing)."""
    problems = []
    if not record:
        return ["the run ended before its final model was saved"]
    for key, want in (("backend", expect_backend), ("dtype", expect_dtype), ("zero_stage", 3)):
        if record[key] != want:
            problems.append(f"{key} is {record[key]!r}, expected {want!r}")
    if not record["partitioned"]:
        problems.append("the weights were not partitioned by ZeRO-3")
    out = Path(record["output_dir"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    if [r["step"] for r in steps] != list(range(1, record["max_steps"] + 1)):
        problems.append(f"metrics.jsonl has steps {[r['step'] for r in steps]}")
    for r in steps:
        if r["skipped"] or not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0):
            problems.append(f"step {r['step']}: loss {r['loss']}, grad_norm {r['grad_norm']}, skipped {r['skipped']}")
    if not (out / "checkpoints" / f"step_{record['max_steps']}" / "COMPLETE").exists():
        problems.append(f"no complete checkpoint of step {record['max_steps']}")
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out / "final", dtype="auto")
    if str(final.dtype).removeprefix("torch.") != expect_dtype:
        problems.append(f"final/ holds {final.dtype} weights, expected {expect_dtype}")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--expect-backend", default="nccl", choices=["nccl", "gloo"])
    p.add_argument("--expect-dtype", default="bfloat16")
    p.add_argument("--json", default=None, help="also write the result line here (rank 0)")
    args, overrides = p.parse_known_args(argv)
    sys.path.insert(0, str(ROOT))
    record: dict = {}
    _observe(record)
    import grpo.train

    start = time.perf_counter()
    sys.argv = ["grpo.train", *overrides]
    grpo.train.main()
    if record.get("rank", 0) != 0:
        return 0
    problems = check(record, args.expect_backend, args.expect_dtype)
    out = Path(record["output_dir"]) if record else None
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if out else []
    result = {**record, "ok": not problems, "problems": problems, "wall_s": round(time.perf_counter() - start, 1),
              **{k.removeprefix("time/"): [round(r[k], 2) for r in rows if k in r]
                 for k in ("time/rollout_s", "time/update_s")},
              "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20) if torch.cuda.is_available() else None}
    line = json.dumps(result)
    print(line, flush=True)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
