import re
import subprocess
import sys

import pytest

from grpo.cli import check_argv
from grpo.config.compose import RECIPE_DIR
from grpo.config.schema import ConfigError, load, schema_keys
from tests.helpers import ROOT, compose_recipe


def test_recipes_compose_and_validate():
    from omegaconf import OmegaConf

    for recipe in sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")):
        raw = OmegaConf.to_container(compose_recipe(recipe, ["trainer.output_dir=/tmp/x"]), resolve=True)
        cfg = load(raw)
        assert cfg.algorithm.group_size >= 2, recipe


def test_smoke_recipe_values():
    from omegaconf import OmegaConf

    cfg = load(OmegaConf.to_container(compose_recipe("smoke", ["algorithm.group_size=3", "trainer.output_dir=o"])))
    assert cfg.model.name_or_path == "tiny:llama"
    assert cfg.algorithm.group_size == 3
    assert set(cfg.reward.functions) == {"accuracy", "format"}


@pytest.mark.parametrize("raw, fragment", [
    ({"trainer": {"lrr": 1}}, "unknown config key 'trainer.lrr' (did you mean 'trainer.lr'?)"),
    ({"trainr": {}}, "unknown config key 'trainr' (did you mean 'trainer'?)"),
    ({"algorithm": {"group_size": 1}}, "algorithm.group_size=1 is out of range"),
    ({"rollout": {"temperature": 0.0}}, "rollout.temperature=0.0 is out of range"),
    ({"rollout": {"max_new_tokens": 0}}, "rollout.max_new_tokens=0 is out of range"),
    ({"trainer": {"lr": -1e-5}}, "trainer.lr=-1e-05 is out of range"),
    ({"trainer": {"lr": "fast"}}, "bad value for 'trainer.lr'"),
    ({"algorithm": {"loss_agg": "mean"}}, "choose one of: token_mean"),
    ({"reward": {"functions": {"x": {"weight": 1}}}}, "reward.functions.x needs an 'fn'"),
    ({"logging": {"wandb": {"mode": "loud"}}}, "logging.wandb.mode='loud'"),
])
def test_bad_values_give_one_line(raw, fragment):
    with pytest.raises(ConfigError) as e:
        load(raw)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_argv_check():
    check_argv(["recipe=smoke", "trainer.max_steps=3", "+reward.functions.mine.fn=m:f", "~reward.functions.format",
                "model.tiny.hidden_size=32", "distributed=none", "logging.wandb.mode=offline"])
    with pytest.raises(ConfigError, match="did you mean 'algorithm.group_size'"):
        check_argv(["algorithm.groupsize=4"])
    with pytest.raises(ConfigError, match=f"recipe='nope' does not exist in {re.escape(str(RECIPE_DIR.resolve()))} "
                                          ".*; available: .*smoke"):
        check_argv(["recipe=nope"])


def test_schema_keys_cover_required_names():
    keys = set(schema_keys())
    for k in ["model.name_or_path", "algorithm.group_size", "algorithm.beta", "rollout.prompts_per_step",
              "rollout.max_new_tokens", "rollout.temperature", "engine.shared_prefix", "trainer.max_steps",
              "trainer.seed", "trainer.output_dir", "trainer.save_every", "trainer.resume", "trainer.lr"]:
        assert k in keys


# `python -m grpo.train ARGS`, then a line that says whether torch was imported
CLI = ("import runpy, sys\n"
       "try:\n    runpy.run_module('grpo.train', run_name='__main__', alter_sys=True)\n"
       "finally:\n    print('torch imported:', 'torch' in sys.modules)\n")


def run_cli(cwd, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, "recipe=smoke", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


@pytest.mark.parametrize("args, fragment, needs_torch", [
    # the command line and the schema are checked before torch is imported
    (["trainer.max_stepz=3"], "unknown config key 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)", False),
    (["algorithm.group_size=1"], "algorithm.group_size=1 is out of range", False),
    # the checks that import the user's code or look at the machine come after
    (["reward.functions.accuracy.fn=nosuchmod:f"], "cannot import module 'nosuchmod'", True),
    (["model.name_or_path=/nonexistent/model"], "model.name_or_path='/nonexistent/model'", True),
    (["data.source=/nonexistent/data.jsonl"], "file not found", True),
])
def test_cli_errors_are_one_line_without_traceback(tmp_path, args, fragment, needs_torch):
    p = run_cli(tmp_path, f"trainer.output_dir={tmp_path}", *args)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: ") and fragment in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1, p.stderr  # one line, no traceback
    assert p.stdout.splitlines()[-1] == f"torch imported: {needs_torch}"


def test_cfg_job_prints_the_config_without_importing_torch(tmp_path):
    p = run_cli(tmp_path, "algorithm.group_size=3", "--cfg", "job")
    assert p.returncode == 0, p.stderr
    assert "group_size: 3" in p.stdout
    assert p.stdout.splitlines()[-1] == "torch imported: False"
