import re
import subprocess
import sys

import pytest

from grpo.cli import check_argv
from grpo.config.compose import RECIPE_DIR
from grpo.config.schema import (
    Config,
    ConfigError,
    _list_example,
    _not_a_mapping,
    _walk,
    load,
    open_dict_keys,
    schema_keys,
    suggest,
    validate,
)
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


# ------------------------------------------------------------------ the schema's own functions, without Hydra: fast
def test_load_of_nothing_is_the_schemas_defaults():
    assert load({}) == Config()
    assert load({"recipe": "smoke", "hydra": {"job": {"name": "x"}}}) == Config()  # Hydra's keys are dropped


def test_schema_keys_are_every_leaf_by_its_dotted_name_in_order():
    keys = schema_keys()
    assert keys[:2] == ["model.name_or_path", "model.dtype"] and keys[-1] == "alarms.non_finite.patience"
    assert {"model.lora.r", "rollout.server.urls", "rollout.vllm.lora_sync", "alarms.truncation.threshold"} <= set(keys)
    assert "model.lora" not in keys and "alarms.truncation" not in keys  # sections are not leaves
    defaults = dict(_walk())
    assert defaults["trainer.adam_betas"] == [0.9, 0.99] and defaults["model.lora.r"] == 16  # factories called
    assert defaults["rollout.tools"] == [] and defaults["trainer.resume"] is None


def test_the_open_dicts_are_the_free_form_dict_keys():
    assert open_dict_keys() == {"data.load_kwargs", "data.task_kwargs", "distributed.ds_config", "logging.wandb",
                                "model.tiny", "reward.functions"}


@pytest.mark.parametrize("key, hint", [
    ("trainer.lrr", " (did you mean 'trainer.lr'?)"),
    ("trainr", " (did you mean 'trainer'?)"),  # a section name
    ("algorithm.kl_coef", " (did you mean 'algorithm.beta'?)"),  # TRL's and verl's name of the KL coefficient
    ("actor.kl_coef", " (did you mean 'algorithm.beta'?)"),
    ("rollout.min_p", ": min-p sampling is not supported; rollout.top_p and rollout.top_k are"),
    ("zzzz", ""),
])
def test_suggest_names_the_close_key_ours_for_theirs_or_nothing(key, hint):
    assert suggest(key) == hint


def test_a_list_example_shows_the_default_items_or_two_placeholders():
    assert _list_example("trainer.adam_betas") == "0.9,0.99"
    assert _list_example("model.lora.target_modules") == "q_proj,k_proj,v_proj,o_proj"
    assert _list_example("rollout.tools") == "a,b"  # an empty default: not `rollout.tools=[]`
    assert _list_example("trainer.lr") == "a,b"


@pytest.mark.parametrize("raw, says", [
    ({"trainer": {"adam_betas": 0.9}}, "trainer.adam_betas must be a list, e.g. trainer.adam_betas=[0.9,0.99]"),
    ({"trainer": {"lr": "fast"}}, "bad value for 'trainer.lr': Value 'fast' of type 'str' could not be converted to "
                                  "Float"),
    ({"trainer": {"lrr": 1}}, "unknown config key 'trainer.lrr' (did you mean 'trainer.lr'?)"),
    ({"model": {"lora": {"rr": 1}}}, "unknown config key 'model.lora.rr' (did you mean 'model.lora.r'?)"),
    ({"rollout": {"min_p": 0.1}}, "unknown config key 'rollout.min_p': min-p sampling is not supported; rollout.top_p "
                                  "and rollout.top_k are"),
    ({"trainr": {}}, "unknown config key 'trainr' (did you mean 'trainer'?)"),
])
def test_load_names_the_key_it_cannot_take(raw, says):
    with pytest.raises(ConfigError) as e:
        load(raw)
    assert str(e.value) == says


def test_a_dict_given_replaces_the_default_and_other_keys_keep_theirs():
    cfg = load({"reward": {"functions": {"mine": {"fn": "m:f"}}}, "model": {"tiny": {"hidden_size": 8}},
                "trainer": {"lr": 2e-6}})
    assert cfg.reward.functions == {"mine": {"fn": "m:f"}} and cfg.model.tiny == {"hidden_size": 8}
    assert cfg.trainer.lr == 2e-6 and cfg.logging.wandb == Config().logging.wandb and cfg.trainer.max_steps == 100


def plain(**sections) -> Config:
    cfg = Config()
    for section, values in sections.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    return cfg


def refusal(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    return str(e.value)


@pytest.mark.parametrize("sections", [
    {}, {"reward": {"functions": {"a": {"fn": "x:y"}, "b": {"fn": "z", "weight": 2}}}},
    {"logging": {"wandb": {}}}, {"logging": {"wandb": None}}, {"logging": {"wandb": {"mode": "online"}}},
    {"algorithm": {"resample_zero_std": 2, "filter_zero_std_groups": True}},
    {"algorithm": {"epsilon": 0.25, "delta": 1.25}}, {"algorithm": {"epsilon_high": 0.5, "delta": 1.5}},
    {"algorithm": {"filter_zero_std_groups": True}},
])
def test_settings_that_fit_together_pass(sections):
    assert validate(plain(**sections)) is not None


@pytest.mark.parametrize("sections, says", [
    ({"model": {"dtype": "fp16"}}, "model.dtype='fp16' is not allowed; choose one of: float32, bfloat16, float16"),
    ({"algorithm": {"kl_estimator": "low_var_kl"}},
     "algorithm.kl_estimator='low_var_kl' is not allowed; choose one of: k1, k2, k3; verl's low_var_kl is "
     "algorithm.kl_estimator=k3 here"),
    ({"algorithm": {"group_size": 1}}, "algorithm.group_size=1 is out of range; allowed: an integer >= 2 (GRPO needs a "
                                       "group to compare)"),
    ({"reward": {"functions": {"a": "arithmetic"}}}, "reward.functions.a needs an 'fn'"),
    ({"reward": {"functions": {"a": {"weight": 1.0}}}}, "reward.functions.a needs an 'fn'"),
    ({"reward": {"functions": {"a": {"fn": "x", "weight": "2"}}}}, "reward.functions.a.weight='2' must be a number"),
    ({"reward": {"functions": {}}}, "reward.functions is empty; give at least one reward function"),
    ({"trainer": {"adam_betas": [0.9]}}, "trainer.adam_betas=[0.9] must be two numbers"),
    ({"logging": {"wandb": {"mode": "loud"}}}, "logging.wandb.mode='loud' is not allowed"),
    ({"algorithm": {"resample_zero_std": 2}}, "algorithm.resample_zero_std=2 needs algorithm.filter_zero_std_groups"),
    ({"algorithm": {"epsilon": 0.25, "delta": 1.125}}, "algorithm.delta=1.125 must be >= 1 + epsilon_high = 1.25"),
    ({"algorithm": {"epsilon_high": 0.5, "delta": 1.25}}, "algorithm.delta=1.25 must be >= 1 + epsilon_high = 1.5"),
    ({"distributed": {"zero_stage": 2}}, "distributed.zero_stage=2 needs distributed.backend=deepspeed"),
    ({"rollout": {"tools": ["calculator"]}}, "rollout.tools=['calculator'] must be"),
    ({"rollout": {"environment": "Game"}}, "rollout.environment='Game' must be"),
    ({"evaluation": {"n": 2}}, "evaluation.n=2 at evaluation.temperature=0"),
])
def test_validate_refuses_in_one_line_naming_the_key(sections, says):
    assert refusal(plain(**sections)).startswith(says)


def test_validate_checks_the_server_section():
    cfg = Config()
    cfg.rollout.server.urls = ["localhost:8000"]
    assert refusal(cfg).startswith("rollout.server.urls: 'localhost:8000' is not a URL")


@pytest.mark.parametrize("raw, says", [
    ({"model": "x"}, "bad value for 'model': Merge error: str is not a subclass of ModelConfig. value: x"),
    ({"model": {"lora": {"r": 8}}, "trainer": 5}, "bad value for 'trainer': Merge error: int is not a subclass of "
                                                  "TrainerConfig. value: 5"),
    ({"model": {"name_or_path": "tiny:llama", "lora": 3}}, "bad value for 'model.lora': Merge error: int is not a "
                                                           "subclass of LoraConfig. value: 3"),
    ({"alarms": {"truncation": 0.5}}, "bad value for 'alarms.truncation': Merge error: float is not a subclass of "
                                      "AlarmRule. value: 0.5"),
    ({"reward": {"functions": [1]}}, "bad value for 'reward.functions': Cannot merge DictConfig with ListConfig"),
])
def test_a_section_given_as_a_plain_value_is_named(raw, says):
    """OmegaConf's merge error for these names no key (it said "bad value for ''")."""
    with pytest.raises(ConfigError) as e:
        load(raw)
    assert str(e.value) == says


def test_not_a_mapping_finds_the_first_section_or_dict_given_as_a_plain_value():
    from omegaconf import OmegaConf

    assert _not_a_mapping({}) == "" and _not_a_mapping({"model": {"name_or_path": "x", "tiny": {}}}) == ""
    assert _not_a_mapping(OmegaConf.create({"data": {"source": "x", "task_kwargs": 3}})) == "data.task_kwargs"
    assert _not_a_mapping({"model": {"lora": {"r": 8}}, "rollout": {"server": "h"}}) == "rollout.server"
