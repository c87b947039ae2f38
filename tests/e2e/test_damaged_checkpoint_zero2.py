"""A damaged newest checkpoint on two processes under DeepSpeed ZeRO-2 with ``rollout.max_staleness=1`` (docs/async.md's
torchrun command, scaled down), every file of it in turn (issue 41; one process: tests/e2e/test_damaged_checkpoint.py).

Run by torchrun, this file is also the worker (``python tests/e2e/test_damaged_checkpoint_zero2.py MODE OUT_DIR
args...``, phases separated by ``--then``): ``train`` is the real command line; ``cases`` runs every case of
OUT_DIR/plan.json in this process, one after the other, both ranks together (`run_cases`), each `fit` with the
plan's config and its own ``trainer.output_dir`` / ``trainer.resume``, and writes what each rank said and raised to
OUT_DIR/said_rank<r>.json. The two processes are two torchrun "nodes" of one process each (tests/e2e/test_multinode.py),
so that the same launch runs one shared ``trainer.output_dir`` and one per node (no shared filesystem).
"""
from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DAMAGE = ("truncate", "empty", "delete")


def damage(path: Path, how: str) -> None:
    """``truncate`` (to half), ``empty``, ``delete``, or ``flip`` its last byte (same size: only the checksum tells)."""
    if how == "delete":
        path.unlink()
        return
    data = path.read_bytes()
    cut = {"truncate": data[: len(data) // 2], "empty": b"", "flip": data[:-1] + bytes([data[-1] ^ 1])}[how]
    path.write_bytes(cut)


class _Said(io.TextIOBase):
    """stderr, each line also kept."""

    def __init__(self, stream):
        self.stream, self.text = stream, []

    def write(self, s: str) -> int:
        self.text.append(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()


def plan(tmp: Path, files: list[str]) -> list[dict]:
    """The cases, in order, after the three-step run ``tmp/ref`` (``files``: its step_3's, the manifest included).
    A case: ``{"name", "dirs": [trainer.output_dir of rank 0, of rank 1], "resume", "copy": [what rank 0 copies
    there first, what rank 1 does] (without final/; null: nothing), "damage": [[rank, file of step_3, how], ...]}``.

    - ``from2``: ref resumed from its step 2 (what every case below must continue with);
    - for every file and every way of damaging it, in ref's copy ``shared/<i>`` (one directory for both ranks):
      ``explicit:<file>:<how>``, ``trainer.resume=<its step_3>`` into a new directory, then ``auto:<file>:<how>``;
    - ``flip``: a byte of rank 1's ZeRO shard flipped (only rank 0 reads the files), explicit then auto;
    - one directory per node: ``pernode`` trains 3 steps afresh into ``pernode/node<r>``, then ``pernode:<r>:<file>:
      <how>`` resumes a copy of it (auto) with only node r's copy of that file damaged."""
    ref, both = str(tmp / "ref"), lambda p: [str(p), str(p)]
    shard = next(f for f in files if f.startswith("deepspeed/") and "zero_pp_rank_1_" in f)
    cases = [{"name": "from2", "dirs": both(tmp / "from2"), "copy": [ref, None],
              "resume": str(tmp / "from2" / "checkpoints" / "step_2")}]
    for i, (name, how) in enumerate([(f, h) for f in files for h in DAMAGE] + [(shard, "flip")]):
        d = tmp / "shared" / str(i)
        cases += [{"name": f"explicit:{name}:{how}", "dirs": both(tmp / "shared" / f"{i}-new"), "copy": [ref, None],
                   "copies": both(d), "damage": [[0, name, how]], "resume": str(d / "checkpoints" / "step_3")},
                  {"name": f"auto:{name}:{how}", "dirs": both(d), "resume": "auto"}]
    nodes = [str(tmp / "pernode" / f"node{r}") for r in (0, 1)]
    cases.append({"name": "pernode", "dirs": nodes, "resume": None})
    for i, (r, name, how) in enumerate([(1, "rank_1.safetensors", "truncate"), (0, "trainer_state.json", "empty"),
                                        (1, shard, "flip"), (1, "COMPLETE", "delete")]):
        cases.append({"name": f"pernode:{r}:{name}:{how}", "dirs": [f"{n}-{i}" for n in nodes], "copy": nodes,
                      "damage": [[r, name, how]], "resume": "auto"})
    return cases


def run_cases(args: list[str], out: Path) -> None:
    """Every case of `plan` in turn (``args``: the config's overrides, the recipe first)."""
    import dataclasses

    import torch.distributed as dist
    from omegaconf import OmegaConf

    from grpo.config.schema import load
    from grpo.errors import GRPOError
    from grpo.trainer import manifest
    from grpo.trainer.loop import fit
    from tests.helpers import compose_recipe

    recipe, *overrides = args
    raw = compose_recipe(recipe.split("=", 1)[1], [*overrides, f"trainer.output_dir={out}"])  # each case sets its own
    base = load(OmegaConf.to_container(raw, resolve=True))
    rank, said = int(os.environ["RANK"]), {}
    step3 = out / "ref" / "checkpoints" / "step_3"
    for case in plan(out, [*manifest.files_of(step3), manifest.NAME]):
        mine = Path(case["dirs"][rank])
        copy = Path(case.get("copies", case["dirs"])[rank])  # where the copy goes (an explicit case: not its run)
        if case.get("copy") and case["copy"][rank]:
            shutil.copytree(case["copy"][rank], copy, ignore=shutil.ignore_patterns("final", ".hydra"))
        for r, name, how in case.get("damage", []):
            if r == rank:
                damage(copy / "checkpoints" / "step_3" / name, how)
        dist.barrier()  # every copy is in place
        cfg = dataclasses.replace(base, trainer=dataclasses.replace(base.trainer, output_dir=str(mine),
                                                                    resume=case["resume"]))
        stderr, sys.stderr = sys.stderr, _Said(sys.stderr)
        error = None
        try:
            fit(cfg)
        except GRPOError as e:
            error = str(e)
        finally:
            said[case["name"]] = {"lines": "".join(sys.stderr.text).splitlines(), "error": error}
            sys.stderr = stderr
        dist.barrier()  # every rank is done with the case
    (out / f"said_rank{rank}.json").write_text(json.dumps(said))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    from tests.e2e.test_distributed import train
    from tests.helpers import run_phases

    run_phases(sys.argv[1:], {"train": train, "cases": run_cases})
    sys.exit(0)


# ------------------------------------------------------------------------------------ the tests
import importlib.util  # noqa: E402

import pytest  # noqa: E402

from grpo.trainer import checkpoint, manifest  # noqa: E402
from tests.e2e.test_async import same_numbers, steps  # noqa: E402
from tests.helpers import THEN  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="distributed tests need deepspeed (pip install 'grpo[deepspeed]')")


def _one_damaged_line(said: dict, name: str) -> list[str]:
    return [line for line in said["lines"] if "is damaged" in line and name in line]


@pytest.mark.slow
def test_every_file_of_a_two_process_zero2_async_checkpoint_damaged_in_turn(tmp_path):
    """One launch (two processes, ZeRO-2, K = 1, a checkpoint every step): a three-step run, then for every file of
    its newest checkpoint (each rank's files, DeepSpeed's, the state, COMPLETE, MANIFEST.json) truncated, emptied and
    deleted, and for a byte flipped in rank 1's ZeRO shard, in a copy: ``trainer.resume=<that checkpoint>`` stops
    both ranks with the same line naming the file, before anything is made; ``trainer.resume=auto`` passes over it
    with one line (rank 0's, the rank that verifies), keeps it as ``damaged-step_3`` as it was found, and trains step
    3 again from step 2 with the metrics of a resume from step 2 (= the uninterrupted run's), writing a step_3 that
    verifies. Then one directory per node: only one node's copy damaged, every rank resumes step 2 (that node says
    why), the same metrics."""
    from tests.e2e.test_async_distributed import doc_command
    from tests.e2e.test_docs_commands import SCALE
    from tests.e2e.test_multinode import two_nodes

    given = doc_command()
    assert given["distributed"] == "zero2" and given["rollout.max_staleness"] == "1"
    scaled = {**given, **SCALE, "trainer.max_steps": "3", "trainer.save_every": "1", "trainer.keep_last": "3",
              "logging.sample_every": "0", "logging.plot": "false"}
    run = [f"{k}={v}" for k, v in scaled.items()]
    phases = [str(Path(__file__)), "train", tmp_path, *run, f"trainer.output_dir={tmp_path / 'ref'}",
              THEN, "cases", tmp_path, *run]
    two_nodes(tmp_path, [list(map(str, phases))] * 2, timeout=900)

    ref, step3 = steps(tmp_path / "ref"), tmp_path / "ref" / "checkpoints" / "step_3"
    files = [*manifest.files_of(step3), manifest.NAME]
    assert {"COMPLETE", "trainer_state.json", "trainer_state.safetensors", "rank_0.json", "rank_0.safetensors",
            "rank_1.json", "rank_1.safetensors", manifest.NAME} <= set(files)
    assert sum(n.startswith("deepspeed/") for n in files) >= 4  # the model states, both ranks' shards, the world
    said = [json.loads((tmp_path / f"said_rank{r}.json").read_text()) for r in (0, 1)]
    cases = plan(tmp_path, files)
    assert [c["name"] for c in cases] == list(said[0]) == list(said[1])  # every case ran, on both ranks
    assert ref[3]["async/version"] == 1 and ref[3]["async/staleness_max"] == 1  # step 3: the batch in flight
    from2 = steps(tmp_path / "from2")
    same_numbers(ref, from2)
    checked = set()
    for case in cases:
        kind, *what = case["name"].split(":")
        s0, s1 = said[0][case["name"]], said[1][case["name"]]
        if kind == "explicit":
            name, how = what[0], what[1]
            assert s0["error"] == s1["error"] and s0["error"] and "\n" not in s0["error"], case["name"]
            assert f"is damaged: {name}" in s0["error"] or (name == "COMPLETE" and "not a complete checkpoint"
                                                            in s0["error"]), (case["name"], s0["error"])
            made = Path(case["dirs"][0])  # refused before anything was made (a checksum: once the model loaded)
            assert not made.exists() if how != "flip" else not {"checkpoints", "metrics.jsonl"} & set(
                p.name for p in made.iterdir()), case["name"]
        elif kind == "auto":
            name, how = what[0], what[1]
            out = Path(case["dirs"][0])
            assert s0["error"] is None and s1["error"] is None, (case["name"], s0["error"], s1["error"])
            line, = _one_damaged_line(s0, f"checkpoint step_3 is damaged ({name}")
            assert "resuming from step_2" in line and f"kept as {out / 'checkpoints' / 'damaged-step_3'}" in line
            assert not _one_damaged_line(s1, "is damaged")  # rank 1 neither verifies nor moves the shared copy
            kept = out / "checkpoints" / "damaged-step_3" / name
            assert kept.exists() == (how != "delete"), case["name"]  # kept as it was found
            if how != "delete":
                original = (step3 / name).read_bytes()
                assert kept.read_bytes() == {"truncate": original[: len(original) // 2], "empty": b"",
                                             "flip": original[:-1] + bytes([original[-1] ^ 1])}[how], case["name"]
            assert checkpoint.damage(out / "checkpoints" / "step_3") is None, case["name"]  # written again, whole
            assert f"resumed from {out / 'checkpoints' / 'step_2'} (step 2)" in "\n".join(s0["lines"])
            same_numbers(from2, steps(out))
            checked.add((name, how))
        elif kind == "pernode" and what:
            r, name, how = int(what[0]), what[1], what[2]
            nodes = [Path(d) for d in case["dirs"]]
            assert s0["error"] is None and s1["error"] is None, (case["name"], s0["error"], s1["error"])
            line, = _one_damaged_line(said[r][case["name"]], f"checkpoint step_3 is damaged ({name}")
            assert f"kept as {nodes[r] / 'checkpoints' / 'damaged-step_3'}" in line
            assert not _one_damaged_line(said[1 - r][case["name"]], "is damaged")  # its copy is intact
            assert not (nodes[1 - r] / "checkpoints" / "damaged-step_3").exists()
            for node in nodes:
                assert checkpoint.damage(node / "checkpoints" / "step_3") is None, case["name"]
            same_numbers(ref, steps(nodes[0]))  # every rank resumed step 2: rank 0's metrics
        elif kind == "pernode":
            same_numbers(ref, steps(Path(case["dirs"][0])))  # one directory per node: the shared directory's run
    shard = next(f for f in files if "zero_pp_rank_1_" in f)
    assert checked == {(f, h) for f in files for h in DAMAGE} | {(shard, "flip")}  # every file, every way
