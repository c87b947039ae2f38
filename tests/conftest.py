import os

import pytest
import torch

torch.set_num_threads(1)
# One thread per test process, and for the commands the tests launch: with `make test`'s two pytest-xdist
# workers on two cores, a second torch thread per process only waits for a descheduled one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
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
