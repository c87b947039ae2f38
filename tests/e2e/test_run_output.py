"""What a user sees and finds after a run: the run directory, the console, reward failures, resume, the
report. One short smoke run (module fixture) serves most checks."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import in_one_process

BAD_REWARDS = '''
import os

def boom(prompts, completions, **kw):
    return _helper_that_fails(completions)

def _helper_that_fails(c):
    raise KeyError("no such column")

def one_score(prompts, completions, **kw):
    return [1.0]

def slow(prompts, completions, **kw):
    with open(os.environ["CALLS_FILE"], "a") as f:
        f.write(f"{len(completions)}\\n")
    import time
    time.sleep(30)
    return [0.0] * len(completions)
'''


def grpo(cwd, *args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "grpo.train", "recipe=smoke", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout, env=env)


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> dict:
    """The command lines of this file, in one process (tests/helpers.py `in_one_process`), from one working directory
    holding the bad rewards: name -> (its output directory, what it gave)."""
    cwd = tmp_path_factory.mktemp("cwd")
    (cwd / "badrewards.py").write_text(BAD_REWARDS)
    commands = {  # name -> output directory, arguments after recipe=smoke, environment
        "first": (cwd / "runs" / "a", ["trainer.max_steps=2", "trainer.save_every=1", "algorithm.beta=0",
                                       "~reward.functions.accuracy", "+reward.functions.boom.fn=badrewards:boom"], {}),
        "one_score": (cwd / "short", ["trainer.max_steps=3", "data.num_eval=0",
                                      "+reward.functions.short.fn=badrewards:one_score"], {}),
        "slow": (cwd / "slow", ["trainer.max_steps=1", "data.num_eval=0", "reward.timeout_s=2",
                                "+reward.functions.slow.fn=badrewards:slow"], {"CALLS_FILE": str(cwd / "calls.txt")}),
    }
    ran = in_one_process([(cwd, ["grpo.train", "recipe=smoke", f"trainer.output_dir={out}", *args], env)
                          for out, args, env in commands.values()])
    return {"cwd": cwd, **{name: (out, p) for (name, (out, _, _)), p in zip(commands.items(), ran)}}


@pytest.fixture(scope="module")
def first_run(cli):
    out, p = cli["first"]
    assert p.returncode == 0, p.stderr[-3000:]
    return cli["cwd"], out, p


def test_a_removed_reward_is_not_scored_and_the_saved_config_says_so(first_run):
    cwd, out, _ = first_run
    rows = [r for r in read(out / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 2
    assert all("reward/accuracy" not in r and "reward/format" in r for r in rows)
    saved = (out / ".hydra" / "config.yaml").read_text()
    assert "boom:" in saved and "accuracy:" not in saved


def test_everything_lands_in_the_output_dir_and_nothing_in_outputs(first_run):
    cwd, out, _ = first_run
    assert not (cwd / "outputs").exists()
    for name in (".hydra/config.yaml", ".hydra/overrides.yaml", "train.log", "metrics.jsonl", "final"):
        assert (out / name).exists(), name


def test_train_log_holds_what_the_console_showed(first_run):
    """train.log is the run's log: the summary line, every step line, the held-out evaluation, the final report
    and the reward's error, as the console showed them."""
    _, out, p = first_run
    log = (out / "train.log").read_text()
    missing = [line for line in p.stderr.splitlines() if line not in log]
    assert not missing, missing
    for shown in ("[grpo] tiny:llama: 64 train / 4 held-out prompts", "step 1/2 [", "step 2/2 [",
                  "  sample  reward=", "(before, 4 prompts, greedy)", "held-out format", "final model: "):
        assert shown in log, shown
    assert log.count("step 2/2 [") == 1  # each line once
    assert re.search(r"^step 2/2 \[\d\d:\d\d<00:00\]  reward ", log, re.M)  # the counter, elapsed<remaining
    assert "[grpo] held-out evaluation (before): 4 prompts, greedy, up to " in log


def test_a_reward_that_raises_shows_the_users_frames_once(first_run):
    _, out, p = first_run
    assert p.stderr.count("reward function 'boom' raised") == 1
    assert "in _helper_that_fails" in p.stderr and "KeyError: 'no such column'" in p.stderr
    assert "grpo/rewards/score.py" not in p.stderr  # the scoring machinery's frames are not the user's
    assert all(r["reward/boom_errors"] == 8 for r in read(out / "metrics.jsonl") if "loss" in r)
    assert "in _helper_that_fails" in (out / "train.log").read_text()


def test_a_quiet_console_when_output_is_not_a_terminal(first_run):
    _, _, p = first_run
    assert "Setting accelerator" not in p.stdout + p.stderr  # deepspeed is not used, and says nothing
    assert "seq/s" not in p.stderr and "Loading weights" not in p.stderr  # no progress-bar redraws in a log
    assert p.stdout == ""  # everything the trainer says goes to stderr


def test_beta_zero_logs_no_kl_and_the_report_says_n_a(first_run):
    cwd, out, _ = first_run
    assert all(r["kl"] is None for r in read(out / "metrics.jsonl") if "loss" in r)
    from grpo.trainer.report import report

    md = report([out], cwd / "report").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| `"))
    assert row.split(" | ")[6] == "n/a"  # final kl
    assert "## Completion length" in md and "KL and completion length" not in md


def grpo_here(monkeypatch, capsys, cwd, *args) -> tuple[int, str]:
    """`grpo-train recipe=smoke <args>` run from ``cwd`` in this process, which holds torch already: (exit code,
    stderr)."""
    from grpo import train

    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(cwd))  # as `python -m` has it
    monkeypatch.setattr(sys, "argv", ["grpo-train", "recipe=smoke", *args])
    capsys.readouterr()
    try:
        train.main()
        code = 0
    except SystemExit as e:
        code = e.code
    finally:  # the user's modules (badrewards) are not left to another test of this process
        for name in [n for n, m in sys.modules.items() if str(getattr(m, "__file__", "")).startswith(str(cwd))]:
            del sys.modules[name]
    return code, capsys.readouterr().err


def test_resume_keeps_the_step_zero_evaluation_and_refuses_a_changed_prompt(first_run, monkeypatch, capsys):
    cwd, out, _ = first_run
    common = [f"trainer.output_dir={out}", "trainer.save_every=1", "algorithm.beta=0", "~reward.functions.accuracy",
              "+reward.functions.boom.fn=badrewards:boom", "trainer.resume=auto", "reward.max_failed_steps=5"]
    changed = [*common, "trainer.max_steps=3", "data.prompt_template='Q: {prompt}'"]
    code, err = grpo_here(monkeypatch, capsys, cwd, *changed)
    assert code == 2
    assert "cannot resume" in err and "data.prompt_template changed" in err
    p = grpo(cwd, *common, "trainer.max_steps=3")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[grpo] resumed from" in p.stderr and p.stdout == ""
    before = [line for line in p.stderr.splitlines() if line.startswith("held-out format")]
    assert before and "before     n/a" not in before[0], p.stderr[-2000:]


def test_a_reward_returning_the_wrong_number_of_scores_stops_at_the_first_step(cli):
    out, p = cli["one_score"]
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: reward.functions.short (badrewards:one_score) returned 1 scores for 8 completions; "
                      "return one score (or None) per completion"]
    assert "Traceback" not in p.stderr
    assert not [r for r in read(out / "metrics.jsonl") if "loss" in r]


def test_a_hanging_reward_is_timed_out_once_per_batch(cli):
    """reward.timeout_s: the batch call is killed after the timeout and not retried sample by sample."""
    out, p = cli["slow"]
    calls = cli["cwd"] / "calls.txt"
    assert p.returncode == 0, p.stderr[-3000:]
    assert calls.read_text().split() == ["8"]  # one call with the whole batch, no per-sample retries
    rows = [r for r in read(out / "metrics.jsonl") if "loss" in r]
    assert rows[0]["reward/slow_errors"] == 8 and rows[0]["reward/slow"] is None


def test_samples_come_from_every_group_first_then_fill_from_within_groups():
    """A rank holding one group still shows num_samples completions (it showed one)."""
    import torch

    from grpo.batch import Batch
    from grpo.experience import sample_rows

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(str, ids))

    class Run:
        tokenizer = Tok()

    one_group = Batch([{"prompt": "p", "answer": 1}], [[9]], [[[1], [2], [3], [4]]], [[False] * 4],
                      torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.zeros(4))
    assert [r["completion"] for r in sample_rows(Run(), one_group, 2)] == ["1", "2"]
    two_groups = Batch([{"prompt": "p", "answer": 1}, {"prompt": "q", "answer": 2}], [[9], [8]],
                       [[[1], [2]], [[5], [6]]], [[False] * 2] * 2, torch.tensor([0.1, 0.2, 0.5, 0.6]), torch.zeros(4))
    rows = sample_rows(Run(), two_groups, 3)
    assert [r["completion"] for r in rows] == ["1", "5", "2"] and [r["reward"] for r in rows] == \
        pytest.approx([0.1, 0.5, 0.2])


def test_the_tests_of_the_first_run_are_scheduled_together():
    """tests/conftest.py's TOGETHER lists the tests of the `cli` process by name: one worker runs them in file order
    (the resume last); the others are scheduled on their own."""
    import inspect

    from tests.conftest import _scope

    def nodeid(name: str) -> str:
        return f"{__name__.replace('.', '/')}.py::{name}"

    tests = {name: inspect.signature(fn).parameters for name, fn in globals().items() if name.startswith("test_")}
    users = [name for name, params in tests.items() if {"first_run", "cli"} & set(params)]
    assert len(users) >= 9 and all(_scope(nodeid(name)) == "run_output_first_run" for name in users), users
    assert all(_scope(nodeid(name)) != "run_output_first_run" for name in set(tests) - set(users))
