"""The codebase's shape (docs/architecture.md, "Rules the tests hold the code to"): no import circle, between modules
or between packages; modules that import alone; the tiers in order, from the loader and the errors at the bottom to
the entry points at the top, with no import running upward; the root config only in config/, trainer/ and the entry
points; small files and functions; and the runtime as the only door to torch.distributed."""
import ast
import subprocess
import sys

from tests.helpers import ROOT

PACKAGE = ROOT / "grpo"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


# The grpo package itself only re-exports the engine (grpo/__init__.py): a name taken from it that is not one of its
# modules (``from grpo import token_logprobs``) is the engine's.
REEXPORTED_BY_GRPO = "grpo.engine"


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """grpo modules that ``name`` imports anywhere in its body (inside functions too: a circle hidden in a
    function is still a circle). grpo uses absolute imports only."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "grpo":
            targets = [f"grpo.{a.name}" if f"grpo.{a.name}" in known else REEXPORTED_BY_GRPO for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, tree, set(modules)) for name, tree in modules.items()}
    # a package's __init__ importing its own submodules is how packages work, not a circle
    graph = {n: {d for d in deps if not d.startswith(n + ".")} for n, deps in graph.items()}
    circles = _circles(graph)
    assert not circles, "import circles:\n" + "\n".join(circles)


# The tiers of the tree, bottom first (docs/architecture.md, "The tree"): the loader and the errors every stage uses,
# the modules the stages share, the stages in the order a step flows through them, the trainer, and the entry points
# above it all. A module may import modules of its own tier and of lower ones, never of a higher one. Each entry is
# a top-level name of grpo (a package or a module) and files the whole of it: no module of a package sits in a tier
# apart from its package (as `grpo/config/cli.py` once sat with the trainer while config/ sat below the stages).
STAGES = [
    ("bottom", ["grpo.errors", "grpo.objects"]),
    ("shared", ["grpo.batch", "grpo.config", "grpo.models", "grpo.tiny_models", "grpo.data", "grpo.tasks",
                "grpo.vision", "grpo.worker_process"]),
    ("engine, runtime, algorithm", ["grpo.engine", "grpo.runtime", "grpo.algorithm", "grpo.evaluation"]),
    ("rewards, rollout", ["grpo.rewards", "grpo.rollout"]),
    ("experience, update", ["grpo.experience", "grpo.update"]),
    ("trainer", ["grpo.trainer"]),
    ("entry points", ["grpo.train", "grpo.serve", "grpo.cli", "grpo.eval"]),
]
TRAINER = [name for name, _ in STAGES].index("trainer")


def top_of(module: str) -> str:
    """The top-level name of grpo that ``module`` belongs to: ``grpo.rollout.server.client`` -> ``grpo.rollout``."""
    return ".".join(module.split(".")[:2])


def stage_of(module: str) -> int | None:
    """The index in STAGES of ``module`` (None: the ``grpo`` package itself, which only re-exports the engine)."""
    for i, (_, tops) in enumerate(STAGES):
        if top_of(module) in tops:
            return i
    return None


def test_every_top_level_name_is_in_exactly_one_tier():
    """STAGES files each of grpo's packages and top-level modules once, whole, and names nothing else."""
    filed = sorted(t for _, tops in STAGES for t in tops)
    assert filed == sorted({top_of(m) for m in _modules() if m != "grpo"})


def _upward(modules: dict[str, ast.Module]) -> list[str]:
    found = []
    for name, tree in modules.items():
        mine = stage_of(name)
        for dep in _imports(name, tree, set(modules)):
            theirs = stage_of(dep)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{name} ({STAGES[mine][0]}) imports {dep} ({STAGES[theirs][0]})")
    return sorted(found)


def test_no_import_runs_upward():
    upward = _upward(_modules())
    assert not upward, "imports that run upward in the tree (docs/architecture.md):\n" + "\n".join(upward)


def test_an_upward_import_anywhere_is_caught():
    """The check above on planted imports: the bottom loader importing the command line (an entry point) is
    reported, as a shared module importing a stage is (inside a function, or through the grpo package's re-export of
    the engine), and the loader importing the errors beside it is not."""
    modules = _modules()
    planted = dict(modules)
    planted["grpo.objects"] = ast.parse("from grpo.errors import ConfigError\nfrom grpo.cli import prepare_argv\n")
    planted["grpo.config.schema"] = ast.parse("def f():\n    from grpo.rewards import registry\n")
    planted["grpo.batch"] = ast.parse("from grpo import token_logprobs\n")  # the engine, through the package
    assert [u for u in _upward(planted) if u not in _upward(modules)] == [
        "grpo.batch (shared) imports grpo.engine (engine, runtime, algorithm)",
        "grpo.config.schema (shared) imports grpo.rewards (rewards, rollout)",
        "grpo.config.schema (shared) imports grpo.rewards.registry (rewards, rollout)",
        "grpo.objects (bottom) imports grpo.cli (entry points)"]


def test_no_circle_between_top_level_packages():
    """Peers of one tier may import each other one way only (rollout imports rewards, never the reverse): the graph
    of grpo's top-level names has no circle, so that every tier could be cut into an order."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, tree in modules.items():
        if name != "grpo":
            graph.setdefault(top_of(name), set()).update(
                top_of(d) for d in _imports(name, tree, set(modules)) if d != "grpo" and top_of(d) != top_of(name))
    assert not _circles(graph), "circles between grpo's packages:\n" + "\n".join(_circles(graph))


def _circles(graph: dict[str, set[str]]) -> list[str]:
    state, circles = {}, []

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return circles


def test_the_root_config_stops_at_the_trainer():
    """Below the trainer code takes settings or its own config section: no module outside config/, trainer/ and
    the entry points imports the root `Config` or annotates a parameter with it."""
    offenders = []
    for name, tree in _modules().items():
        if (stage_of(name) or 0) >= TRAINER or top_of(name) == "grpo.config":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "grpo.config.schema" and \
                    any(a.name == "Config" for a in node.names):
                offenders.append(f"{name}:{node.lineno} imports the root Config")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs:
                    if a.annotation is not None and ast.unparse(a.annotation).strip("'\"") == "Config":
                        offenders.append(f"{name}:{node.lineno} {node.name}({a.arg}: Config)")
    assert not offenders, "\n".join(offenders)


def test_every_module_imports_alone():
    """Each module imported first, in a fresh interpreter state for grpo (torch and friends stay loaded)."""
    names = [n for n in _modules() if n != "grpo.__main__"]
    script = (
        "import importlib, sys, traceback\n"
        "import torch, transformers  # noqa: F401  (loaded once; only grpo's modules are reset)\n"
        f"bad = []\nfor name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m == 'grpo' or m.startswith('grpo.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception as e:\n        bad.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(bad))\nsys.exit(1 if bad else 0)\n")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]


def test_files_and_functions_stay_small():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{rel}: {text.count(chr(10))} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {n} lines (at most {MAX_FUNCTION_LINES})")
    assert not too_long, "\n".join(too_long)


def test_the_runtime_is_the_only_door_to_torch_distributed():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("grpo", "runtime"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and n.startswith("torch.distributed") for n in names) or \
                        (isinstance(node, ast.ImportFrom) and node.module == "torch" and
                         any(a.name == "distributed" for a in node.names)):
                    offenders.append(f"{rel}:{node.lineno} imports torch.distributed")
            if isinstance(node, ast.Attribute) and node.attr == "distributed" and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch":
                offenders.append(f"{rel}:{node.lineno} uses torch.distributed")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr" and \
                    "runtime" in ast.unparse(node.args[0]):
                offenders.append(f"{rel}:{node.lineno} {ast.unparse(node)}: declare it on the runtime interface")
    assert not offenders, "\n".join(offenders)


def test_most_modules_have_a_test_at_the_mirrored_path():
    """``grpo/<package>/<module>.py`` -> ``tests/<package>/test_<module>.py`` (docs/architecture.md, "Tests")."""
    modules = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py"]
    missing = [str(p.relative_to(PACKAGE)) for p in modules
               if not (ROOT / "tests" / p.relative_to(PACKAGE).parent / f"test_{p.stem}.py").exists()]
    covered = 1 - len(missing) / len(modules)
    assert covered >= 0.8, f"{covered:.0%} of modules have a mirrored test file; without one: {', '.join(missing)}"
