"""Every command block of docs/distributed.md, validated without a cluster: each block says in a first comment
line that it is a cluster-only example validated here; every launcher command in it (torchrun, deepspeed,
accelerate launch, srun, a SLURM batch script's directives) is parsed by that launcher's own argument parser,
its `grpo.train` overrides compose into a valid config, and its number of processes passes the start-up checks
(`rollout.prompts_per_step` and the held-out split divide over the ranks). The launches themselves run, scaled
to one machine, in tests/e2e/test_distributed.py, tests/e2e/test_multinode.py and tests/e2e/test_rank_failure.py."""
from __future__ import annotations

import importlib.util
import re
import shlex

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None
                                or importlib.util.find_spec("accelerate") is None,
                                reason="needs deepspeed and accelerate (their launchers' parsers)")

DOC = ROOT / "docs" / "distributed.md"
MARK = "cluster-only example (validated by tests/e2e/test_distributed_docs.py"
LAUNCHERS = ("torchrun", "deepspeed", "accelerate", "srun")
# what the SLURM variables stand for when a batch script is checked (its own #SBATCH --nodes wins)
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]"}
SBATCH_OPTIONS = {"job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "requeue",
                  "partition", "output", "error", "mem", "exclusive", "account"}


def blocks() -> list[str]:
    """Every fenced block of the doc that holds a launcher command."""
    out = []
    for block in re.findall(r"```\w*\n(.*?)```", DOC.read_text(), re.S):
        lines = [ln.strip() for ln in block.replace("\\\n", " ").splitlines()]
        if any(ln.split()[:1] and ln.split()[0] in LAUNCHERS for ln in lines):
            out.append(block)
    return out


def commands(block: str, env: dict) -> list[list[str]]:
    """The launcher commands of ``block`` as words, shell variables replaced from ``env``."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m[1], m[0]), line.strip())
        words = shlex.split(line, comments=True)
        if words and words[0] in LAUNCHERS:
            out.append(words[1:] if words[0] == "srun" else words)
    return out


def sbatch(block: str) -> dict:
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=?(\S*)", block, re.M))
    assert set(directives) <= SBATCH_OPTIONS, set(directives) - SBATCH_OPTIONS
    return directives


def launch(words: list[str], block: str) -> tuple[int, list[str]]:
    """(number of processes, grpo.train overrides) of one launcher command, parsed by the launcher's parser."""
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        a = get_args_parser().parse_args(words[1:])
        assert a.module and a.training_script == "grpo.train", words
        nnodes = int(str(a.nnodes).split(":")[-1])
        return nnodes * int(a.nproc_per_node), a.training_script_args
    if words[0] == "deepspeed":
        from deepspeed.launcher.runner import parse_args

        a = parse_args(words[1:])
        assert a.module and a.user_script == "grpo.train", words
        if "--hostfile" in words:  # the doc shows the hostfile's lines as comments: "#   node1 slots=8"
            slots = [int(n) for n in re.findall(r"^#\s+\S+ slots=(\d+)", block, re.M)]
            assert slots, "the hostfile example lists no hosts"
            return sum(slots), a.user_args
        return a.num_gpus, a.user_args
    assert words[:2] == ["accelerate", "launch"], words
    from accelerate.commands.launch import launch_command_parser

    a = launch_command_parser().parse_args(words[2:])
    assert a.module and a.training_script == "grpo.train", words
    return a.num_processes, a.training_script_args


def check_run(world: int, overrides: list[str]) -> None:
    from omegaconf import OmegaConf

    from grpo.config.compose import compose
    from grpo.config.schema import load
    from grpo.runtime.base import check_world_size

    if not any(o.startswith("trainer.output_dir=") for o in overrides):  # the command line names one itself
        overrides = [*overrides, "trainer.output_dir=outputs/doc-check"]
    raw = compose(overrides)
    cfg = load(OmegaConf.to_container(OmegaConf.masked_copy(raw, [k for k in raw if k != "hydra"]), resolve=True))
    assert cfg.distributed.backend == "deepspeed", overrides
    check_world_size(cfg.rollout.prompts_per_step, world)
    assert cfg.data.num_eval == 0 or cfg.data.num_eval >= world


def test_every_command_block_is_marked_and_validated():
    found = blocks()
    assert len(found) >= 6
    launches = 0
    for block in found:
        assert MARK in block.splitlines()[0] or MARK in block.splitlines()[1], block[:200]
        env = dict(SLURM)
        if "#SBATCH" in block:
            directives = sbatch(block)
            env["SLURM_NNODES"] = directives["nodes"]
            env["MASTER"] = "node1"
            assert directives["ntasks-per-node"] == "1"  # one torchrun per node starts that node's ranks
        for words in commands(block, env):
            world, overrides = launch(words, block)
            if "#SBATCH" in block:
                assert world == int(directives["nodes"]) * int(directives["gpus-per-node"])
            check_run(world, overrides)
            launches += 1
    assert launches >= 10


def test_the_checks_catch_a_wrong_command():
    block = "# " + MARK + ")\ntorchrun --nnodes 3 --nproc_per_node 8 -m grpo.train recipe=zero3-multi\n"
    (words,) = commands(block, {})
    from grpo.errors import SetupError

    with pytest.raises(SetupError, match="prompts_per_step=64 must be divisible"):
        check_run(*launch(words, block))                      # 24 processes do not divide 64 prompts
    with pytest.raises(SystemExit):
        launch(["torchrun", "--num-nodes", "2", "-m", "grpo.train"], block)  # a flag torchrun does not have
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError):
        check_run(8, ["recipe=zero3-multi", "trainer.sve_every=5"])  # a misspelt key
