"""grpo/sampler.py: the one factory of what a run samples with. The trainer's sampler and one built to sample ahead
differ only where sampling ahead must (weights published to it, never synced from the live model; every rollout
seeded); each has its own prompt sampler, rewards and workers, and gives back what it holds when closed."""
import pytest

from grpo.sampler import build_sampler
from grpo.trainer.build import build_run


@pytest.mark.parametrize("environment", [False, True])
def test_the_factory_builds_the_trainers_sampler_and_one_that_samples_ahead(cfg_factory, environment):
    extra = {"rollout": {"environment": "tests.tool_fixtures:Counter", "max_turns": 2, "tool_timeout_s": 7.0}} \
        if environment else {}
    cfg = cfg_factory({**extra, "data": {"num_eval": 0}, "reward": {"timeout_s": 30.0}})
    run = build_run(cfg)
    mine = trainer = run.sampler
    try:
        assert trainer.backend.follow is False and not trainer.seeded  # hf: the live model, torch's own RNG
        trainer.prompts.next(5)
        mine = build_sampler(run.settings.sampler, run.runtime, run.tokenizer, run.splits.train, run.toolset,
                             prompts_state=trainer.prompts.state_dict(), ahead=True)
        assert mine.seeded and mine.prompts is not trainer.prompts
        assert mine.prompts.next(3) == trainer.prompts.next(3)  # the same prompts next, from the same position
        assert mine.reward_names == trainer.reward_names and ("Counter" in mine.reward_names) == environment
        assert all(a is not b for a, b in zip(mine.rewards, trainer.rewards))
        assert (mine.tool_worker is None) == (mine.turn_loop is None) == (not environment)
        if environment:
            assert mine.tool_worker is not trainer.tool_worker and mine.tool_worker.timeout_s == 7.0
        killed = []
        for r in mine.rewards:
            if r.worker is not None:
                r.worker.kill = lambda w=r.worker: killed.append(w)
        if environment:
            mine.tool_worker.kill = lambda: killed.append("tools")
        mine.close()
        assert len(killed) == 1 + environment  # one shared reward worker, killed once; the tool worker
    finally:
        run.close()


def test_the_sampler_records_the_versions_that_answered_and_seeds_from_the_prompt_position(cfg_factory):
    from grpo.rollout.backends import step_seed
    from grpo.rollout.base import Completions

    class Versioned:
        def generate(self, prompt_ids, group_size, sampling, seed=None, suffixes=None):
            return Completions([[[1]]] * len(prompt_ids), [[False]] * len(prompt_ids), versions=[4, None])

        def sync_weights(self, model, version):
            pass

        def stats(self):
            return {}

        def close(self):
            pass

    run = build_run(cfg_factory({"data": {"num_eval": 0}}))
    try:
        s = run.sampler
        s.backend.backend = Versioned()
        s.generate([[1], [2]], 1, None)
        assert s.versions == {4} and s.seed_for(1) is None
        s.seeded = True
        p = s.prompts
        assert s.seed_for(1) == step_seed(s.seed, 0, p.epoch, p.position) != s.seed_for(2)
        assert s.seed_for(2) == step_seed(s.seed, 0, p.epoch, p.position, 2)
    finally:
        run.close()
