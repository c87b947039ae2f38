"""grpo/engine/unwrap.py: the model inside its wrappers (DataParallel, peft)."""
import pytest
import torch

from grpo.engine.unwrap import unwrap_chain, unwrap_model
from grpo.models import tiny_model


def test_through_data_parallel_and_peft():
    import peft

    base = tiny_model("llama", 50)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    wrapped = torch.nn.DataParallel(lora)
    assert unwrap_model(wrapped) is base
    assert unwrap_model(wrapped, peft=False) is lora
    assert len(unwrap_chain(wrapped)) == 3 and unwrap_model(base) is base


class _Inner(torch.nn.Module):
    pass


class DistributedDataParallel:  # stand-ins named as the wrappers are: unwrapping goes by class name and `.module`
    def __init__(self, module):
        self.module = module


class DeepSpeedEngine(DistributedDataParallel):
    pass


class _SubclassOfDataParallel(torch.nn.DataParallel):  # a subclass is a DataParallel too (found along the mro)
    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module = module


class _Peft:
    def __init__(self, base, cfg=None, **kw):
        self.peft_config, self.base = {"default": cfg}, base
        if cfg is not None:
            self.active_peft_config = cfg

    def get_base_model(self):
        return self.base


class _Cfg:
    def __init__(self, prompt_learning):
        self.is_prompt_learning = prompt_learning


def test_each_wrapper_by_its_name_and_module_attribute():
    inner = _Inner()
    for wrap in (DistributedDataParallel, DeepSpeedEngine, _SubclassOfDataParallel):
        w = wrap(inner)
        assert unwrap_chain(w) == [w, inner]
        assert unwrap_model(wrap(inner)) is inner and unwrap_model(wrap(inner), peft=False) is inner
    other = type("OtherWrapper", (), {"module": inner})()  # a `.module` alone does not make a wrapper
    assert unwrap_chain(other) == [other]
    named = type("DataParallel", (), {})()  # nor does the name alone
    assert unwrap_chain(named) == [named]


def test_peft_wrappers_and_prompt_learning_adapters():
    inner = _Inner()
    lora = _Peft(inner, _Cfg(False))
    ddp = DistributedDataParallel(lora)
    assert unwrap_chain(ddp) == [ddp, lora, inner]
    assert unwrap_chain(ddp, peft=False) == [ddp, lora]
    assert unwrap_model(ddp, peft=False) is lora
    assert unwrap_chain(_Peft(inner))[-1] is inner  # no active config: unwrapped
    no_flag = _Peft(inner, object())
    assert unwrap_model(no_flag) is inner  # a config without is_prompt_learning is no prompt-learning adapter
    half = type("HalfPeft", (), {"peft_config": {}})()  # peft_config without get_base_model: no peft model
    assert unwrap_chain(half) == [half]
    with pytest.raises(NotImplementedError, match="prompt-learning"):
        unwrap_model(DistributedDataParallel(_Peft(inner, _Cfg(True))))
    assert unwrap_model(_Peft(inner, _Cfg(True)), peft=False).base is inner  # not unwrapped: not refused


def test_at_most_eight_wrappers_are_unwrapped():
    inner = _Inner()
    m = inner
    for _ in range(9):
        m = DistributedDataParallel(m)
    chain = unwrap_chain(m)
    assert len(chain) == 9 and chain[-1] is not inner and chain[-1].module is inner
    assert unwrap_chain(m.module)[-1] is inner
