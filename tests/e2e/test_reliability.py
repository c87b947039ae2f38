"""Exact resume, crash safety, fault handling and bad input (issue 5)."""
import json
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from grpo.errors import SetupError
from grpo.trainer import checkpoint
from grpo.trainer.loop import fit
from tests.helpers import in_one_process

COMPARED = ("loss", "reward_mean", "reward_std", "kl", "grad_norm", "completion_len_mean", "reward/accuracy",
            "reward/format", "entropy", "ratio_mean", "clip_ratio")


def steps(out: Path) -> dict:
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def assert_same_run(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for s in a:
        for k in COMPARED:
            assert a[s][k] == pytest.approx(b[s][k], rel=1e-6, abs=1e-9), (s, k)


@pytest.mark.parametrize("mu,stop", [(1, 2), (2, 3)], ids=["mu1", "mu2-mid-batch"])
def test_resume_gives_identical_metrics(cfg_factory, tmp_path, mu, stop):
    """mu2-mid-batch: stopped after pass 1 of the second batch; the resume must run pass 2 on the same rollouts
    (run.buffer, saved in the checkpoint) with the same old log-probs."""
    algo = {"num_iterations": mu}
    straight = cfg_factory({"trainer": {"max_steps": 4, "output_dir": str(tmp_path / "a")}, "algorithm": algo})
    fit(straight)
    half = cfg_factory({"trainer": {"max_steps": stop, "output_dir": str(tmp_path / "b")}, "algorithm": algo})
    fit(half)
    state = checkpoint.load_state(tmp_path / "b" / "checkpoints" / f"step_{stop}")
    assert (state["buffer"] is not None) == (mu == 2)
    if mu == 2:
        assert state["buffer"].old_logps is not None
    rest = cfg_factory({"trainer": {"max_steps": 4, "output_dir": str(tmp_path / "b"), "resume": "auto"},
                        "algorithm": algo})
    out = fit(rest)
    assert out["steps"] == 4
    assert_same_run(steps(tmp_path / "a"), steps(tmp_path / "b"))
    a = checkpoint.load_state(tmp_path / "a" / "checkpoints" / "step_4")
    b = checkpoint.load_state(tmp_path / "b" / "checkpoints" / "step_4")
    assert a["sampler"] == b["sampler"]


def test_resume_of_a_finished_run_exits_without_training(cfg_factory, tmp_path, capsys):
    cfg = cfg_factory({"trainer": {"max_steps": 1, "output_dir": str(tmp_path / "r")}})
    fit(cfg)
    assert ", 1 step, lr " in capsys.readouterr().err  # the summary line: not "1 steps"
    # a changed learning rate would take effect from the next step: there is none, so it is not announced
    again = cfg_factory({"trainer": {"max_steps": 1, "output_dir": str(tmp_path / "r"), "resume": "auto", "lr": 0.125}})
    assert fit(again) == {"steps": 1, "resumed": True}
    err = capsys.readouterr().err
    assert "already reached trainer.max_steps=1" in err and "changed since the checkpoint" not in err


def test_resume_after_a_stop_before_the_final_save_writes_it(cfg_factory, tmp_path, capsys):
    """Killed after the last checkpoint but before final/ was written: resuming saves final/ from it."""
    import shutil

    import transformers

    cfg = cfg_factory({"trainer": {"max_steps": 1, "output_dir": str(tmp_path / "r")}})
    fit(cfg)
    final = tmp_path / "r" / "final"
    want = transformers.AutoModelForCausalLM.from_pretrained(final).state_dict()
    shutil.rmtree(final)
    again = cfg_factory({"trainer": {"max_steps": 1, "output_dir": str(tmp_path / "r"), "resume": "auto"}})
    assert fit(again) == {"steps": 1, "resumed": True, "final_saved": True}
    assert "stopped before its final model was saved" in capsys.readouterr().err
    got = transformers.AutoModelForCausalLM.from_pretrained(final).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert fit(again) == {"steps": 1, "resumed": True}  # now complete: nothing to do


def test_resume_refuses_a_changed_run_unless_forced(cfg_factory, tmp_path):
    fit(cfg_factory({"trainer": {"max_steps": 1, "output_dir": str(tmp_path / "r")}}))
    changed = {"algorithm": {"group_size": 3}, "trainer": {"max_steps": 2, "output_dir": str(tmp_path / "r"),
                                                           "resume": "auto"}}
    with pytest.raises(SetupError, match="algorithm.group_size changed"):
        fit(cfg_factory(changed))
    changed["trainer"]["force_resume"] = True
    assert fit(cfg_factory(changed))["steps"] == 2


def test_resume_from_explicit_path_and_bad_paths(cfg_factory, tmp_path):
    fit(cfg_factory({"trainer": {"max_steps": 2, "save_every": 1, "output_dir": str(tmp_path / "r")}}))
    ckpt = tmp_path / "r" / "checkpoints" / "step_1"
    out = fit(cfg_factory({"trainer": {"max_steps": 2, "output_dir": str(tmp_path / "s"), "resume": str(ckpt)}}))
    assert out["steps"] == 2 and sorted(steps(tmp_path / "s")) == [2]
    with pytest.raises(SetupError, match="no such checkpoint directory"):
        fit(cfg_factory({"trainer": {"output_dir": str(tmp_path / "t"), "resume": str(tmp_path / "nope")}}))


def test_crash_during_save_leaves_previous_checkpoint(tmp_path):
    def good(d):
        (d / "x").write_text("ok")

    checkpoint.save(tmp_path, 1, good, keep_last=2)

    def crash(d):
        (d / "x").write_text("half")
        raise KeyboardInterrupt  # the process dies mid-write

    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 2, crash, keep_last=2)
    assert checkpoint.latest(tmp_path).name == "step_1"
    assert (tmp_path / "checkpoints" / ".tmp-step_2").exists()  # never taken for complete
    checkpoint.save(tmp_path, 3, good, keep_last=1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_3"]  # old + junk removed after


# ------------------------------------------------------------------------------------- processes
def _cmd(out, *extra):
    return [sys.executable, "-m", "grpo.train", "recipe=smoke", f"trainer.output_dir={out}", "trainer.max_steps=6",
            "trainer.save_every=1", "logging.sample_every=0", *extra]


def _newest(out: Path) -> int:
    last = checkpoint.latest(out) if out.exists() else None
    return int(last.name.split("_")[1]) if last is not None else 0


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_uses_it_and_matches(tmp_path):
    """Each kill lands after a checkpoint newer than the last kill's exists (then at a random moment: mid-step,
    mid-save; once step 5 is saved, possibly during start-up); the next launch must say it resumed from exactly
    the newest complete checkpoint, and the finished run equals an unbroken one."""
    ref = tmp_path / "ref"
    subprocess.run(_cmd(ref), check=True, capture_output=True, timeout=300, cwd=tmp_path)
    rng = random.Random(0)
    out = tmp_path / "killed"
    newest, kills = 0, 0  # the newest complete checkpoint when the previous launch ended
    for launch in range(5):  # three killed launches, then one that finishes (bounded: a bug must not hang CI)
        log = tmp_path / f"launch{launch}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(_cmd(out, "trainer.resume=auto"), stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
        if kills < 3:
            target = min(newest + 1 + rng.randrange(2), 5)
            deadline = time.time() + 240
            while time.time() < deadline and p.poll() is None and _newest(out) < target:
                time.sleep(0.02)
            if p.poll() is None:
                assert _newest(out) >= target, f"no checkpoint step_{target} in 240 s"
                time.sleep(rng.uniform(0.0, 0.3))  # a random moment after it: mid-step or mid-save
                p.send_signal(signal.SIGKILL)
                kills += 1
        rc = p.wait(timeout=300)
        text = log.read_text()
        assert rc in (0, -signal.SIGKILL), text[-2000:]
        started = "[grpo] resumed from" in text or rc == 0
        if launch > 0 and started:  # resumed from the newest checkpoint the previous launch left, not from scratch
            assert f"resumed from {out / 'checkpoints' / f'step_{newest}'} (step {newest})" in text, text[-2000:]
        elif launch > 0:  # killed during start-up (step 5 was already saved): it must have written nothing
            assert _newest(out) == newest, text[-2000:]
        newest = _newest(out)
        if rc == 0:
            break
    assert kills >= 1 and rc == 0 and (out / "final").exists(), f"{kills} kills, exit {rc}"
    assert_same_run(steps(ref), steps(out))


def test_sigterm_checkpoints_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    p = subprocess.Popen(_cmd(out, "trainer.max_steps=200", "trainer.save_every=0"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and len(steps(out)) >= 1):
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert "stopped by signal" in err
    assert err.count("[grpo] SIGTERM: stopping after step") == 1, err[-2000:]
    last = checkpoint.latest(out)
    assert last is not None and int(last.name.split("_")[1]) == max(steps(out))


def test_ctrl_c_says_so_at_once_and_a_second_one_stops_cleanly(tmp_path):
    """A step held for 4 s by a slow reward: the first Ctrl-C is answered before that step ends; the second stops
    the process there (exit 130) with one line and no traceback, and step 1's checkpoint stays complete."""
    import queue
    import threading

    (tmp_path / "slowrewards.py").write_text("import time\n\ndef slow(prompts, completions, **kw):\n"
                                             "    time.sleep(4)\n    return [0.0] * len(completions)\n")
    out = tmp_path / "run"
    p = subprocess.Popen(_cmd(out, "trainer.max_steps=50", "data.num_eval=0",
                              "+reward.functions.slow.fn=slowrewards:slow"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in p.stderr], daemon=True)
    reader.start()
    seen: list[str] = []

    def until(found) -> list[str]:
        start, deadline = len(seen), time.time() + 240
        while time.time() < deadline and p.poll() is None:
            try:
                seen.append(lines.get(timeout=0.5))
            except queue.Empty:
                continue
            if found(seen[-1]):
                return seen[start:]
        p.kill()
        raise AssertionError("".join(seen)[-3000:])

    try:
        until(lambda line: line.split()[:2] == ["step", "1/50"])
        while _newest(out) < 1 and p.poll() is None:  # step 1's checkpoint follows its line; step 2 then waits 4 s
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        before = until(lambda line: "[grpo] SIGINT: stopping after step" in line)
        assert "stopping after step 2" in before[-1] and not any(line.startswith("step") for line in before)
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=60)
    finally:
        p.kill()
    reader.join(timeout=10)
    while not lines.empty():
        seen.append(lines.get())
    text = "".join(seen)
    assert rc == 130, text[-3000:]
    assert "Traceback" not in text and not any(line.split()[:2] == ["step", "2/50"] for line in seen)
    last = [line for line in seen if line.strip()][-1]
    assert last.startswith("[grpo] second SIGINT: stopping now, without finishing step 2; the last complete "
                           f"checkpoint, {out / 'checkpoints' / 'step_1'}, is intact"), text[-3000:]
    assert checkpoint.latest(out).name == "step_1" and checkpoint.load_state(checkpoint.latest(out))["step"] == 1


# ----------------------------------------------------------------------------------------- faults
@pytest.fixture
def fault_module(tmp_path, monkeypatch):
    (tmp_path / "faulty_rewards.py").write_text(textwrap.dedent("""
        def flaky(prompts, completions, answer, **_):
            out = []
            for a in answer:
                if int(a) % 2:
                    raise ValueError("odd answers break this reward")
                out.append(1.0)
            return out

        def always_fails(prompts, completions, **_):
            raise RuntimeError("broken")

        def always_nan(prompts, completions, **_):
            return [float("nan")] * len(completions)

        def always_none(prompts, completions, **_):
            return [None] * len(completions)

        def hangs_on_odd(prompts, completions, answer, **_):
            if any(int(a) % 2 for a in answer):
                while True:
                    pass
            return [1.0] * len(completions)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("faulty_rewards", None)


def test_reward_that_raises_on_some_samples_is_counted(cfg_factory, tmp_path, fault_module):
    cfg = cfg_factory({"reward": {"functions": {"flaky": {"fn": "faulty_rewards:flaky"}}, "max_failed_steps": 100},
                       "trainer": {"max_steps": 3}, "data": {"num_eval": 0}})
    fit(cfg)
    rows = steps(Path(cfg.trainer.output_dir))
    assert sum(r["reward/flaky_errors"] for r in rows.values()) > 0
    assert all(r["reward/flaky_errors"] < 8 or r["reward/flaky"] is None for r in rows.values())


@pytest.mark.parametrize("fn, why", [("always_fails", "it raised RuntimeError: broken;"),
                                     ("always_nan", "it returned nan;"),
                                     ("always_none", "it returned None for every sample;")])
def test_reward_scoring_no_sample_stops_the_run(cfg_factory, fault_module, fn, why):
    """Raises, NaN or None on every sample: the run stops after max_failed_steps training steps, each of them logged
    (the held-out evaluation before training does not count), and the message says what the function did."""
    cfg = cfg_factory({"reward": {"functions": {fn: {"fn": f"faulty_rewards:{fn}"}},
                                  "max_failed_steps": 2},
                       "trainer": {"max_steps": 5}, "data": {"num_eval": 2}})
    with pytest.raises(SetupError) as e:
        fit(cfg)
    assert f"{fn!r} scored no sample in 2 training rollouts in a row (the last at step 2;" in str(e.value)
    assert why in str(e.value) and "\n" not in str(e.value)
    rows = steps(Path(cfg.trainer.output_dir))
    assert sorted(rows) == [1, 2] and all(rows[s][f"reward/{fn}"] is None for s in rows)


def test_hanging_reward_is_killed_after_timeout(cfg_factory, fault_module, caplog):
    cfg = cfg_factory({"reward": {"functions": {"hang": {"fn": "faulty_rewards:hangs_on_odd"}}, "timeout_s": 1.5,
                                  "max_failed_steps": 10},
                       "trainer": {"max_steps": 1}, "data": {"num_eval": 0}})
    t0 = time.time()
    fit(cfg)
    row = steps(Path(cfg.trainer.output_dir))[1]
    assert row["reward/hang_errors"] > 0
    assert time.time() - t0 < 120
    said = [r.getMessage() for r in caplog.records if "'hang'" in r.getMessage()]
    assert len(said) == 1 and "'hang' timed out after 1.5 s (reward.timeout_s)" in said[0] and "raised" not in said[0]


def test_non_finite_steps_are_skipped_then_stop(cfg_factory, monkeypatch):
    import grpo.update as update

    real = update.objective

    def poisoned(*a, **k):
        loss, stats = real(*a, **k)
        return loss * float("nan"), stats

    monkeypatch.setattr(update, "objective", poisoned)
    cfg = cfg_factory({"trainer": {"max_steps": 10, "max_bad_steps": 2}, "data": {"num_eval": 0}})
    with pytest.raises(SetupError, match="2 steps in a row had a non-finite loss or gradient"):
        fit(cfg)
    out = Path(cfg.trainer.output_dir)
    rows = steps(out)
    assert [r["skipped"] for r in rows.values()] == [True, True]
    assert rows[2]["skipped_steps"] == 2
    assert checkpoint.latest(out) is not None  # a usable checkpoint of the last good state


# -------------------------------------------------------------------------------------- bad input
def _cli_errors(tmp_path, *commands: list[str]) -> list[str]:
    """The one error line of each command line (``grpo-train recipe=smoke ARGS``, run from ``tmp_path``), which
    must fail without a traceback; all of them run in one process (tests/helpers.py `in_one_process`)."""
    lines = []
    for p in in_one_process([(tmp_path, ["grpo.train", "recipe=smoke", f"trainer.output_dir={tmp_path}/o", *args])
                             for args in commands], timeout_each=120):
        assert p.returncode != 0
        assert "Traceback" not in p.stderr
        errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, p.stderr
        lines.append(errors[0])
    return lines


def test_bad_data_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1", "answer": 2}\n{"question": "2+2", "answer": 4}\n')
    odd = tmp_path / "data.txt"
    odd.write_text("x")
    errors = _cli_errors(tmp_path, [f"data.source={empty}"], [f"data.source={rows}"], [f"data.source={odd}"])
    assert "the file is empty" in errors[0]
    assert "data row 1 has no 'prompt' value" in errors[1]
    assert "unknown file type" in errors[2]


def test_bad_reward_signature_and_resume_path(tmp_path):
    (tmp_path / "sigmod.py").write_text("def one_arg(x):\n    return [0.0]\n")
    errors = _cli_errors(tmp_path, ["reward.functions.accuracy.fn=sigmod:one_arg"],
                         [f"trainer.resume={tmp_path}/missing"])
    assert "expected fn(prompts, completions" in errors[0]
    assert "no such checkpoint directory" in errors[1]


def test_fresh_run_into_a_used_directory_is_refused(cfg_factory, tmp_path):
    fit(cfg_factory({"trainer": {"max_steps": 1, "output_dir": str(tmp_path / "r")}}))
    with pytest.raises(SetupError, match="already holds checkpoints of another run"):
        fit(cfg_factory({"trainer": {"max_steps": 2, "output_dir": str(tmp_path / "r")}}))


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_resuming_an_older_checkpoint_does_nothing_or_abandons_the_later_steps(cfg_factory, tmp_path, capsys):
    """Nothing to do: nothing deleted (step_3, step_4, their metrics and final/ stay). Training on from step 2:
    checkpoints, metrics lines and final/ of steps 3-4 go, and final/ is then the new step 3's model."""
    out = tmp_path / "r"
    base = {"save_every": 1, "keep_last": 4, "output_dir": str(out)}
    fit(cfg_factory({"trainer": {**base, "max_steps": 4}, "data": {"num_eval": 0}}))
    old_final = _weights(out / "final" / "model.safetensors")
    metrics = (out / "metrics.jsonl").read_text()
    older = {**base, "resume": str(out / "checkpoints" / "step_2")}
    assert fit(cfg_factory({"trainer": {**older, "max_steps": 2}, "data": {"num_eval": 0}}))["steps"] == 2
    assert "nothing to do" in capsys.readouterr().err
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step_1", "step_2", "step_3", "step_4"]
    assert (out / "metrics.jsonl").read_text() == metrics
    assert all(torch.equal(v, old_final[k]) for k, v in _weights(out / "final" / "model.safetensors").items())
    fit(cfg_factory({"trainer": {**older, "max_steps": 3}, "data": {"num_eval": 0}}))
    err = capsys.readouterr().err
    assert "removed step_3, step_4, 3 metrics lines, final/" in err, err  # steps 3 and 4, the held-out line at 4
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step_1", "step_2", "step_3"]
    assert sorted(steps(out)) == [1, 2, 3]
    final = _weights(out / "final" / "model.safetensors")
    step_3 = _weights(out / "checkpoints" / "step_3" / "trainable.safetensors")
    common = sorted(set(final) & set(step_3))
    assert common and all(torch.equal(final[k], step_3[k]) for k in common)
    assert not all(torch.equal(final[k], old_final[k]) for k in common)


def test_resume_applies_a_changed_learning_rate(cfg_factory, tmp_path, capsys):
    """trainer.lr lowered on resume: the resumed step trains at it (weights barely move) and says what changed."""
    out = tmp_path / "r"
    base = {"save_every": 1, "keep_last": 3, "output_dir": str(out), "lr": 1e-3}
    fit(cfg_factory({"trainer": {**base, "max_steps": 2}, "data": {"num_eval": 0}}))
    capsys.readouterr()
    fit(cfg_factory({"trainer": {**base, "max_steps": 3, "resume": "auto", "lr": 1e-12, "weight_decay": 0.1},
                       "data": {"num_eval": 0}}))
    err = capsys.readouterr().err
    notice = [line for line in err.splitlines() if "changed since the checkpoint" in line]
    assert len(notice) == 1 and "trainer.lr 0.001 -> 1e-12" in notice[0] and "trainer.max_steps 2 -> 3" in notice[0]
    assert "trainer.weight_decay 0.0 -> 0.1" in notice[0]
    assert steps(out)[3]["lr"] == pytest.approx(1e-12)
    w1, w2, w3 = (_weights(out / "checkpoints" / f"step_{s}" / "trainable.safetensors") for s in (1, 2, 3))
    moved = lambda a, b: max(float((a[k] - b[k]).abs().max()) for k in a)  # noqa: E731
    assert moved(w1, w2) > 1e-5 and moved(w2, w3) < 1e-8


def test_wandb_resume_continues_the_run_and_logs_a_completions_table(cfg_factory, tmp_path, monkeypatch):
    """WANDB_MODE=offline: the resume's wandb run has the id the first launch stored in the run directory, and
    every sample_every step logs the `completions` table (prompt, completion, each reward, advantage)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "r"
    fit(cfg_factory({"trainer": {"max_steps": 1, "output_dir": str(out)}, "data": {"num_eval": 0},
                       "logging": {"sample_every": 1}}))
    run_id = (out / "wandb_run_id").read_text().strip()
    fit(cfg_factory({"trainer": {"max_steps": 2, "output_dir": str(out), "resume": "auto"},
                       "data": {"num_eval": 0}, "logging": {"sample_every": 1}}))
    assert (out / "wandb_run_id").read_text().strip() == run_id
    launches = sorted((out / "wandb").glob("offline-run-*"))
    assert len(launches) == 2 and all(p.name.endswith(f"-{run_id}") for p in launches), launches
    for step, launch in zip((1, 2), launches):
        [table] = launch.glob(f"files/media/table/completions_{step}_*.table.json")
        logged = json.loads(table.read_text())
        assert logged["columns"] == ["step", "prompt", "completion", "reward/accuracy", "reward/format", "reward",
                                     "advantage"]
        assert len(logged["data"]) == 8 and all(row[0] == step and "What is" in row[1] for row in logged["data"])


def test_logged_lr_is_the_one_each_step_trained_with(cfg_factory, tmp_path):
    """Warmup visible from step 1, the last step of a decaying schedule not 0."""
    cfg = cfg_factory({"trainer": {"max_steps": 4, "lr": 1e-3, "warmup_steps": 2, "lr_schedule": "linear"},
                       "data": {"num_eval": 0}})
    fit(cfg)
    assert [r["lr"] for r in steps(Path(cfg.trainer.output_dir)).values()] == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])


def test_train_restores_signal_handlers(cfg_factory):
    before = signal.getsignal(signal.SIGINT)
    fit(cfg_factory({"trainer": {"max_steps": 1}, "data": {"num_eval": 0}}))
    assert signal.getsignal(signal.SIGINT) is before


def test_eval_with_no_scored_sample_prints_na_not_a_traceback(cfg_factory, fault_module, capsys):
    cfg = cfg_factory({"reward": {"functions": {"accuracy": {"fn": "faulty_rewards:always_fails"}},
                                  "max_failed_steps": 5}, "trainer": {"max_steps": 1}})
    fit(cfg)
    assert "n/a (no sample scored)" in capsys.readouterr().err


def test_flex_kernel_on_cpu_is_refused_before_the_model_loads(tmp_path):
    flex, fast = _cli_errors(tmp_path, ["engine.attention_kernel=flex", "trainer.device=cpu"],
                             ["engine.attention_kernel=fast"])
    assert "engine.attention_kernel=flex needs a CUDA device" in flex
    assert "engine.attention_kernel='fast' is not allowed" in fast
