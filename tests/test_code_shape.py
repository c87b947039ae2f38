"""The codebase's shape (docs/architecture.md, "Rules the tests hold the code to"): no import circle, modules
that import alone, small files and functions, and the runtime as the only door to torch.distributed."""
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


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """grpo modules that ``name`` imports anywhere in its body (inside functions too: a circle hidden in a
    function is still a circle). grpo uses absolute imports only."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
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
    state, circles = {}, []

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)


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
