"""grpo/sampler.py: the one factory of what a run samples with. The trainer's sampler and one built to sample ahead
differ only where sampling ahead must (weights published to it, never synced from the live model; every rollout
seeded); each has its own prompt sampler, rewards and workers, and gives back what it holds when closed."""
from types import SimpleNamespace

import pytest

from grpo.sampler import build_sampler
from grpo.trainer.build import build_run
from tests.under_mutmut import bounded_under_mutmut  # noqa: F401  (a looping mutant fails in seconds)


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


# ---------------------------------------------------------------- unit level: the factory and the sampler with fakes
class Fakes:
    """What `build_sampler` builds from, replaced: each records how it was called."""

    def __init__(self, monkeypatch, caps):
        from grpo import sampler

        self.calls = []
        self.caps = caps
        fake_registry = SimpleNamespace(BackendContext=sampler.registry.BackendContext,
                                        capabilities=lambda name: self.calls.append(("caps", name)) or self.caps,
                                        make=lambda name, ctx: self.calls.append(("make", name, ctx)) or "backend")
        monkeypatch.setattr(sampler, "registry", fake_registry)
        monkeypatch.setattr(sampler, "build_rewards", lambda functions: self.calls.append(("rewards", functions)) or [
            SimpleNamespace(name="built", worker=None)])
        monkeypatch.setattr(sampler, "in_worker", lambda rewards, t: self.calls.append(("in_worker", t)) or rewards)
        monkeypatch.setattr(sampler, "environment_reward", lambda toolset: SimpleNamespace(name=toolset.reward_name,
                                                                                           worker=None))
        monkeypatch.setattr(sampler, "ToolWorker", lambda env, t: SimpleNamespace(env=env, timeout_s=t))
        monkeypatch.setattr(sampler, "turn_loop_maker", lambda *a: ("loop", *a))


def _settings(**rollout):
    from grpo.config.schema import DataConfig, RewardConfig, RolloutConfig
    from grpo.sampler import SamplerSettings

    return SamplerSettings(backend="fake", rollout=RolloutConfig(**rollout),
                           reward=RewardConfig(functions={"f": {"fn": "length"}}, timeout_s=5.0,
                                               completion_format="text"),
                           data=DataConfig(), model_name="m", seed=11, longest_prompt=40, episodes="episodes")


@pytest.mark.parametrize("ahead,seeded", [(False, False), (False, True), (True, False)])
def test_the_factory_wires_the_backend_rewards_and_prompts_from_the_settings(monkeypatch, ahead, seeded):
    from grpo.rollout.registry import Capabilities
    from grpo.sampler import SYNC_CHECK_TOKENS

    fakes = Fakes(monkeypatch, Capabilities(seeded=seeded))
    settings = _settings()
    rows = [{"prompt_ids": list(range(50))}, {"prompt_ids": [7]}, {"prompt_ids": [8]}]
    runtime = SimpleNamespace(rank=0)
    s = build_sampler(settings, runtime, "tok", rows, None, prompts_state={"epoch": 2, "position": 1}, progress=True,
                      **({"ahead": True} if ahead else {}))  # not sampling ahead unless asked
    assert fakes.calls == [("rewards", {"f": {"fn": "length"}}), ("in_worker", 5.0), ("caps", "fake")]
    assert s.reward_names == ["built"] and s.completion_format == "text" and s.seed == 11 and s.rows is rows
    assert s.runtime is runtime and s.tokenizer == "tok" and s.turn_loop is None and s.tool_worker is None
    assert s.seeded == (seeded or ahead) and s.backend.follow == (not ahead) and s.backend.runtime is runtime
    assert (s.prompts.num_rows, s.prompts.seed, s.prompts.epoch, s.prompts.position) == (3, 11, 2, 1)
    assert s.backend.make() == "backend"  # what makes it at the first rollout, from the context
    _, name, ctx = fakes.calls[-1]
    assert name == "fake" and ctx.check_ids == list(range(SYNC_CHECK_TOKENS)) and SYNC_CHECK_TOKENS == 32
    assert (ctx.runtime, ctx.tokenizer, ctx.rollout, ctx.model_name, ctx.seed, ctx.longest_prompt) == (
        runtime, "tok", settings.rollout, "m", 11, 40)
    assert ctx.progress is True and ctx.multi_turn is False


def test_the_factory_adds_the_tool_worker_turn_loop_and_environment_reward_of_episodes(monkeypatch):
    from grpo.rollout.registry import Capabilities

    fakes = Fakes(monkeypatch, Capabilities(live_weights=True))
    settings = _settings(environment="x:Env", tool_timeout_s=7.0)
    given = [SimpleNamespace(name="mine", worker=None)]
    toolset = SimpleNamespace(env_reward=True, environment="the env", reward_name="env")
    s = build_sampler(settings, "rt", "tok", [], toolset, rewards=given)
    assert s.reward_names == ["mine", "env"] and [r.name for r in given] == ["mine"]  # the list given stays as it was
    assert (s.tool_worker.env, s.tool_worker.timeout_s) == ("the env", 7.0)
    assert s.turn_loop == ("loop", "episodes", "tok", toolset, s.tool_worker, settings.data, "rt")
    assert s.prompts.num_rows == 0 and s.prompts.position == 0
    assert s.backend.caps is fakes.caps and s.backend.follow is False  # a backend on the live model syncs nothing
    assert s.backend.make() == "backend"
    ctx = fakes.calls[-1][2]
    assert ctx.check_ids == [] and ctx.progress is False and ctx.multi_turn is True  # no rows; an episode's K/V kept
    no_reward = build_sampler(settings, "rt", "tok", [{"prompt_ids": [1, 2]}],
                              SimpleNamespace(env_reward=False, environment="e"), rewards=given)
    assert no_reward.reward_names == ["mine"] and no_reward.tool_worker is not None


def test_the_sampler_generates_seeds_and_closes_what_it_holds():
    from grpo.data import PromptSampler
    from grpo.rollout.backends import step_seed
    from grpo.rollout.base import Completions
    from grpo.sampler import Sampler

    got, killed = [], []

    class Backend:
        def ready(self):
            return self

        def generate(self, prompt_ids, group_size, sampling, seed=None, suffixes=None):
            got.append((prompt_ids, group_size, sampling, seed, suffixes))
            return Completions([[[1]]], [[False]], versions=self.versions)

        def close(self):
            killed.append("backend")

    worker = SimpleNamespace(kill=lambda: killed.append("rewards"))
    other = SimpleNamespace(kill=lambda: killed.append("other rewards"))
    rewards = [SimpleNamespace(name="a", worker=worker), SimpleNamespace(name="b", worker=worker),
               SimpleNamespace(name="c", worker=None), SimpleNamespace(name="d", worker=other)]
    prompts = PromptSampler(4, seed=0, epoch=3, position=2)
    backend = Backend()
    s = Sampler(SimpleNamespace(rank=2), "tok", [], prompts, backend, rewards, seed=5,
                tool_worker=SimpleNamespace(kill=lambda: killed.append("tools")))
    assert s.completion_format == "auto" and s.seeded and s.turn_loop is None and s.versions == set()
    backend.versions = [3, None, 4]
    s.generate([[1]], 2, "sampling", seed=9, suffixes=["x"])
    backend.versions = None
    s.generate([[1]], 1, "sampling")
    assert got == [([[1]], 2, "sampling", 9, ["x"]), ([[1]], 1, "sampling", None, None)] and s.versions == {3, 4}
    assert s.seed_for(1) == step_seed(5, 2, 3, 2) and s.seed_for(2) == step_seed(5, 2, 3, 2, 2)
    s.close()
    assert killed == ["backend", "tools", "rewards", "other rewards"]  # a shared reward worker killed once
    killed.clear()
    plain = Sampler(None, "tok", [], prompts, backend, rewards[2:3], seeded=False)
    plain.close()
    assert killed == ["backend"] and plain.seed == 0 and plain.tool_worker is None
