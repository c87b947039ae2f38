#!/usr/bin/env python
"""The whole GRPO step with each rollout backend: hf (our decode loop), vllm (an engine in the trainer's process)
and server (vLLM's server started by grpo-serve, weights pushed every step), alternated in one run.

    python scripts/bench_server.py                         # quickstart on CPU: hf, vllm, server, twice, 3 steps each
    python scripts/bench_server.py --backends hf,server --rounds 1 --steps 2
    python scripts/bench_server.py --backends server,server-K1 --steps 4   # synchronous vs rollout.max_staleness=1
    python scripts/bench_server.py --device cuda --server-gpu-util 0.35 --json server.json   # bench_gpu.sh server
    python scripts/bench_server.py --dry-run               # the plan only

Runs in the environment that has vLLM (``.venv-vllm``). One server (``grpo-serve`` with the same recipe and
overrides) serves every server run; its start-up time is reported apart. Each run is ``grpo.train`` with
``data.num_eval=0``; a row is the median ``step_time_s`` of its steps after the first (the first holds the vLLM
engine's start, or the server's first push), with ``time/sync_s`` (push + sync check) for the server backend.
``server-K<n>`` is the server backend with ``rollout.max_staleness=<n>`` (docs/async.md): its push overlaps the
update (``time/weights_load_s``), and ``time/trainer_wait_s`` is the trainer idle, waiting for its batch.
Prints one JSON line per run and (--json) writes them all.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--recipe", default="quickstart")
    p.add_argument("--backends", default="hf,vllm,server", help="comma-separated, run in this order each round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")
    p.add_argument("--server-gpu-util", type=float, default=None,
                   help="CUDA: the server's --gpu-memory-utilization (when it shares the GPU with the trainer)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run at most")
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("overrides", nargs="*", help="more grpo-train/grpo-serve overrides (key=value)")
    return p.parse_args(argv)


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(a, port: int, out: Path) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(the server's command, [(backend, trainer command)] in run order)."""
    common = [f"recipe={a.recipe}", f"trainer.device={a.device}", *a.overrides]
    serve = [sys.executable, "-m", "grpo.serve", *common, f"rollout.server.port={port}"]
    if a.server_gpu_util is not None:
        serve += ["--", "--gpu-memory-utilization", str(a.server_gpu_util)]
    runs = []
    for r in range(a.rounds):
        for b in a.backends.split(","):
            kind, _, lag = b.partition("-K")
            extra = [f"rollout.server.urls=[http://127.0.0.1:{port}]"] if kind == "server" else []
            extra += [f"rollout.max_staleness={lag}"] if lag else []
            runs.append((b, [sys.executable, "-m", "grpo.train", *common, f"rollout.backend={kind}", *extra,
                             f"trainer.max_steps={a.steps}", "data.num_eval=0", "logging.plot=false",
                             "logging.sample_every=0", f"trainer.output_dir={out / f'{b}-{r}'}"]))
    return serve, runs


def _up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def start_server(cmd: list[str], port: int, log: Path, timeout: float) -> tuple[subprocess.Popen, float]:
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    while not _up(port):
        if proc.poll() is not None or time.time() - t0 > timeout:
            raise SystemExit(f"the server did not come up; its log: {log}")
        time.sleep(1)
    return proc, time.time() - t0


def measure(backend: str, cmd: list[str], out: Path, timeout: int) -> dict:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"backend": backend, "error": f"not done after --timeout {timeout} s"}
    if p.returncode != 0:
        return {"backend": backend, "error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r][1:]
    row = {"backend": backend, "steps_timed": len(rows),
           "step_time_s": statistics.median(r["step_time_s"] for r in rows),
           "rollout_s": statistics.median(r["time/rollout_s"] for r in rows),
           "update_s": statistics.median(r["time/update_s"] for r in rows)}
    if backend == "server":
        row["sync_s"] = statistics.median(r["time/sync_s"] for r in rows)
    if backend.startswith("server-K"):  # the push runs on the generator's thread, the trainer waits for batches
        row["push_s"] = statistics.median(r["time/weights_load_s"] for r in rows)
        row["trainer_wait_s"] = statistics.median(r["time/trainer_wait_s"] for r in rows)
        row["staleness_max"] = max(r["async/staleness_max"] for r in rows)
    if backend.startswith("server"):
        row["sync_logprob_gap_max"] = max(r["server/sync_logprob_gap"] for r in rows)
    return row


def main(argv=None) -> None:
    a = parse(argv)
    port = a.port or _free_port()
    out = Path(tempfile.mkdtemp(prefix="bench-server-"))
    serve, runs = commands(a, port, out)
    if a.dry_run:
        print(" ".join(serve))
        for _, cmd in runs:
            print(" ".join(cmd))
        return
    results, proc = [], None
    try:
        if any(b.startswith("server") for b, _ in runs):
            proc, start_s = start_server(serve, port, out / "server.log", a.timeout)
            results.append({"server_start_s": round(start_s, 1)})
            print(json.dumps(results[-1]), flush=True)
        for b, cmd in runs:
            results.append(measure(b, cmd, Path(cmd[-1].split("=", 1)[1]), a.timeout))
            print(json.dumps(results[-1]), flush=True)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
