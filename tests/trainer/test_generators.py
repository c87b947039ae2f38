"""grpo/trainer/generators.py: the samplers of asynchronous GRPO come from the run's one factory. The generator
process's side samples with its own copy of the policy, loads published weights and samples only with the version it
holds; the servers' side has parts of its own (tokenizer, rewards, prompt sampler), sees only the weights pushed to
the servers, refuses a batch whose requests were answered by several versions, and closes what it opened."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from grpo.batch import Batch
from grpo.trainer import generators
from grpo.trainer.build import build_run


def _spec(cfg, run, **kw):
    return generators.ProcessSpec(run.settings, cfg.model, run.toolset, run.splits.train,
                                  run.sampler.prompts.state_dict(), **kw)


@pytest.mark.parametrize("tools", [False, True])
def test_the_generator_process_samples_as_the_trainer_does_but_seeded(cfg_factory, tools):
    """The same backend kind and settings as the trainer's (the turn cache exactly for multi-turn runs), the prompt
    sampler from the trainer's position, every rollout seeded (the process's RNG is not in a checkpoint), and the
    weights only those published to it."""
    extra = {"rollout": {"tools": ["grpo.rollout.episodes.calculator:python"], "tool_format": "code",
                         "max_turns": 2}} if tools else {}
    cfg = cfg_factory({**extra, "data": {"num_eval": 0}})
    run = build_run(cfg)
    run.sampler.prompts.next(3)
    side = generators.build_process_side(_spec(cfg, run))
    mine = side.sampler
    try:
        assert mine.seeded and not run.sampler.seeded
        assert not mine.backend.follow and (mine.turn_loop is None) == (not tools)
        made, theirs = mine.backend.ready(), run.sampler.backend.ready()
        assert type(made) is type(theirs) and (made.turns is not None) == (theirs.turns is not None) == tools
        assert made._model() is side.policy and theirs._model() is run.runtime.model
        assert mine.prompts.state_dict() == run.sampler.prompts.state_dict() and mine.prompts is not run.sampler.prompts
    finally:
        run.close()
        mine.close()


def test_the_process_side_loads_published_weights_and_samples_only_with_the_version_it_holds(cfg_factory,
                                                                                             monkeypatch):
    """``load`` copies a version's weights into its own policy by name; ``sample`` refuses a version it does not
    hold, and gives back the batch with the behaviour log-probs of its policy (the trainer's engine settings and
    temperature), the version on every group, and the prompt sampler after the batch."""
    cfg = cfg_factory({"data": {"num_eval": 0}, "rollout": {"batch_size": 3, "share_prompt": False},
                       "reward": {"completion_format": "text"}})
    run = build_run(cfg)
    try:
        side = generators.build_process_side(_spec(cfg, run, threads=1, rank=1, world_size=2))
    finally:
        run.close()
    mine = side.sampler
    assert (mine.runtime.rank, mine.runtime.world_size, mine.completion_format) == (1, 2, "text")
    assert side.policy.training and torch.get_num_threads() == 1
    hf = mine.backend.ready()
    assert (hf.batch_size, hf.share_prompt) == (3, False)
    assert mine.reward_names == run.sampler.reward_names
    name, param = next(iter(side.policy.named_parameters()))
    new = torch.full_like(param, 0.25)
    side.load(4, {name: new})
    assert side.version == 4 and torch.equal(param, new) and param is not new
    with pytest.raises(RuntimeError, match="step 7 wants the weights of version 3, the generator holds 4: published "
                                           "out of order"):
        side.sample(7, 3)
    batch = Batch([{}, {}], [[1], [2]], [[[3]], [[4]]], [[False], [False]], torch.zeros(2), torch.zeros(2), stats={})
    asked = []

    def sample(sampler, s):
        assert sampler is mine and s is side.settings.collect
        sampler.prompts.next(2)
        return batch

    monkeypatch.setattr(generators.experience, "sample", sample)
    monkeypatch.setattr(generators, "nested_logprobs", lambda *a: asked.append(a) or "logps")
    got = side.sample(7, 4)
    assert (got.step, got.version, got.batch, got.sampler) == (7, 4, batch, mine.prompts.state_dict())
    assert got.sampler != run.sampler.prompts.state_dict()  # its own sampler moved on, the trainer's did not
    assert batch.versions == [4, 4] and batch.sampling_logps == "logps"
    s = side.settings.collect
    assert asked == [(mine.runtime, side.policy, batch, s.engine, s.sampling.temperature)]
    mine.close()


class FakeServers:
    """The servers' backend: each `generate` answers with the next of ``answers`` (the versions it reports)."""
    version = 0

    def __init__(self, *answers):
        self.answers, self.calls, self.closed = list(answers), [], False

    def generate(self, *args, **kw):
        self.calls.append((args, kw))
        return SimpleNamespace(versions=self.answers.pop(0))

    def stats(self):
        return {"server/sync_logprob_gap": 0.125}

    def sync_weights(self, model, version):
        raise AssertionError("sampling ahead never syncs: the worker pushes")

    def close(self):
        self.closed = True


def _batch():
    return Batch([{}, {}], [[1], [2]], [[[3]], [[4]]], [[False], [False]], torch.zeros(2), torch.zeros(2), stats={})


@pytest.mark.parametrize("episodes", [False, True])
def test_the_server_generator_samples_with_its_own_parts_and_the_pushed_versions(cfg_factory, monkeypatch, episodes):
    """With an environment: a tool worker and a turn loop of its own, the environment's reward beside the others."""
    from grpo.rollout import registry

    extra = {"rollout": {"environment": "tests.tool_fixtures:Counter", "max_turns": 2, "tool_timeout_s": 7.0}} \
        if episodes else {}
    cfg = cfg_factory({**extra, "data": {"num_eval": 0}, "reward": {"timeout_s": 30.0}})
    run = build_run(cfg)
    on_servers = dataclasses.replace(run.settings.sampler, backend="server")  # a backend that samples ahead on a thread
    run.settings = dataclasses.replace(run.settings, sampler=on_servers)
    servers = FakeServers([3, 3], [3], None, [2, 3])
    monkeypatch.setattr(registry, "make", lambda name, ctx: name == "server" and servers)
    run.sampler.prompts.next(3)
    trainer_prompts = run.sampler.prompts.state_dict()
    seen = []

    def sample(mine, s):  # experience.sample: two requests, then its prompts drawn
        seen.append(mine)
        mine.generate("prompts", 2, "sampling", seed=5)
        mine.generate("more", 1, "sampling")
        mine.prompts.next(2)
        return _batch()

    monkeypatch.setattr(generators.experience, "sample", sample)
    gen = generators.server_generator(run)
    try:
        got = gen.sample(5, 3)
        mine, = seen
        assert [c[0][0] for c in servers.calls] == ["prompts", "more"] and servers.calls[0][1]["seed"] == 5
        assert (got.step, got.version, got.batch.versions) == (5, 3, [3, 3])
        assert got.batch.stats["server/version_lag"] == 1.0  # step 5 trains after version 4: one version behind
        assert got.sampler == mine.prompts.state_dict() and run.sampler.prompts.state_dict() == trainer_prompts
        assert mine.prompts is not run.sampler.prompts and mine.rewards is not run.sampler.rewards
        assert mine.tokenizer is not run.tokenizer and mine.tokenizer("3+4=") == run.tokenizer("3+4=")
        assert mine.backend.stats() == {"server/sync_logprob_gap": 0.125} and mine.seeded
        assert not mine.backend.follow  # the weights are the worker's pushes: never synced from the live model
        assert gen.backend is servers and gen.model is run.runtime.model and gen.full_weights is not None
        with pytest.raises(RuntimeError, match=r"^the batch of step 6 was sampled with weight versions \[2, 3\], "
                                               r"not 3: a push came between its requests$"):
            gen.sample(6, 3)  # a request without versions (None) adds none; the next came back from version 2
        names = mine.reward_names
        assert names == run.sampler.reward_names and ("Counter" in names) == episodes  # the trainer's too
        assert (mine.tool_worker is None) == (mine.turn_loop is None) == (not episodes)
        killed = []
        for r in mine.rewards:
            if r.worker is not None:
                r.worker.kill = lambda w=r.worker: killed.append(w)
        if episodes:
            assert mine.tool_worker is not run.sampler.tool_worker and mine.tool_worker.timeout_s == 7.0
            mine.tool_worker.kill = lambda: killed.append("tools")
    finally:
        gen.close()
        run.close()
    assert len(killed) == 1 + episodes and servers.closed  # one shared reward worker, killed once; the tool worker
    assert len({id(r.worker) for r in mine.rewards if r.worker is not None}) == 1
