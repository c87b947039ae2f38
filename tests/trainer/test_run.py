"""grpo/trainer/run.py: LoopState's starting values (what a fresh run and a checkpoint's restore start from)."""
from grpo.trainer.run import LoopState, Run


def test_a_fresh_state_starts_at_step_zero_with_no_buffer():
    s = LoopState()
    assert (s.step, s.buffer, s.bad_steps, s.skipped_steps, s.stop_requested) == (0, None, 0, 0, False)
    assert s.failed_reward_steps == {} and LoopState().failed_reward_steps is not s.failed_reward_steps
    assert {"settings", "rollout", "eval_backend", "turn_loop"} <= set(Run.__dataclass_fields__)
