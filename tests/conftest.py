import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture
def cfg_factory(tmp_path):
    """A validated smoke Config with overrides given as a nested dict."""
    from omegaconf import OmegaConf

    from grpo.config import load
    from tests.helpers import smoke_raw

    def make(overrides: dict | None = None):
        raw = OmegaConf.merge(smoke_raw(), {"trainer": {"output_dir": str(tmp_path / "run")}}, overrides or {})
        return load(OmegaConf.to_container(raw, resolve=True))

    return make
