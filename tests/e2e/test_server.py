"""rollout.backend=server against real vLLM servers (`grpo-serve`, processes on 127.0.0.1; no mocks), on the tiny
model of the vLLM tests (head_dim 64). One server serves the whole module (it takes a minute or two to start);
it is killed and restarted once, by the fault test that needs it. The tests run in file order:

1. docs/rollout.md's two-terminal walkthrough, the trainer started first (it waits, saying so once), scaled down;
   after each push the server's log-probs agree with the trainer's (the sync check's gap, logged every step);
2. a server of another model or a shorter max length is refused at connect in one line;
3. a trainer killed mid-run leaves the server serving, and a new trainer takes it over;
4. two training processes (ZeRO-2, ZeRO-3) against the one server: one push per step;
5. a server killed mid-run ends the run with one line naming it, no traceback, the last checkpoint intact; after
   the server's restart `trainer.resume=auto` completes the run;
6. asynchronous GRPO (``rollout.max_staleness=1``, docs/async.md) with the server as the generator;
7. the same from two ZeRO-3 training processes (docs/async.md's torchrun command), resumed from a checkpoint with
   each rank's batch in flight;
8. two servers (a second one started for it), one killed mid-run at K = 1: the run goes on with the other, says so,
   and logs one server up; started again on its port, the killed one rejoins (docs/async.md#faults).

Runs where vLLM imports (``make test-vllm``); elsewhere skipped, saying why.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import ROOT, VLLM_TINY, vllm_problem

pytestmark = pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))

TINY = [f"model.tiny.{k}={v}" for k, v in VLLM_TINY.items()]
# the docs' commands scaled down: the tiny model, short completions, no held-out evaluation
SCALE = ["model=tiny", *TINY, "data.num_eval=0", "rollout.max_new_tokens=8", "data.num_train=32",
         "rollout.prompts_per_step=2", "algorithm.group_size=4", "logging.sample_every=0", "logging.plot=false"]
WAIT = "rollout.server.connect_timeout_s=900"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _free_port() -> int:
    from grpo.runtime.transfer import free_port

    return free_port()


def docs_commands(doc: str = "rollout.md", after: str = "### Two terminals", until: str = "###") -> dict[str, str]:
    """docs/rollout.md's walkthrough (or the part of ``doc`` from ``after`` to ``until``): its grpo-serve and
    grpo-train command lines."""
    text = (ROOT / "docs" / doc).read_text().split(after, 1)[1].split(until, 1)[0]
    out = {}
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and Path(words[0]).name in ("grpo-serve", "grpo-train"):
                out[Path(words[0]).name] = words
    return out


class Server:
    """A `grpo-serve` process (its own process group: a kill takes vLLM's engine process with it)."""

    def __init__(self, port: int, log: Path, args: list[str]):
        self.port, self.url, self.log = port, f"http://127.0.0.1:{port}", log
        self.args = args

    def start(self) -> "Server":
        self.proc = subprocess.Popen([sys.executable, "-m", "grpo.serve", *self.args], stdout=self.log.open("ab"),
                                     stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
        return self

    def up(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def wait(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while not self.up():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(1)

    def info(self) -> dict:
        req = urllib.request.Request(self.url + "/collective_rpc", data=b'{"method": "grpo_model_info"}',
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["results"][0]

    def serving(self) -> "Server":
        """Started (and up) if it is not: a test run on its own."""
        if getattr(self, "proc", None) is None or self.proc.poll() is not None:
            self.start()
        self.wait()
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    port = _free_port()
    serve = docs_commands()["grpo-serve"][1:]
    serve = [w if not w.startswith("rollout.server.port=") else f"rollout.server.port={port}" for w in serve]
    state = {"tmp": tmp, "server": Server(port, tmp / "server.log", serve + SCALE)}
    yield state
    state["server"].kill()


def train(ctx, name: str, *args: str, popen: bool = False, timeout: int = 900):
    cmd = [sys.executable, "-m", "grpo.train", "recipe=quickstart", *SCALE, "rollout.backend=server",
           f"rollout.server.urls=[{ctx['server'].url}]", WAIT, f"trainer.output_dir={ctx['tmp'] / name}", *args]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                start_new_session=True)
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)


def steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "reward_mean" in r]


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def test_the_documented_walkthrough_trains_and_the_trainer_waits_for_a_late_server(ctx):
    cmd = docs_commands()["grpo-train"]
    assert cmd[1:3] == ["recipe=quickstart", "rollout.backend=server"], cmd
    assert docs_commands()["grpo-serve"][1:2] == ["recipe=quickstart"]
    words = [w if not w.startswith("rollout.server.urls=") else f"rollout.server.urls=[{ctx['server'].url}]"
             for w in cmd[1:]]
    run = ctx["tmp"] / "walkthrough"
    trainer = subprocess.Popen([sys.executable, "-m", "grpo.train", *words, *SCALE, WAIT, "trainer.max_steps=2",
                                "trainer.lr=1e-3", f"trainer.output_dir={run}"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=_env())
    time.sleep(2)  # the trainer is up first
    ctx["server"].start()
    out, err = trainer.communicate(timeout=1500)
    assert trainer.returncode == 0, err[-4000:]
    assert err.count("waiting for the rollout server") == 1, err[-3000:]
    rows = steps(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the server samples from the trainer's policy after every push
        assert r["server/sync_logprob_gap"] < 1e-3 and r["server/version_lag"] == 0
        assert r["rollout_is/logp_diff_abs_max"] < 1e-3
    assert ctx["server"].info()["pushes"] == 2  # at connect, and after the first optimizer step


@pytest.mark.parametrize("change,expect", [
    ("model.tiny.intermediate_size=512", "serves another model than the trainer's: intermediate_size=256"),
    ("rollout.max_new_tokens=900", "has max_model_len="),
])
def test_a_server_of_another_model_or_length_is_refused_at_connect(ctx, change, expect):
    p = train(ctx, "refused-" + change.split("=")[0], "trainer.max_steps=1", change, timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout server " + ctx["server"].url) and expect in last, last
    assert "Traceback" not in p.stderr


def test_a_killed_trainer_leaves_the_server_serving_and_a_new_one_takes_over(ctx):
    first = train(ctx, "killed", "trainer.max_steps=50", popen=True)
    try:
        _wait_for(lambda: len(steps(ctx["tmp"] / "killed")) >= 1, 900, "the first trainer made no step")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
    assert ctx["server"].up()
    p = train(ctx, "takeover", "trainer.max_steps=2")
    assert p.returncode == 0, p.stderr[-4000:]
    assert all(r["server/sync_logprob_gap"] < 1e-3 for r in steps(ctx["tmp"] / "takeover"))


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_two_training_processes_push_once_per_step(ctx, zero):
    from tests.e2e.test_distributed import ZERO3, torchrun

    before = ctx["server"].info()["pushes"]
    out = ctx["tmp"] / zero
    args = ZERO3 if zero == "zero3" else ["distributed=zero2"]
    p = torchrun("-m", "grpo.train", "recipe=quickstart", *SCALE, "rollout.backend=server",
                 f"rollout.server.urls=[{ctx['server'].url}]", WAIT, f"trainer.output_dir={out}",
                 "trainer.max_steps=2", *args, cwd=ctx["tmp"], timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = steps(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["server/sync_logprob_gap"] < 1e-3 for r in rows)
    assert ctx["server"].info()["pushes"] - before == 2  # one per step, not one per rank


def test_a_killed_server_ends_the_run_in_one_line_and_resume_completes_after_its_restart(ctx):
    # A tiny step takes 0.1 s: the run is long enough (60 steps) that the kill lands while it trains, and it is
    # killed as soon as step 2 is saved.
    run, last_step = ctx["tmp"] / "faulty", 60
    trainer = train(ctx, "faulty", f"trainer.max_steps={last_step}", "trainer.save_every=1",
                    "rollout.server.retries=1", popen=True)
    while not ((run / "checkpoints" / "step_2" / "COMPLETE").exists() or trainer.poll() is not None):
        time.sleep(0.02)
    ctx["server"].kill()
    _, err = trainer.communicate(timeout=600)
    assert trainer.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rollout server " + ctx["server"].url) and "trainer.resume=auto" in last, last
    assert "Traceback" not in err
    done = sorted(int(d.name.split("_")[1]) for d in (run / "checkpoints").iterdir() if (d / "COMPLETE").exists())
    assert done and 2 <= done[-1] < last_step
    ctx["server"].start().wait()
    p = train(ctx, "faulty", f"trainer.max_steps={last_step}", "trainer.save_every=100", "trainer.resume=auto")
    assert p.returncode == 0, p.stderr[-4000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{done[-1]}'}" in p.stderr
    assert steps(run)[-1]["step"] == last_step


def test_k1_with_the_server_as_the_generator_logs_its_staleness_and_the_sync_gap(ctx):
    """K = 1: the server samples step t with version max(0, t-2) while the trainer trains; one push per version
    (0 and 1 for 3 steps), each checked against the trainer's log-probs of the snapshot it pushed."""
    before = ctx["server"].serving().info()["pushes"]
    run = ctx["tmp"] / "async"
    p = train(ctx, "async", "rollout.max_staleness=1", "trainer.max_steps=3", "trainer.lr=1e-3")
    assert p.returncode == 0, p.stderr[-4000:]
    rows = steps(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        t = r["step"]
        assert r["async/staleness_max"] == r["server/version_lag"] == min(1, t - 1), r
        assert r["async/version"] == max(0, t - 2) and r["time/trainer_wait_s"] >= 0
        assert r["server/sync_logprob_gap"] < 1e-3
    assert rows[0]["rollout_is/logp_diff_abs_max"] < 1e-3  # step 1: the server's log-probs on the trainer's weights
    assert "is the bottleneck" in p.stderr
    assert ctx["server"].info()["pushes"] - before == 2


def test_two_zero3_processes_with_the_server_as_the_generator_resume_exactly(ctx):
    """docs/async.md's torchrun command (ZeRO-3, K = 1, two processes) against the real server, scaled down: each
    version pushed once (0 and 1 for 3 steps), the staleness and the sync check as for one process; resumed from its
    step-2 checkpoint, which holds each rank's batch of step 3 (version 1), step 3 trains as uninterrupted."""
    import shutil

    from tests.e2e.test_async import same_numbers
    from tests.e2e.test_async import steps as by_step
    from tests.e2e.test_async_distributed import doc_command
    from tests.e2e.test_distributed import ZERO3, torchrun

    given = doc_command(server=True)
    assert given["distributed"] == "zero3" and given["rollout.max_staleness"] == "1"
    before = ctx["server"].serving().info()["pushes"]
    run, again = ctx["tmp"] / "async-zero3", ctx["tmp"] / "async-zero3-resumed"
    words = [f"{k}={v}" for k, v in given.items() if k != "rollout.server.urls"]

    def launch(out, *extra):
        p = torchrun("-m", "grpo.train", *words, *SCALE, *ZERO3[1:], f"rollout.server.urls=[{ctx['server'].url}]", WAIT,
                     "trainer.max_steps=3", "trainer.save_every=2", "trainer.keep_last=3", f"trainer.output_dir={out}",
                     *extra, cwd=ctx["tmp"], timeout=1200)
        assert p.returncode == 0, p.stderr[-4000:]
        return p

    launch(run)
    rows = steps(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["async/staleness_max"] == r["server/version_lag"] == min(1, r["step"] - 1), r
        assert r["server/sync_logprob_gap"] < 1e-3
    assert ctx["server"].info()["pushes"] - before == 2  # versions 0 and 1, by rank 0 alone
    shutil.copytree(run, again, ignore=shutil.ignore_patterns("final"))
    p = launch(again, f"trainer.resume={again / 'checkpoints' / 'step_2'}")
    assert "resumed from" in p.stderr
    same_numbers(by_step(run), by_step(again))


def test_two_servers_one_killed_mid_run_the_run_goes_on_and_it_rejoins_once_restarted(ctx):
    """The second server is SIGKILLed mid-run (K = 1): the run drops it and goes on with the first; started again on
    the same port (a fresh vLLM: its label is vLLM's default, its weights the checkpoint's), it is probed before a
    later push, checked, pushed the run's weights and taken back: one line, `server/servers_up` back to 2, and every
    step's sync check below the tolerance (it never samples with its old weights). The trainer is then stopped
    by SIGTERM (a graceful stop after its step)."""
    first = ctx["server"].serving()
    port = _free_port()
    second = Server(port, ctx["tmp"] / "second.log", [w if not w.startswith("rollout.server.port=") else
                                                      f"rollout.server.port={port}" for w in first.args]).start()
    try:
        second.wait()
        run = ctx["tmp"] / "two"
        trainer = subprocess.Popen([sys.executable, "-m", "grpo.train", "recipe=quickstart", *SCALE,
                                    "rollout.backend=server", f"rollout.server.urls=[{first.url},{second.url}]", WAIT,
                                    f"trainer.output_dir={run}", "trainer.max_steps=100000", "trainer.save_every=0",
                                    "rollout.max_staleness=1", "rollout.server.retries=0",
                                    "rollout.server.rejoin_every_s=0"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        _wait_for(lambda: len(steps(run)) >= 2 or trainer.poll() is not None, 900, "no second step")
        second.kill()
        _wait_for(lambda: any(r["server/servers_up"] == 1 for r in steps(run)) or trainer.poll() is not None, 900,
                  "the killed server was not dropped")
        second.start().wait()
        _wait_for(lambda: steps(run)[-1]["server/servers_up"] == 2 or trainer.poll() is not None, 900,
                  "the restarted server did not rejoin")
        trainer.send_signal(signal.SIGTERM)
        _, err = trainer.communicate(timeout=900)
        assert "stopped by signal" in err, err[-4000:]
        assert f"carrying on with 1 of 2 rollout servers ({first.url})" in err, err[-3000:]
        assert err.count(f"rollout server {second.url} rejoined at version") == 1, err[-3000:]
        up = [r["server/servers_up"] for r in steps(run)]
        assert up[0] == up[-1] == 2 and 1 in up, up
        assert all(r["server/sync_logprob_gap"] < 1e-3 for r in steps(run))
        assert second.info()["pushes"] >= 1  # the restarted process was pushed the run's weights
    finally:
        second.kill()
