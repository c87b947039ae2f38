"""grpo/trainer/build.py: the learning-rate schedule (warmup, then constant, linear or cosine)."""
import pytest

from grpo.config.schema import TrainerConfig
from grpo.trainer.build import lr_lambda


@pytest.mark.parametrize("schedule,mid,end", [("constant", 1.0, 1.0), ("linear", 0.5, 0.0), ("cosine", 0.5, 0.0)])
def test_warmup_then_the_schedule(schedule, mid, end):
    f = lr_lambda(TrainerConfig(max_steps=12, warmup_steps=2, lr_schedule=schedule))
    assert f(0) == pytest.approx(0.5) and f(1) == pytest.approx(1.0)
    assert f(7) == pytest.approx(mid) and f(12) == pytest.approx(end, abs=1e-9)
