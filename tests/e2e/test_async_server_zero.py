"""Asynchronous GRPO with the rollout servers as the generator (docs/async.md) on two CPU training processes through
DeepSpeed ZeRO-3 and ZeRO-2: each rank's worker thread samples its share from the servers, rank 0 pushes each
version once, the workers agree on the push, the sync check and refill rounds through a gloo group of their own.

The server is `tests.rollout.server.fake_server.FakeServer`, run in the test's process: a real tiny model the trainer's
weights are pushed into through the real gloo channel (its prompt and behaviour log-probs are that model's), with
completions canned by seed, so that which prompts are asked with which seeds, and so the rewards and refill rounds,
do not depend on the weights (the real vLLM server: tests/e2e/test_server.py, `make test-vllm`).

Run by torchrun, this file is also the worker (``python tests/e2e/test_async_server_zero.py MODE OUT_DIR args...``,
phases separated by ``--then``):

- ``pipeline``: build the run, then three steps through `pipeline.batches` at the run's lag with a `policy_update`
  each; every rank writes what it trained on (its prompts, rewards, versions) and the step's reduced statistics;
- ``train`` / ``resume``: tests/e2e/test_distributed.py's, after rank 0 has told the server which phase starts
  (a ``/phase`` request, recorded with the others, so the test can split the server's log by phase).
"""
from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def flat_or_first(prompts, completions, **columns):
    """0 for every sample of a prompt of even length (a zero-std group: refilled), else the first character's code."""
    return [0.0 if len(str(p)) % 2 == 0 else float(ord(str(c)[:1] or " ") % 7) for p, c in zip(prompts, completions)]


def _mark(args: list[str], out: Path) -> None:
    """Rank 0 tells every server which phase starts (the phase's output directory), before anything is asked."""
    if int(os.environ.get("RANK", "0")) == 0:
        urls = next(a.split("=", 1)[1] for a in args if a.startswith("rollout.server.urls="))
        for url in urls.strip("[]").split(","):
            req = urllib.request.Request(url + "/phase", data=json.dumps({"phase": out.name}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            urllib.request.urlopen(req, timeout=30).read()


def pipeline_steps(args: list[str], out: Path) -> None:
    from tests.e2e.test_async_distributed import pipeline_steps as steps_of

    _mark(args, out)
    steps_of(args, out, process=None)


def marked(phase):
    return lambda args, out: (_mark(args, Path(next(a.split("=", 1)[1] for a in args
                                                    if a.startswith("trainer.output_dir=")))), phase(args, out))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tests.e2e.test_distributed import resume, train
    from tests.helpers import run_phases

    run_phases(sys.argv[1:], {"pipeline": pipeline_steps, "train": marked(train), "resume": marked(resume)})
    sys.exit(0)


# ------------------------------------------------------------------------------------ the tests
import importlib.util  # noqa: E402
from collections import Counter  # noqa: E402

import pytest  # noqa: E402

from grpo.trainer import checkpoint  # noqa: E402
from grpo.trainer.pipeline import sampled_with  # noqa: E402
from tests.e2e.test_async import same_numbers, steps  # noqa: E402
from tests.e2e.test_distributed import ZERO3, launch  # noqa: E402
from tests.helpers import THEN  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="distributed tests need deepspeed (pip install 'grpo[deepspeed]')")


def _by_phase(server) -> tuple[dict[str, Counter], Counter]:
    """Of each phase: (prompt, seed) of every generation request (the sync check's left out), and the weight pushes."""
    asked, pushes, phase = {}, Counter(), None
    for path, body in server.requests:
        if path == "/phase":
            phase = body["phase"]
            asked[phase] = Counter()
        elif path == "/v1/completions" and "n" in body:
            asked[phase][(tuple(body["prompt"]), body["seed"])] += 1
        elif path == "/collective_rpc" and body["method"] == "grpo_receive":
            pushes[phase] += 1
    return asked, pushes


@pytest.mark.slow
def test_zero3_and_zero2_on_two_processes_with_the_server_as_the_generator(tmp_path):
    """One launch. ZeRO-3 at K = 2 through `pipeline.batches`: both ranks train on batches of the scheduled version,
    each its own prompts, the statistics over both ranks. Then 5 steps with refill rounds: the synchronous server run
    (K = 0) and K = 1 on ZeRO-3, K = 2 on ZeRO-2: the staleness and the servers' version lag as scheduled, the sync
    check passing after each push (one per version), the servers asked for exactly the synchronous run's prompts and
    seeds (refill rounds agreed over both ranks); each resumed from its step-2 checkpoint, which holds each rank's
    batches in flight: the uninterrupted run's metrics. And K = 1 against two servers, the second restarting mid-run:
    dropped, taken back by both ranks before a later push (rollout.server.rejoin_every_s=0), the K = 1 run's metrics."""
    from grpo.config.schema import load
    from grpo.models import load_model, load_tokenizer
    from tests.e2e.test_async_distributed import doc_command
    from tests.e2e.test_docs_commands import SCALE
    from tests.helpers import compose_recipe
    from tests.rollout.server.fake_server import FakeServer

    # docs/async.md's command (ZeRO-3, K = 1 against a server), scaled down: the tiny model, 5 steps, refill rounds
    given, T = doc_command(server=True), 5
    assert given["distributed"] == "zero3" and given["rollout.backend"] == "server"
    assert given["rollout.max_staleness"] == "1"
    cfg = load(compose_recipe(given["recipe"], ["model=tiny", f"trainer.output_dir={tmp_path / 'unused'}"]))
    vocab = len(load_tokenizer(cfg.model.name_or_path))
    server = FakeServer(model=load_model(cfg.model, vocab, seed=5), name=cfg.model.name_or_path, max_model_len=1024,
                        vocab=vocab).start()
    # a second server for one run: it dies under its fourth group and is up again at once, fresh, and rejoins
    second = FakeServer(model=load_model(cfg.model, vocab, seed=5), name=cfg.model.name_or_path, max_model_len=1024,
                        vocab=vocab, restart_after=3).start()
    try:
        common = [f"rollout.server.urls=[{server.url}]", "rollout.server.connect_timeout_s=30",
                  "rollout.prompts_per_step=4", "logging.sample_every=0", "logging.plot=false"]
        scaled = {**given, **SCALE, "rollout.prompts_per_step": "4", "rollout.server.urls": f"[{server.url}]",
                  "algorithm.group_size": "4", "trainer.max_steps": str(T), "trainer.save_every": "2",
                  "trainer.keep_last": "3", "logging.sample_every": "0", "logging.plot": "false"}
        refill = [*(f"{k}={v}" for k, v in scaled.items() if k not in ("distributed", "rollout.max_staleness")),
                  "reward.functions.accuracy.weight=0.0", "reward.functions.format.weight=0.0",
                  f"+reward.functions.first.fn=tests.e2e.{Path(__file__).stem}:flat_or_first",
                  "algorithm.filter_zero_std_groups=true", "algorithm.resample_zero_std=2"]
        z2, z3 = ["distributed=zero2"], [f"distributed={given['distributed']}", *ZERO3[1:]]
        run = {name: tmp_path / name for name in ("sync", "k1", "k1r", "k1j", "k2", "k2r")}
        both = [a for a in refill if not a.startswith("rollout.server.urls=")] + [
            f"rollout.server.urls=[{server.url},{second.url}]", "rollout.server.rejoin_every_s=0"]
        p = launch(Path(__file__), "pipeline", tmp_path / "pipe", *ZERO3, "rollout.backend=server", *common,
               "rollout.max_staleness=2",
               THEN, "train", run["sync"], *z3, *refill, f"trainer.output_dir={run['sync']}",
               THEN, "train", run["k1"], *z3, *refill, f"rollout.max_staleness={given['rollout.max_staleness']}",
               f"trainer.output_dir={run['k1']}",
               THEN, "resume", run["k1"], *z3, *refill, "rollout.max_staleness=1",
               f"trainer.output_dir={run['k1r']}", f"trainer.resume={run['k1r'] / 'checkpoints' / 'step_2'}",
               THEN, "train", run["k1j"], *z3, *both, "rollout.max_staleness=1", f"trainer.output_dir={run['k1j']}",
               THEN, "train", run["k2"], *z2, *refill, "rollout.max_staleness=2", f"trainer.output_dir={run['k2']}",
               THEN, "resume", run["k2"], *z2, *refill, "rollout.max_staleness=2",
               f"trainer.output_dir={run['k2r']}", f"trainer.resume={run['k2r'] / 'checkpoints' / 'step_2'}",
               cwd=tmp_path, phase_s=300)
        asked, pushes = _by_phase(server)
        asked_second, _ = _by_phase(second)
    finally:
        server.stop()
        second.stop()
    # the pipeline at K = 2 on ZeRO-3: each rank trains on its own batch of the scheduled version
    ranks = [torch.load(tmp_path / "pipe" / f"pipeline_rank{r}.pt", weights_only=False) for r in (0, 1)]
    for t, (a, b) in enumerate(zip(*ranks), start=1):
        assert set(a["versions"]) == set(b["versions"]) == {sampled_with(t, 2)}, t
        assert a["prompts"] and b["prompts"] and not set(a["prompts"]) & set(b["prompts"])  # each rank its share
        rewards = a["rewards"] + b["rewards"]
        assert a["stats"]["reward_mean"] == b["stats"]["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert a["stats"]["async/staleness_max"] == b["stats"]["server/version_lag"] == t - 1 - sampled_with(t, 2)
        assert a["stats"]["server/sync_logprob_gap"] == b["stats"]["server/sync_logprob_gap"] < 1e-5
        assert a["grad_norm"] == pytest.approx(b["grad_norm"]) and a["grad_norm"] > 0
    # the 5-step runs: staleness as scheduled, one push per version, the synchronous run's prompts and seeds
    for name, K in (("k1", 1), ("k2", 2)):
        got = steps(run[name])
        for t, m in got.items():
            assert m["async/staleness_max"] == m["server/version_lag"] == t - 1 - sampled_with(t, K), (name, t)
            assert m["async/version"] == sampled_with(t, K) and m["server/sync_logprob_gap"] < 1e-5, (name, t)
        assert sum(m["resample_rounds"] for m in got.values()) > 0  # refill rounds ran, on both ranks together
        assert asked[name] == asked["sync"], name
        # each version the schedule samples with pushed once (by rank 0), the resumed run's from the checkpoint's on
        assert pushes[name] == len({sampled_with(t, K) for t in range(1, T + 1)}), name
        assert pushes[name + "r"] == len({sampled_with(t, K) for t in range(3 + K, T + 1)}), name
        held = [checkpoint.load_state(run[name] / "checkpoints" / "step_2", f"rank_{r}")["in_flight"] for r in (0, 1)]
        assert [{s: g.version for s, g in h["batches"].items()} for h in held] == \
            [{s: sampled_with(s, K) for s in range(3, 3 + K)}] * 2
        assert held[0]["batches"][3].batch.rows != held[1]["batches"][3].batch.rows  # each rank's own batch
        resumed = steps(run[name + "r"])
        same_numbers(got, resumed)  # steps 3-4 trained again from the checkpoint: the uninterrupted run's
        # the resumed run asks only for what was not in flight at the checkpoint: a part of the uninterrupted run's
        assert asked[name + "r"] and not asked[name + "r"] - asked[name]
        assert sum(asked[name + "r"].values()) < sum(asked[name].values())
    assert pushes["sync"] == T  # the synchronous run: one push per step, not one per rank
    # K = 1 with two servers, one restarting mid-run: dropped on both ranks, taken back on both before a later push,
    # the uninterrupted run's metrics (the same prompts and seeds asked, whichever server answered)
    assert second.restarts == 1 and p.stderr.count(f"rollout server {second.url} rejoined at version") == 1
    same_numbers(steps(run["k1"]), steps(run["k1j"]))
    assert set(asked["k1j"] + asked_second["k1j"]) == set(asked["sync"])
    up = [m["server/servers_up"] for _, m in sorted(steps(run["k1j"]).items())]
    assert min(up) == 1 and up[-1] == 2, up
