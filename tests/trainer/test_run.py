"""grpo/trainer/run.py: LoopState's starting values (what a fresh run and a checkpoint's restore start from) and what
`Run.close` gives back."""
from grpo.trainer.run import LoopState, Run


def test_a_fresh_state_starts_at_step_zero_with_no_buffer():
    s = LoopState()
    assert (s.step, s.buffer, s.bad_steps, s.skipped_steps, s.stop_requested) == (0, None, 0, 0, False)
    assert s.failed_reward_steps == {} and LoopState().failed_reward_steps is not s.failed_reward_steps
    assert {"settings", "sampler", "eval_backend", "toolset"} <= set(Run.__dataclass_fields__)


def test_close_gives_back_the_sampler():
    closed = []

    class Held:
        def close(self):
            closed.append("sampler")

    Run(**{**dict.fromkeys(Run.__dataclass_fields__), "sampler": Held()}).close()
    assert closed == ["sampler"]
