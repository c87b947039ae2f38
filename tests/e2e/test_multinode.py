"""Two "nodes" on one machine: two separate torchrun commands (--nnodes 2, one process each), as two hosts
would launch them, with one trainer.output_dir per node (no shared filesystem) or one shared directory.

Run by torchrun, this file is also the worker (``python tests/e2e/test_multinode.py MODE OUT_DIR args...``, phases
separated by ``--then`` as in tests/e2e/test_distributed.py): ``train`` is the real command line, ``lose`` deletes
OUT_DIR (a checkpoint a node lost). All the runs the tests check are the phases of one launch of the two nodes: the
processes start, import and join the group once."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lose(args: list[str], out: Path) -> None:
    shutil.rmtree(out)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tests.e2e.test_distributed import train
    from tests.helpers import run_phases

    run_phases(sys.argv[1:], {"train": train, "lose": lose})
    sys.exit(0)


# ------------------------------------------------------------------------------------ the tests
import pytest  # noqa: E402

from tests.e2e.test_distributed import SMOKE, ZERO3, _env, _free_port  # noqa: E402
from tests.helpers import THEN  # noqa: E402

pytestmark = pytest.mark.slow


def two_nodes(cwd: Path, commands: list[list[str]], timeout: int) -> list[subprocess.CompletedProcess]:
    """Node 0 and node 1 started as two independent commands (``commands[node]``: what follows torchrun's own
    options); returns both finished processes."""
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                               "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port, *cmd],
                              cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node, cmd in enumerate(commands)]
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


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One launch of the two nodes, phase after phase: ZeRO-2 with per-node directories (1 step, in zero2/); ZeRO-3
    (save_every=1) for 3 steps in one shared directory (zero3/shared), then with per-node directories stopped after
    step 2 (zero3/node0, zero3/node1), node 1's step-2 checkpoint deleted (node 1 died while finalising its copy),
    then resumed (trainer.resume=auto) to step 3. Returns the directory and node 0's finished process."""
    tmp = tmp_path_factory.mktemp("multinode")
    zero3 = [*SMOKE, *ZERO3, "trainer.save_every=1", "data.num_eval=0"]
    shared = tmp / "zero3" / "shared"

    def phases(node: int) -> list[str]:
        own = tmp / "zero3" / f"node{node}"
        return [str(Path(__file__)),
                "train", tmp, *SMOKE, "distributed=zero2", "trainer.max_steps=1", "data.num_eval=0",
                f"trainer.output_dir={tmp / 'zero2' / f'node{node}'}",
                THEN, "train", tmp, *zero3, "trainer.max_steps=3", f"trainer.output_dir={shared}",
                THEN, "train", tmp, *zero3, "trainer.max_steps=2", f"trainer.output_dir={own}",
                *([THEN, "lose", own / "checkpoints" / "step_2"] if node == 1 else []),
                THEN, "train", tmp, *zero3, "trainer.max_steps=3", "trainer.resume=auto", f"trainer.output_dir={own}"]

    first, _ = two_nodes(tmp, [list(map(str, phases(node))) for node in (0, 1)], timeout=600)
    return tmp, first


def test_zero2_one_directory_per_node_writes_a_complete_checkpoint_on_each(nodes):
    n0, n1 = (nodes[0] / "zero2" / f"node{node}" for node in (0, 1))
    for node, rank in ((n0, 0), (n1, 1)):
        step = node / "checkpoints" / "step_1"
        assert (step / "COMPLETE").exists() and (step / "trainer_state.json").exists()
        assert (step / f"rank_{rank}.json").exists()
        assert (step / "deepspeed" / "mp_rank_00_model_states.pt").exists()  # each node's first rank writes it
        assert list((step / "deepspeed").glob(f"zero_pp_rank_{rank}_*_optim_states.pt"))
    assert (n0 / "final").is_dir() and (n0 / "metrics.jsonl").exists()
    assert not (n1 / "final").exists() and not (n1 / "metrics.jsonl").exists()  # global rank 0 only


def test_zero3_per_node_directories_resume_and_match_a_shared_directory(nodes):
    """Per-node directories, stopped after step 2, resumed to step 3 after node 1 lost its newest checkpoint
    (both nodes then agree on step 1): every step's metrics equal one uninterrupted run in a shared directory."""
    tmp, first = nodes
    n0 = tmp / "zero3" / "node0"
    assert f"resumed from {n0}/checkpoints/step_1 (step 1)" in first.stderr
    want, got = losses(tmp / "zero3" / "shared"), losses(n0)
    assert sorted(got) == [1, 2, 3]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-6), step
