"""Asynchronous GRPO end to end (issue 33, docs/async.md): K = 0 is the synchronous run exactly; K = 2 logs its
staleness every step, is the same run twice, and resumes from a checkpoint (in process, and after a kill -9) into
the same metrics; the generator process's weights are the trainer's (at K = 0 through the process, and with LoRA,
the behaviour log-probs equal the trainer's bit for bit); zero-std refill rounds come from the generator."""
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo.trainer import checkpoint, pipeline
from grpo.trainer.loop import train

COMPARED = ("loss", "reward_mean", "reward_std", "kl", "grad_norm", "completion_len_mean", "reward/accuracy",
            "reward/format", "entropy", "ratio_mean", "clip_ratio", "rollout_is/logp_diff_abs_mean",
            "rollout_is/ratio_max", "async/staleness_max", "async/version")


def steps(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def same_numbers(a: dict, b: dict, keys=COMPARED) -> None:
    assert sorted(a) == sorted(b)
    for s in a:
        for k in keys:
            assert a[s].get(k) == b[s].get(k), (s, k, a[s].get(k), b[s].get(k))


@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    """One K = 2 run of 5 steps, checkpointed every 2 steps (used by several tests)."""
    from omegaconf import OmegaConf

    from grpo.config.schema import load
    from tests.helpers import smoke_raw

    def make(out, **trainer):
        run = {"max_steps": 5, "save_every": 2, "keep_last": 3, "output_dir": str(out), **trainer}
        raw = OmegaConf.merge(smoke_raw(), {"rollout": {"max_staleness": 2}, "logging": {"sample_every": 0},
                                            "data": {"num_eval": 0}, "trainer": run})
        return load(OmegaConf.to_container(raw, resolve=True))

    out = tmp_path_factory.mktemp("k2") / "run"
    train(make(out))
    return make, out


def test_max_staleness_0_is_the_synchronous_run_exactly(cfg_factory, tmp_path, monkeypatch):
    plain = train(cfg_factory({"trainer": {"output_dir": str(tmp_path / "plain")}}))
    monkeypatch.setattr(pipeline, "GeneratorProcess", None)  # K = 0 starts no generator process
    zero = train(cfg_factory({"trainer": {"output_dir": str(tmp_path / "zero")}, "rollout": {"max_staleness": 0}}))
    a, b = steps(tmp_path / "plain"), steps(tmp_path / "zero")
    timing = {k for m in a.values() for k in m if k.startswith("time/") or k == "step_time_s"}
    same_numbers(a, b, keys=sorted({k for m in a.values() for k in m} - timing))
    assert not any(k.startswith("async/") for m in b.values() for k in m)
    assert plain["eval_after"] == zero["eval_after"]


def test_k2_logs_staleness_every_step_and_the_same_config_gives_the_same_run(k2, tmp_path):
    make, out = k2
    got = steps(out)
    for t, m in got.items():
        assert m["async/staleness_max"] == m["async/staleness_mean"] == min(2, t - 1)  # never above K; > 0 from 2
        assert m["async/version"] == max(0, t - 3) and m["time/trainer_wait_s"] >= 0
        assert m["time/generator_wait_s"] >= 0 and "async/in_flight" in m
    # step 1 samples with the trainer's own weights: the behaviour log-probs are the trainer's, bit for bit
    assert got[1]["rollout_is/logp_diff_abs_max"] == 0.0 and got[1]["rollout_is/ratio_max"] == 1.0
    assert all(got[t]["rollout_is/logp_diff_abs_max"] > 0 for t in (2, 3, 4, 5))  # stale: the correction acts
    train(make(tmp_path / "again"))
    same_numbers(got, steps(tmp_path / "again"))


def test_a_resume_from_a_checkpoint_trains_what_was_in_flight(k2, tmp_path):
    """The checkpoint after step 2 stores the batches of steps 3 and 4 (sampled with version 0 and 1); resuming
    from it gives steps 3-5 exactly as the uninterrupted run had them."""

    make, out = k2
    ckpt = tmp_path / "step_2"
    shutil.copytree(out / "checkpoints" / "step_2", ckpt)
    saved = checkpoint.load_state(ckpt)["in_flight"]
    assert saved["lag"] == 2 and {s: g.version for s, g in saved["batches"].items()} == {3: 0, 4: 1}
    train(make(tmp_path / "resumed", resume=str(ckpt)))
    got = steps(tmp_path / "resumed")
    assert sorted(got) == [3, 4, 5]
    same_numbers({t: steps(out)[t] for t in got}, got)


def _children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in found.read_text().split()] if found.exists() else []


@pytest.mark.slow
def test_kill_9_after_a_checkpoint_and_resume_give_the_uninterrupted_metrics(k2, tmp_path):
    """grpo-train with K = 2 killed (SIGKILL) after its step-2 checkpoint, mid-run; the generator process dies with
    it; trainer.resume=auto finishes the run with the metrics of the uninterrupted one (the k2 fixture's)."""
    _, ref = k2
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "grpo.train", "recipe=smoke", "rollout.max_staleness=2", "trainer.max_steps=5",
           "trainer.save_every=2", "trainer.keep_last=3", "logging.sample_every=0", "data.num_eval=0",
           f"trainer.output_dir={out}", "trainer.resume=auto"]
    with open(tmp_path / "first.log", "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=tmp_path)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None and checkpoint.latest(out) is None:
        time.sleep(0.02)
    assert p.poll() is None, (tmp_path / "first.log").read_text()[-2000:]
    generators = _children(p.pid)
    assert generators, "no generator process"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    time.sleep(1.0)
    assert not [g for g in generators if Path(f"/proc/{g}").exists() and "Z" not in
                Path(f"/proc/{g}/stat").read_text().split()[2]], "the generator outlived the trainer"
    assert checkpoint.latest(out).name == "step_2" and len(steps(out)) < 5
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {out / 'checkpoints' / 'step_2'} (step 2)" in done.stderr
    same_numbers(steps(ref), steps(out))


def test_several_passes_per_batch_clip_against_the_proximal_policy_and_weight_against_the_behaviour(cfg_factory,
                                                                                                    tmp_path):
    """num_iterations = 2 through the generator process at K = 0: a batch at steps 1 and 3, each trained twice. The
    old log-probs (pi_prox: the trainer's weights when the batch's first pass starts) equal the behaviour log-probs
    bit for bit, so the behaviour weight is 1 on both passes, while the second pass's PPO ratio moves off 1."""
    from grpo.trainer.build import build_run
    from grpo.trainer.run import LoopState
    from grpo.update import policy_update

    cfg = cfg_factory({"algorithm": {"num_iterations": 2, "beta": 0.0}, "data": {"num_eval": 0},
                       "trainer": {"output_dir": str(tmp_path / "r"), "max_steps": 4, "lr": 1e-2}})
    run = build_run(cfg)
    src = pipeline.batches(run, cfg, LoopState(), process=True)
    try:
        for step in (1, 3):
            batch = src.batch(step)
            assert batch.versions == [step - 1] * len(batch.completion_ids) and batch.old_logps is not None
            assert all(torch.equal(a, b) for ga, gb in zip(batch.old_logps, batch.sampling_logps)
                       for a, b in zip(ga, gb))
            first, second = (policy_update(run.runtime, batch, run.settings.update) for _ in range(2))
            assert first["rollout_is/logp_diff_abs_max"] == second["rollout_is/logp_diff_abs_max"] == 0.0
            assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
            assert abs(second["ratio_mean"] - 1.0) > 1e-5, second  # off-policy against pi_prox, not pi_behav
    finally:
        src.close()
        run.close()


def test_k1_with_two_passes_per_batch_logs_its_lag_and_resumes_mid_batch(cfg_factory, tmp_path):
    """num_iterations = 2, K = 1: the batch of step 3 is sampled with version 0 (while steps 1-2 train), that of
    step 5 with version 2; staleness in loop steps, K x 2 once the pipeline is full. A checkpoint after step 3 (mid
    batch: the buffer and the batch of step 5 in flight) resumes into the uninterrupted run's steps 4 and 5."""
    def make(out, **trainer):
        return cfg_factory({"algorithm": {"num_iterations": 2}, "rollout": {"max_staleness": 1},
                            "logging": {"sample_every": 0}, "data": {"num_eval": 0},
                            "trainer": {"max_steps": 5, "save_every": 3, "output_dir": str(out), **trainer}})

    train(make(tmp_path / "full"))
    got = steps(tmp_path / "full")
    assert [got[t]["async/version"] for t in range(1, 6)] == [0, 0, 0, 0, 2]
    assert [got[t]["async/staleness_max"] for t in range(1, 6)] == [0, 0, 2, 2, 2]
    assert all(got[t]["ratio_mean"] != 1.0 for t in (2, 4))  # the second pass of each batch
    saved = checkpoint.load_state(tmp_path / "full" / "checkpoints" / "step_3")
    assert saved["buffer"] is not None and {s: g.version for s, g in saved["in_flight"]["batches"].items()} == {5: 2}
    train(make(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoints" / "step_3")))
    back = steps(tmp_path / "resumed")
    assert sorted(back) == [4, 5]
    same_numbers({t: got[t] for t in back}, back)


ENV = '''
def half_flat(prompts, completions, **columns):
    """The same reward for every sample of a group whose prompt has an even length (zero std), else the length."""
    return [0.0 if len(str(p)) % 2 == 0 else float(len(str(c))) for p, c in zip(prompts, completions)]
'''
COMPOSED = {
    "full": {},
    "lora": {"model": {"lora": {"enabled": True, "r": 4, "alpha": 8}}},
    "zero-std refill": {"algorithm": {"filter_zero_std_groups": True, "resample_zero_std": 2},
                        "reward": {"functions": {"half": {"fn": "async_env:half_flat"},  # the recipe's two: weight 0
                                                 "accuracy": {"weight": 0.0}, "format": {"weight": 0.0}}}},
    "multi-turn": {"rollout": {"environment": "tests.tool_fixtures:TwoTurns", "max_turns": 2, "max_new_tokens": 8}},
}


@pytest.mark.parametrize("name", list(COMPOSED))
def test_the_generator_process_holds_the_trainers_weights(cfg_factory, tmp_path, monkeypatch, name):
    """Through the generator process at K = 0 every batch samples with the weights the trainer has when it trains
    on it: the behaviour log-probs (the generator's engine on its copy of the weights) equal the trainer's bit for
    bit, step after step (the published weights arrive whole: all of them first, then the trained ones, LoRA's
    adapter only), also with refill rounds and multi-turn episodes sampled in the generator."""
    from grpo.trainer.build import build_run
    from grpo.trainer.run import LoopState
    from grpo.update import policy_update

    (tmp_path / "async_env.py").write_text(ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = cfg_factory({**COMPOSED[name], "data": {"num_eval": 0},
                       "trainer": {"output_dir": str(tmp_path / "r"), "max_steps": 3}})
    run = build_run(cfg)
    src, rounds = pipeline.batches(run, cfg, LoopState(), process=True), []
    try:
        for step in (1, 2, 3):
            batch = src.batch(step)
            assert batch.versions == [step - 1] * len(batch.completion_ids)
            out = policy_update(run.runtime, batch, run.settings.update)
            assert out["rollout_is/logp_diff_abs_max"] == 0.0 and out["grad_norm"] > 0, (step, out)
            if name == "zero-std refill":
                rounds.append(batch.stats["resample_rounds"])
            if name == "multi-turn":
                assert batch.completion_masks is not None and batch.stats["episode/turns_mean"] > 1
    finally:
        src.close()
    assert name != "zero-std refill" or sum(rounds) > 0, rounds  # refill rounds ran, in the generator


@pytest.mark.slow
def test_the_commands_of_docs_async_md(tmp_path):
    """Each grpo-train command of docs/async.md, scaled down (the tiny model, 3 steps): every step logs the lag it
    promises, and with trainer.save_every the checkpoint holds the next K batches, finished."""
    import re
    import shlex

    from tests.e2e.test_docs_commands import SCALE
    from tests.helpers import ROOT, in_one_process

    text = (ROOT / "docs" / "async.md").read_text()
    commands = [shlex.split(line, comments=True) for block in re.findall(r"```bash\n(.*?)```", text, re.S)
                for line in block.splitlines() if line.startswith("grpo-train")]
    assert len(commands) == 2
    runs = []
    for i, words in enumerate(commands):
        given = dict(w.split("=", 1) for w in words[1:])
        args = {**given, **SCALE, "trainer.max_steps": "3", "trainer.output_dir": str(tmp_path / f"run{i}")}
        if "trainer.save_every" in given:
            args["trainer.save_every"] = "1"
        runs.append((given, [f"{k}={v}" for k, v in args.items()]))
    # both in one process (tests/helpers.py `in_one_process`), each as `python -m grpo.train` would run it
    for i, ((given, _), p) in enumerate(zip(runs, in_one_process([(tmp_path, ["grpo.train", *a]) for _, a in runs]))):
        out = tmp_path / f"run{i}"
        assert p.returncode == 0, p.stderr[-2000:]
        K = int(given["rollout.max_staleness"])
        assert [m["async/staleness_max"] for m in steps(out).values()] == [min(K, t - 1) for t in (1, 2, 3)]
        assert "is the bottleneck" in p.stderr
        if "trainer.save_every" in given:
            saved = checkpoint.load_state(out / "checkpoints" / "step_2")["in_flight"]
            assert {s: g.version for s, g in saved["batches"].items()} == {3: 1}  # K = 1: step 3, version 1
