import subprocess
import sys

import pytest

from grpo.cli import check_argv
from grpo.config import ConfigError, load, schema_keys
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
    with pytest.raises(ConfigError, match="recipe='nope' does not exist; available: .*smoke"):
        check_argv(["recipe=nope"])


def test_schema_keys_cover_required_names():
    keys = set(schema_keys())
    for k in ["model.name_or_path", "algorithm.group_size", "algorithm.beta", "rollout.prompts_per_step",
              "rollout.max_new_tokens", "rollout.temperature", "engine.shared_prefix", "trainer.max_steps",
              "trainer.seed", "trainer.output_dir", "trainer.save_every", "trainer.resume", "trainer.lr"]:
        assert k in keys


@pytest.mark.parametrize("args, fragment", [
    (["trainer.max_stepz=3"], "unknown config key 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)"),
    (["algorithm.group_size=1"], "algorithm.group_size=1 is out of range"),
    (["reward.functions.accuracy.fn=nosuchmod:f"], "cannot import module 'nosuchmod'"),
    (["model.name_or_path=/nonexistent/model"], "model.name_or_path='/nonexistent/model'"),
    (["data.source=/nonexistent/data.jsonl"], "file not found"),
])
def test_cli_errors_are_one_line_without_traceback(tmp_path, args, fragment):
    p = subprocess.run([sys.executable, "-m", "grpo.train", "recipe=smoke", f"trainer.output_dir={tmp_path}", *args],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode != 0
    assert fragment in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    error_lines = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert len(error_lines) == 1
