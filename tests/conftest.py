import json
import os
from pathlib import Path

import pytest
import torch

# torch.testing.assert_close's first call imports torch.distributed.tensor (and sympy): about 1 s. Imported here, it is
# paid once per test process, and mutmut's mutants, forked from a process that collected the tests, do not pay it
# again each (one kernel module's mutants: 107 CPU-s without, 39 with).
import torch.distributed.tensor  # noqa: F401

torch.set_num_threads(1)
# One thread per test process, and for the commands the tests launch: with `make test`'s two pytest-xdist
# workers on two cores, a second torch thread per process only waits for a descheduled one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

# Tests that one pytest-xdist worker runs together, one after the other, in file order: those that write a recipe
# into this checkout's recipes/ or read every file there (test_docs_commands' commands write theirs into a copy of
# the checkout); those that share a module fixture launching a run (run once, not once per worker). Every other
# test is scheduled on its own. (pytest-xdist's xdist_group mark does not group under pytest 9.2, whose node ids it
# can no longer rewrite, so the scheduler is given the grouping here.)
TOGETHER = {
    "recipes_dir": ("tests/config/test_compose.py::test_a_recipe_written_from_the_docs_snippets",
                    "tests/config/test_compose.py::test_a_built_in_folder_recipe_with_a_comment_above",
                    "tests/config/test_schema.py::test_recipes_compose_and_validate",
                    "tests/e2e/test_config_reference.py::"),
    "report_sweep": ("tests/trainer/test_report.py::",),           # `sweep`: a two-run smoke sweep
    "run_output_first_run": tuple(f"tests/e2e/test_run_output.py::test_{name}" for name in (  # `cli`, `first_run`
        "a_removed_reward", "everything_lands", "train_log_holds", "a_reward_that_raises", "a_quiet_console",
        "beta_zero_logs", "resume_keeps", "a_reward_returning", "a_hanging_reward")),  # resume_keeps resumes the run
    "server": ("tests/e2e/test_server.py::",),  # `ctx`: one grpo-serve process the walkthrough starts late
    "multinode": ("tests/e2e/test_multinode.py::",),  # `nodes`: one launch of two torchrun nodes
    "damaged_checkpoint": ("tests/e2e/test_damaged_checkpoint.py::",),  # `runs`: a three-step run and a resume of it
    "own_project": ("tests/e2e/test_own_project.py::",),  # `installed`: a fresh venv with the wheel and torch
    "memory_cli": tuple(f"tests/engine/test_memory.py::test_{name}" for name in (  # `cli`: three commands, one process
        "impossible_fit", "auto_is")),
    "tools_cli": tuple(f"tests/e2e/test_tools_train.py::test_{name}" for name in (  # `cli`: one process
        "a_smoke_run_with", "a_bad_tool", "tools_with_the_tiny", "tools_with_smollm2")),
    "conversational": ("tests/e2e/test_conversational.py::test_a_",),  # `smoke_runs`: two runs, one process
    "docs_commands": ("tests/e2e/test_docs_commands.py::test_documented",),  # `ran`: every command in one process
}


def _scope(nodeid: str) -> str:
    return next((group for group, prefixes in TOGETHER.items() if nodeid.startswith(prefixes)), nodeid)


# Seconds each scheduling unit (a TOGETHER group, else a test) took in a whole `make test`, setup and teardown
# included: the order the scheduler hands out work. `RECORD_DURATIONS=1 make test` writes it again (docs/testing.md).
DURATIONS = Path(__file__).parent / "durations.json"
UNKNOWN_SLOW_S = 30.0  # a slow-marked unit not in DURATIONS yet (a new test) is ranked as if it took this long


def pytest_collection_modifyitems(items):
    """Longest first, by DURATIONS (a group by its whole time; a slow-marked unit not recorded yet as UNKNOWN_SLOW_S,
    any other as 0 s), each group's tests in their order: the scheduler hands out work in this order, so the long
    launches overlap from the start and both workers end together on short tests instead of one running a long
    test alone at the end."""
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    slow = {_scope(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items[:] = longest_first(items, lambda item: _scope(item.nodeid), recorded, slow)
    _cheapest_first_under_mutmut(items)


def longest_first(items: list, scope_of, recorded: dict[str, float], slow: set[str]) -> list:
    """``items`` ordered by their unit's cost, highest first; a unit's items together, in their order; units of the
    same cost in collection order."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(scope_of(item), i)

    def cost(unit: str) -> float:
        return recorded.get(unit, UNKNOWN_SLOW_S if unit in slow else 0.0)

    return sorted(items, key=lambda item: (-cost(scope_of(item)), first[scope_of(item)]))


_took: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """With RECORD_DURATIONS=1: add up each unit's setup, call and teardown (in the controller under xdist)."""
    if os.environ.get("RECORD_DURATIONS") == "1":
        _took[_scope(report.nodeid)] = _took.get(_scope(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """With RECORD_DURATIONS=1: merge this run's times into DURATIONS (units not run keep theirs)."""
    if os.environ.get("RECORD_DURATIONS") == "1" and not hasattr(session.config, "workerinput") and _took:
        merge_durations(DURATIONS, _took)


def merge_durations(path: Path, took: dict[str, float]) -> None:
    """``took`` (seconds per unit) written into the file at ``path`` over what it held, rounded to 0.01 s."""
    recorded = json.loads(path.read_text()) if path.exists() else {}
    recorded.update({unit: round(s, 2) for unit, s in took.items()})
    path.write_text(json.dumps(dict(sorted(recorded.items())), indent=0) + "\n")


def _cheapest_first_under_mutmut(items) -> None:
    """In a `make mutate` mutant's run (docs/testing.md; mutmut runs it in mutants/ with ``-x``): the test files
    that reached the mutant in order of their fastest test, each file's tests fastest first, timed by mutmut's
    stats run. The first failing test ends the run, so a mutant a unit test kills no longer waits for a collect-
    level test that happened to come first. A file's tests stay together (its module fixtures are built once)."""
    if os.environ.get("MUTANT_UNDER_TEST", "") in ("", "stats", "fail") or not os.path.exists("mutmut-stats.json"):
        return
    with open("mutmut-stats.json") as f:
        took = json.load(f)["duration_by_test"]
    cost = {item.nodeid: took.get(item.nodeid, float("inf")) for item in items}
    first = {}
    for item in items:
        first[item.path] = min(first.get(item.path, float("inf")), cost[item.nodeid])
    items.sort(key=lambda item: (first[item.path], str(item.path), cost[item.nodeid]))


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist there is nothing to schedule
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Together(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False  # the order is pytest_collection_modifyitems's, not by group size
    return Together(config, log)


@pytest.fixture
def cfg_factory(tmp_path):
    """A validated smoke Config with overrides given as a nested dict."""
    from omegaconf import OmegaConf

    from grpo.config.schema import load
    from tests.helpers import smoke_raw

    def make(overrides: dict | None = None):
        raw = OmegaConf.merge(smoke_raw(), {"trainer": {"output_dir": str(tmp_path / "run")}}, overrides or {})
        return load(OmegaConf.to_container(raw, resolve=True))

    return make
