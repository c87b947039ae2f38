"""The process runtime: who am I, where do tensors live, how do backward and the optimizer step run.

`LocalRuntime` is one process (CPU or one GPU). A multi-process runtime provides the same methods,
so the training loop does not care which one it has.
"""
from __future__ import annotations

import math
import os

import torch


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LocalRuntime:
    rank = 0
    local_rank = 0
    world_size = 1
    is_main = True

    def __init__(self, device: str = "auto"):
        self.device = pick_device(device)
        if self.device.type == "cpu":
            # transformers' save_pretrained imports deepspeed when it is installed (accelerate's unwrap), and
            # deepspeed then prints "Setting accelerator to CPU" into the run's summary; name it up front.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        self.model = self.optimizer = self.scheduler = None

    def setup(self, model, optimizer, scheduler):
        self.model, self.optimizer, self.scheduler = model.to(self.device), optimizer, scheduler
        return self.model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, max_grad_norm: float) -> tuple[float, bool]:
        """Clip, then step optimizer and scheduler unless the gradient is non-finite.
        Returns (grad_norm, stepped)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
        norm = float(norm)
        stepped = math.isfinite(norm)
        if stepped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, stepped

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        return list(values)

    def gather(self, obj) -> list:
        return [obj]

    def barrier(self) -> None:
        pass

    def node_local_checkpoints(self, on: bool) -> None:
        """One process: its output_dir is the only one."""

    def unwrap(self, model=None):
        return model if model is not None else self.model
