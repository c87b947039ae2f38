"""grpo/trainer/generator_side.py: the generator process's run is built like the trainer's sampling side."""
import pytest

from grpo.trainer.build import build_run
from grpo.trainer.generator_side import GeneratorSpec, build


@pytest.mark.parametrize("tools", [False, True])
def test_the_generator_keeps_kv_across_turns_exactly_when_the_trainers_rollout_does(cfg_factory, tools):
    """The turn cache (grpo/rollout/turn_cache.py) is on in the generator's seeded backend for multi-turn episodes,
    as in the trainer's own rollout backend, and off for single-turn runs; the sampler starts from the trainer's."""
    extra = {"rollout": {"tools": ["grpo.rollout.episodes.calculator:python"], "tool_format": "code",
                         "max_turns": 2}} if tools else {}
    cfg = cfg_factory({**extra, "data": {"num_eval": 0}})
    run = build_run(cfg)
    run.sampler.next(3)
    side = build(GeneratorSpec(cfg, run.settings, run.splits.train, run.sampler.state_dict()))
    try:
        mine, theirs = side.run.rollout.make(), run.rollout.make()
        assert mine.seeded and not theirs.seeded
        assert (mine.turns is not None) == (theirs.turns is not None) == tools
        assert side.run.sampler.state_dict() == run.sampler.state_dict()
    finally:
        run.close()
        if side.run.tool_worker is not None:
            side.run.tool_worker.kill()
