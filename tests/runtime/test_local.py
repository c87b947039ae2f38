"""grpo/runtime/local.py: one process; a step clips the gradient and skips a non-finite one."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo.errors import SetupError
from grpo.runtime.local import WEIGHTS, LocalRuntime


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


def test_pick_device_auto_is_cuda_when_there_is_one_and_a_name_is_taken_as_it_is(monkeypatch):
    from grpo.runtime.local import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device() == torch.device("cpu") and pick_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device() == torch.device("cuda") and pick_device("auto") == torch.device("cuda")
    assert pick_device("cpu") == torch.device("cpu") and pick_device("cuda:1") == torch.device("cuda:1")


def test_a_cpu_runtime_names_deepspeeds_accelerator_and_keeps_its_rank(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    rt = LocalRuntime("cpu", 1, 2)
    assert (rt.device, rt.rank, rt.world_size) == (torch.device("cpu"), 1, 2) and not rt.is_main
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # set by the user: kept
    LocalRuntime("cpu")
    assert os.environ["DS_ACCELERATOR"] == "cuda"
    monkeypatch.delenv("DS_ACCELERATOR")
    LocalRuntime("meta")  # not the CPU: left to deepspeed
    assert "DS_ACCELERATOR" not in os.environ
    assert LocalRuntime().rank == 0 and LocalRuntime().world_size == 1


def _runtime(frozen_bias=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    model.bias.requires_grad_(not frozen_bias)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    rt = LocalRuntime("cpu")
    rt.setup(model, opt, sched)
    return rt, model, opt, sched


def test_the_step_clips_to_max_grad_norm_only_when_it_is_positive_and_clears_the_gradients():
    for max_norm in (0.5, 0.0, -1.0, 1.0, 8.0):
        rt, model, opt, sched = _runtime(frozen_bias=True)
        w = model.weight.detach().clone()
        (model(torch.tensor([[3.0, 4.0]])) * 1.2).sum().backward()  # gradient (3.6, 4.8): norm 6
        norm, stepped = rt.step(max_norm)
        assert stepped and abs(norm - 6.0) < 1e-5
        # clipped to max_norm (below 6): a step of length max_norm; not clipped: of length 6 (lr 1)
        step = float((w - model.weight.detach()).norm())
        assert abs(step - (max_norm if 0 < max_norm < 6 else 6.0)) < 1e-5, (max_norm, step)
        assert model.weight.grad is None and sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.5


def test_the_step_skips_a_non_finite_gradient_and_still_clears_it():
    rt, model, opt, sched = _runtime()
    w = model.weight.detach().clone()
    (model(torch.ones(1, 2)) * float("nan")).sum().backward()
    norm, stepped = rt.step(0.0)
    assert not stepped and norm != norm and torch.equal(model.weight, w)
    assert model.weight.grad is None and sched.last_epoch == 0


def test_the_step_clips_only_the_trainable_parameters():
    rt, model, opt, sched = _runtime(frozen_bias=True)
    model.bias.grad = torch.full_like(model.bias, 100.0)  # a stale gradient of a frozen parameter: not counted
    (model(torch.tensor([[3.0, 4.0]])) * 1.2).sum().backward()
    norm, _ = rt.step(10.0)
    assert abs(norm - 6.0) < 1e-5


def test_save_and_load_the_trainable_parameters_and_the_optimizer_state(tmp_path):
    rt, model, opt, sched = _runtime(frozen_bias=True)
    model.weight.data = torch.tensor([[1.0, 2.0, 3.0, 4.0]]).reshape(2, 2).t()[:1]  # a non-contiguous view
    (model(torch.ones(1, 2))).sum().backward()
    state = rt.save_model_state(tmp_path)
    assert state == opt.state_dict()
    saved = load_file(str(tmp_path / WEIGHTS))
    assert list(saved) == ["weight"] and torch.equal(saved["weight"], torch.tensor([[1.0, 3.0]]))
    rt2, model2, opt2, _ = _runtime(frozen_bias=True)
    bias = model2.bias.detach().clone()
    opt_state = {"state": {}, "param_groups": [dict(opt2.state_dict()["param_groups"][0], lr=0.25)]}
    rt2.load_model_state(str(tmp_path), opt_state)
    assert torch.equal(model2.weight, torch.tensor([[1.0, 3.0]])) and torch.equal(model2.bias, bias)
    assert opt2.param_groups[0]["lr"] == 0.25


def test_load_names_a_deepspeed_checkpoint_and_a_missing_parameter(tmp_path):
    rt, model, opt, _ = _runtime()
    (tmp_path / "deepspeed").mkdir()
    with pytest.raises(SetupError, match="written by DeepSpeed"):
        rt.load_model_state(tmp_path, opt.state_dict())
    save_file({"weight": torch.zeros(1, 2)}, str(tmp_path / WEIGHTS))  # no bias, which is trainable here
    with pytest.raises(SetupError, match=r"missing bias\)"):
        rt.load_model_state(tmp_path, opt.state_dict())
    rt, model, opt, _ = _runtime(frozen_bias=True)  # the bias is frozen: not needed
    rt.load_model_state(tmp_path, opt.state_dict())
    assert torch.equal(model.weight, torch.zeros(1, 2))
    empty = tmp_path / "none"
    empty.mkdir()
    with pytest.raises(Exception, match="No such file|not found|does not exist"):
        rt.load_model_state(empty, opt.state_dict())  # neither file: safetensors' own error
