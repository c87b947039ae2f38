"""Two "nodes" on one machine: two separate torchrun commands (--nnodes 2, one process each), as two hosts
would launch them, with one trainer.output_dir per node (no shared filesystem) or one shared directory."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_distributed import SMOKE, ZERO3, _env, _free_port

pytestmark = pytest.mark.slow


def two_nodes(cwd: Path, dirs: tuple[Path, Path], *args: str, timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Node 0 and node 1 started as two independent commands; returns both finished processes."""
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port,
                               "-m", "grpo.train", *SMOKE, *args, f"trainer.output_dir={out}"],
                              cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node, out in enumerate(dirs)]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    for p in done:
        assert p.returncode == 0, p.stderr[-4000:]
    return done


def losses(run_dir: Path) -> dict[int, tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["reward_mean"], r["grad_norm"]) for r in rows if "loss" in r}


def test_zero2_one_directory_per_node_writes_a_complete_checkpoint_on_each(tmp_path):
    n0, n1 = tmp_path / "node0", tmp_path / "node1"
    two_nodes(tmp_path, (n0, n1), "distributed=zero2", "trainer.max_steps=1", "data.num_eval=0")
    for node, rank in ((n0, 0), (n1, 1)):
        step = node / "checkpoints" / "step_1"
        assert (step / "COMPLETE").exists() and (step / "trainer_state.pt").exists()
        assert (step / f"rank_{rank}.pt").exists()
        assert (step / "deepspeed" / "mp_rank_00_model_states.pt").exists()  # each node's first rank writes it
        assert list((step / "deepspeed").glob(f"zero_pp_rank_{rank}_*_optim_states.pt"))
    assert (n0 / "final").is_dir() and (n0 / "metrics.jsonl").exists()
    assert not (n1 / "final").exists() and not (n1 / "metrics.jsonl").exists()  # global rank 0 only


def test_zero3_per_node_directories_resume_and_match_a_shared_directory(tmp_path):
    """Per-node directories, stopped after step 2, resumed to step 3 after node 1 lost its newest checkpoint
    (both nodes then agree on step 1): every step's metrics equal one uninterrupted run in a shared directory."""
    common = [*ZERO3, "trainer.save_every=1", "data.num_eval=0"]
    shared = tmp_path / "shared"
    two_nodes(tmp_path, (shared, shared), *common, "trainer.max_steps=3")
    n0, n1 = tmp_path / "node0", tmp_path / "node1"
    two_nodes(tmp_path, (n0, n1), *common, "trainer.max_steps=2")
    shutil.rmtree(n1 / "checkpoints" / "step_2")  # node 1 died while finalising its copy of step 2
    first, _ = two_nodes(tmp_path, (n0, n1), *common, "trainer.max_steps=3", "trainer.resume=auto")
    assert f"resumed from {n0}/checkpoints/step_1 (step 1)" in first.stderr
    want, got = losses(shared), losses(n0)
    assert sorted(got) == [1, 2, 3]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-6), step
