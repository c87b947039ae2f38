"""grpo/runtime/deepspeed_config.py: the DeepSpeed config derived from the run's DistributedConfig and RunShape."""
import pytest

from grpo.config.schema import DistributedConfig
from grpo.errors import SetupError
from grpo.runtime.base import RunShape
from grpo.runtime.deepspeed_config import check, ds_config


def test_batch_fields_clipping_and_precision_come_from_the_run_shape():
    d = DistributedConfig(backend="deepspeed", zero_stage=3)
    shape = RunShape(prompts_per_step=8, group_size=4, max_grad_norm=0.5, dtype="bfloat16")
    out = ds_config(d, shape, 2)
    assert out["train_micro_batch_size_per_gpu"] == 16 and out["train_batch_size"] == 32
    assert out["gradient_clipping"] == 0.5 and out["bf16"]["enabled"]
    assert "gradient_clipping" not in ds_config(d, shape, 2, train=False)
    with pytest.raises(SetupError, match="divisible"):
        check(d, shape, 3)
