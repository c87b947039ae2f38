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

from tests.e2e.test_distributed import SMOKE, ZERO3, torchrun  # noqa: E402
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
import signal
import time


def short_on_rank1(prompts, completions, **kwargs):
    """One score too few on rank 1 only: a RewardCountError there, never retried."""
    return [0.0] * (len(completions) - (os.environ["RANK"] == "1"))


def hang_on_rank1(prompts, completions, **kwargs):
    """Never returns on rank 1: rank 0 waits for it in its next collective. The hung rank dies at torchrun's SIGTERM
    (the default action, not the trainer's stop-after-this-step handler): torchrun stops the other ranks of a failed
    group with a fixed 30 s grace before its SIGKILL (torch 2.13 passes them no --shutdown-timeout), which a rank
    that cannot act on the signal would make this test wait for."""
    if os.environ["RANK"] == "1":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while os.environ["RANK"] == "1":
        time.sleep(0.5)
    return [0.0] * len(completions)
'''


def run_failing(tmp_path, fn: str, *args: str):
    (tmp_path / "rank_rewards.py").write_text(REWARDS)  # importable: `python -m` puts the cwd on sys.path
    t0 = time.monotonic()
    p = torchrun("-m", "grpo.train", *SMOKE, "distributed=zero2", f"trainer.output_dir={tmp_path / 'run'}",
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
    p, seconds = run_failing(tmp_path, "hang_on_rank1", "distributed.timeout_s=10")
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, p.stderr[-3000:]
    assert errors[0].startswith("error: rank 0 of 2: a collective timed out or lost another rank"), errors
    assert "distributed.timeout_s=10" in errors[0]
    assert 'grpo/train.py"' not in p.stderr, p.stderr[-3000:]
    assert seconds < 120  # start-up, 10 s of waiting, then torchrun's SIGTERM to the hung rank


KILLER = '''
import os
import signal

calls = {}


def killed_once(prompts, completions, die_at: int = 0, rank: int = 1, attempt: int = 0, **kwargs):
    """0 for every completion; with die_at > 0, ``rank`` SIGKILLs itself in the middle of step ``die_at``
    (its reward call of that step: one prompt per rank and step; the calls counted per run, by its arguments) of
    the group's attempt ``attempt`` only (torchrun's restart count)."""
    key = (die_at, rank, attempt)
    calls[key] = calls.get(key, 0) + 1
    if calls[key] == die_at and os.environ["RANK"] == str(rank) and \
            os.environ.get("TORCHELASTIC_RESTART_COUNT") == str(attempt):
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



@pytest.mark.slow
def test_a_killed_rank_with_the_server_generator_stops_and_resumes_exactly(tmp_path):
    """The same with the rollout server as the asynchronous generator (K = 1, ZeRO-3, a fake server holding a real
    tiny model in this process), torchrun --max-restarts 2, one launch of three runs: an uninterrupted one; one whose
    rank 1 SIGKILLs itself on its worker thread sampling step 3 ahead (its trainer on step 2); one whose rank 0, the
    rank that pushes the weights, does so sampling step 4 (after pushing version 2). Each time the other rank stops by
    itself with one line naming the lost rank (a rank stuck on the dead one would be killed silently by torchrun), the
    server stays usable, and the resumed run (trainer.resume=auto) pushes the checkpoint's weights to it and ends with
    every step's metrics equal to the uninterrupted run's."""
    import json

    from grpo.config.schema import load
    from grpo.models import load_model, load_tokenizer
    from tests.helpers import compose_recipe
    from tests.rollout.server.fake_server import FakeServer

    (tmp_path / "kill_rewards.py").write_text(KILLER)
    cfg = load(compose_recipe("smoke", [f"trainer.output_dir={tmp_path / 'unused'}"]))
    vocab = len(load_tokenizer(cfg.model.name_or_path))
    server = FakeServer(model=load_model(cfg.model, vocab, seed=5), name=cfg.model.name_or_path, max_model_len=1024,
                        vocab=vocab).start()
    common = [*SMOKE, *ZERO3, "data.num_eval=0", "trainer.max_steps=4", "trainer.save_every=1",
              "trainer.resume=auto", "distributed.timeout_s=120", "rollout.backend=server", "rollout.max_staleness=1",
              f"rollout.server.urls=[{server.url}]", "rollout.server.connect_timeout_s=60"]

    def run(name: str, die_at: int = 0, rank: int = 1, attempt: int = 0) -> list[str]:
        fn = f"+reward.functions.kill={{fn: 'kill_rewards:killed_once', die_at: {die_at}, rank: {rank}, " \
             f"attempt: {attempt}}}"
        return ["train", str(tmp_path / name), *common, fn, f"trainer.output_dir={tmp_path / name}"]

    def metrics(name: str) -> dict:
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["loss"], r["reward_mean"], r["grad_norm"], r["async/version"]) for r in rows
                if "loss" in r}

    try:
        p = torchrun("--max-restarts", "2", str(Path(__file__)), *run("straight"), THEN, *run("lost1", 3), THEN,
                     *run("lost0", 4, rank=0, attempt=1), cwd=tmp_path, timeout=600)
    finally:
        server.stop()
    assert p.returncode == 0, p.stderr[-4000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, p.stderr[-4000:]
    for line, (me, lost) in zip(errors, ((0, 1), (1, 0))):
        assert line.startswith(f"error: rank {me} of 2: a collective timed out or lost another rank ("), line
        assert f"; rank {lost} did not answer within 5 s: it failed (its message is above), was killed" in line
    for name, step in (("lost1", 1), ("lost0", 2)):
        assert f"resumed from {tmp_path / name}/checkpoints/step_{step} (step {step})" in p.stderr, p.stderr[-4000:]
    want = metrics("straight")
    assert sorted(want) == [1, 2, 3, 4]
    for name in ("lost1", "lost0"):
        got = metrics(name)
        assert sorted(got) == sorted(want), name
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-9), (name, step)
    joins = sum(path == "/collective_rpc" and body["method"] == "grpo_join" for path, body in server.requests)
    assert joins == 5  # each run's rank 0 joined the server's channel, and both resumed runs again: it stayed usable
