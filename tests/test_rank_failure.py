"""A rank that fails stops every rank (two CPU processes under torchrun, ZeRO-2): no rank is left waiting in a
collective. A rank that raises exits at once with its one-line error and torchrun stops the other; a rank that
hangs is given up on after distributed.timeout_s by the ranks waiting for it, which stop with one line."""
import time

import pytest

from tests.test_distributed import SMOKE, torchrun

pytestmark = pytest.mark.slow

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


def run_failing(tmp_path, fn: str, *args: str):
    (tmp_path / "rank_rewards.py").write_text(REWARDS)  # importable: `python -m` puts the cwd on sys.path
    t0 = time.monotonic()
    p = torchrun("-m", "grpo.train", *SMOKE, "distributed=zero2", f"trainer.output_dir={tmp_path / 'run'}",
                 "data.num_eval=0", f"+reward.functions.bad={{fn: 'rank_rewards:{fn}'}}", *args,
                 cwd=tmp_path, timeout=180)
    return p, time.monotonic() - t0


def test_a_rank_that_raises_stops_every_rank(tmp_path):
    p, seconds = run_failing(tmp_path, "short_on_rank1", "distributed.timeout_s=120")
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors and "returned 3 scores for 4 completions" in errors[0], p.stderr[-3000:]
    assert 'grpo/train.py"' not in p.stderr, p.stderr[-3000:]  # no traceback through our code
    assert seconds < 100  # well before distributed.timeout_s: the failing rank's exit ends the group


def test_a_rank_that_hangs_is_given_up_after_distributed_timeout_s(tmp_path):
    p, seconds = run_failing(tmp_path, "hang_on_rank1", "distributed.timeout_s=10")
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, p.stderr[-3000:]
    assert errors[0].startswith("error: rank 0 of 2: a collective timed out or lost another rank"), errors
    assert "distributed.timeout_s=10" in errors[0]
    assert 'grpo/train.py"' not in p.stderr, p.stderr[-3000:]
    # start-up, 10 s of waiting, then torchrun's SIGTERM (which a rank stuck in a reward cannot act on) and,
    # 30 s later, its SIGKILL
    assert seconds < 150
