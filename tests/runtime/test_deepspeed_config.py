"""grpo/runtime/deepspeed_config.py: the DeepSpeed config derived from the run's DistributedConfig and RunShape."""
import pytest
import torch

from grpo.config.schema import DistributedConfig
from grpo.errors import SetupError
from grpo.runtime.base import RunShape
from grpo.runtime.deepspeed_config import _flat_keys, _merge, check, ds_config, launcher_env, uses_bf16


def test_batch_fields_clipping_and_precision_come_from_the_run_shape():
    d = DistributedConfig(backend="deepspeed", zero_stage=3)
    shape = RunShape(prompts_per_step=8, group_size=4, max_grad_norm=0.5, dtype="bfloat16")
    out = ds_config(d, shape, 2)
    assert out["train_micro_batch_size_per_gpu"] == 16 and out["train_batch_size"] == 32
    assert out["gradient_clipping"] == 0.5 and out["bf16"]["enabled"]
    assert "gradient_clipping" not in ds_config(d, shape, 2, train=False)
    with pytest.raises(SetupError, match="divisible"):
        check(d, shape, 3)


def _env(monkeypatch, **env):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_launcher_env_reads_rank_world_and_local_rank(monkeypatch):
    _env(monkeypatch, RANK="2", WORLD_SIZE="4", MASTER_ADDR="h", MASTER_PORT="1", LOCAL_RANK="0")
    assert launcher_env() == (2, 4, 0)
    _env(monkeypatch, RANK="3", WORLD_SIZE="4", MASTER_ADDR="h", MASTER_PORT="1")  # no LOCAL_RANK: the rank
    assert launcher_env() == (3, 4, 3)
    _env(monkeypatch, RANK="0", WORLD_SIZE="1", MASTER_ADDR="h", MASTER_PORT="1")
    assert launcher_env() == (0, 1, 0)


def test_launcher_env_names_what_is_missing_or_wrong(monkeypatch):
    _env(monkeypatch, RANK="0", WORLD_SIZE="2")
    with pytest.raises(SetupError, match=r"\(MASTER_ADDR, MASTER_PORT not set\)"):
        launcher_env()
    _env(monkeypatch, RANK="0", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="")  # empty counts as not set
    with pytest.raises(SetupError, match=r"\(MASTER_PORT not set\)"):
        launcher_env()
    _env(monkeypatch, RANK="x", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1")
    with pytest.raises(SetupError, match="must be integers"):
        launcher_env()
    _env(monkeypatch, RANK="0", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1", LOCAL_RANK="y")
    with pytest.raises(SetupError, match="must be integers"):
        launcher_env()
    for rank in ("2", "-1"):
        _env(monkeypatch, RANK=rank, WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1")
        with pytest.raises(SetupError, match=rf"RANK={rank} is not in \[0, WORLD_SIZE=2\)"):
            launcher_env()


def test_check_refuses_an_owned_key_or_one_under_it_and_takes_the_others():
    shape = RunShape(prompts_per_step=8, group_size=4, max_grad_norm=1.0, dtype="float32")
    check(DistributedConfig(backend="deepspeed", ds_config={"zero_optimization": {"reduce_bucket_size": 5}}), shape, 2)
    check(DistributedConfig(backend="deepspeed", ds_config={"bf16x": 1, "optimizerx": {"a": 1}}), shape, 2)
    check(DistributedConfig(backend="deepspeed"), shape, 2)
    for ds, key in (({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
                    ({"bf16": {"enabled": True}}, "bf16"),
                    ({"a": 1, "zero_optimization": {"offload_param": {"device": "nvme"}}},
                     "zero_optimization.offload_param"),
                    ({"optimizer": {"type": {"x": 1}}}, "optimizer"),
                    ({"bf16.enabled": True}, r"bf16\.enabled")):  # a dotted key under an owned one
        with pytest.raises(SetupError, match=rf"^distributed\.ds_config\.{key} is derived"):
            check(DistributedConfig(backend="deepspeed", ds_config=ds), shape, 2)


def test_flat_keys_name_every_nested_key_with_its_path():
    assert _flat_keys({"a": 1, "b": {"c": {"d": 2}, "e": 3}}) == ["a", "b", "b.c", "b.c.d", "b.e"]
    assert _flat_keys(None) == [] and _flat_keys({}) == []


def test_merge_keeps_the_base_and_goes_into_dicts_only():
    base = {"a": 1, "z": {"x": 1, "y": {"k": 1}}, "s": 2}
    out = _merge(base, {"z": {"y": {"j": 2}, "w": 3}, "s": {"n": 1}, "new": {"m": 1}})
    assert out == {"a": 1, "z": {"x": 1, "y": {"k": 1, "j": 2}, "w": 3}, "s": {"n": 1}, "new": {"m": 1}}
    assert base == {"a": 1, "z": {"x": 1, "y": {"k": 1}}, "s": 2}  # a copy
    assert _merge(base, None) == base and _merge(base, None) is not base
    assert _merge({"a": {"b": 1}}, {"a": 5}) == {"a": 5}
    deep = _merge(base, {})
    deep["z"]["y"]["k"] = 9  # a deep copy: the base is never changed through the result
    assert base["z"]["y"]["k"] == 1


def test_ds_config_whole_for_training_and_for_a_frozen_reference(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    shape = RunShape(prompts_per_step=8, group_size=3, max_grad_norm=2, dtype="float32")
    d = DistributedConfig(backend="deepspeed", zero_stage=2, offload_optimizer=True, offload_params=True,
                          ds_config={"steps_per_print": 5, "zero_optimization": {"reduce_bucket_size": 7}})
    out = ds_config(d, shape, 4)
    assert out == {
        "train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 1, "train_batch_size": 24,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                              "reduce_bucket_size": 7},
        "bf16": {"enabled": False}, "steps_per_print": 5, "wall_clock_breakdown": False,
        "gradient_clipping": 2.0, "zero_allow_untested_optimizer": True}
    assert isinstance(out["gradient_clipping"], float)
    assert type(out["train_micro_batch_size_per_gpu"]) is int and type(out["train_batch_size"]) is int
    ref = ds_config(d, shape, 4, train=False)
    assert ref["zero_optimization"] == {"stage": 0, "reduce_bucket_size": 7}
    assert "gradient_clipping" not in ref and "zero_allow_untested_optimizer" not in ref
    assert ds_config(DistributedConfig(backend="deepspeed"), shape, 4)["steps_per_print"] == 10 ** 9


def test_ds_config_zero3_offloads_parameters_and_gathers_weights_on_save(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    shape = RunShape(prompts_per_step=2, group_size=2, max_grad_norm=1.0, dtype="float32")
    d = DistributedConfig(backend="deepspeed", zero_stage=3, offload_params=True, bf16=True)
    for train in (True, False):
        out = ds_config(d, shape, 4, train=train)  # 2 prompts over 4 ranks: at least one a rank
        assert out["train_micro_batch_size_per_gpu"] == 1 and out["train_batch_size"] == 4
        assert type(out["train_micro_batch_size_per_gpu"]) is int
        assert out["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                            "stage3_gather_16bit_weights_on_model_save": True}
        assert out["bf16"] == {"enabled": True}
    assert ds_config(DistributedConfig(backend="deepspeed", zero_stage=1), shape, 1, train=False)[
        "zero_optimization"] == {"stage": 0}
    assert ds_config(DistributedConfig(backend="deepspeed", zero_stage=1), shape, 1)["zero_optimization"] == {
        "stage": 1}


def test_bf16_from_the_distributed_section_or_the_models_dtype():
    d = DistributedConfig(backend="deepspeed")
    assert uses_bf16(d, RunShape(1, 1, 1.0, "bfloat16")) is True
    assert uses_bf16(d, RunShape(1, 1, 1.0, "float32")) is False
    assert uses_bf16(DistributedConfig(backend="deepspeed", bf16=True), RunShape(1, 1, 1.0, "float32")) is True
