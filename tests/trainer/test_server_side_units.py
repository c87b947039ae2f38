"""grpo/trainer/server_side.py without servers or a training loop: the server generator's sampling half has parts of
its own (tokenizer, rewards, prompt sampler), sees only the weights pushed to the servers, refuses a batch whose
requests were answered by several versions, labels the batch with its version and lag, and closes what it opened."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from grpo.batch import Batch
from grpo.trainer import server_side
from grpo.trainer.build import build_run


class FakeServers:
    """The servers' backend: each `generate` answers with the next of ``answers`` (the versions it reports)."""
    name, version = "server", 0

    def __init__(self, *answers):
        self.answers, self.calls, self.closed = list(answers), [], False
        self.stats = {"server/sync_logprob_gap": 0.125, "other": 1.0}

    def generate(self, *args, **kw):
        self.calls.append((args, kw))
        return SimpleNamespace(versions=self.answers.pop(0))

    def close(self):
        self.closed = True


def _batch():
    return Batch([{}, {}], [[1], [2]], [[[3]], [[4]]], [[False], [False]], torch.zeros(2), torch.zeros(2), stats={})


@pytest.mark.parametrize("episodes", [False, True])
def test_the_server_generator_samples_with_its_own_parts_and_the_pushed_versions(cfg_factory, monkeypatch, episodes):
    """With an environment: a tool worker and a turn loop of its own, the environment's reward beside the others."""
    extra = {"rollout": {"environment": "tests.tool_fixtures:Counter", "max_turns": 2, "tool_timeout_s": 7.0}} \
        if episodes else {}
    cfg = cfg_factory({**extra, "data": {"num_eval": 0}, "reward": {"timeout_s": 30.0}})
    built = build_run(cfg)
    servers = FakeServers([3, 3], [3], None, [2, 3])
    run = dataclasses.replace(built, rollout=SimpleNamespace(make=lambda: servers))
    run.sampler.next(3)
    trainer_sampler = run.sampler.state_dict()
    seen = []

    def sample(mine):  # experience.sample: two requests, then its prompts drawn
        seen.append(mine)
        backend = mine.rollout.ready()
        backend.generate("prompts", 2, seed=5)
        backend.generate("more")
        mine.sampler.next(2)
        return _batch()

    monkeypatch.setattr(server_side.experience, "sample", sample)
    gen = server_side.server_generator(run, cfg)
    try:
        got = gen.sample(5, 3)
        mine, = seen
        assert servers.calls == [(("prompts", 2), {"seed": 5}), (("more",), {})]
        assert (got.step, got.version, got.batch.versions) == (5, 3, [3, 3])
        assert got.batch.stats["server/version_lag"] == 1.0  # step 5 trains after version 4: one version behind
        assert got.sampler == mine.sampler.state_dict() and run.sampler.state_dict() == trainer_sampler
        assert mine.sampler is not run.sampler and mine.rewards is not run.rewards
        assert mine.tokenizer is not run.tokenizer and mine.tokenizer("3+4=") == run.tokenizer("3+4=")
        assert mine.rollout.stats() == {"server/sync_logprob_gap": 0.125} and mine.rollout.name == "server"
        assert (mine.policy, mine.settings, mine.splits) == (run.policy, run.settings, run.splits)
        assert gen.backend is servers and gen.model is run.runtime.model and gen.full_weights is not None
        with pytest.raises(RuntimeError, match=r"^the batch of step 6 was sampled with weight versions \[2, 3\], "
                                               r"not 3: a push came between its requests$"):
            gen.sample(6, 3)  # a request without versions (None) adds none; the next came back from version 2
        names = [r.name for r in mine.rewards]
        assert names == [r.name for r in run.rewards] and ("Counter" in names) == episodes  # the trainer's too
        assert mine.toolset is run.toolset
        assert (mine.tool_worker is None) == (mine.turn_loop is None) == (not episodes)
        killed = []
        for r in mine.rewards:
            if r.worker is not None:
                r.worker.kill = lambda w=r.worker: killed.append(w)
        if episodes:
            assert mine.tool_worker is not run.tool_worker and mine.tool_worker.timeout_s == 7.0
            mine.tool_worker.kill = lambda: killed.append("tools")
    finally:
        gen.close()
        built.close()
    assert len(killed) == 1 + episodes and servers.closed  # one shared reward worker, killed once; the tool worker
    assert len({id(r.worker) for r in mine.rewards if r.worker is not None}) == 1
