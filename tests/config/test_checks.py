"""grpo/config/checks.py: the checks of `validate` that span several keys of one section, each on a plain `Config`
(no Hydra): what passes, and the one line that names the key of what does not."""
import pytest

from grpo.config.checks import check_distributed, check_server, check_tools, check_trainer
from grpo.config.schema import Config
from grpo.errors import ConfigError


def refused(check, cfg) -> str:
    with pytest.raises(ConfigError) as e:
        check(cfg)
    return str(e.value)


def with_(**sections) -> Config:
    """A default Config with some keys set: ``rollout={"tools": [...]}``; a dotted section for a sub-section."""
    cfg = Config()
    for section, values in sections.items():
        obj = cfg
        for part in section.split("__"):
            obj = getattr(obj, part)
        for k, v in values.items():
            setattr(obj, k, v)
    return cfg


# ------------------------------------------------------------------------------------------ rollout.tools / environment
@pytest.mark.parametrize("tools", [[], ["pkg.mod:fn"], ("a:b", "c.d:e")])
def test_tools_given_as_module_function_strings_pass(tools):
    check_tools(with_(rollout={"tools": tools}))


@pytest.mark.parametrize("tools, shown", [
    ("pkg.mod:fn", "'pkg.mod:fn'"),          # one string, not a list
    (["pkg.mod:fn", "calculator"], "['pkg.mod:fn', 'calculator']"),  # a bare name among good ones
    ([3], "[3]"),                            # not a string
])
def test_tools_that_are_not_a_list_of_module_function_strings_are_refused(tools, shown):
    assert refused(check_tools, with_(rollout={"tools": tools})) == \
        f"rollout.tools={shown} must be a list of 'package.module:function' strings"


@pytest.mark.parametrize("environment", [None, "my.envs:Game"])
def test_an_environment_class_or_none_passes(environment):
    check_tools(with_(rollout={"environment": environment}))


@pytest.mark.parametrize("environment", ["Game", 3, ["a:B"]])
def test_an_environment_that_is_not_a_module_class_string_is_refused(environment):
    assert refused(check_tools, with_(rollout={"environment": environment})) == \
        f"rollout.environment={environment!r} must be 'package.module:Class' or null"


# ----------------------------------------------------------------------------------------------------- rollout.server
@pytest.mark.parametrize("urls", [[], ["http://h:8000"], ["https://gen.example", "http://10.0.0.2:8001"]])
def test_server_urls_with_a_scheme_and_a_host_pass(urls):
    check_server(with_(rollout__server={"urls": urls}))


@pytest.mark.parametrize("url", ["localhost:8000", "http://", "https://", 8000, "ftp://h:1"])
def test_a_server_url_without_scheme_or_host_is_refused(url):
    cfg = with_(rollout__server={"urls": ["http://ok:1", url]})
    assert refused(check_server, cfg) == f"rollout.server.urls: {url!r} is not a URL; give http://HOST:PORT"


@pytest.mark.parametrize("name", ["MY_KEY", "GRPO_SERVER_API_KEY", "_k1"])
def test_the_api_key_variable_name_passes(name):
    check_server(with_(rollout__server={"api_key_env": name}))


@pytest.mark.parametrize("name", ["sk-abc123", "1KEY", "", "KÉY"])
def test_an_api_key_instead_of_its_variable_name_is_refused(name):
    assert refused(check_server, with_(rollout__server={"api_key_env": name})).startswith(
        "rollout.server.api_key_env must be the NAME of an environment variable")


# ------------------------------------------------------------------------------------------------------- distributed
@pytest.mark.parametrize("values, key", [
    ({"zero_stage": 2}, "distributed.zero_stage=2"),
    ({"zero_stage": 3, "bf16": True}, "distributed.zero_stage=3"),  # the stage is named first
    ({"offload_optimizer": True}, "distributed.offload_optimizer=true"),
    ({"offload_params": True, "bf16": True}, "distributed.offload_params=true"),  # the first one that is on
    ({"bf16": True}, "distributed.bf16=true"),
    ({"ds_config": {"train_micro_batch_size_per_gpu": 1}}, "distributed.ds_config"),
])
def test_deepspeed_keys_without_the_deepspeed_backend_name_the_first_one_set(values, key):
    assert refused(check_distributed, with_(distributed=values)) == \
        f"{key} needs distributed.backend=deepspeed (use distributed=zero2 or distributed=zero3)"


def test_the_plain_backend_with_every_deepspeed_key_off_passes_also_with_float16():
    check_distributed(with_(model={"dtype": "float16"}))  # float16 is refused with deepspeed only


@pytest.mark.parametrize("values", [
    {"zero_stage": 0}, {"zero_stage": 3, "offload_params": True}, {"zero_stage": 1, "offload_optimizer": True},
    {"zero_stage": 2, "offload_optimizer": True, "bf16": True, "ds_config": {"a": 1}},
])
def test_deepspeed_settings_that_fit_together_pass(values):
    check_distributed(with_(distributed={"backend": "deepspeed", **values}, model={"dtype": "bfloat16"}))


@pytest.mark.parametrize("values, says", [
    ({"zero_stage": 2, "offload_params": True}, "distributed.offload_params=true needs distributed.zero_stage=3 "
                                                "(got 2); use distributed=zero3"),
    ({"zero_stage": 0, "offload_optimizer": True}, "distributed.offload_optimizer=true needs distributed.zero_stage "
                                                   ">= 1"),
])
def test_deepspeed_offloads_need_their_stage(values, says):
    assert refused(check_distributed, with_(distributed={"backend": "deepspeed", **values})) == says


def test_deepspeed_refuses_float16():
    cfg = with_(distributed={"backend": "deepspeed", "zero_stage": 2}, model={"dtype": "float16"})
    assert refused(check_distributed, cfg).startswith("model.dtype=float16 is not supported with "
                                                      "distributed.backend=deepspeed")


# ----------------------------------------------------------------------------------------------------------- trainer
@pytest.mark.parametrize("betas", [[0.9, 0.99], [0, 0], [0.0, 0.999999], (0.5, 0)])
def test_two_betas_in_zero_to_one_pass(betas):
    check_trainer(with_(trainer={"adam_betas": betas}))


@pytest.mark.parametrize("betas", [[0.9], [0.9, 0.99, 0.999], [0.9, 1.0], [-0.1, 0.9], ["0.9", 0.99], [0.9, None]])
def test_betas_that_are_not_two_numbers_in_zero_to_one_are_refused(betas):
    assert refused(check_trainer, with_(trainer={"adam_betas": betas})) == \
        f"trainer.adam_betas={list(betas)} must be two numbers in [0, 1), e.g. trainer.adam_betas=[0.9,0.99]"


@pytest.mark.parametrize("resume", [None, "auto", "", "outputs/run/checkpoints/step_3"])
def test_resume_null_auto_or_a_path_passes(resume):
    check_trainer(with_(trainer={"resume": resume}))


@pytest.mark.parametrize("resume", [3, True, ["auto"]])
def test_a_resume_that_is_not_a_string_is_refused(resume):
    assert refused(check_trainer, with_(trainer={"resume": resume})) == \
        "trainer.resume must be null, 'auto' or a checkpoint path"
