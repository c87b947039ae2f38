"""A checkpoint written by the tree before the stage-package redesign (main at b7ec722: `grpo/loop.py`,
`grpo/checkpoint.py`, ... at the top of the package) still resumes, rollout buffer and all.

tests/fixtures/pre_redesign_checkpoint/step_1 is that tree's step-1 checkpoint of a two-step smoke run (a smaller
tiny model, num_iterations=2, zero-std filtering with one resample round; overrides.json): its trainer_state.pt
pickles the step's `grpo.batch.Batch` (the second optimizer pass reuses it), so `grpo.batch` must stay importable.
expected.json holds what that tree logged for step 2 when it ran straight through."""
import json
import shutil

import pytest

from grpo.batch import Batch
from grpo.trainer import checkpoint
from grpo.trainer.loop import train
from grpo.trainer.state_files import load_legacy
from tests.helpers import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "pre_redesign_checkpoint"


def test_a_checkpoint_of_the_pre_redesign_tree_resumes_to_the_same_step(cfg_factory, tmp_path, capsys):
    """Its pickle read without running code (the restricted unpickler), with a one-time note; the checkpoint it
    writes next is today's format."""
    ckpt = tmp_path / "old" / "step_1"
    shutil.copytree(FIXTURE / "step_1", ckpt)
    state = load_legacy(ckpt / "trainer_state.pt")
    assert isinstance(state["buffer"], Batch) and state["buffer"].old_logps is not None
    overrides = json.loads((FIXTURE / "overrides.json").read_text())
    overrides["trainer"].update(output_dir=str(tmp_path / "new"), resume=str(ckpt))
    assert train(cfg_factory(overrides))["steps"] == 2
    assert capsys.readouterr().err.count("was written before checkpoints carried a manifest") == 1
    assert checkpoint.damage(tmp_path / "new" / "checkpoints" / "step_2") is None  # a manifest, no pickle
    assert not list((tmp_path / "new" / "checkpoints" / "step_2").glob("*.pt"))
    rows = [json.loads(line) for line in (tmp_path / "new" / "metrics.jsonl").read_text().splitlines()]
    step2 = next(r for r in rows if r.get("step") == 2 and "loss" in r)
    expected = json.loads((FIXTURE / "expected.json").read_text())["step_2"]
    for key, value in expected.items():  # step 2 trains on the buffered rollouts: the same numbers
        assert step2[key] == pytest.approx(value, rel=1e-5, abs=1e-8), key
