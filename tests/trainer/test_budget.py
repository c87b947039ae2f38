"""grpo/trainer/budget.py: the micro-batch budget at start; a prompt + completion that cannot fit is refused."""
from types import SimpleNamespace

import pytest
import torch

from grpo.errors import SetupError
from grpo.models import tiny_model
from grpo.runtime.local import LocalRuntime
from grpo.trainer.budget import plan


def _runtime():
    rt = LocalRuntime("cpu")
    model = tiny_model("llama", 40)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.setup(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    return rt


def test_an_explicit_budget_is_kept_and_one_too_small_refused_naming_the_key(cfg_factory, capsys):
    splits = SimpleNamespace(train=[{"prompt_ids": [1] * 20}, {"prompt_ids": [1] * 30}])
    rt = _runtime()
    assert plan(cfg_factory({"engine": {"max_tokens_per_micro_batch": 256}}), splits, rt) == 256
    with pytest.raises(SetupError, match="max_tokens_per_micro_batch"):
        plan(cfg_factory({"engine": {"max_tokens_per_micro_batch": 40}}), splits, rt)  # 30 + 16 > 40
    assert plan(cfg_factory({"engine": {"max_tokens_per_micro_batch": "auto"}}), splits, rt) >= 46
