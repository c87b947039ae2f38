"""How long a run takes to come back after a rank dies: the `torchrun --max-restarts` scenario of
tests/e2e/test_rank_failure.py, timed.

    PYTHONPATH=. python scripts/measure_restart.py [--zero 2|3] [--nproc 2] [--die-at 3] [--steps 3]

Two processes train the smoke recipe (tiny model, CPU, gloo) with a checkpoint every step; in the middle of step
``--die-at`` rank 1 SIGKILLs itself (a node lost). The other rank's collective fails, torchrun restarts the
group, and trainer.resume=auto continues from the last complete checkpoint. Printed, in seconds after the kill:
when the surviving rank stopped with its one line, when the restarted group had resumed (checkpoint loaded),
and when it had trained its first step again; and how many steps were trained twice. Every output line of the
run is timestamped as it arrives (the workers run unbuffered).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KILLER = '''
import os
import signal
import time

calls = 0


def killed_once(prompts, completions, die_at: int = 0, stamp: str = "", **kwargs):
    """Rank 1 notes the time and SIGKILLs itself at its ``die_at``-th reward call (step die_at), first attempt only."""
    global calls
    calls += 1
    if calls == die_at and os.environ["RANK"] == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, work: Path) -> tuple[list[tuple[float, str]], float | None]:
    """The launcher's merged output as (arrival time, line), and the time rank 1 killed itself."""
    (work / "kill_rewards.py").write_text(KILLER)
    stamp = work / "killed_at"
    fn = f"+reward.functions.kill={{fn: 'kill_rewards:killed_once', die_at: {args.die_at}, stamp: '{stamp}'}}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--max-restarts", "1",
           "--master_port", str(_port()), "-m", "grpo.train", "recipe=smoke", "logging.sample_every=0",
           "logging.plot=false", f"distributed=zero{args.zero}", "data.num_eval=0", f"trainer.max_steps={args.steps}",
           "trainer.save_every=1", "trainer.resume=auto", f"distributed.timeout_s={args.timeout_s}", fn,
           f"trainer.output_dir={work / 'run'}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(work), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [(time.time(), line.rstrip("\n")) for line in proc.stdout]
    if proc.wait() != 0:
        sys.exit("the run failed:\n" + "\n".join(line for _, line in lines[-40:]))
    return lines, float(stamp.read_text()) if stamp.exists() else None


def first_after(lines, t0: float, needle: str) -> float | None:
    return next((t - t0 for t, line in lines if t >= t0 and needle in line), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--zero", type=int, default=2, choices=[2, 3])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--die-at", type=int, default=3, help="the step in which rank 1 dies")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=60, help="distributed.timeout_s")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        lines, killed = run(args, Path(tmp))
        if killed is None:
            sys.exit("rank 1 never reached its reward call of step --die-at")
        resumed_line = next((line for _, line in lines if "resumed from" in line), "")
        result = {
            "zero": args.zero, "nproc": args.nproc, "die_at": args.die_at,
            "start_to_kill_s": round(killed - start, 1),
            "survivor_stopped_s": first_after(lines, killed, "a collective timed out or lost another rank"),
            "resumed_s": first_after(lines, killed, "resumed from"),
            "first_step_again_s": first_after(lines, killed, f"step {args.die_at:>4}"),
            "resumed_from": resumed_line.split("resumed from ")[-1],
            "completed_steps_lost": args.die_at - 1 - int(resumed_line.rsplit("step ", 1)[-1].rstrip(")") or 0)
            if resumed_line else None,
            "total_s": round(lines[-1][0] - start, 1),
        }
    result = {k: round(v, 1) if isinstance(v, float) else v for k, v in result.items()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
