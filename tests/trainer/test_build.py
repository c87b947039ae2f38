"""grpo/trainer/build.py: the learning-rate schedule, the seed, the runtime, the checks before any model loads
(`preflight`), the parts of a run wired from the config (`_build`, over stand-ins) and who owns the output directory."""
import pytest

from grpo.config.schema import TrainerConfig
from grpo.trainer.build import lr_lambda
from tests.under_mutmut import bounded_under_mutmut  # noqa: F401


@pytest.mark.parametrize("schedule,mid,end", [("constant", 1.0, 1.0), ("linear", 0.5, 0.0), ("cosine", 0.5, 0.0)])
def test_warmup_then_the_schedule(schedule, mid, end):
    f = lr_lambda(TrainerConfig(max_steps=12, warmup_steps=2, lr_schedule=schedule))
    assert f(0) == pytest.approx(0.5) and f(1) == pytest.approx(1.0)
    assert f(7) == pytest.approx(mid) and f(12) == pytest.approx(end, abs=1e-9)


# The rest of build.py over stand-ins (no model, no data, no runtime of its own): `make mutate` runs these.
import contextlib  # noqa: E402
import random  # noqa: E402
from dataclasses import replace  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401 - what AdamW's constructor imports (seconds): at collection, not in each mutant

from grpo.config.schema import Config  # noqa: E402
from grpo.errors import SetupError  # noqa: E402
from grpo.rollout import registry  # noqa: E402
from grpo.rollout.episodes.spec import Toolset  # noqa: E402
from grpo.trainer import build  # noqa: E402


def test_the_schedule_at_its_edges():
    linear = lr_lambda(TrainerConfig(max_steps=10, warmup_steps=0, lr_schedule="linear"))
    assert linear(0) == 1.0 and linear(5) == pytest.approx(0.5) and linear(10) == 0.0 and linear(20) == 0.0
    assert linear(2) == pytest.approx(0.8)  # a straight line (the cosine is 0.905 there)
    cosine = lr_lambda(TrainerConfig(max_steps=4, warmup_steps=4, lr_schedule="cosine"))
    assert [cosine(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert cosine(4) == pytest.approx(1.0) and cosine(5) == pytest.approx(0.0, abs=1e-12)  # a span of at least 1
    cosine = lr_lambda(TrainerConfig(max_steps=8, warmup_steps=0, lr_schedule="cosine"))
    assert cosine(2) == pytest.approx(0.5 * (1 + 2 ** -0.5))


def test_set_seed_seeds_every_generator_and_numpys_modulo_2_32():
    def draws():
        return random.random(), np.random.rand(), torch.rand(1).item()

    seed = 2**33 - 1  # numpy takes 32 bits: seeded with 2**32 - 1
    build.set_seed(seed)
    first = draws()
    random.seed(seed)
    np.random.seed(2**32 - 1)
    torch.manual_seed(seed)
    assert draws() == first
    build.set_seed(seed)
    assert draws() == first
    build.set_seed(3)
    second = draws()
    assert all(a != b for a, b in zip(first, second))


def test_make_runtime_is_local_on_the_trainers_device_or_deepspeed_with_the_runs_shape(monkeypatch):
    import sys
    import types

    from grpo.runtime.base import RunShape
    from grpo.runtime.local import LocalRuntime

    cfg = Config()
    cfg = replace(cfg, trainer=replace(cfg.trainer, device="cpu"))
    runtime = build.make_runtime(cfg)
    assert isinstance(runtime, LocalRuntime) and runtime.device == torch.device("cpu")
    made = []
    fake = types.ModuleType("grpo.runtime.deepspeed")
    fake.DeepSpeedRuntime = lambda *a: made.append(a) or "DS"
    monkeypatch.setitem(sys.modules, "grpo.runtime.deepspeed", fake)
    cfg = replace(cfg, distributed=replace(cfg.distributed, backend="deepspeed"),
                  rollout=replace(cfg.rollout, prompts_per_step=3), algorithm=replace(cfg.algorithm, group_size=5),
                  trainer=replace(cfg.trainer, max_grad_norm=0.5, device="cpu"), model=replace(cfg.model, dtype="x"))
    assert build.make_runtime(cfg) == "DS"
    assert made == [(cfg.distributed, RunShape(3, 5, 0.5, "x"), "cpu")]


def _checks(monkeypatch, toolset=None):
    """Stand-ins for every check preflight calls, in the order it calls them."""
    calls = []
    monkeypatch.setattr(build, "check_name", lambda name: calls.append(("name", name)))
    monkeypatch.setattr(registry, "check", lambda r, m, device: calls.append(("backend", device)) or calls.append(
        ("backend's", r, m)))
    monkeypatch.setattr(build, "resolve_resume", lambda resume, out: calls.append(("resume", resume, out)))
    monkeypatch.setattr(build, "build_rewards", lambda fns: calls.append(("rewards", fns)) or ["R"])
    monkeypatch.setattr(build, "build_toolset", lambda tools, env: calls.append(("tools", tools, env)) or toolset)
    monkeypatch.setattr(build.data, "check_source", lambda d: calls.append(("data", d)))
    monkeypatch.setattr(build, "check_sets", lambda sets, d, rw: calls.append(("sets", sets, d, rw)))
    monkeypatch.setattr(build, "get_policy_loss", lambda name: calls.append(("loss", name)))
    monkeypatch.setattr(build, "check_async", lambda cfg: calls.append(("async", cfg)))
    return calls


def _cfg(out, **trainer):
    cfg = Config()
    return replace(cfg, trainer=replace(cfg.trainer, output_dir=str(out), **trainer),
                   model=replace(cfg.model, name_or_path="tiny:llama"),
                   reward=replace(cfg.reward, functions={"r": {"fn": "m:f"}}))


def test_preflight_runs_every_check_in_order_and_returns_the_rewards_and_toolset(monkeypatch, tmp_path):
    tools = Toolset(protocol="tools", env_name="r", env_reward=False)
    calls = _checks(monkeypatch, toolset=tools)
    cfg = _cfg(tmp_path / "o", resume="runs/x/checkpoints/step_1", device="cpu")
    cfg = replace(cfg, rollout=replace(cfg.rollout, tools=["m:add"], environment="m:Env"))
    assert build.preflight(cfg) == (["R"], tools)
    assert calls == [("name", "tiny:llama"), ("backend", "cpu"), ("backend's", cfg.rollout, cfg.model),
                     ("resume", "runs/x/checkpoints/step_1", str(tmp_path / "o")), ("rewards", {"r": {"fn": "m:f"}}),
                     ("tools", ["m:add"], "m:Env"), ("data", cfg.data), ("sets", cfg.evaluation.sets, cfg.data, ["R"]),
                     ("loss", cfg.algorithm.policy_loss), ("async", cfg)]
    for resume in (None, "", "auto"):
        calls.clear()
        build.preflight(replace(cfg, trainer=replace(cfg.trainer, resume=resume)))
        assert not any(c[0] == "resume" for c in calls if isinstance(c, tuple))


def test_preflight_resolves_auto_to_the_device_there_is(monkeypatch, tmp_path):
    calls = _checks(monkeypatch)
    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        build.preflight(_cfg(tmp_path, device="auto"))
    assert [c for c in calls if c[0] == "backend"] == [("backend", "cuda"), ("backend", "cpu")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    build.preflight(_cfg(tmp_path, device="cuda"))
    assert [c for c in calls if c[0] == "backend"][-1] == ("backend", "cuda")


def test_preflight_refuses_each_mistake_before_any_model(monkeypatch, tmp_path):
    calls = _checks(monkeypatch)
    with pytest.raises(SetupError, match=r"^trainer.output_dir is not set$"):
        build.preflight(_cfg(""))
    (tmp_path / "f").write_text("")
    with pytest.raises(SetupError, match=r"is an existing file; give a directory$"):
        build.preflight(_cfg(tmp_path / "f"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SetupError, match=r"^trainer.device=cuda but this machine has no usable CUDA device"):
        build.preflight(_cfg(tmp_path, device="cuda"))
    flex = _cfg(tmp_path, device="cpu")
    flex = replace(flex, engine=replace(flex.engine, attention_kernel="flex"))
    with pytest.raises(SetupError, match=r"^engine.attention_kernel=flex needs a CUDA device \(this run is on cpu"):
        build.preflight(flex)
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    build.preflight(replace(flex, trainer=replace(flex.trainer, device="auto")))  # flex on CUDA
    assert calls[1] == ("backend", "cuda")

    def missing(resume, out):
        raise FileNotFoundError("no such checkpoint directory x")

    monkeypatch.setattr(build, "resolve_resume", missing)
    with pytest.raises(SetupError, match=r"^no such checkpoint directory x$") as e:
        build.preflight(_cfg(tmp_path, device="cpu", resume="x"))
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_preflight_refuses_a_reward_named_as_the_environment_that_rewards(monkeypatch, tmp_path):
    env = Toolset(protocol="text", environment="m:Game", env_name="Game", env_reward=True)
    calls = _checks(monkeypatch, toolset=env)
    cfg = _cfg(tmp_path, device="cpu")
    named = replace(cfg, reward=replace(cfg.reward, functions={"Game": {"fn": "m:f"}}))
    with pytest.raises(SetupError, match=r"^reward.functions.Game: the environment's reward\(\) is logged under"):
        build.preflight(named)
    assert not any(c[0] == "data" for c in calls)
    assert build.preflight(cfg) == (["R"], env)  # another name
    _checks(monkeypatch, toolset=replace(env, env_reward=False))
    build.preflight(named)  # an environment without reward(): nothing logged under its name


def test_build_run_preflights_then_builds_under_the_runtimes_failure_guard(monkeypatch):
    seen = []

    class Runtime:
        @contextlib.contextmanager
        def peer_failures_as_errors(self):
            seen.append("guard")
            yield
            seen.append("unguarded")

    runtime = Runtime()
    monkeypatch.setattr(build, "preflight", lambda cfg: seen.append(("preflight", cfg)) or (["R"], "T"))
    monkeypatch.setattr(build, "make_runtime", lambda cfg: seen.append(("runtime", cfg)) or runtime)
    monkeypatch.setattr(build, "_build", lambda cfg, rt, rw, ts: seen.append(("build", cfg, rt, rw, ts)) or "RUN")
    assert build.build_run("CFG") == "RUN"
    assert seen == [("preflight", "CFG"), ("runtime", "CFG"), "guard", ("build", "CFG", runtime, ["R"], "T"),
                    "unguarded"]


class _Runtime:
    def __init__(self, rank=0, world_size=1, local_rank=0, gathered=None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.is_main = rank == 0
        self.gathered, self.node_local, self.calls = gathered, None, []
        self.device = "cpu"

    def gather(self, value):
        self.calls.append(("gather", value))
        return [value if self.gathered is None else self.gathered, "other"]

    def node_local_checkpoints(self, local):
        self.node_local = local

    # what _build reads
    def prepare_reference(self, model):
        self.calls.append(("reference", model))
        return ("placed", model)

    def setup(self, model, optimizer, scheduler):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def all_max(self, values):
        self.calls.append(("all_max", values))
        return {k: v * 2 for k, v in values.items()}

    def generation_context(self):
        return contextlib.nullcontext()


def test_one_process_owns_its_output_dir_without_a_marker(tmp_path):
    runtime = _Runtime()
    assert build.owns_output_dir(runtime, str(tmp_path / "o")) is True
    assert runtime.calls == [] and runtime.node_local is None and not (tmp_path / "o").exists()


def test_rank_0_writes_the_marker_and_the_ranks_that_see_it_share_its_output_dir(tmp_path):
    main = _Runtime(rank=0, world_size=2)
    assert build.owns_output_dir(main, str(tmp_path / "o" / "p")) is True
    token = (tmp_path / "o" / "p" / ".grpo-rank0").read_text()
    assert len(token) == 32 and main.calls == [("gather", token)] and main.node_local is False
    other = _Runtime(rank=1, world_size=2, local_rank=0, gathered=token)
    assert build.owns_output_dir(other, str(tmp_path / "o" / "p")) is False
    assert other.calls == [("gather", None)] and other.node_local is False
    assert build.owns_output_dir(_Runtime(rank=0, world_size=2), str(tmp_path / "o" / "p"))
    assert (tmp_path / "o" / "p" / ".grpo-rank0").read_text() != token  # a fresh token each run


def test_a_node_whose_output_dir_is_not_rank_0s_keeps_checkpoints_of_its_own_on_its_first_rank(tmp_path):
    first = _Runtime(rank=2, world_size=4, local_rank=0, gathered="abc")
    assert build.owns_output_dir(first, str(tmp_path / "n" / "o")) is True
    assert first.node_local is True and (tmp_path / "n" / "o").is_dir()
    assert not (tmp_path / "n" / "o" / ".grpo-rank0").exists()
    second = _Runtime(rank=3, world_size=4, local_rank=1, gathered="abc")
    assert build.owns_output_dir(second, str(tmp_path / "n" / "o")) is False and second.node_local is True
    (tmp_path / "n" / "o" / ".grpo-rank0").write_text("stale")  # another run's marker
    assert build.owns_output_dir(_Runtime(rank=2, world_size=4, gathered="abc"), str(tmp_path / "n" / "o"))


class _Tokenizer:
    chat_template = None

    def __len__(self):
        return 11


class _Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
        self.frozen = torch.nn.Linear(2, 2).requires_grad_(False)


def _build_stand_ins(monkeypatch, splits, toolset_note=None):
    from grpo.trainer import budget

    seen = {"printed": []}
    tokenizer, policy = _Tokenizer(), _Policy().eval()
    monkeypatch.setattr(build, "owns_output_dir", lambda rt, out: seen.setdefault("owner", (rt, out)) and "OWNER")
    monkeypatch.setattr(build, "set_seed", lambda s: seen.setdefault("seed", s))
    monkeypatch.setattr(build, "load_tokenizer", lambda name: seen.setdefault("tokenizer", name) and tokenizer)
    monkeypatch.setattr(build, "load_image_processor", lambda name, tok: seen.setdefault("images", (name, tok))
                        and "IMAGES")
    monkeypatch.setattr(build, "choose_format", lambda ts, req, tok, chat: seen.setdefault(
        "format", (ts, req, tok, chat)) and (replace(ts, tool_format="hermes"), toolset_note))
    monkeypatch.setattr(build.data, "build", lambda d, tok, **kw: seen.setdefault("data", (d, tok, kw)) and splits)
    monkeypatch.setattr(build, "load_model", lambda m, vocab, seed: seen.setdefault("model", (m, vocab, seed))
                        and policy)
    monkeypatch.setattr(build, "load_reference", lambda m, p, vocab, seed: seen.setdefault(
        "reference", (m, p, vocab, seed)) and "REF")
    monkeypatch.setattr(build, "check_head", lambda model, agree: seen.setdefault("head", (model, agree(0.5))))
    monkeypatch.setattr(budget, "plan", lambda cfg, sp, rt: seen.setdefault("plan", (cfg, sp, rt)) and "PLAN")
    monkeypatch.setattr(registry, "resolve", lambda name, device: seen.setdefault("resolve", (name, device)) and "hf")
    monkeypatch.setattr(registry, "check_images", lambda name, backend, rows, **kw: seen.setdefault(
        "images_check", (name, backend, rows, kw)))
    monkeypatch.setattr(build, "uses_chat", lambda d, tok: seen.setdefault("chat", (d, tok)) and "CHAT")
    settings = SimpleNamespace(sampler="SAMPLER_SETTINGS", evaluation=SimpleNamespace(batch_size=6))
    monkeypatch.setattr(build, "derive", lambda cfg, plan, **kw: seen.setdefault("derive", (cfg, plan, kw))
                        and settings)
    monkeypatch.setattr(build, "interactive", lambda: True)
    monkeypatch.setattr(build, "build_sampler", lambda st, rt, tok, rows, ts, **kw: seen.setdefault(
        "sampler", (st, rt, tok, rows, ts, kw)) and "SAMPLER")

    class HF:
        def __init__(self, model, tok, **kw):
            seen["greedy"] = (model, tok, kw)

    monkeypatch.setattr(build, "HFBackend", HF)
    return seen, tokenizer, policy, settings


def _splits(train=(), eval_=(), dropped=0, note=None):
    return SimpleNamespace(train=list(train), eval=list(eval_), dropped=dropped, note=note)


def _build_cfg(beta=0.0, **kw):
    cfg = Config()
    return replace(cfg, trainer=replace(cfg.trainer, seed=10, lr=0.01, adam_betas=[0.8, 0.9], weight_decay=0.1,
                                        max_steps=4, warmup_steps=2, output_dir="OUT"),
                   model=replace(cfg.model, name_or_path="tiny:llama"),
                   algorithm=replace(cfg.algorithm, beta=beta), **kw)


def test_build_loads_and_wires_every_part_of_a_single_turn_run(monkeypatch, capsys):
    rows = [{"prompt_ids": [1, 2, 3]}]
    splits = _splits(train=rows, eval_=[{"prompt_ids": [1] * 5}])
    seen, tokenizer, policy, settings = _build_stand_ins(monkeypatch, splits)
    cfg = _build_cfg()
    runtime = _Runtime(rank=1, world_size=1)
    runtime.is_main = True
    run = build._build(cfg, runtime, ["R"], None)
    assert seen["owner"] == (runtime, "OUT") and seen["seed"] == 11 and seen["tokenizer"] == "tiny:llama"
    assert seen["images"] == ("tiny:llama", tokenizer) and "format" not in seen
    assert seen["data"] == (cfg.data, tokenizer, {"tools": None, "keep_turns": False, "system_text": None,
                                                  "sets": cfg.evaluation.sets, "image_processor": "IMAGES"})
    assert seen["model"] == (cfg.model, 11, 10) and "reference" not in seen and run.reference is None
    assert policy.training and runtime.model is policy
    opt = runtime.optimizer
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["params"] == list(policy.a.parameters())
    group = opt.param_groups[0]
    assert (group["betas"], group["weight_decay"]) == ((0.8, 0.9), 0.1)
    assert group["lr"] == pytest.approx(0.005) and runtime.scheduler.lr_lambdas[0](1) == 1.0  # warmup, step 0: 1/2
    assert seen["head"] == (policy, 1.0) and ("all_max", {"head_gap": 0.5}) in runtime.calls
    assert seen["plan"] == (cfg, splits, runtime) and seen["resolve"] == (cfg.rollout.backend, "cpu")
    assert seen["images_check"] == (cfg.rollout.backend, "hf", rows, {
        "zero3": False, "rollout": cfg.rollout, "frozen_tower": cfg.model.freeze_vision_tower})
    assert seen["chat"] == (cfg.data, tokenizer)
    assert seen["derive"] == (cfg, "PLAN", {"chat": "CHAT", "backend": "hf", "longest_prompt": 5})
    assert seen["sampler"] == ("SAMPLER_SETTINGS", runtime, tokenizer, rows, None, {"rewards": ["R"],
                                                                                    "progress": True})
    model_of, tok, kw = seen["greedy"]
    assert model_of() is policy and tok is tokenizer
    assert kw == {"batch_size": 6, "progress": True, "context": runtime.generation_context, "desc": "eval",
                  "keep_turns": False}
    assert (run.runtime, run.tokenizer, run.policy, run.splits, run.sampler, run.settings) == (
        runtime, tokenizer, policy, splits, "SAMPLER", settings)
    assert run.owns_output_dir == "OWNER" and run.toolset is None and run.image_processor == "IMAGES"
    assert isinstance(run.eval_backend, build.HFBackend) and capsys.readouterr().err == ""


def test_build_with_beta_places_a_reference_and_zero3_and_the_longest_prompt_default(monkeypatch):
    splits = _splits()
    seen, tokenizer, policy, _ = _build_stand_ins(monkeypatch, splits)
    cfg = _build_cfg(beta=0.1)
    cfg = replace(cfg, distributed=replace(cfg.distributed, backend="deepspeed", zero_stage=3))
    runtime = _Runtime(rank=0)
    monkeypatch.setattr(build, "interactive", lambda: False)
    run = build._build(cfg, runtime, [], None)
    assert seen["reference"] == (cfg.model, policy, 11, 10) and ("reference", "REF") in runtime.calls
    assert run.reference == ("placed", "REF") and seen["images_check"][3]["zero3"] is True
    assert seen["derive"][2]["longest_prompt"] == cfg.data.max_prompt_tokens
    assert seen["sampler"][5]["progress"] is False and seen["greedy"][2]["progress"] is False
    for backend, stage in (("deepspeed", 2), ("none", 3)):
        seen = _build_stand_ins(monkeypatch, splits)[0]
        build._build(replace(cfg, distributed=replace(cfg.distributed, backend=backend, zero_stage=stage)),
                     _Runtime(), [], None)
        assert seen["images_check"][3]["zero3"] is False


def test_build_on_another_rank_prints_nothing_and_is_not_interactive(monkeypatch, capsys):
    splits = _splits(train=[{"prompt_ids": [1]}], dropped=3, note="a note")
    seen, *_ = _build_stand_ins(monkeypatch, splits, toolset_note="chose hermes")
    runtime = _Runtime(rank=1, world_size=2)
    build._build(_build_cfg(), runtime, [], Toolset(protocol="tools"))
    assert capsys.readouterr().err == "" and seen["sampler"][5]["progress"] is False and seen["seed"] == 11


def test_build_says_what_it_dropped_and_noted_on_rank_0(monkeypatch, capsys):
    splits = _splits(train=[{"prompt_ids": [1]}] * 2, eval_=[{"prompt_ids": [2]}], dropped=3, note="a note")
    _build_stand_ins(monkeypatch, splits)
    cfg = _build_cfg()
    build._build(cfg, _Runtime(), [], None)
    assert capsys.readouterr().err == (
        f"[grpo] dropped 3 prompts longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens}; 2 train / 1 "
        "held-out remain\n[grpo] a note\n")


def test_build_refuses_fewer_held_out_prompts_than_processes(monkeypatch):
    _build_stand_ins(monkeypatch, _splits(train=[{"prompt_ids": [1]}], eval_=[{"prompt_ids": [1]}]))
    with pytest.raises(SetupError, match=r"^the held-out split has 1 prompts, fewer than the number of processes \(2"):
        build._build(_build_cfg(), _Runtime(world_size=2), [], None)
    for n, world in ((2, 2), (0, 2), (1, 1)):
        seen = _build_stand_ins(monkeypatch, _splits(train=[{"prompt_ids": [1]}], eval_=[{"prompt_ids": [1]}] * n))[0]
        build._build(_build_cfg(), _Runtime(world_size=world, gathered="x"), [], None)
        assert "greedy" in seen


def test_build_of_a_tool_run_chooses_the_format_and_renders_the_tools_and_system_text(monkeypatch, capsys):
    from grpo.rollout.episodes import formats

    splits = _splits(train=[{"prompt_ids": [1, 2]}])
    seen, tokenizer, *_ = _build_stand_ins(monkeypatch, splits, toolset_note="tool_format=auto: hermes")
    cfg = _build_cfg()
    cfg = replace(cfg, rollout=replace(cfg.rollout, tool_format="auto"), data=replace(cfg.data, chat_template=True))
    toolset = Toolset(protocol="tools", schemas=({"name": "calc"},))

    class Format:
        def template_tools(self, schemas):
            return ("tools of", schemas)

        def system_text(self, schemas):
            return ("system of", schemas)

    monkeypatch.setattr(formats, "of", lambda ts: seen.setdefault("of", ts) and Format())
    run = build._build(cfg, _Runtime(), [], toolset)
    chosen = replace(toolset, tool_format="hermes")
    assert seen["format"] == (toolset, "auto", tokenizer, True) and seen["of"] == chosen and run.toolset == chosen
    kw = seen["data"][2]
    assert kw["tools"] == ("tools of", [{"name": "calc"}]) and kw["system_text"] == ("system of", [{"name": "calc"}])
    assert kw["keep_turns"] is True and seen["sampler"][4] == chosen and seen["greedy"][2]["keep_turns"] is True
    assert capsys.readouterr().err == "[grpo] tool_format=auto: hermes\n"
    seen = _build_stand_ins(monkeypatch, splits)[0]  # the text protocol: no format, no note
    monkeypatch.setattr(formats, "of", lambda ts: pytest.fail("a text protocol has no tool format"))
    build._build(cfg, _Runtime(), [], Toolset(protocol="text"))
    assert seen["data"][2]["tools"] is None and seen["data"][2]["system_text"] is None
    assert seen["data"][2]["keep_turns"] is True and capsys.readouterr().err == ""
