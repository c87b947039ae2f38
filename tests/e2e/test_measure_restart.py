"""scripts/measure_restart.py (docs/benchmarks.md's restart figure) on a recorded launch: the scenario itself, the
torchrun restart after rank 1 is SIGKILLed, is tests/e2e/test_rank_failure.py's; here the timing the script reads
off the launcher's lines, in this process (no launch)."""
import importlib.util
import json

from tests.helpers import ROOT


def test_measure_restart_times_each_event_after_the_kill(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("measure_restart", ROOT / "scripts" / "measure_restart.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    t0 = 1000.0
    lines = [(t0 + 1, "[grpo] step    2 ..."), (t0 + 3, "[grpo] step    3 ..."),  # before the kill: not counted
             (t0 + 5.2, "error: rank 0 of 2: a collective timed out or lost another rank (...)"),
             (t0 + 40.0, "[grpo] resumed from /tmp/x/run/checkpoints/step_2 (step 2)"),
             (t0 + 41.3, "[grpo] step    3 reward 0.5"), (t0 + 50.0, "[grpo] done")]
    monkeypatch.setattr(script.time, "time", lambda: t0 - 10)
    monkeypatch.setattr(script, "run", lambda args, work: (lines, t0 + 5.0))
    assert script.main(["--zero", "3"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == {"zero": 3, "nproc": 2, "die_at": 3, "start_to_kill_s": 15.0, "survivor_stopped_s": 0.2,
                   "resumed_s": 35.0, "first_step_again_s": 36.3,
                   "resumed_from": "/tmp/x/run/checkpoints/step_2 (step 2)", "completed_steps_lost": 0, "total_s": 60.0}
