"""Every command block of README.md and the user docs, run as a user would paste it, scaled down (the tiny
model, one step), each checked for the effect its text promises. A command added to those docs without a
case here fails `test_every_documented_command_has_a_case`. The commands run from a checkout of the user's own (a copy
of this one's code, configs and recipes, as getting-started.md's `git clone ... && cd grpo` leaves the user in, with
the files the docs tell the user to write), so the recipe the docs tell the user to write into recipes/ never lands
in this checkout; each test's commands in a working directory of their own (the commands that build on each other,
`CHAINS`, in one, in their order). All of them run in one process (tests/in_one_process.py: each is the entry
point's main() with the command's arguments, its exit status and output those of a process of its own), which
imports torch and transformers once instead of once per command."""
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, in_one_process

DOCS = ["README.md", "docs/getting-started.md", "docs/data.md", "docs/tasks.md", "docs/rewards.md",
        "docs/tools-and-environments.md"]
# key -> value appended unless the command sets the key itself: the tiny model, one short step
SCALE = {"model": "tiny", "trainer.max_steps": "1", "data.num_eval": "0", "rollout.max_new_tokens": "8",
         "rollout.prompts_per_step": "2", "data.num_train": "32"}


# the last section of getting-started.md runs from an installed wheel outside the checkout:
# tests/e2e/test_own_project.py
OWN_PROJECT = "## 8. Use it from your own project"


def doc_commands() -> list[str]:
    out = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text().split(OWN_PROJECT)[0], re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line.strip(), comments=True)
                if words[:1] in (["grpo-train"], ["grpo-report"]) or words[:3] == ["python", "-m", "grpo.train"]:
                    command = shlex.join(words)
                    if command not in out:
                        out.append(command)
    return out


def block_starting_with(doc: str, first_line: str) -> str:
    """The fenced block of ``doc`` whose first line is ``first_line`` (a file the docs tell you to write)."""
    for block in re.findall(r"```\w*\n(.*?)```", (ROOT / doc).read_text(), re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"{doc} has no block starting with {first_line!r}")


# ------------------------------------------------------------------------------------------ checks
def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps(run_dir: Path) -> list[dict]:
    return [m for m in metrics(run_dir) if "loss" in m]


def saved_config(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())


def scored(run_dir: Path) -> set[str]:
    return {k.split("/")[1] for m in steps(run_dir) for k in m if k.startswith("reward/") and "_" not in k[7:]}


def run_dirs(cwd: Path) -> set[Path]:
    return {p.parent for p in cwd.glob("outputs/*/*/.hydra")}


def new_run(ctx) -> Path:
    """The run directory the last command created under ./outputs."""
    runs = run_dirs(ctx.cwd) - ctx.before
    assert len(runs) == 1, runs
    return runs.pop()


def check_steps(n):
    def check(ctx, p):
        assert [m["step"] for m in steps(new_run(ctx))] == list(range(1, n + 1))
    return check


def check_group_size(g):
    def check(ctx, p):
        run = new_run(ctx)
        assert saved_config(run)["algorithm"]["group_size"] == g
        assert steps(run)
    return check


def check_sweep(sizes, sweep_dir):
    def check(ctx, p):
        runs = sorted((ctx.cwd / sweep_dir).glob("*/metrics.jsonl")) if sweep_dir else \
            sorted(q for q in ctx.cwd.glob("multirun/*/*/*/metrics.jsonl"))
        assert sorted(saved_config(r.parent)["algorithm"]["group_size"] for r in runs) == sorted(sizes)
    return check


def check_rewards(expected: dict):
    """The run scored exactly these functions (name -> fn)."""
    def check(ctx, p):
        run = new_run(ctx)
        assert scored(run) == set(expected), scored(run)
        assert {k: v["fn"] for k, v in saved_config(run)["reward"]["functions"].items()} == expected
    return check


def check_cfg_job(rewards: dict, task_kwargs: dict):
    def check(ctx, p):
        cfg = yaml.safe_load(p.stdout)
        assert {k: v["fn"] for k, v in cfg["reward"]["functions"].items()} == rewards
        assert cfg["data"]["task_kwargs"] == task_kwargs
    return check


def check_error(line):
    def check(ctx, p):
        assert p.stderr.strip() == line
    return check


def check_dir(path, **expect):
    def check(ctx, p):
        run = ctx.cwd / path
        assert (run / "final").is_dir() and steps(run)
        if "resumed" in expect:
            assert expect["resumed"] in p.stderr
        if "rewards" in expect:
            assert scored(run) == expect["rewards"]
    return check


def check_report(sweep_dir, rows):
    def check(ctx, p):
        md = (ctx.cwd / sweep_dir / "report.md").read_text()
        assert sum(line.startswith("| `") for line in md.splitlines()) == rows
        assert all((ctx.cwd / sweep_dir / png).exists() for png in ("reward.png", "heldout.png", "kl_length.png"))
    return check


def check_weight(name, weight):
    def check(ctx, p):
        run = new_run(ctx)
        assert saved_config(run)["reward"]["functions"][name]["weight"] == weight and name in scored(run)
    return check


def check_task(expected: dict):
    def check(ctx, p):
        run = new_run(ctx)
        data = saved_config(run)["data"]
        assert {k: data[k] for k in expected} == expected and steps(run)
    return check


def check_episodes(rewards: set):
    """A multi-turn run: episode metrics logged, and these rewards scored (an environment's reward() included)."""
    def check(ctx, p):
        run = new_run(ctx)
        assert scored(run) == rewards, scored(run)
        assert all(m["episode/turns_mean"] >= 1 and "episode/tool_use_rate" in m for m in steps(run))
    return check


# how each format's description of the tools ends (the samples keep the prompt's end)
FORMAT_TEXT_END = {"hermes": "</tool_response> tags.", "code": "comes back inside ```output and ```."}


def check_tool_format(name: str, rewards: set):
    """A run with tools: the format chosen said once, the tools in the prompt, episode metrics logged."""
    def check(ctx, p):
        assert p.stderr.count(f"[grpo] rollout.tool_format={name} (") == 1, p.stderr[-2000:]
        check_episodes(rewards)(ctx, p)
        sample = json.loads((new_run(ctx) / "samples.jsonl").read_text().splitlines()[0])
        assert FORMAT_TEXT_END[name] in sample["prompt"]
        cfg = saved_config(new_run(ctx))
        assert all(f"reward/{k}" in m for k in cfg["reward"]["functions"] for m in steps(new_run(ctx)))
    return check


def check_help(ctx, p):
    assert p.stdout.startswith("usage: grpo-train recipe=NAME") and "docs/getting-started.md" in p.stdout
    assert all(f"\n  {r.stem} " in p.stdout for r in (ROOT / "recipes").glob("*.yaml"))


QS = {"accuracy": "arithmetic", "format": "number_only"}
MINE = {"mine": "myrewards:short_and_right", "format": "number_only"}
# command as documented -> (extra arguments for the scaled run, check)
CASES = {
    "grpo-train recipe=smoke trainer.max_steps=3": ([], check_steps(3)),
    "python -m grpo.train recipe=quickstart algorithm.group_size=4": ([], check_group_size(4)),
    "grpo-train -m recipe=smoke algorithm.group_size=2,4,8": ([], check_sweep([2, 4, 8], None)),
    "grpo-train recipe=smoke trainer.output_dir=runs/a trainer.resume=auto": ([], check_dir("runs/a")),
    "grpo-train recipe=quickstart +reward.functions.mine.fn=myrewards:short_and_right "
    "+reward.functions.mine.weight=0.5 '~reward.functions.accuracy'": ([], check_rewards(MINE)),
    "grpo-train recipe=quickstart algorithm.group_size=4 trainer.lr=1e-5": ([], check_group_size(4)),
    "grpo-train --help": (None, check_help),
    "grpo-train recipe=smoke trainer.max_stepz=3":
        ([], check_error("error: unknown config key 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)")),
    "grpo-train recipe=quickstart --cfg job": (None, check_cfg_job(QS, {"level": 0})),
    "grpo-train recipe=my-first": ([], check_group_size(12)),
    "grpo-train recipe=quickstart reward=math --cfg job":
        (None, check_cfg_job({"accuracy": "math_accuracy", "format": "format"}, {"level": 0})),
    "grpo-train recipe=quickstart data=countdown --cfg job":
        (None, check_cfg_job(QS, {"min_numbers": 3, "max_numbers": 4})),
    "python -m grpo.train recipe=quickstart '~reward.functions.accuracy' "
    "+reward.functions.mine.fn=myrewards:short_and_right +reward.functions.mine.weight=1.0":
        ([], check_rewards(MINE)),
    "grpo-train -m recipe=quickstart algorithm.group_size=2,4,8,16 hydra.sweep.dir=multirun/g":
        ([], check_sweep([2, 4, 8, 16], "multirun/g")),
    "grpo-report multirun/g": ([], check_report("multirun/g", 4)),
    "grpo-train recipe=quickstart trainer.output_dir=runs/qs trainer.save_every=10": ([], check_dir("runs/qs")),
    "grpo-train recipe=quickstart trainer.output_dir=runs/qs trainer.save_every=10 trainer.resume=auto":
        (["trainer.max_steps=2"],
         check_dir("runs/qs", resumed="[grpo] resumed from runs/qs/checkpoints/step_1 (step 1)")),
    "grpo-train recipe=quickstart data.source=data/qa.jsonl '~reward.functions.accuracy' "
    "'+reward.functions.match={fn: exact_match, weight: 1.0, mode: contains}'":
        ([], check_rewards({"match": "exact_match", "format": "number_only"})),
    "grpo-train recipe=quickstart data.source=train.parquet "
    "'reward.functions={score: {fn: my_reward:compute_score}}'":
        ([], check_rewards({"score": "my_reward:compute_score"})),
    # the tiny model's tokenizer spends a token per character: countdown prompts need more than the group's 256
    "grpo-train recipe=quickstart data=countdown reward=countdown":
        (["data.max_prompt_tokens=512"],
         check_rewards({"accuracy": "countdown", "format": "format", "tags": "tag_count"})),
    "grpo-train recipe=quickstart data.source=builtin:countdown +data.task_kwargs.max_numbers=3 reward=countdown":
        ([], check_task({"source": "builtin:countdown", "task_kwargs": {"max_numbers": 3}})),
    "grpo-train recipe=quickstart '+reward.functions.rep={fn: repetition_penalty, weight: 0.5}'":
        ([], check_rewards({**QS, "rep": "repetition_penalty"})),
    "grpo-train recipe=quickstart reward.functions.format.weight=1.0": ([], check_weight("format", 1.0)),
    "grpo-train recipe=quickstart '~reward.functions.format'": ([], check_rewards({"accuracy": "arithmetic"})),
    "grpo-train recipe=quickstart 'reward.functions={acc: {fn: arithmetic, strict: true}}'":
        ([], check_rewards({"acc": "arithmetic"})),
    "grpo-train recipe=quickstart reward=math": ([], check_rewards({"accuracy": "math_accuracy", "format": "format"})),
    "grpo-train recipe=smoke rollout.environment=myenv:Guess rollout.max_turns=3 rollout.max_tool_tokens=16":
        ([], check_episodes({"accuracy", "format", "Guess"})),
    "grpo-train recipe=smoke 'rollout.tools=[mytools:add]' rollout.max_turns=2":
        ([], check_tool_format("hermes", {"accuracy", "format"})),
    # the recipe as measured (docs/benchmarks.md#current-figures): the code format, the python tool
    "grpo-train recipe=calculator-tools": (["logging.sample_every=1"],
                                           check_tool_format("code", {"accuracy"})),  # and reward/tool_call
}


# commands that use what the one before made: each chain runs in one test, in this order
CHAINS = [
    ("grpo-train -m recipe=quickstart algorithm.group_size=2,4,8,16 hydra.sweep.dir=multirun/g",
     "grpo-report multirun/g"),
    ("grpo-train recipe=quickstart trainer.output_dir=runs/qs trainer.save_every=10",
     "grpo-train recipe=quickstart trainer.output_dir=runs/qs trainer.save_every=10 trainer.resume=auto"),
]
ALONE = [c for c in CASES if not any(c in chain for chain in CHAINS)]


def test_every_documented_command_has_a_case():
    documented = doc_commands()
    assert sorted(documented) == sorted(CASES), (set(documented) ^ set(CASES))
    assert all(c in CASES for chain in CHAINS for c in chain)


class Context:
    def __init__(self, cwd: Path):
        self.cwd, self.before = cwd, set()


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> Path:
    """The files the docs tell the user to write beside the checkout's code (made once per worker)."""
    files = tmp_path_factory.mktemp("user-files")
    (files / "myrewards.py").write_text(block_starting_with("README.md", "# myrewards.py"))
    (files / "myenv.py").write_text(block_starting_with("docs/tools-and-environments.md", "# myenv.py"))
    (files / "mytools.py").write_text(block_starting_with("docs/tools-and-environments.md", "# mytools.py"))
    (files / "data").mkdir()
    (files / "data" / "qa.jsonl").write_text(block_starting_with("docs/data.md", '{"prompt"'))
    _verl_parquet(files)
    # the docs say: copy a recipe into recipes/ and edit it
    (files / "recipes").mkdir()
    (files / "recipes" / "my-first.yaml").write_text(
        block_starting_with("docs/getting-started.md", "# @package _global_\n# recipes/my-first.yaml"))
    return files


UNITS = [(c,) for c in ALONE] + CHAINS  # what runs in one working directory, in order: a test's commands


@pytest.fixture(scope="module")
def ran(request, tmp_path_factory, user_files) -> dict:
    """The commands of every selected test of this file (conftest.py's TOGETHER: one worker runs them all), in one
    process from the user's checkout: a copy of this one's code, configs and recipes (so `python -m grpo.train`
    imports its grpo/, whose configs/recipe is its recipes/) with the user's files added. Each unit of `UNITS` runs
    in a directory of its own holding the user's files. unit -> its working directory and each command's `Ran`."""
    root = tmp_path_factory.mktemp("docs-commands")
    checkout = root / "grpo"
    for part in ("grpo", "configs", "recipes"):
        shutil.copytree(ROOT / part, checkout / part, symlinks=True,
                        ignore=shutil.ignore_patterns("_data", "__pycache__"))
    shutil.copytree(user_files, checkout, dirs_exist_ok=True)
    selected = {item.callspec.params.get("chain") or (item.callspec.params["command"],)
                for item in request.session.items if item.module is request.module and hasattr(item, "callspec")}
    units, commands = {}, []
    for i, unit in enumerate(u for u in UNITS if u in selected):
        units[unit] = cwd = root / f"unit{i}"
        shutil.copytree(user_files, cwd)
        commands += [(cwd, argv(command, CASES[command][0])[2:]) for command in unit]
    done = iter(in_one_process(commands, path=checkout, timeout_each=600))
    return {unit: (cwd, [next(done) for _ in unit]) for unit, cwd in units.items()}


def _verl_parquet(cwd: Path) -> None:
    """data.md's verl example: a preprocessed parquet (messages, reward_model.ground_truth, ...) and a compute_score."""
    import pandas as pd

    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"What is {a} + {a}?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * a)}, "extra_info": {"index": a}}
            for a in range(12)]
    pd.DataFrame(rows).to_parquet(cwd / "train.parquet")
    (cwd / "my_reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                      "    return float(str(ground_truth) in solution_str)\n")


def argv(command: str, extra: list[str] | None) -> list[str]:
    words = shlex.split(command)
    if words[0] == "grpo-report":
        return [sys.executable, "-m", "grpo.trainer.report", *words[1:]]
    words = words[3:] if words[0] == "python" else words[1:]
    if extra is None:  # --cfg job: print only, nothing to scale
        return [sys.executable, "-m", "grpo.train", *words]
    given = {w.lstrip("+~").split("=")[0] for w in words + extra}
    scale = [f"{k}={v}" for k, v in SCALE.items() if k not in given]
    return [sys.executable, "-m", "grpo.train", *words, *extra, *scale]


def check_unit(ran: dict, unit: tuple[str, ...]) -> None:
    """Each command of ``unit`` succeeded (the misspelt key: failed) with the effect its check wants; `new_run` sees
    the run directories it added to what the command before it left."""
    cwd, done = ran[unit]
    ctx, before = Context(cwd), set()
    for command, p in zip(unit, done):
        ctx.before = {(cwd / path).parent for path in before if Path(path).match("outputs/*/*/.hydra")}
        if "max_stepz" not in command:
            assert p.returncode == 0, p.stderr[-3000:]
        CASES[command][1](ctx, p)
        before = p.files


@pytest.mark.slow
@pytest.mark.parametrize("command", ALONE)
def test_documented_command(ran, command):
    check_unit(ran, (command,))


@pytest.mark.slow
@pytest.mark.parametrize("chain", CHAINS, ids=lambda chain: chain[-1])
def test_documented_commands_in_order(ran, chain):
    check_unit(ran, chain)
