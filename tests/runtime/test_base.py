"""grpo/runtime/base.py: the one-process behaviour every runtime starts from; the world-size check."""
import pytest

from grpo.errors import SetupError
from grpo.runtime.base import Runtime, check_world_size
from grpo.runtime.local import LocalRuntime


def test_collectives_of_one_process_are_the_identity():
    rt = LocalRuntime("cpu")
    assert isinstance(rt, Runtime) and rt.world_size == 1 and rt.is_main
    assert rt.all_reduce({"a": 1.5}) == {"a": 1.5} and rt.all_max({"n": 3.0}) == {"n": 3.0}
    assert rt.gather(7) == [7] and rt.any_rank(True) and not rt.any_rank(False)
    with rt.generation_context() as extra:
        assert extra == {}


def test_prompts_per_step_must_divide_among_the_processes():
    check_world_size(8, 4)
    with pytest.raises(SetupError, match="rollout.prompts_per_step=6 must be divisible.*4"):
        check_world_size(6, 4)
