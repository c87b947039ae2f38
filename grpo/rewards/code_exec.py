"""Code reward: run the completion's Python against the row's tests in the sandbox.

Score: the fraction of the row's tests that pass (0.0 to 1.0); 0.0 when the code does not run,
times out or breaks out of the harness; None when the row has no tests, or when the sandbox
itself failed to start (logged: that is not the model's fault). See
:mod:`grpo.rewards.sandbox` for what the code can and cannot do.
"""
from __future__ import annotations

import ast
import json
import logging
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor

from grpo.rewards import sandbox
from grpo.rewards.registry import register

log = logging.getLogger("grpo.rewards")
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_PY = ("python", "py", "python3", "py3")

# Runs inside the sandbox. The nonce arrives on stdin (then replaced by /dev/null), so the solution
# cannot read it from argv, the environment or a file, and cannot print fake results by accident
# or by simple tricks; code that deliberately inspects the harness's frames could still forge them.
# Each result is written as soon as its test finishes: a test that hangs keeps earlier credit.
_HARNESS = r"""
import json, os, sys
nonce = sys.stdin.readline().strip()
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the nonce's file is gone; input() sees EOF
out = os.dup(1)
os.dup2(2, 1)  # the solution's prints go to stderr: they cannot push results out of the kept output
os.write(out, f"{nonce} start\n".encode())
steps = json.load(open("tests.json", encoding="utf-8"))
source = open("solution.py", encoding="utf-8").read()
ns = {"__name__": "solution", "__builtins__": __builtins__}
try:
    exec(compile(source, "solution.py", "exec"), ns)
except BaseException as e:
    print(f"solution raised {type(e).__name__}: {e}", file=sys.stderr)
i = 0
for kind, text in steps:
    try:
        exec(compile(text, f"test_{i}", "exec"), ns)
        ok = 1
    except BaseException as e:
        ok = 0
        print(f"test {i} failed: {type(e).__name__}: {e}", file=sys.stderr)
    if kind == "test":
        os.write(out, f"{nonce} {i} {ok}\n".encode())
        i += 1
"""


def extract_code(completion: str) -> str:
    """The Python program in ``completion``: the last ```python fenced block (or the last fence
    without a language), else the whole text. Reasoning before ``</think>`` is ignored."""
    text = completion if isinstance(completion, str) else ""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    blocks = _FENCE.findall(text)
    for wanted in (_PY, ("",)):
        chosen = [code for lang, code in blocks if lang.lower() in wanted]
        if chosen:
            return chosen[-1]
    return text


def parse_tests(tests, entry_point: str | None = None) -> list[tuple[str, str]]:
    """The row's tests as ordered ``(kind, code)`` steps, kind ``test`` (scored) or ``setup``.

    A list: each item is one test. One string of code: each top-level ``assert`` is a test, the
    other statements (imports, helpers) are setup run in order; a string without top-level
    asserts (HumanEval's ``def check(candidate): ...``) is one test, followed by
    ``check(<entry_point>)`` when the row has an ``entry_point`` column.
    """
    if tests is None:
        return []
    if isinstance(tests, (list, tuple)):
        return [("test", str(t)) for t in tests if str(t).strip()]
    text = str(tests)
    if entry_point and "def check(" in text:
        return [("test", f"{text}\ncheck({entry_point})")]
    try:
        body = ast.parse(text).body
    except (SyntaxError, ValueError):
        return [("test", text)] if text.strip() else []
    if not any(isinstance(node, ast.Assert) for node in body):
        return [("test", text)] if text.strip() else []
    return [("test" if isinstance(node, ast.Assert) else "setup", ast.unparse(node)) for node in body]


def run_tests(code: str, steps: list[tuple[str, str]], limits: sandbox.Limits) -> float:
    """Fraction of the ``test`` steps that pass when run after ``code`` in one sandboxed process."""
    n = sum(kind == "test" for kind, _ in steps)
    if n == 0:
        return 0.0
    nonce = secrets.token_hex(16)
    files = {"solution.py": code, "tests.json": json.dumps(steps), "harness.py": _HARNESS}
    res = sandbox.run_python(files, "harness.py", limits, stdin=nonce + "\n")
    if f"{nonce} start" not in res.stdout:  # the harness never ran: not the model's fault
        raise RuntimeError(f"the sandbox did not start ({res.mode}): {res.stderr.strip()[-500:]}")
    passed: dict[int, int] = {}
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit() and parts[2] in ("0", "1"):
            idx = int(parts[1])
            if idx in passed or idx >= n:  # a forged or repeated line: trust nothing
                return 0.0
            passed[idx] = int(parts[2])
    return sum(passed.values()) / n


def code_tests(prompts: list[str], completions: list[str], tests: list | None = None,
               entry_point: list | None = None, timeout_s: float = 5.0, max_workers: int | None = None,
               memory_mb: int = 1024, max_procs: int = 16, **_) -> list[float | None]:
    """Fraction of the row's ``tests`` (column) passed by the completion's Python code.

    ``timeout_s`` (default 5): wall-clock limit per sample, then the sample's processes are
    killed and unfinished tests fail. ``max_workers``: samples run in parallel (default: CPU
    count, at most 8). ``memory_mb``: address-space limit per process. ``max_procs``: process
    and thread limit. None for rows without tests.
    """
    limits = sandbox.Limits(timeout_s=float(timeout_s), memory_mb=int(memory_mb), max_procs=int(max_procs))
    jobs = []
    for i, completion in enumerate(completions):
        ep = entry_point[i] if entry_point is not None else None
        steps = parse_tests(tests[i] if tests is not None else None, ep)
        jobs.append((extract_code(completion), steps) if steps else None)
    workers = max(1, int(max_workers or min(8, os.cpu_count() or 1)))
    sandbox.isolation()  # probe once (and warn) before the threads start

    def one(job):
        if job is None:
            return None
        try:
            return run_tests(job[0], job[1], limits)
        except Exception:  # the sandbox itself failed (not the model's fault): no score
            log.warning("code_tests: sandbox failure (the sample scores None)", exc_info=True)
            return None

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, jobs))


register("code_tests")(code_tests)  # by a call, not a decorator: mutmut (`make mutate`) skips decorated functions
