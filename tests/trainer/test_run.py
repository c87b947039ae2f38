"""grpo/trainer/run.py: LoopState's starting values (what a fresh run and a checkpoint's restore start from) and what
`Run.close` gives back."""
from grpo.trainer.run import LoopState, Run


def test_a_fresh_state_starts_at_step_zero_with_no_buffer():
    s = LoopState()
    assert (s.step, s.buffer, s.bad_steps, s.skipped_steps, s.stop_requested) == (0, None, 0, 0, False)
    assert s.failed_reward_steps == {} and LoopState().failed_reward_steps is not s.failed_reward_steps
    assert {"settings", "rollout", "eval_backend", "turn_loop"} <= set(Run.__dataclass_fields__)


def test_close_gives_back_the_rollout_the_tool_worker_and_each_reward_worker_once():
    from grpo.rewards.score import RewardFunction

    closed = []

    class Held:
        def __init__(self, name):
            self.name = name

        def close(self):
            closed.append(self.name)

        def kill(self):
            closed.append(self.name)

    shared = Held("reward worker")  # every function of reward.timeout_s > 0 runs in the one worker
    rewards = [RewardFunction("a", len, worker=shared), RewardFunction("b", len, worker=shared),
               RewardFunction("c", len)]
    fields = dict.fromkeys(Run.__dataclass_fields__)
    run = Run(**{**fields, "rollout": Held("rollout"), "tool_worker": Held("tool worker"), "rewards": rewards})
    run.close()
    assert sorted(closed) == ["reward worker", "rollout", "tool worker"]
    closed.clear()
    Run(**{**fields, "rollout": Held("rollout"), "rewards": [], "tool_worker": None}).close()  # no workers
    assert closed == ["rollout"]
