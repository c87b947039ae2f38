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


def test_the_generator_side_loads_published_weights_and_samples_only_with_the_version_it_holds(cfg_factory,
                                                                                             monkeypatch):
    """``load`` copies a version's weights into its own policy by name; ``sample`` refuses a version it does not
    hold, and gives back the batch with the behaviour log-probs of its policy (the trainer's engine settings and
    temperature), the version on every group, and the prompt sampler after the batch."""
    import torch

    from grpo.batch import Batch
    from grpo.trainer import generator_side

    cfg = cfg_factory({"data": {"num_eval": 0}, "rollout": {"batch_size": 3, "share_prompt": False},
                       "reward": {"completion_format": "text"}})
    run = build_run(cfg)
    try:
        side = build(GeneratorSpec(cfg, run.settings, run.splits.train, run.sampler.state_dict(), threads=1, rank=1,
                                   world_size=2))
    finally:
        run.close()
    mine = side.run
    assert (mine.runtime.rank, mine.runtime.world_size, mine.completion_format) == (1, 2, "text")
    assert mine.policy.training and torch.get_num_threads() == 1
    hf = mine.rollout.make()
    assert (hf.batch_size, hf.share_prompt) == (3, False) and mine.eval_backend is hf
    assert [r.name for r in mine.rewards] == [r.name for r in run.rewards]
    name, param = next(iter(mine.policy.named_parameters()))
    new = torch.full_like(param, 0.25)
    side.load(4, {name: new})
    assert side.version == 4 and torch.equal(param, new) and param is not new
    with pytest.raises(RuntimeError, match="step 7 wants the weights of version 3, the generator holds 4: published "
                                           "out of order"):
        side.sample(7, 3)
    batch = Batch([{}, {}], [[1], [2]], [[[3]], [[4]]], [[False], [False]], torch.zeros(2), torch.zeros(2), stats={})
    asked = []

    def sample(r):
        r.sampler.next(2)
        return batch

    monkeypatch.setattr(generator_side.experience, "sample", sample)
    monkeypatch.setattr(generator_side, "nested_logprobs", lambda *a: asked.append(a) or "logps")
    got = side.sample(7, 4)
    assert (got.step, got.version, got.batch, got.sampler) == (7, 4, batch, mine.sampler.state_dict())
    assert got.sampler != run.sampler.state_dict()  # its own sampler moved on, the trainer's did not
    assert batch.versions == [4, 4] and batch.sampling_logps == "logps"
    s = mine.settings.collect
    assert asked == [(mine.runtime, mine.policy, batch, s.engine, s.sampling.temperature)]


def test_own_sampling_parts_with_an_environment_are_the_generators_own(cfg_factory):
    """The environment's reward joins the configured ones, the tool worker runs the configured environment with
    rollout.tool_timeout_s, the prompt sampler starts where it is told; nothing is the trainer's object."""
    from grpo.trainer.generator_side import own_sampling_parts

    cfg = cfg_factory({"rollout": {"environment": "tests.tool_fixtures:Counter", "max_turns": 2, "tool_timeout_s": 7.0},
                       "data": {"num_eval": 0}})
    run = build_run(cfg)
    try:
        run.sampler.next(5)
        state = run.sampler.state_dict()
        rewards, sampler, worker, loop = own_sampling_parts(cfg, run.settings, run.tokenizer, run.toolset,
                                                            run.runtime, len(run.splits.train), state)
        assert [r.name for r in rewards] == [r.name for r in run.rewards] and rewards[-1].name == "Counter"
        assert all(a is not b for a, b in zip(rewards, run.rewards))
        assert sampler is not run.sampler and sampler.state_dict() == run.sampler.state_dict()
        assert sampler.next(3) == run.sampler.next(3)  # the same prompts next, from the same seed and position
        assert worker is not run.tool_worker and (worker.environment, worker.timeout_s) == (
            "tests.tool_fixtures:Counter", 7.0)
        assert callable(loop) and loop is not run.turn_loop
        plain = own_sampling_parts(cfg, run.settings, run.tokenizer, None, run.runtime, 4, run.sampler.state_dict())
        assert [r.name for r in plain[0]] == [r.name for r in run.rewards][:-1] and plain[2:] == (None, None)
        worker.kill()
    finally:
        run.close()
