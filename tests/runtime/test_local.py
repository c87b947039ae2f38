"""grpo/runtime/local.py: one process; a step clips the gradient and skips a non-finite one."""
import torch

from grpo.runtime.local import LocalRuntime


def test_the_local_step_clips_and_refuses_a_non_finite_gradient():
    rt = LocalRuntime("cpu")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.setup(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    rt.expect_backwards(1)
    rt.backward((rt.model(torch.ones(1, 2)) * 100).sum())
    norm, stepped = rt.step(1.0)
    assert stepped and norm > 1.0
    w = model.weight.detach().clone()
    rt.expect_backwards(1)
    rt.backward((rt.model(torch.ones(1, 2)) * float("inf")).sum())
    _, stepped = rt.step(1.0)
    assert not stepped and torch.equal(model.weight, w)
