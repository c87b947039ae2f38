"""grpo/trainer/state_files.py: the trainer's state as safetensors + JSON, back exactly (every kind of value a
checkpoint holds: tensors, a tensor held twice, tuples, int-keyed optimizer state, numpy's RNG state and scalars,
a `Batch`, an in-flight `Generated`); reading runs no code. Earlier checkpoints' pickles: the restricted unpickler
reads the pre-redesign fixture and refuses a pickle that would run code."""
from __future__ import annotations

import json
import os
import pickle
import random

import numpy as np
import pytest
import torch

from grpo.batch import Batch
from grpo.errors import SetupError
from grpo.rollout.generator_process import Generated
from grpo.trainer import state_files
from tests.helpers import ROOT


def _batch():
    return Batch(rows=[{"prompt": "p", "answer": "1", "meta": {"k": [1, 2]}}], prompt_ids=[[1, 2]],
                 completion_ids=[[[3], [4, 5]]], truncated=[[False, True]], rewards=torch.tensor([0.5, -1.0]),
                 advantages=torch.tensor([1.0, -1.0]), old_logps=[[torch.tensor([-0.1]), torch.tensor([-0.2, -0.3])]],
                 stats={"reward_mean": 0.25, "nan": float("nan")}, versions=[3])


def _state():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(2, 2))])
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    opt.step()
    shared = torch.arange(4.0)
    random.seed(3)
    np.random.seed(4)
    return {"step": 7, "optimizer": opt.state_dict(), "rng": {"python": random.getstate(),
            "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
            "buffer": _batch(), "in_flight": {"lag": 1, "batches": {8: Generated(8, 7, _batch(), {"epoch": 0})}},
            "twice": [shared, shared], "bf16": torch.ones(2, dtype=torch.bfloat16), "flag": torch.tensor([True]),
            "np_scalar": np.float32(1.5), "empty": torch.zeros(0), "size": torch.Size([2, 3]), "none": None,
            "pair": ("a", torch.ones(2)), "by_index": {0: torch.zeros(1), 1: (torch.ones(1),)}}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, float) and a != a:
        assert b != b
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) or isinstance(a, torch.Size) and type(b) is tuple
        assert len(a) == len(b) and all(_same(x, y) is None for x, y in zip(a, b))
    elif isinstance(a, dict):
        assert list(a) == list(b) and all(_same(a[k], b[k]) is None for k in a)
    elif isinstance(a, (Batch, Generated)):
        assert type(a) is type(b) and _same(vars(a), vars(b)) is None
    else:
        assert type(a) is type(b) and a == b


def test_every_kind_of_state_comes_back_exactly(tmp_path):
    state = _state()
    state_files.save(tmp_path, "s", state)
    back = state_files.load(tmp_path, "s")
    _same(state, back)
    assert back["twice"][0] is back["twice"][1]  # held twice, stored once
    assert isinstance(back["optimizer"]["state"], dict) and sorted(back["optimizer"]["state"]) == [0, 1]
    random.setstate(back["rng"]["python"])  # the RNG states are usable as they come back
    np.random.set_state(back["rng"]["numpy"])
    random.seed(3), np.random.seed(4)
    expected = (random.random(), np.random.rand())
    random.setstate(state["rng"]["python"]), np.random.set_state(state["rng"]["numpy"])
    assert (random.random(), np.random.rand()) == expected
    tree = json.loads((tmp_path / "s.json").read_text())  # plain data: the JSON holds no tensor's values
    assert tree["twice"] == [{"__tensor__": "0"}, {"__tensor__": "0"}] or tree["twice"][0] == tree["twice"][1]


def test_views_of_one_memory_are_stored_apart_and_a_whole_tensor_is_not_copied(tmp_path):
    base = torch.arange(12.0)
    state = {"whole": base, "view": base.view(3, 4), "slice": base[2:5], "strided": base[::3], "t": base.view(3, 4).t()}
    tensors = {}
    tree = state_files.encode(state, tensors, {})
    assert tensors[tree["whole"]["__tensor__"]].data_ptr() == base.data_ptr()  # the optimizer's moments: no copy
    assert tensors[tree["view"]["__tensor__"]].data_ptr() != base.data_ptr()  # a second view of it: a copy
    state_files.save(tmp_path, "s", state)
    back = state_files.load(tmp_path, "s")
    assert all(torch.equal(back[k], v) for k, v in state.items())
    other, transposed = torch.ones(3), torch.arange(6.0).view(2, 3).t()  # whole memories of their own
    tensors = {}
    more = torch.zeros(2)
    tree = state_files.encode({"t": transposed, "a": other, "b": more}, tensors, {})
    assert tensors[tree["a"]["__tensor__"]].data_ptr() == other.data_ptr()  # a second whole tensor: no copy either
    assert tensors[tree["b"]["__tensor__"]].data_ptr() == more.data_ptr()
    state_files.save(tmp_path, "t", {"t": transposed})  # not contiguous: stored as a contiguous copy
    assert torch.equal(state_files.load(tmp_path, "t")["t"], transposed)


def test_a_dict_whose_keys_look_like_tags_and_tuple_keys_round_trip(tmp_path):
    state = {"__tensor__": "not a tensor", "nested": {(1, 2): "tuple key", 3: "int key"}}
    state_files.save(tmp_path, "s", state)
    assert state_files.load(tmp_path, "s") == state


def test_a_value_it_cannot_store_is_named(tmp_path):
    with pytest.raises(TypeError, match="cannot hold a object"):
        state_files.save(tmp_path, "s", {"x": object()})


def test_the_pre_redesign_checkpoints_pickle_is_read_without_running_code():
    state = state_files.load_legacy(ROOT / "tests" / "fixtures" / "pre_redesign_checkpoint" / "step_1" /
                                    "trainer_state.pt")
    assert isinstance(state["buffer"], Batch) and state["step"] == 1
    assert isinstance(state["rng"]["numpy"][1], np.ndarray)


class _Payload:
    """What a malicious pickle does: unpickling calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("how", ["pickle", "pickle-2", "alone", "torch.save"])
def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path, how):
    """A plain pickle (protocol 4: STACK_GLOBAL; protocol 2: GLOBAL; the payload alone) or torch.save's."""
    marker = tmp_path / "ran"
    path = tmp_path / "trainer_state.pt"
    payload = {"step": 1, "optimizer": _Payload(marker)}
    if how == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(_Payload(marker) if how == "alone" else payload, protocol=2 if how == "pickle-2"
                                      else 4))
    with pytest.raises(SetupError, match=r"refusing .*trainer_state.pt: its pickle names posix.system, which would run "
                       "code") as e:
        state_files.load_legacy(path)
    assert "\n" not in str(e.value)
    assert not marker.exists()  # nothing ran


def test_a_damaged_legacy_pickle_is_one_line(tmp_path):
    path = tmp_path / "trainer_state.pt"
    torch.save({"step": 1}, path)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(SetupError) as e:
        state_files.load_legacy(path)
    message = str(e.value)  # torch's first line that says something (at most 200 characters of it)
    assert message.startswith(f"refusing {path}: PytorchStreamReader failed reading zip archive: not a ZIP archive")
    assert message.endswith(" (a checkpoint is read without running code from it); resume from another checkpoint or "
                            "start a new trainer.output_dir")
    assert len(message) == len(f"refusing {path}: ") + 200 + len(message.split(" (a checkpoint is read")[1]) + 22


def test_load_state_notes_an_old_checkpoint_once(tmp_path, capsys):
    torch.save({"step": 2}, tmp_path / "trainer_state.pt")
    assert state_files.load_state(tmp_path, "trainer_state")["step"] == 2
    assert state_files.load_state(tmp_path, "trainer_state")["step"] == 2
    assert capsys.readouterr().err == (f"[grpo] {tmp_path} was written before checkpoints carried a manifest and "
                                       "plain-data state: it is not verified, and its pickle is read without running "
                                       "code; the next checkpoints use the new format\n")
    state_files.save(tmp_path, "trainer_state", {"step": 3})  # the new format wins over the old file
    assert state_files.load_state(tmp_path, "trainer_state")["step"] == 3


def test_a_plain_pickle_naming_nothing_is_refused_with_torchs_reason_not_its_boilerplate(tmp_path):
    path = tmp_path / "trainer_state.pt"
    path.write_bytes(pickle.dumps({"step": 1}, protocol=4))  # torch's restricted unpickler reads no protocol-4 frame
    with pytest.raises(SetupError) as e:
        state_files.load_legacy(path)
    assert str(e.value).startswith(f"refusing {path}: Unsupported operand 149 (a checkpoint is read without running")


def test_todays_state_cut_short_is_one_line_even_where_nobody_verified_it(tmp_path):
    state_files.save(tmp_path, "trainer_state", {"step": 3})
    (tmp_path / "trainer_state.safetensors").unlink()
    with pytest.raises(SetupError, match=r"^checkpoint .*: trainer_state cannot be read \("):
        state_files.load_state(tmp_path, "trainer_state")


def test_a_load_that_fails_without_a_word_is_named_by_its_error(tmp_path, monkeypatch):
    path = tmp_path / "trainer_state.pt"
    path.write_bytes(b"\x80")

    def silent(*args, **kwargs):
        raise EOFError()

    monkeypatch.setattr(torch, "load", silent)
    with pytest.raises(SetupError, match=r"refusing .*trainer_state.pt: EOFError \(a checkpoint is read without"):
        state_files.load_legacy(path)


def test_an_in_flight_batch_pickled_before_the_generators_module_was_renamed_still_loads(tmp_path, monkeypatch):
    """Checkpoints of asynchronous GRPO written before `grpo.rollout.generator` became `generator_process` name the
    in-flight batch's class by its old module: it is still read (without running code) as today's `Generated`."""
    import dataclasses
    import sys
    import types

    old = types.ModuleType("grpo.rollout.generator")

    @dataclasses.dataclass
    class OldGenerated:  # the same fields under the old module's name
        step: int
        version: int
        batch: object
        sampler: dict
        wait_s: float = 0.0
        busy_s: float = 0.0
        load_s: float = 0.0

    OldGenerated.__name__ = OldGenerated.__qualname__ = "Generated"
    OldGenerated.__module__ = old.__name__
    old.Generated = OldGenerated
    monkeypatch.setitem(sys.modules, old.__name__, old)
    path = tmp_path / "trainer_state.pt"
    torch.save({"in_flight": {"batches": {3: OldGenerated(3, 1, None, {"drawn": 2}, 0.5)}}}, path)
    got = state_files.load_legacy(path)["in_flight"]["batches"][3]
    assert type(got) is Generated and (got.step, got.version, got.sampler, got.wait_s) == (3, 1, {"drawn": 2}, 0.5)
