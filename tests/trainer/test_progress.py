"""The console's step counter (grpo/trainer/progress.py): ``step k/N [elapsed<remaining]``, the time left from this
process's mean seconds per step."""
from grpo.trainer.logger import format_line
from grpo.trainer.progress import StepClock


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_elapsed_and_remaining_from_the_mean_step_time_so_far():
    now = Clock()
    clock = StepClock(0, 30, now=now)
    now.t += 20
    assert clock.line(1) == "step  1/30 [00:20<09:40]"  # 29 steps left at 20 s
    now.t += 40
    assert clock.line(2) == "step  2/30 [01:00<14:00]"  # 28 left at the mean, 30 s
    now.t += 3600
    assert clock.line(30) == "step 30/30 [1:01:00<00:00]"


def test_a_resumed_run_counts_its_own_steps_only():
    now = Clock()
    clock = StepClock(20, 30, now=now)  # resumed from step 20: the steps before took another process's time
    now.t += 10
    assert clock.line(21) == "step 21/30 [00:10<01:30]"


def test_the_console_line_starts_with_it():
    line = format_line({"step": 3, "reward_mean": 0.5, "step_time_s": 2.0}, "step 3/9 [00:06<00:12]")
    assert line == "step 3/9 [00:06<00:12]  reward 0.500  s/step 2.0"
    assert format_line({"step": 3, "reward_mean": 0.5}).startswith("step    3  reward")  # without one (no loop)
