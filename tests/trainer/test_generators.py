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


# ---- over stand-ins (no model, no run, no process): the unit tests `make mutate` selects ---------------------------
def _side(monkeypatch, asked):
    policy = torch.nn.Linear(2, 2)
    prompts = SimpleNamespace(state_dict=lambda: {"pos": len(asked)})
    sampler = SimpleNamespace(runtime="its runtime", prompts=prompts)
    settings = SimpleNamespace(collect=SimpleNamespace(engine="its engine", sampling=SimpleNamespace(temperature=0.7)))

    def sample(smp, s):
        asked.append(("sample", smp, s))
        return SimpleNamespace(completion_ids=[[1], [2], [3]])

    monkeypatch.setattr(generators.experience, "sample", sample)
    monkeypatch.setattr(generators, "nested_logprobs", lambda *a: asked.append(("logprobs", *a)) or "behaviour")
    return generators.ProcessSide(sampler, policy, settings)


def test_the_process_side_copies_each_weight_by_name_and_holds_its_version(monkeypatch):
    side = _side(monkeypatch, [])
    assert side.version is None and side.params == dict(side.policy.named_parameters())
    w = torch.arange(4.0).reshape(2, 2)
    side.load(3, {"weight": w})
    assert side.version == 3 and torch.equal(side.policy.weight, w) and side.policy.weight.requires_grad
    assert side.policy.weight.data_ptr() != w.data_ptr()  # copied into its own parameter
    b = side.policy.bias.detach().clone()
    side.load(4, {})
    assert side.version == 4 and torch.equal(side.policy.bias, b)


def test_the_process_side_samples_then_takes_the_behaviour_log_probs_of_its_policy(monkeypatch):
    asked = []
    side = _side(monkeypatch, asked)
    side.load(2, {})
    got = side.sample(5, 2)
    s = side.settings.collect
    assert asked == [("sample", side.sampler, s),
                     ("logprobs", "its runtime", side.policy, got.batch, "its engine", 0.7)]
    assert (got.step, got.version, got.sampler) == (5, 2, {"pos": 2})
    assert got.batch.sampling_logps == "behaviour" and got.batch.versions == [2, 2, 2]
    with pytest.raises(RuntimeError, match=r"^step 6 wants the weights of version 3, the generator holds 2: "):
        side.sample(6, 3)


def test_build_process_side_loads_its_own_tokenizer_policy_and_sampler_on_the_ranks_runtime(monkeypatch):
    asked, made = [], []
    model = torch.nn.Linear(2, 2).eval()

    class Runtime:
        def __init__(self, device, rank, world_size):
            asked.append(("runtime", device, rank, world_size))
            made.append(self)

        def setup(self, m, optimizer, scheduler):
            asked.append(("setup", m, optimizer, scheduler))
            return m

    monkeypatch.setattr(generators.torch, "set_num_threads", lambda n: asked.append(("threads", n)))
    monkeypatch.setattr(generators, "load_tokenizer", lambda name: asked.append(("tokenizer", name)) or "x" * 11)
    monkeypatch.setattr(generators, "load_model", lambda mcfg, vocab, seed: asked.append(("model", mcfg, vocab, seed))
                        or model)
    monkeypatch.setattr(generators, "LocalRuntime", Runtime)
    monkeypatch.setattr(generators, "build_sampler", lambda *a, **kw: asked.append(("sampler", a[0], a[2:], kw))
                        or runtimes.append(a[1])
                        or "its sampler")
    settings = SimpleNamespace(seed=5, sampler="sampler settings", collect=None)
    mcfg = SimpleNamespace(name_or_path="tiny")
    spec = generators.ProcessSpec(settings, mcfg, "tools", ["row"], {"pos": 1}, threads=3, rank=1, world_size=2,
                                  device="cuda:1")
    runtimes = []
    side = generators.build_process_side(spec)
    assert runtimes == made and len(made) == 1  # the sampler's runtime is this rank's own
    rt = asked[2]
    assert asked == [("threads", 3), ("tokenizer", "tiny"), rt, ("model", mcfg, 11, 5), ("setup", model, None, None),
                     ("sampler", "sampler settings", ("x" * 11, ["row"], "tools"), {"prompts_state": {"pos": 1},
                                                                                    "ahead": True})]
    assert rt == ("runtime", "cuda:1", 1, 2) and side.policy is model and model.training
    assert side.sampler == "its sampler" and side.settings is settings


def test_a_process_spec_defaults_to_one_thread_on_rank_zero_of_one_on_the_cpu():
    spec = generators.ProcessSpec("s", "m", None, [], {})
    assert (spec.threads, spec.rank, spec.world_size, spec.device) == (1, 0, 1, "cpu")


def test_process_generator_hands_the_ranks_spec_to_a_generator_process(monkeypatch):
    made = []
    monkeypatch.setattr(generators, "GeneratorProcess", lambda build, spec, name: made.append((build, spec, name)))
    monkeypatch.setattr(generators.torch, "get_num_threads", lambda: 6)
    run = SimpleNamespace(runtime=SimpleNamespace(rank=3, world_size=4, device=torch.device("cuda", 3)),
                          settings="settings", toolset="tools", splits=SimpleNamespace(train=["r"]),
                          sampler=SimpleNamespace(prompts=SimpleNamespace(state_dict=lambda: {"pos": 9})))
    generators.process_generator(run, "model section")
    (build, spec, name), = made
    assert build is generators.build_process_side and name == "grpo-generator-3"
    assert spec == generators.ProcessSpec("settings", "model section", "tools", ["r"], {"pos": 9}, 6, 3, 4, "cuda:3")


def test_the_server_generator_builds_its_own_sampler_on_the_thread_view_and_checks_the_versions(monkeypatch):
    asked = []
    tokenizer = SimpleNamespace(vocab={"a": 1})
    prompts = SimpleNamespace(state_dict=lambda: {"pos": len(asked)})
    mine = SimpleNamespace(versions=set(), prompts=prompts, close="its close",
                           backend=SimpleNamespace(ready=lambda: "connected servers"))

    def build_sampler(settings, view, tok, train, toolset, prompts_state, ahead):
        asked.append(("sampler", settings, view, tok, train, toolset, prompts_state, ahead))
        return mine

    def sample(smp, s):
        assert smp is mine and not smp.versions, "the versions of an earlier batch are cleared"
        asked.append(("sample", s))
        smp.versions.update(answers.pop(0))
        return SimpleNamespace(completion_ids=[[1], [2]], stats={"reward_mean": 1.0})

    monkeypatch.setattr(generators, "build_sampler", build_sampler)
    monkeypatch.setattr(generators.experience, "sample", sample)
    monkeypatch.setattr(generators, "ServerGenerator", lambda backend, model, fn, full_weights, closers:
                        SimpleNamespace(backend=backend, model=model, sample=fn, full_weights=full_weights,
                                        closers=closers))
    rt = SimpleNamespace(thread_view=lambda: "thread view", model="the model", full_weights="gather")
    run = SimpleNamespace(runtime=rt, settings=SimpleNamespace(collect="collect", sampler="sampler settings"),
                          tokenizer=tokenizer, splits=SimpleNamespace(train=["r"]), toolset="tools",
                          sampler=SimpleNamespace(prompts=SimpleNamespace(state_dict=lambda: {"pos": -1})))
    gen = generators.server_generator(run)
    (_, settings, view, tok, train, toolset, state, ahead), = asked
    assert (settings, view, train, toolset, state, ahead) == ("sampler settings", "thread view", ["r"], "tools",
                                                              {"pos": -1}, True)
    assert tok is not tokenizer and tok.vocab == tokenizer.vocab and tok.vocab is not tokenizer.vocab
    assert (gen.backend, gen.model, gen.full_weights, gen.closers) == ("connected servers", "the model", "gather",
                                                                       ["its close"])
    answers = [{4}, {3, 4}, set()]
    got = gen.sample(6, 4)
    assert asked[1:] == [("sample", "collect")]
    assert (got.step, got.version, got.sampler) == (6, 4, {"pos": 2})
    assert got.batch.versions == [4, 4] and got.batch.stats == {"reward_mean": 1.0, "server/version_lag": 1.0}
    with pytest.raises(RuntimeError, match=r"^the batch of step 7 was sampled with weight versions \[3, 4\], not 4: "):
        gen.sample(7, 4)
    with pytest.raises(RuntimeError, match=r"with weight versions \[\], not 5"):
        gen.sample(8, 5)
