"""A rank that fails stops every rank (two CPU processes under torchrun, ZeRO-2): no rank is left waiting in a
collective. A rank that raises exits at once with its one-line error and torchrun stops the other; a rank that
hangs is given up on after distributed.timeout_s by the ranks waiting for it, which stop with one line.

Run by torchrun, this file is also the worker (``python tests/e2e/test_rank_failure.py train OUT_DIR args...``, phases
separated by ``--then`` as in tests/e2e/test_distributed.py): the command line, with the working directory (where
the tests write their reward modules) importable as under ``python -m grpo.train``."""
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), os.getcwd()]
    from tests.e2e.test_distributed import train
    from tests.helpers import run_phases

    run_phases(sys.argv[1:], {"train": train})
    sys.exit(0)


# ------------------------------------------------------------------------------------ the tests
import pytest  # noqa: E402

from tests.e2e.test_distributed import SMOKE, torchrun  # noqa: E402
from tests.helpers import THEN  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="distributed tests need deepspeed (pip install 'grpo[deepspeed]')")


def test_peer_failure_names_lost_collectives_only():
    from datetime import timedelta
    from types import SimpleNamespace

    from grpo.errors import PeerLostError, SetupError
    from grpo.runtime.deepspeed import DeepSpeedRuntime

    rt = SimpleNamespace(rank=0, world_size=2, timeout=timedelta(seconds=10))
    lost = DeepSpeedRuntime.peer_failure(rt, RuntimeError("[/gloo/unbound_buffer.cc:78] Timed out waiting 10000ms "
                                                          "for recv operation to complete"))
    assert isinstance(lost, PeerLostError)
    assert str(lost).startswith("rank 0 of 2: a collective timed out or lost another rank (Timed out waiting 10000ms")
    assert "distributed.timeout_s=10" in str(lost) and "\n" not in str(lost)
    assert DeepSpeedRuntime.peer_failure(rt, RuntimeError("Connection closed by peer [127.0.0.1]:4"))
    assert DeepSpeedRuntime.peer_failure(rt, SetupError("timed out waiting for a reward")) is None  # already one line
    assert DeepSpeedRuntime.peer_failure(rt, ValueError("shapes differ")) is None                 # a bug: traceback
REWARDS = '''
import os
import time


def short_on_rank1(prompts, completions, **kwargs):
    """One score too few on rank 1 only: a RewardCountError there, never retried."""
    return [0.0] * (len(completions) - (os.environ["RANK"] == "1"))


def hang_on_rank1(prompts, completions, **kwargs):
    """Never returns on rank 1: rank 0 waits for it in its next collective."""
    while os.environ["RANK"] == "1":
        time.sleep(0.5)
    return [0.0] * len(completions)
'''


def run_failing(tmp_path, fn: str, *args: str, launcher: tuple[str, ...] = ()):
    (tmp_path / "rank_rewards.py").write_text(REWARDS)  # importable: `python -m` puts the cwd on sys.path
    t0 = time.monotonic()
    p = torchrun(*launcher, "-m", "grpo.train", *SMOKE, "distributed=zero2", f"trainer.output_dir={tmp_path / 'run'}",
                 "data.num_eval=0", f"+reward.functions.bad={{fn: 'rank_rewards:{fn}'}}", *args,
                 cwd=tmp_path, timeout=180)
    return p, time.monotonic() - t0


@pytest.mark.slow
def test_a_rank_that_raises_stops_every_rank(tmp_path):
    p, seconds = run_failing(tmp_path, "short_on_rank1", "distributed.timeout_s=120")
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors and "returned 3 scores for 4 completions" in errors[0], p.stderr[-3000:]
    assert 'grpo/train.py"' not in p.stderr, p.stderr[-3000:]  # no traceback through our code
    assert seconds < 100  # well before distributed.timeout_s: the failing rank's exit ends the group


@pytest.mark.slow
def test_a_rank_that_hangs_is_given_up_after_distributed_timeout_s(tmp_path):
    # torchrun SIGTERMs the ranks, then SIGKILLs them after --shutdown_timeout (30 s by default): 5 s here
    p, seconds = run_failing(tmp_path, "hang_on_rank1", "distributed.timeout_s=10",
                             launcher=("--shutdown_timeout", "5"))
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, p.stderr[-3000:]
    assert errors[0].startswith("error: rank 0 of 2: a collective timed out or lost another rank"), errors
    assert "distributed.timeout_s=10" in errors[0]
    assert 'grpo/train.py"' not in p.stderr, p.stderr[-3000:]
    # start-up, 10 s of waiting, then torchrun's SIGTERM (which a rank stuck in a reward cannot act on) and,
    # 5 s later, its SIGKILL
    assert seconds < 150


KILLER = '''
import os
import signal

calls = {}


def killed_once(prompts, completions, die_at: int = 0, **kwargs):
    """0 for every completion; with die_at > 0, rank 1 SIGKILLs itself in the middle of step ``die_at``
    (its reward call of that step: one prompt per rank and step; the calls counted per die_at, each run its own) of
    the group's first attempt only."""
    calls[die_at] = calls.get(die_at, 0) + 1
    if calls[die_at] == die_at and os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)
'''


@pytest.mark.slow
def test_a_killed_rank_restarts_the_group_and_the_run_resumes_exactly(tmp_path):
    """torchrun --max-restarts 1, one launch of two runs: an uninterrupted one, then one whose rank 1 is SIGKILLed
    during step 3 (of 3); rank 0 stops with the one line, torchrun restarts both (the finished first run has
    nothing left to do), trainer.resume=auto continues from step 2's checkpoint, and every step's metrics equal the
    uninterrupted run's."""
    import json

    (tmp_path / "kill_rewards.py").write_text(KILLER)
    common = [*SMOKE, "distributed=zero2", "data.num_eval=0", "trainer.max_steps=3", "trainer.save_every=1",
              "trainer.resume=auto", "distributed.timeout_s=60"]

    def run(name: str, die_at: int) -> list[str]:
        fn = f"+reward.functions.kill={{fn: 'kill_rewards:killed_once', die_at: {die_at}}}"
        return ["train", str(tmp_path / name), *common, fn, f"trainer.output_dir={tmp_path / name}"]

    def losses(name: str) -> dict:
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["loss"], r["reward_mean"], r["grad_norm"]) for r in rows if "loss" in r}

    p = torchrun("--max-restarts", "1", str(Path(__file__)), *run("straight", 0), THEN, *run("killed", 3),
                 cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "error: rank 0 of 2: a collective timed out or lost another rank" in p.stderr, p.stderr[-4000:]
    assert f"resumed from {tmp_path / 'killed'}/checkpoints/step_2 (step 2)" in p.stderr, p.stderr[-4000:]
    want, got = losses("straight"), losses("killed")
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-9), step
