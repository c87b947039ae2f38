"""grpo/trainer/checkpoint.py's directory bookkeeping past one digit: steps are ordered by number, not by name
(``step_10`` sorts before ``step_9`` as text), for ``resume=auto``, pruning to ``keep_last`` and what a resume
abandons (``later_than``); and the ranks' agreement on one step to resume."""
from __future__ import annotations

from grpo.trainer import checkpoint


def _save(out, step, keep_last=2):
    return checkpoint.save(out, step, lambda tmp: (tmp / "w").write_text(str(step)), keep_last=keep_last)


def _names(out):
    return [p.name for p in checkpoint.complete_checkpoints(out)]


def test_steps_past_nine_order_by_number_for_resume_and_pruning(tmp_path):
    for step in (8, 9, 10):
        _save(tmp_path, step, keep_last=3)
    (tmp_path / "checkpoints" / "step_11").mkdir()  # no COMPLETE marker: never a checkpoint
    assert _names(tmp_path) == ["step_8", "step_9", "step_10"]  # oldest first, by number
    assert checkpoint.latest(tmp_path).name == "step_10"
    assert checkpoint.resolve_resume("auto", tmp_path).name == "step_10"  # the newest, not step_9
    _save(tmp_path, 11, keep_last=2)  # pruning keeps the two newest: 10 and 11, not 8 and 9
    assert _names(tmp_path) == ["step_10", "step_11"]
    assert (tmp_path / "checkpoints" / "step_11" / "w").read_text() == "11"
    for step in range(12, 101, 11):  # 12, 23, ..., 100: one, two and three digits
        _save(tmp_path, step, keep_last=2)
    assert _names(tmp_path) == ["step_89", "step_100"]
    assert checkpoint.resolve_resume("auto", tmp_path).name == "step_100"


def test_later_than_picks_only_the_numerically_newer_ones(tmp_path):
    """What a resume from a step abandons: the checkpoints after it by number (step_100 and step_19 after step_10;
    step_9 and step_2 before it, though step_9 sorts after step_10 as text)."""
    for step in (2, 9, 10, 19, 100):
        _save(tmp_path, step, keep_last=10)
    assert [p.name for p in checkpoint.later_than(tmp_path, 10)] == ["step_19", "step_100"]
    assert [p.name for p in checkpoint.later_than(tmp_path, 9)] == ["step_10", "step_19", "step_100"]
    assert checkpoint.later_than(tmp_path, 100) == [] and checkpoint.step_of(tmp_path / "step_100") == 100


class _Gathered:
    """A rank whose gather returns what every rank said: its own view and the other ranks' (multi-node resume)."""

    def __init__(self, *others):
        self.others = list(others)

    def gather(self, obj):
        return [obj, *self.others]


def _cfg(out):
    from types import SimpleNamespace

    return SimpleNamespace(trainer=SimpleNamespace(output_dir=str(out)))


def test_ranks_agree_on_the_newest_step_every_node_holds(tmp_path):
    """One output_dir per node: a node that died while finalising step_10 holds one fewer; every rank resumes
    step_9, the newest complete on all of them (by number: step_10 > step_9 > step_2)."""
    import pytest

    from grpo.errors import SetupError
    from grpo.trainer.checkpoint import _agree_on_checkpoint

    for step in (2, 9, 10):
        _save(tmp_path, step, keep_last=5)
    mine = checkpoint.complete_checkpoints(tmp_path)
    newest = checkpoint.latest(tmp_path)
    same = _Gathered(("step_10", ["step_2", "step_9", "step_10"]))
    assert _agree_on_checkpoint(same, _cfg(tmp_path), newest, mine) == (newest, mine)  # all agree: unchanged
    behind = _Gathered(("step_9", ["step_9", "step_2"]), ("step_10", ["step_10", "step_9", "step_2"]))
    ckpt, existing = _agree_on_checkpoint(behind, _cfg(tmp_path), newest, mine)
    assert ckpt == tmp_path / "checkpoints" / "step_9" and existing == mine
    both = _Gathered(("step_10", ["step_2", "step_10"]))  # common: 2 and 10 (10 is newer by number, older by name)
    assert _agree_on_checkpoint(both, _cfg(tmp_path), newest, mine)[0].name == "step_10"
    with pytest.raises(SetupError, match="no checkpoint in common"):
        _agree_on_checkpoint(_Gathered(("step_11", ["step_11"])), _cfg(tmp_path), newest, mine)
    with pytest.raises(SetupError, match="no checkpoint in common"):  # this rank resumes, the other starts fresh
        _agree_on_checkpoint(_Gathered((None, [])), _cfg(tmp_path), newest, mine)


def test_a_fresh_start_is_refused_when_any_node_holds_checkpoints(tmp_path):
    from grpo.trainer.checkpoint import _agree_on_checkpoint

    other = _Gathered((None, ["step_4"]))
    ckpt, existing = _agree_on_checkpoint(other, _cfg(tmp_path), None, [])
    assert ckpt is None and existing == [tmp_path / "checkpoints" / "step_4"]  # restore refuses, naming it
    mine = [tmp_path / "checkpoints" / "step_3"]
    assert _agree_on_checkpoint(_Gathered((None, [])), _cfg(tmp_path), None, mine) == (None, mine)
    assert _agree_on_checkpoint(_Gathered((None, [])), _cfg(tmp_path), None, []) == (None, [])  # all fresh
