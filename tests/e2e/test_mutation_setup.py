"""`make mutate` (docs/testing.md) without running it (an hour of CPU): the module list and the test selection in
pyproject.toml's [tool.mutmut] name files and tests that exist, every listed equivalent mutant has a reason and
belongs to a mutated module, and scripts/mutate_report.py scores mutmut's results as documented."""
from __future__ import annotations

import ast
import json
import re
import sys

import pytest

from tests.helpers import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

CFG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
sys.path.insert(0, str(ROOT / "scripts"))
import mutate_report  # noqa: E402


def test_mutated_modules_and_selected_tests_exist():
    assert CFG["source_paths"] == ["grpo"]
    for path in CFG["only_mutate"]:
        assert (ROOT / path).is_file(), f"[tool.mutmut] only_mutate names {path}, which does not exist"
    selection = [s for s in CFG["pytest_add_cli_args_test_selection"] if s.startswith("tests/")]
    assert selection
    for item in selection:
        file, _, test = item.partition("::")
        assert (ROOT / file).is_file(), item
        if test:
            names = {n.name for n in ast.parse((ROOT / file).read_text()).body if isinstance(n, ast.FunctionDef)}
            assert test in names, f"{item}: no such test"
    for pattern in CFG["do_not_mutate_patterns"]:
        re.compile(pattern)
    makefile = (ROOT / "Makefile").read_text()
    assert "\nmutate: setup\n" in makefile and "scripts/mutate_report.py" in makefile
    assert "mutmut" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "mutate"][0]


def test_every_listed_equivalent_has_a_reason_and_a_mutated_module():
    listed = mutate_report.equivalents()
    assert listed
    for key, reason in listed.items():
        module = key.split(": ", 1)[0]
        assert module in CFG["only_mutate"], key
        assert len(reason) > 10 and reason.split(":")[0] in ("equivalent", "device"), (key, reason)


def _meta(tmp_path, codes: dict):
    d = tmp_path / "mutants" / "grpo" / "algorithm"
    d.mkdir(parents=True)
    (d / "advantages.py.meta").write_text(json.dumps({"exit_code_by_key": codes}))
    return tmp_path / "mutants"


def test_report_scores_and_fails_on_an_untriaged_survivor(tmp_path, monkeypatch):
    listed = next(iter(k for k in mutate_report.equivalents() if k.startswith("grpo/algorithm/advantages.py: ")))
    line = listed.split(": ", 1)[1]
    diffs = {"m_equiv": f"--- grpo/algorithm/advantages.py\n+++ grpo/algorithm/advantages.py\n-    old\n+{line}",
             "m_new": "--- grpo/algorithm/advantages.py\n+++ grpo/algorithm/advantages.py\n-    x = 1\n+    x = 2"}
    monkeypatch.setattr(mutate_report, "diff_of", lambda name, module, mutants: diffs[name])
    codes = {"m_k1": 1, "m_k2": 1, "m_k3": 3, "m_timeout": 36, "m_equiv": 0, "m_new": 0, "m_skip": None}
    text, ok = mutate_report.report(_meta(tmp_path, codes), min_score=50)
    # 4 caught (3 killed + 1 timeout) of 5 counted: the equivalent and the one not run are left out
    assert "Score: **80.0%** of 5 non-equivalent mutants killed" in text
    assert "1 equivalent, 1 not run" in text and "| grpo/algorithm/advantages.py | 4 | 1 | 0 | 1 |" in text
    assert "### m_new: survived" in text and "key: `grpo/algorithm/advantages.py: x = 2`" in text
    assert not ok and "1 survivor(s) neither killed nor listed" in text
    codes["m_new"] = 1
    (tmp_path / "mutants").rename(tmp_path / "old")
    text, ok = mutate_report.report(_meta(tmp_path, codes), min_score=95)
    assert "Score: **100.0%** of 5" in text and ok
    text, ok = mutate_report.report(tmp_path / "mutants", min_score=100.1)
    assert not ok  # below the minimum score


@pytest.mark.parametrize("code,status", [(1, "killed"), (3, "killed"), (0, "survived"), (33, "no tests"),
                                         (5, "no tests"), (36, "timeout"), (-24, "timeout"), (None, "not run"),
                                         (34, "not run"), (-11, "suspicious")])
def test_exit_codes(code, status):
    assert mutate_report.status(code) == status


def test_the_documented_make_mutate_commands_run_mutmut_then_the_report():
    """Each `make mutate ...` line of docs/testing.md, dry-run (`make -n`): mutmut on 2 workers with the given
    arguments, then the report with the documented minimum score."""
    import shlex
    import subprocess

    text = (ROOT / "docs" / "testing.md").read_text()
    lines = [line.split("#")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.splitlines() if line.startswith("make mutate")]
    assert len(lines) == 3  # every module; some modules; some mutants by name, keeping the earlier results
    for line in lines:
        words = shlex.split(line)
        p = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        args = [w.split("=", 1)[1] for w in words if w.startswith("MUTATE_ARGS=")]
        want = " ".join(["mutmut run --max-children 2", *args])
        assert want in p.stdout and ('if [ "0" = 1 ]' in p.stdout) == ("MUTATE_FRESH=0" in words), p.stdout
        assert "scripts/mutate_report.py --min-score 95" in p.stdout


# mutmut 3 leaves a function with any decorator but a lone @staticmethod/@classmethod unmutated, nested functions
# included (mutmut/mutation/file_mutation.py): in only_mutate, such a function is registered, wrapped or made a property
# by a call after its definition, or listed here with its reason.
UNMUTATED_DECORATED = {
    "grpo/batch.py: Batch.group_sizes": "a one-line property, pinned by test_batch and test_experience",
    "grpo/rollout/episodes/turns.py: Episodes.completion_ids": "a one-line property, pinned by test_turns' "
                                                               "test_sums_and_metrics_of_every_counter",
    "grpo/rollout/episodes/turns.py: Episodes.masks": "a one-line property, pinned by the same test",
    "grpo/rollout/episodes/turns.py: Episodes.truncated": "a one-line property, pinned by the same test",
    "grpo/sampler.py: Sampler.reward_names": "a one-line property, pinned by test_sampler's factory tests",
    "grpo/runtime/base.py: Runtime.is_main": "a one-line property, pinned by tests/runtime/test_base.py",
    "grpo/runtime/base.py: Runtime.generation_context": "a context manager yielding {}, pinned by test_base",
    "grpo/runtime/base.py: Runtime.full_weights": "a context manager yielding False, pinned by test_base and "
                                                  "test_thread_view",
    "grpo/rollout/weights.py: as_they_are": "a context manager yielding False (full_weights of one process), "
                                            "pinned by test_lora_sync",
    "grpo/vision/images.py: ImagePrompt.ids": "a one-line property (list(self)), pinned by test_vision",
    "grpo/trainer/run.py: Run.model": "a one-line property (the runtime's), pinned by test_run",
    "grpo/trainer/run.py: Run.optimizer": "a one-line property (the runtime's), pinned by test_run",
    "grpo/trainer/run.py: Run.scheduler": "a one-line property (the runtime's), pinned by test_run",
}


def skipped_by_mutmut(source: str) -> list[str]:
    """Qualified names of the functions in ``source`` that mutmut does not mutate for their decorators."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                deco = child.decorator_list
                lone = len(deco) == 1 and isinstance(deco[0], ast.Name) and deco[0].id in ("staticmethod",
                                                                                             "classmethod")
                if deco and not lone:
                    out.append(prefix + child.name)  # its nested functions are skipped with it
                else:
                    visit(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")  # a decorated class's methods are mutated
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_no_function_in_only_mutate_is_left_unmutated_for_its_decorator():
    skipped = {f"{path}: {name}" for path in CFG["only_mutate"]
               for name in skipped_by_mutmut((ROOT / path).read_text())}
    unlisted = sorted(skipped - set(UNMUTATED_DECORATED))
    assert not unlisted, ("mutmut does not mutate a decorated function: register, wrap or make it a property by a call "
                          f"after its definition (as grpo/tasks/ do), or list it with a reason: {unlisted}")
    assert set(UNMUTATED_DECORATED) <= skipped, sorted(set(UNMUTATED_DECORATED) - skipped)  # no stale entries
    assert all(len(reason) > 10 for reason in UNMUTATED_DECORATED.values())


def test_what_mutmut_skips_for_a_decorator():
    source = '''
import functools
@register("x")
def registered(): pass
class C:
    @staticmethod
    def fine(): pass
    @classmethod
    def fine_too(cls): pass
    @property
    def prop(self): pass
    @staticmethod
    @functools.cache
    def two(): pass
@dataclass
class D:
    def method(self):
        @functools.wraps(f)
        def inner(): pass
        def plain(): pass
        return inner
@torch.no_grad()
async def sampled():
    def inside(): pass
'''
    assert skipped_by_mutmut(source) == ["registered", "C.prop", "C.two", "D.method.<locals>.inner", "sampled"]
