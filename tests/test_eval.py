"""grpo/eval.py (``grpo-eval``) over stand-ins: its options, the config it refuses, what each ``--model`` names, the
policy it loads, the backend and the run it hands to the evaluation, the table and the files it writes.
tests/e2e/test_evaluation.py runs the documented commands end to end."""
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from grpo import eval as grpo_eval
from grpo.config.schema import Config
from grpo.errors import ConfigError, SetupError
from tests.under_mutmut import bounded_under_mutmut  # noqa: F401


def test_parse_takes_each_model_the_out_dir_and_leaves_the_overrides():
    args, rest = grpo_eval.parse(["recipe=a", "--model", "m1", "x=1", "--model=m2", "--out", "o"])
    assert args.model == ["m1", "m2"] and args.out == "o" and rest == ["recipe=a", "x=1"]
    args, rest = grpo_eval.parse([])
    assert args.model == [] and args.out == "eval-results" and rest == []
    with pytest.raises(SetupError, match=r"^grpo-eval: unknown option --modle; usage: grpo-eval \[recipe=NAME\]"):
        grpo_eval.parse(["a=1", "--modle", "x", "-q"])


def test_help_says_what_grpo_eval_does_and_each_option(capsys):
    with pytest.raises(SystemExit) as e:
        grpo_eval.parse(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and out.startswith(f"usage: {grpo_eval.USAGE} ")
    assert " ".join(grpo_eval.__doc__.split("\n\n")[0].split()) in out and "no training. options:" in out
    assert "--model MODEL a model to evaluate (repeat to compare)" in out
    assert "--out OUT where eval.json and eval.md go (default: eval-results)" in out


def test_a_malformed_option_is_argparses_line_under_grpo_evals_name(capsys):
    with pytest.raises(SystemExit) as e:
        grpo_eval.parse(["--model"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"usage: {grpo_eval.USAGE}\n")
    assert err.endswith("\ngrpo-eval: error: argument --model: expected one argument\n")


def _config_stand_ins(monkeypatch, raw):
    from grpo import cli
    from grpo.config import compose, schema

    seen = {}
    monkeypatch.setattr(cli, "check_argv", lambda ov: seen.setdefault("checked", list(ov)))
    monkeypatch.setattr(compose, "normalize", lambda ov: [*ov, "normalized"])
    monkeypatch.setattr(compose, "compose", lambda ov: seen.setdefault("composed", ov) and OmegaConf.create(raw))
    monkeypatch.setattr(schema, "load", lambda r: seen.setdefault("loaded", r) and Config(
        rollout=replace(Config().rollout, **r.get("rollout", {}))))
    return seen


def test_load_config_composes_as_grpo_train_does_without_hydras_keys(monkeypatch):
    raw = {"hydra": {"x": 1}, "trainer": {"output_dir": None}, "lr": "${trainer.output_dir}"}
    seen = _config_stand_ins(monkeypatch, raw)
    assert isinstance(grpo_eval.load_config(["a=1"]), Config)
    assert seen == {"checked": ["a=1"], "composed": ["a=1", "normalized"],
                    "loaded": {"trainer": {"output_dir": "outputs"}, "lr": "outputs"}}
    raw["trainer"]["output_dir"] = "mine"
    seen = _config_stand_ins(monkeypatch, raw)
    grpo_eval.load_config([])
    assert seen["loaded"]["trainer"]["output_dir"] == "mine"
    seen = _config_stand_ins(monkeypatch, {"trainer": {}})
    grpo_eval.load_config([])
    assert seen["loaded"]["trainer"]["output_dir"] == "outputs"


@pytest.mark.parametrize("rollout, refused", [
    ({"tools": ["m:f"]}, "grpo-eval does not run multi-turn episodes"),
    ({"environment": "m:E"}, "grpo-eval does not run multi-turn episodes"),
    ({"backend": "server"}, "grpo-eval runs the model in this process, not rollout.backend=server"),
    ({"backend": "hf"}, None), ({"backend": "auto"}, None), ({"backend": "vllm"}, None),
])
def test_load_config_refuses_episodes_and_a_remote_backend(monkeypatch, rollout, refused):
    from grpo.rollout import registry

    _config_stand_ins(monkeypatch, {"trainer": {}, "rollout": rollout})
    asked = []
    real = registry.capabilities
    monkeypatch.setattr(registry, "capabilities", lambda name: asked.append(name) or real(name))
    if refused is None:
        assert grpo_eval.load_config([]).rollout.backend == rollout["backend"]
        assert asked == ([] if rollout["backend"] == "auto" else [rollout["backend"]])
    else:
        with pytest.raises(SetupError, match=f"^{refused}"):
            grpo_eval.load_config([])


def test_resolve_model_reads_a_run_a_checkpoint_a_model_directory_or_a_name(monkeypatch, tmp_path):
    from grpo.trainer import checkpoint

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run" / "final").mkdir(parents=True)
    assert grpo_eval.resolve_model("~/run") == (str(tmp_path / "run" / "final"), None)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "trainable.safetensors").write_text("")
    assert grpo_eval.resolve_model(str(tmp_path / "ckpt")) == ("", tmp_path / "ckpt")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert grpo_eval.resolve_model(str(tmp_path / "hf")) == (str(tmp_path / "hf"), None)
    assert grpo_eval.resolve_model("tiny:llama") == ("tiny:llama", None)
    (tmp_path / "ds" / "deepspeed").mkdir(parents=True)
    with pytest.raises(SetupError, match=r"ds: a DeepSpeed checkpoint; evaluate the run's final/ instead$"):
        grpo_eval.resolve_model(str(tmp_path / "ds"))
    (tmp_path / "nothing").mkdir()
    asked = []
    monkeypatch.setattr(checkpoint, "latest", lambda p: asked.append(p))
    with pytest.raises(SetupError, match=r"nothing: neither a run \(final/, checkpoints/\), a checkpoint"):
        grpo_eval.resolve_model(str(tmp_path / "nothing"))
    monkeypatch.setattr(checkpoint, "latest", lambda p: asked.append(p) or p / "checkpoints" / "step_4")
    assert grpo_eval.resolve_model(str(tmp_path / "nothing")) == ("", tmp_path / "nothing" / "checkpoints" / "step_4")
    assert asked == [tmp_path / "nothing"] * 2


class _Model(torch.nn.Module):
    def __init__(self, frozen=False):
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
        self.b = torch.nn.Linear(2, 1)
        self.b.requires_grad_(not frozen)


def _policy_stand_ins(monkeypatch, model):
    from grpo import models

    seen = {}
    monkeypatch.setattr(models, "load_tokenizer", lambda name: seen.setdefault("tokenizer", name) and "abc")
    monkeypatch.setattr(models, "load_model", lambda mcfg, vocab, seed: seen.setdefault("model", (mcfg, vocab, seed))
                        and model)
    return seen


def test_load_policy_of_a_model_name_loads_it_without_the_configs_adapter_in_eval_mode(monkeypatch):
    cfg = Config()
    cfg = replace(cfg, model=replace(cfg.model, name_or_path="tiny:qwen2", gradient_checkpointing=True,
                                     lora=replace(cfg.model.lora, r=8)), trainer=replace(cfg.trainer, seed=7))
    model = _Model().train()
    seen = _policy_stand_ins(monkeypatch, model)
    tokenizer, out = grpo_eval.load_policy(cfg, "tiny:llama", "cpu")
    mcfg, vocab, seed = seen["model"]
    assert tokenizer == "abc" and seen["tokenizer"] == "tiny:llama" and (vocab, seed) == (3, 7)
    assert mcfg == replace(cfg.model, name_or_path="tiny:llama", gradient_checkpointing=False,
                           lora=type(cfg.model.lora)())
    assert out is model and not out.training and not any(p.requires_grad for p in out.parameters())


def test_load_policy_of_a_checkpoint_puts_its_weights_into_the_configs_model(monkeypatch, tmp_path):
    from safetensors.torch import save_file

    cfg = Config()
    cfg = replace(cfg, model=replace(cfg.model, name_or_path="tiny:qwen2", lora=replace(cfg.model.lora, r=8)))
    model = _Model(frozen=True)
    trained = _Model()
    save_file({"a.weight": trained.a.weight.detach().clone(), "a.bias": trained.a.bias.detach().clone()},
              str(tmp_path / "trainable.safetensors"))
    seen = _policy_stand_ins(monkeypatch, model)
    _, out = grpo_eval.load_policy(cfg, str(tmp_path), "cpu")
    assert seen["tokenizer"] == "tiny:qwen2" and seen["model"][0] == replace(cfg.model, gradient_checkpointing=False)
    assert torch.equal(out.a.weight, trained.a.weight) and not torch.equal(out.b.weight, trained.b.weight)
    model = _Model()  # b trainable: the checkpoint lacks it
    _policy_stand_ins(monkeypatch, model)
    with pytest.raises(SetupError, match=r"the checkpoint has no b\.weight for the config's model tiny:qwen2 \(give"):
        grpo_eval.load_policy(cfg, str(tmp_path), "cpu")


def test_load_policy_of_a_final_dir_with_an_adapter_loads_the_configs_model_and_the_adapter(monkeypatch, tmp_path):
    import sys
    import types

    peft = types.ModuleType("peft")  # a stand-in: importing peft costs seconds
    peft.PeftModel = type("PeftModel", (), {})
    monkeypatch.setitem(sys.modules, "peft", peft)
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    cfg = Config()
    cfg = replace(cfg, model=replace(cfg.model, name_or_path="tiny:qwen2", lora=replace(cfg.model.lora, r=8)))
    model, wrapped = _Model(), _Model()
    seen = _policy_stand_ins(monkeypatch, model)
    peft.PeftModel.from_pretrained = staticmethod(lambda m, name: seen.setdefault("peft", (m, name)) and wrapped)
    tokenizer, out = grpo_eval.load_policy(cfg, str(tmp_path), "cpu")
    assert seen["tokenizer"] == str(tmp_path) and seen["peft"] == (model, str(tmp_path)) and out is wrapped
    assert seen["model"][0] == replace(cfg.model, gradient_checkpointing=False, lora=type(cfg.model.lora)())


def test_backend_for_makes_rollout_backends_backend_with_the_evaluations_budget(monkeypatch):
    from grpo.rollout import registry
    from grpo.trainer import logger

    seen = {}

    class Backend:
        desc = "train"

    monkeypatch.setattr(registry, "resolve", lambda name, device: seen.setdefault("resolve", (name, device)) and "hf")
    monkeypatch.setattr(registry, "make", lambda name, ctx: seen.update(make=(name, ctx)) or Backend())
    monkeypatch.setattr(logger, "interactive", lambda: True)
    cfg = Config()
    cfg = replace(cfg, rollout=replace(cfg.rollout, backend="auto"), evaluation=replace(cfg.evaluation, seed=5))
    runtime = SimpleNamespace(device=torch.device("cpu"))
    splits = SimpleNamespace(eval=[{"prompt_ids": list(range(40))}],
                             sets={"s": [{"prompt_ids": [1, 2]}, {"prompt_ids": list(range(50))}]})
    backend = grpo_eval.backend_for(cfg, runtime, "tok", splits, SimpleNamespace(max_new_tokens=9, batch_size=3))
    assert backend.desc == "eval" and seen["resolve"] == ("auto", "cpu")
    name, ctx = seen["make"]
    assert name == "hf" and ctx == registry.BackendContext(
        runtime, "tok", replace(cfg.rollout, max_new_tokens=9, batch_size=3), cfg.model.name_or_path, 5,
        longest_prompt=50, check_ids=list(range(32)), progress=True)
    splits = SimpleNamespace(eval=[], sets={"s": [{"prompt_ids": [4, 5]}]})
    grpo_eval.backend_for(cfg, runtime, "tok", splits, SimpleNamespace(max_new_tokens=9, batch_size=3))
    assert seen["make"][1].check_ids == [4, 5] and seen["make"][1].longest_prompt == 2


def _evaluate_stand_ins(monkeypatch, splits, metrics=None):
    from grpo import data
    from grpo.runtime import local
    from grpo.trainer import evaluate, settings

    seen = {"closed": 0}

    class Runtime:
        device = torch.device("cpu")

        def __init__(self, device):
            seen["runtime"] = device

        def setup(self, model, optimizer, scheduler):
            seen["setup"] = (model, optimizer, scheduler)

    class Backend:
        def close(self):
            seen["closed"] += 1

    def fake_evaluate(run, label):
        seen["run"], seen["label"], seen["grad"] = run, label, torch.is_grad_enabled()
        if metrics is None:
            raise RuntimeError("failed")
        return metrics

    monkeypatch.setattr(local, "LocalRuntime", Runtime)
    monkeypatch.setattr(grpo_eval, "load_policy", lambda cfg, spec, device: seen.setdefault(
        "policy", (cfg, spec, device)) and ("tok", "model"))
    monkeypatch.setattr(data, "build", lambda d, tok, sets: seen.setdefault("data", (d, tok, sets)) and splits)
    monkeypatch.setattr(settings, "eval_settings", lambda cfg: seen.setdefault("settings", cfg) and "SETTINGS")
    monkeypatch.setattr(grpo_eval, "backend_for", lambda cfg, rt, tok, sp, st: seen.setdefault(
        "backend", (cfg, rt, tok, sp, st)) and Backend())
    monkeypatch.setattr(evaluate, "evaluate", fake_evaluate)
    return seen


def test_evaluate_model_evaluates_one_model_without_gradients_and_closes_the_backend(monkeypatch):
    cfg = Config()
    cfg = replace(cfg, trainer=replace(cfg.trainer, device="cpu"),
                  reward=replace(cfg.reward, completion_format="answer_tags"))
    splits = SimpleNamespace(eval=[1], sets={})
    seen = _evaluate_stand_ins(monkeypatch, splits, {"pass@1": 0.5, "acc": 1.0})
    assert grpo_eval.evaluate_model(cfg, "m", ["R"]) == {"eval/pass@1": 0.5, "eval/acc": 1.0}
    assert seen["runtime"] == "cpu" and seen["policy"] == (cfg, "m", "cpu") and seen["setup"] == ("model", None, None)
    assert seen["data"] == (cfg.data, "tok", cfg.evaluation.sets) and seen["settings"] is cfg
    assert seen["backend"][0] is cfg and seen["backend"][2:] == ("tok", splits, "SETTINGS")
    run = seen["run"]
    assert seen["label"] == "m" and not seen["grad"] and seen["closed"] == 1
    assert (run.tokenizer, run.splits, run.settings.evaluation, run.runtime) == ("tok", splits, "SETTINGS",
                                                                                  seen["backend"][1])
    assert run.eval_backend is not None and vars(run.sampler) == {
        "tokenizer": "tok", "rewards": ["R"], "completion_format": "answer_tags", "turn_loop": None}
    seen = _evaluate_stand_ins(monkeypatch, SimpleNamespace(eval=[], sets={"s": [1]}))
    with pytest.raises(RuntimeError):
        grpo_eval.evaluate_model(cfg, "m", [])
    assert seen["closed"] == 1
    seen = _evaluate_stand_ins(monkeypatch, SimpleNamespace(eval=[], sets={}))
    with pytest.raises(SetupError, match=r"^nothing to evaluate: data.num_eval=0 and no evaluation.sets$"):
        grpo_eval.evaluate_model(cfg, "m", [])
    assert "backend" not in seen


def test_markdown_is_a_row_a_metric_a_column_a_model_and_their_difference_for_two():
    assert grpo_eval.markdown(["a", "b"], [{"x": 0.5, "y": 1.0}, {"x": 0.75, "z": 2.0}]) == (
        "| metric | `a` | `b` | difference |\n|---|---|---|---|\n| `x` | 0.500 | 0.750 | 0.250 |\n"
        "| `y` | 1.000 | – | – |\n| `z` | – | 2.000 | – |\n")
    assert grpo_eval.markdown(["a"], [{"x": 0.12345}]) == "| metric | `a` |\n|---|---|\n| `x` | 0.123 |\n"
    assert grpo_eval.markdown(["a", "b", "c"], [{"x": 1}, {"x": 2}, {"x": 3}]).splitlines()[2] == \
        "| `x` | 1.000 | 2.000 | 3.000 |"


def _run_eval_stand_ins(monkeypatch, cfg, *workers):
    """Stand-ins for what run_eval calls; the rewards share ``workers`` (each reward function with a worker of its
    own, and one more sharing the first's)."""
    from grpo.rewards import score
    from grpo.trainer import evaluate, logger

    seen = {"order": []}
    rewards = [SimpleNamespace(worker=w) for w in (*workers, *workers[:1], None)]
    monkeypatch.setattr(grpo_eval, "load_config", lambda ov: seen["order"].append(("config", ov)) or cfg)
    monkeypatch.setattr(score, "build", lambda fns, timeout: seen["order"].append(("rewards", fns, timeout))
                        or rewards)
    monkeypatch.setattr(evaluate, "check_sets", lambda sets, d, rw: seen["order"].append(
        ("sets", sets is cfg.evaluation.sets, d is cfg.data, rw is rewards)))
    monkeypatch.setattr(grpo_eval, "resolve_model", lambda spec: seen["order"].append(("resolve", spec)))
    monkeypatch.setattr(logger, "quiet_when_not_interactive", lambda: seen["order"].append("quiet"))
    monkeypatch.setattr(grpo_eval, "evaluate_model", lambda c, spec, rw: seen["order"].append(
        ("eval", spec, c is cfg, rw is rewards)) or {"eval/x": 0.5 if spec == "a" else 0.75})
    return seen


def test_run_eval_checks_everything_then_evaluates_each_model_and_writes_both_files(monkeypatch, tmp_path):
    cfg = Config()
    cfg = replace(cfg, reward=replace(cfg.reward, functions={"r": {"fn": "m:f"}}, timeout_s=3.0),
                  trainer=replace(cfg.trainer, eval_max_new_tokens=7))
    killed = []
    workers = [SimpleNamespace(kill=lambda n=n: killed.append(n)) for n in (1, 2)]
    seen = _run_eval_stand_ins(monkeypatch, cfg, *workers)
    path = grpo_eval.run_eval(["x=1", "--model", "a", "--model", "b", "--out", str(tmp_path / "o" / "p")])
    assert path == tmp_path / "o" / "p" / "eval.json" and killed == [1, 2]  # each worker, once
    assert seen["order"] == [("config", ["x=1"]), ("rewards", {"r": {"fn": "m:f"}}, 3.0), ("sets", True, True, True),
                             ("resolve", "a"), ("resolve", "b"), "quiet", ("eval", "a", True, True),
                             ("eval", "b", True, True)]
    doc = json.loads(path.read_text())
    assert doc["models"] == [{"model": "a", "metrics": {"eval/x": 0.5}}, {"model": "b", "metrics": {"eval/x": 0.75}}]
    assert doc["max_new_tokens"] == 7 and doc["reward"] == {"r": {"fn": "m:f"}}
    assert doc["evaluation"]["seed"] == cfg.evaluation.seed and doc["data"]["source"] == cfg.data.source
    assert path.read_text().endswith("}\n") and path.read_text().startswith('{\n  "models"')
    assert (tmp_path / "o" / "p" / "eval.md").read_text() == "# grpo-eval: a, b\n\n" + grpo_eval.markdown(
        ["a", "b"], [{"eval/x": 0.5}, {"eval/x": 0.75}])


def test_run_eval_without_a_model_evaluates_the_configs_and_kills_the_workers_on_failure(monkeypatch, tmp_path):
    cfg = Config()
    cfg = replace(cfg, model=replace(cfg.model, name_or_path="tiny:gpt2"),
                  rollout=replace(cfg.rollout, max_new_tokens=11))
    seen = _run_eval_stand_ins(monkeypatch, cfg)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eval-results").mkdir()  # there already: written into
    path = grpo_eval.run_eval([])
    assert path == tmp_path.joinpath("eval-results", "eval.json").relative_to(tmp_path)
    assert ("eval", "tiny:gpt2", True, True) in seen["order"] and json.loads(path.read_text())["max_new_tokens"] == 11
    killed = []
    _run_eval_stand_ins(monkeypatch, cfg, SimpleNamespace(kill=lambda: killed.append(1)))

    def fails(c, spec, rw):
        raise SetupError("broken")

    monkeypatch.setattr(grpo_eval, "evaluate_model", fails)
    with pytest.raises(SetupError):
        grpo_eval.run_eval(["--out", "x"])
    assert killed == [1] and not (tmp_path / "x").exists()


@pytest.mark.parametrize("raised", [SetupError("bad one"), ConfigError("bad one"), FileNotFoundError("bad one")])
def test_main_is_one_line_and_exit_2_on_a_mistake(monkeypatch, capsys, raised):
    def fails(argv):
        raise raised

    monkeypatch.setattr(grpo_eval, "run_eval", fails)
    with pytest.raises(SystemExit) as e:
        grpo_eval.main(["a=1"])
    assert e.value.code == 2 and capsys.readouterr().err == "error: bad one\n"


def test_main_says_where_it_wrote_and_reads_sys_argv_without_arguments(monkeypatch, capsys, tmp_path):
    import sys

    seen = []
    monkeypatch.setattr(grpo_eval, "run_eval", lambda argv: seen.append(argv) or tmp_path / "eval.json")
    grpo_eval.main(["a=1"])
    assert capsys.readouterr().err == f"wrote {tmp_path}/eval.json and {tmp_path}/eval.md\n"
    monkeypatch.setattr(sys, "argv", ["grpo-eval", "b=2"])
    grpo_eval.main()
    assert seen == [["a=1"], ["b=2"]]
