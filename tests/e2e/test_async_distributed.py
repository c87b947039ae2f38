"""Asynchronous GRPO (docs/async.md) on two CPU processes (gloo) through DeepSpeed ZeRO-2 and ZeRO-3: one generator
process per rank, each sampling its rank's share of every step.

Run by torchrun, this file is also the worker (``python tests/e2e/test_async_distributed.py MODE OUT_DIR args...``,
phases separated by ``--then`` as in tests/e2e/test_distributed.py, whose ``train`` and ``resume`` modes it reuses):

- ``pipeline``: build the run, then three steps through the generator processes at K = 0 (`pipeline.batches` with
  ``process=True``: every batch samples with the weights the trainer has when it trains on it; ``process=None``: the
  run's own generator at its lag) and a `policy_update` each; every rank writes what it sampled and the update's
  mismatch metrics.
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def pipeline_steps(args: list[str], out: Path, process: bool | None = True) -> None:
    from omegaconf import OmegaConf

    from grpo.config.schema import load
    from grpo.trainer import pipeline
    from grpo.trainer.build import build_run
    from grpo.trainer.run import LoopState
    from grpo.update import policy_update
    from tests.helpers import compose_recipe

    raw = compose_recipe("smoke", [f"trainer.output_dir={out / 'run'}", "data.num_eval=0", "trainer.max_steps=3",
                                   *args])
    cfg = load(OmegaConf.to_container(raw, resolve=True))
    run = build_run(cfg)
    src, record = pipeline.batches(run, cfg, LoopState(), process=process), []
    try:
        for step in (1, 2, 3):
            batch = src.batch(step)
            stats = policy_update(run.runtime, batch, run.settings.update)
            record.append({"versions": batch.versions, "rewards": batch.rewards.tolist(),
                           "prompts": [r["prompt"] for r in batch.rows], "reward_mean": batch.stats["reward_mean"],
                           "num_groups": batch.stats.get("num_groups"), "diff": stats["rollout_is/logp_diff_abs_max"],
                           "grad_norm": stats["grad_norm"], "stats": dict(batch.stats)})
    finally:
        src.close()
        run.close()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(record, out / f"pipeline_rank{run.runtime.rank}.pt")


def damaged(args: list[str], src: Path) -> None:
    """``resume``, with one file of the copy's newest checkpoint truncated by rank 0 first (``damage=<its path in the
    checkpoint>`` leads the arguments)."""
    import os
    import shutil

    import torch.distributed as dist

    from tests.e2e.test_distributed import train

    name, args = args[0].split("=", 1)[1], args[1:]
    dst = Path(next(a.split("=", 1)[1] for a in args if a.startswith("trainer.output_dir=")))
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("final"))
        newest = max((dst / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        (newest / name).write_bytes((newest / name).read_bytes()[:-1])
    dist.barrier()
    train(args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tests.e2e.test_distributed import resume, train
    from tests.helpers import run_phases

    run_phases(sys.argv[1:], {"pipeline": pipeline_steps, "train": train, "resume": resume, "damaged": damaged})
    sys.exit(0)


# ------------------------------------------------------------------------------------ the tests
import importlib.util  # noqa: E402

import pytest  # noqa: E402

from grpo.trainer import checkpoint  # noqa: E402
from tests.e2e.test_async import same_numbers, steps  # noqa: E402
from tests.e2e.test_distributed import ZERO3, launch  # noqa: E402
from tests.helpers import THEN  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="distributed tests need deepspeed (pip install 'grpo[deepspeed]')")


def doc_command(server: bool = False) -> dict[str, str]:
    """The overrides of the torchrun command of docs/async.md (2 processes) with the hf generators, or (``server``)
    with the rollout servers as the generator."""
    text = (ROOT / "docs" / "async.md").read_text()
    lines = [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()
             if line.strip().startswith("torchrun") and ("rollout.backend=server" in line) == server]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0], comments=True)
    assert words[:5] == ["torchrun", "--nproc_per_node", "2", "-m", "grpo.train"], words
    return dict(w.split("=", 1) for w in words[5:])


@pytest.mark.slow
def test_zero2_and_zero3_on_two_processes_with_a_generator_per_rank(tmp_path):
    """One launch: ZeRO-3 through the generator processes at K = 0 (the published weights are gathered whole: every
    rank's behaviour log-probs equal its trainer's bit for bit, step after step; each rank samples its own prompts;
    the logged statistics are over both ranks); then ZeRO-2 with K = 1 for 3 steps, twice (the same metrics), and
    resumed from its step-2 checkpoint, which holds each rank's batch of step 3 (version 1): step 3 as uninterrupted.
    The ZeRO-2 runs are the torchrun command of docs/async.md, scaled down (the tiny model, 3 steps)."""
    from tests.e2e.test_docs_commands import SCALE

    a, b, c, d = tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d"
    given = doc_command()
    assert given["distributed"] == "zero2" and given["rollout.max_staleness"] == "1"
    scaled = {**given, **SCALE, "trainer.max_steps": "3", "trainer.save_every": "2", "trainer.keep_last": "3",
              "logging.sample_every": "0", "logging.plot": "false"}
    run = [f"{k}={v}" for k, v in scaled.items()]
    p = launch(Path(__file__), "pipeline", tmp_path / "zero3", *ZERO3, "logging.sample_every=0",
               THEN, "train", a, *run, f"trainer.output_dir={a}",
               THEN, "train", b, *run, f"trainer.output_dir={b}",
               THEN, "resume", a, *run, f"trainer.output_dir={c}", f"trainer.resume={c / 'checkpoints' / 'step_2'}",
               THEN, "damaged", a, "damage=rank_1.safetensors", *run, f"trainer.output_dir={d}", "trainer.resume=auto",
               cwd=tmp_path, phase_s=300)
    ranks = [torch.load(tmp_path / "zero3" / f"pipeline_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for t in range(3):
        assert [r[t]["diff"] for r in ranks] == [0.0, 0.0] and ranks[0][t]["grad_norm"] > 0, t
        assert ranks[0][t]["versions"] == ranks[1][t]["versions"] == [t] * len(ranks[0][t]["versions"])
        assert not set(ranks[0][t]["prompts"]) & set(ranks[1][t]["prompts"])  # each rank its share
        rewards = ranks[0][t]["rewards"] + ranks[1][t]["rewards"]
        assert ranks[0][t]["reward_mean"] == ranks[1][t]["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    first = steps(a)
    assert [first[t]["async/staleness_max"] for t in (1, 2, 3)] == [0, 1, 1]
    assert [first[t]["async/version"] for t in (1, 2, 3)] == [0, 0, 1]
    assert first[1]["rollout_is/logp_diff_abs_max"] == 0.0 and first[3]["rollout_is/logp_diff_abs_max"] > 0
    same_numbers(first, steps(b))
    held = [checkpoint.load_state(a / "checkpoints" / "step_2", f"rank_{r}")["in_flight"] for r in (0, 1)]
    assert [{s: g.version for s, g in h["batches"].items()} for h in held] == [{3: 1}, {3: 1}]
    assert held[0]["batches"][3].batch.rows != held[1]["batches"][3].batch.rows  # each rank's own batch
    assert f"resumed from {c / 'checkpoints' / 'step_2'} (step 2)" in p.stderr
    same_numbers(first, steps(c))  # steps 1-2 copied, step 3 trained again on the stored batches
    # step 3 of d's copy had rank 1's in-flight batch cut short: passed over, kept, step 3 trained again from step 2
    assert "checkpoint step_3 is damaged (rank_1.safetensors has" in p.stderr
    assert (d / "checkpoints" / "damaged-step_3").is_dir() and checkpoint.damage(d / "checkpoints" / "step_3") is None
    same_numbers(first, steps(d))
    _every_file_of_a_two_process_checkpoint_is_verified(a / "checkpoints" / "step_3", tmp_path / "copy")


def _every_file_of_a_two_process_checkpoint_is_verified(step: Path, tmp: Path) -> None:
    """Both ranks' files, DeepSpeed's shards and the state are in the manifest; each truncated, emptied or deleted
    in turn is named (a flipped byte of the same size: by the checksum)."""
    import shutil

    from grpo.trainer import manifest

    names = manifest.files_of(step)
    assert {"COMPLETE", "trainer_state.json", "trainer_state.safetensors", "rank_0.json", "rank_0.safetensors",
            "rank_1.json", "rank_1.safetensors"} <= set(names) and sum(n.startswith("deepspeed/") for n in names) >= 3
    assert sorted(manifest.read(step)) == names and checkpoint.damage(step) is None
    for name in [*names, manifest.NAME]:
        for how in ("truncate", "empty", "delete", "flip"):
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(step, tmp)
            data = (tmp / name).read_bytes()
            if how == "delete":
                (tmp / name).unlink()
            else:
                cut = {"truncate": data[:-1], "empty": b"", "flip": data[:-1] + bytes([data[-1] ^ 1]) if data else b"x"}
                (tmp / name).write_bytes(cut[how])
            why = checkpoint.damage(tmp)
            assert why is not None and (name in why or (name == "COMPLETE" and "COMPLETE is missing" in why)), \
                (name, how)
