"""Every `scripts/*.py` command that docs/ and the README show names a script that exists and only options that
script's own parser offers (read from its `--help`), so a renamed or removed option cannot leave a benchmark
recipe in the docs that fails on its first flag. The benchmarks themselves are run scaled down by
tests/test_bench_*.py and tests/engine/test_logprobs.py."""
from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def shown_lines(doc: Path) -> list[str]:
    """Every command line ``doc`` shows: the lines of its fenced blocks (continuations joined) and its inline code
    spans (docs/benchmarks.md gives each figure's command in a table cell)."""
    text = doc.read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    return lines + re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def doc_commands() -> list[tuple[str, str, list[str]]]:
    """(doc, script, options) for every command shown that runs a Python script from scripts/."""
    found = []
    for doc in DOCS:
        for line in shown_lines(doc):
            m = re.search(r"python (scripts/\w+\.py)(.*)", line.split("#")[0])
            if m:
                found.append((doc.name, m.group(1), re.findall(r"(?<!\S)(--[\w-]+)", m.group(2))))
    return found


@functools.cache
def help_text(script: str) -> str:
    p = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_the_docs_show_benchmark_commands():
    scripts = {s for _, s, _ in doc_commands()}
    assert {"scripts/bench_prefix.py", "scripts/bench_prefix_scaling.py", "scripts/bench_trl.py"} <= scripts


@pytest.mark.parametrize("doc,script,options", doc_commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_each_documented_script_command_uses_options_its_parser_has(doc, script, options):
    assert (ROOT / script).is_file(), f"{doc} runs {script}, which does not exist"
    offered = set(re.findall(r"(?<![\w-])(--[\w-]+)", help_text(script)))
    unknown = [o for o in options if o not in offered]
    assert not unknown, f"{doc}: {script} has no option {unknown}"


def test_make_bench_runs_the_commands_benchmarks_md_shows():
    """`make bench` (printed by `make -n`) runs exactly the bench_trl.py commands docs/benchmarks.md says it runs."""
    p = subprocess.run(["make", "-n", "bench"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    make = [line.split("scripts/bench_trl.py", 1)[1].split() for line in p.stdout.splitlines()
            if "scripts/bench_trl.py" in line]
    text = re.sub(r"\\\n\s*", " ", (ROOT / "docs" / "benchmarks.md").read_text())
    shown = [m.split() for m in re.findall(r"python scripts/bench_trl\.py([^#\n]*)", text)]
    assert len(make) == 4 and all(cmd in shown for cmd in make), (make, shown)


def training_commands() -> list[list[str]]:
    """The overrides of every `grpo-train` / `python -m grpo.train` command docs/benchmarks.md shows."""
    found = []
    for line in shown_lines(ROOT / "docs" / "benchmarks.md"):
        m = re.search(r"(?:grpo-train|-m grpo\.train)((?:\s+[\w.+~/=,:-]+)*)", line.split("#")[0])
        if m:
            found.append(m.group(1).split())
    return found


def test_each_documented_training_command_passes_the_checks_a_run_starts_with(monkeypatch, capsys):
    """Each figure's `grpo-train ...` composes and passes every check made before a model loads (`--cfg job`, in
    this process): a renamed key, recipe or choice cannot leave the page a command that fails on its first line."""
    from grpo.cli import prepare_argv

    commands = training_commands()
    assert len(commands) >= 8 and ["recipe=calculator-tools", "trainer.output_dir=/tmp/calc-rerun"] in commands
    for overrides in commands:
        with pytest.raises(SystemExit) as e:
            prepare_argv(["grpo-train", "--cfg", "job", *overrides])
        assert e.value.code == 0, overrides
        assert "trainer:" in capsys.readouterr().out, overrides


@pytest.mark.parametrize("target,runs", [("train", "-m grpo.train recipe=quickstart"),
                                         ("bench-prefix", "scripts/bench_prefix.py"),
                                         ("bench-prefix", "scripts/bench_prefix_scaling.py --md docs/prefix-scaling.md "
                                                          "--plot docs/prefix-scaling.png"),
                                         ("recipes-check", "scripts/recipes_check.py")])
def test_the_make_targets_the_page_names_run_its_commands(target, runs):
    """docs/benchmarks.md gives `make train`, `make bench-prefix` and `make recipes-check` for figures whose
    commands it shows: the targets (printed by `make -n`) run those commands."""
    assert f"make {target}" in (ROOT / "docs" / "benchmarks.md").read_text()
    p = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and runs in p.stdout, p.stdout + p.stderr
