"""grpo/engine/unwrap.py: the model inside its wrappers (DataParallel, peft)."""
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
