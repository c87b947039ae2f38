"""One process, on the CPU or one GPU: the `Runtime` defaults plus the optimizer step and checkpoint files."""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from grpo.errors import SetupError
from grpo.runtime.base import Runtime

WEIGHTS = "trainable.safetensors"   # the trainable parameters, in a checkpoint directory


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LocalRuntime(Runtime):
    def __init__(self, device: str = "auto", rank: int = 0, world_size: int = 1):
        """``rank`` of ``world_size``: a process that does one rank's share of a run of many on its own (asynchronous
        GRPO's generator of that rank samples the rank's prompts with its seeds); its collectives are over itself."""
        self.device, self.rank, self.world_size = pick_device(device), rank, world_size
        if self.device.type == "cpu":
            # transformers' save_pretrained imports deepspeed when it is installed (accelerate's unwrap), and
            # deepspeed then prints "Setting accelerator to CPU" into the run's summary; name it up front.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")

    def step(self, max_grad_norm: float) -> tuple[float, bool]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
        norm = float(norm)
        stepped = math.isfinite(norm)
        if stepped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, stepped

    def save_model_state(self, ckpt: Path) -> dict:
        """The trainable parameters as safetensors; the optimizer state goes into the trainer state."""
        from safetensors.torch import save_file

        state = {n: p.detach().cpu().contiguous() for n, p in self.model.named_parameters() if p.requires_grad}
        save_file(state, str(Path(ckpt) / WEIGHTS))
        return self.optimizer.state_dict()

    def load_model_state(self, ckpt: Path, optimizer_state) -> None:
        from safetensors.torch import load_file

        ckpt = Path(ckpt)
        if not (ckpt / WEIGHTS).exists() and (ckpt / "deepspeed").is_dir():
            raise SetupError(f"checkpoint {ckpt} was written by DeepSpeed; resume it with the same distributed= "
                             "setting and number of processes")
        state = load_file(str(ckpt / WEIGHTS))
        missing = [n for n, p in self.model.named_parameters() if p.requires_grad and n not in state]
        if missing:
            raise SetupError(f"checkpoint {ckpt} does not match the model (missing {missing[0]}); "
                             "wrong model.name_or_path?")
        self.model.load_state_dict(state, strict=False)
        self.optimizer.load_state_dict(optimizer_state)
