"""grpo/runtime/thread_view.py: a thread's view of the runtime; its collectives go over its own group, on CPU.

The collectives are checked against a stand-in runtime and stand-ins for torch.distributed's calls (recording the
group and the tensors' device): a gloo group of two processes is `make test`'s (tests/runtime/test_deepspeed.py)."""
import torch

from grpo.runtime.thread_view import ThreadView


class _Runtime:
    """Answers `_reduce` as a two-rank sum or max of the values and the values + 1, and records how it was asked."""
    world_size, rank, device, model = 3, 1, torch.device("cuda"), "the model"

    def __init__(self):
        self.calls = []

    def _reduce(self, values, op, group=None, device=None):
        self.calls.append((op, group, device))
        if op == torch.distributed.ReduceOp.SUM:
            return {k: v + (v + 1) for k, v in values.items()}
        return {k: max(v, v + 1) for k, v in values.items()}

    def full_weights(self, params):
        return ("full", params)


def test_the_view_answers_as_its_runtime_except_the_collectives():
    rt = _Runtime()
    view = ThreadView(rt, "group")
    assert view.rank == 1 and view.world_size == 3 and view.device == torch.device("cuda") and view.model == "the model"
    assert view.full_weights([1]) == ("full", [1])


def test_reductions_go_over_the_views_group_on_cpu_tensors():
    rt = _Runtime()
    view = ThreadView(rt, "group")
    assert view.all_reduce({"a": 1.0, "b": 2.0}) == {"a": 3.0, "b": 5.0}
    assert view.all_max({"a": 1.0}) == {"a": 2.0}
    ops = torch.distributed.ReduceOp
    assert rt.calls == [(ops.SUM, "group", "cpu"), (ops.MAX, "group", "cpu")]


def test_any_rank_is_a_sum_of_flags_over_the_group():
    class Rt(_Runtime):
        def _reduce(self, values, op, group=None, device=None):
            self.calls.append((op, group, device))
            return {k: v + self.others for k, v in values.items()}

    rt = Rt()
    view = ThreadView(rt, "group")
    rt.others = 0.0
    assert view.any_rank(True) is True and view.any_rank(False) is False
    rt.others = 1.0
    assert view.any_rank(False) is True
    rt.others = -1.0  # a flag sum of exactly 0 is "no rank": strictly positive means some rank said True
    assert view.any_rank(True) is False
    assert {c[0] for c in rt.calls} == {torch.distributed.ReduceOp.SUM} and {c[1] for c in rt.calls} == {"group"}


def test_gather_and_barrier_go_over_the_views_group(monkeypatch):
    seen = []

    def all_gather_object(out, obj, group=None):
        seen.append(("gather", list(out), group))
        for i in range(len(out)):
            out[i] = (i, obj)

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(torch.distributed, "barrier", lambda group=None: seen.append(("barrier", group)))
    view = ThreadView(_Runtime(), "group")
    assert view.gather("x") == [(0, "x"), (1, "x"), (2, "x")]
    assert view.barrier() is None
    assert seen == [("gather", [None, None, None], "group"), ("barrier", "group")]
