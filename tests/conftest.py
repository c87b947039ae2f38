import os

import pytest
import torch

torch.set_num_threads(1)
# One thread per test process, and for the commands the tests launch: with `make test`'s two pytest-xdist
# workers on two cores, a second torch thread per process only waits for a descheduled one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

# Tests that write a recipe into recipes/ (the docs tell users to) or read every file there: one pytest-xdist
# worker runs them all, one after the other, in file order (test_docs_commands' commands also build on each
# other). Every other test is scheduled on its own. (pytest-xdist's xdist_group mark does not group under
# pytest 9.2, whose node ids it can no longer rewrite, so the scheduler is given the grouping here.)
RECIPES_DIR_TESTS = (
    "tests/test_composition.py::test_a_recipe_written_from_the_docs_snippets",
    "tests/test_config.py::test_recipes_compose_and_validate",
    "tests/test_config_reference.py::",
    "tests/test_docs_commands.py::",
)


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist there is nothing to schedule
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class RecipesDirTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "recipes_dir" if nodeid.startswith(RECIPES_DIR_TESTS) else nodeid

    return RecipesDirTogether(config, log)


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
