"""grpo/rewards/code_exec.py without a process: the code and the tests taken from a row, the harness's results read
back, the batch scored in parallel. A stand-in for the sandbox answers as the harness would; the harness itself runs
in a real sandbox in tests/rewards/test_sandbox.py."""
import json
import logging
import os
import threading

import pytest

from grpo.rewards import code_exec, sandbox
from grpo.rewards.code_exec import code_tests, extract_code, parse_tests, run_tests
from grpo.rewards.registry import REWARDS
from tests.under_mutmut import bounded_under_mutmut  # noqa: F401  (a mutant's endless loop: 3 s)


def test_the_code_is_the_last_python_fence_after_the_reasoning_else_the_last_bare_fence_else_the_text():
    text = "<think>```python\nwrong()\n```</think>Here:\n```py\ndef f():\n    return 1\n```\nand ```python\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("<think>```python\nwrong()\n```</think>no code") == "no code"  # reasoning's code is not it
    assert extract_code("<think>a</think>```python\nX\n```</think>B") == "B"  # after the last </think>
    assert extract_code("```\nprint(1)\n```\n```\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```Python3 title\nA\n```\n```\nB\n```") == "A\n"  # a python fence beats a bare one
    assert extract_code("```js\nlet a\n```\n```py3\nP\n```\n```\nB\n```") == "P\n"
    assert extract_code("```js\nlet a\n```") == "```js\nlet a\n```"  # no python and no bare fence: the text
    assert extract_code("```python\ndef f(): return 1") == "def f(): return 1"  # cut-off fence
    assert extract_code("def f(): return 1") == "def f(): return 1"
    assert extract_code(None) == "" and extract_code(["msg"]) == ""


def test_a_rows_tests_are_its_items_its_top_level_asserts_or_one_check_of_the_entry_point():
    assert parse_tests(["assert f(1) == 1", "  ", 7]) == [("test", "assert f(1) == 1"), ("test", "7")]
    assert parse_tests(("a", "b")) == [("test", "a"), ("test", "b")]
    steps = parse_tests("import math\nassert f(1)==1\nx = 2; assert f(x) == 2\n")
    assert steps == [("setup", "import math"), ("test", "assert f(1) == 1"), ("setup", "x = 2"),
                     ("test", "assert f(x) == 2")]
    check = "def check(candidate):\n    assert candidate(1)\n"
    assert parse_tests(check, "f") == [("test", f"{check}\ncheck(f)")]
    assert parse_tests(check) == [("test", check)]  # no entry point: the text as one test
    assert parse_tests("def check(c):\n    pass\nassert f()", "f") == [("test", "def check(c):\n    pass\nassert f()"
                                                                         "\ncheck(f)")]
    assert parse_tests("this is not python (") == [("test", "this is not python (")]
    assert parse_tests("x = \0") == [("test", "x = \0")]  # null bytes: ast refuses them
    assert parse_tests("\xa0\n") == []  # no code, and not python either (a no-break space)
    assert parse_tests("   \n") == [] and parse_tests("") == [] and parse_tests(None) == [] and parse_tests([]) == []
    assert parse_tests(12) == [("test", "12")]


class _Sandbox:
    """sandbox.run_python answered as the harness would: ``lines`` (with ``{n}`` for the nonce) after the start."""

    def __init__(self, lines=(), start=True, stderr=""):
        self.lines, self.start, self.stderr, self.calls = list(lines), start, stderr, []

    def __call__(self, files, main, limits, stdin=""):
        self.calls.append((files, main, limits, stdin))
        n = stdin.strip()
        out = ([f"{n} start"] if self.start else []) + [line.format(n=n) for line in self.lines]
        return sandbox.Result(0, "\n".join(out) + "\n", self.stderr, False, "bwrap")


def test_run_tests_sends_the_code_steps_and_harness_and_reads_back_only_its_nonces_results(monkeypatch):
    box = _Sandbox(["{n} 0 1", "{n} 1 0", "{n} 2 1"])
    monkeypatch.setattr(sandbox, "run_python", box)
    steps = [("setup", "import math"), ("test", "assert a"), ("test", "assert b"), ("test", "assert c")]
    limits = sandbox.Limits(timeout_s=3)
    assert run_tests("def f(): pass", steps, limits) == pytest.approx(2 / 3)  # setup steps are not scored
    files, main, given, stdin = box.calls[0]
    assert files == {"solution.py": "def f(): pass", "tests.json": json.dumps(steps), "harness.py": code_exec._HARNESS}
    assert main == "harness.py" and given is limits
    assert stdin.endswith("\n") and len(stdin.strip()) == 32 and int(stdin, 16) >= 0  # 16 random bytes, in hex
    monkeypatch.setattr(sandbox, "run_python", box := _Sandbox(["{n} 0 1"]))
    run_tests("", steps, limits)
    run_tests("", steps, limits)
    assert box.calls[0][3] != box.calls[1][3]  # a fresh nonce every run


@pytest.mark.parametrize("lines,score", [
    (["{n} 0 1", "{n} 1 1"], 2 / 3),              # the third test hung: no result, no credit
    (["{n} 0 1", "{n} 0 1"], 0.0),                # a result repeated: forged, nothing counts
    (["{n} 0 1", "{n} 3 1"], 0.0),                # a test index past the last: forged
    (["{n} 0 0", "{n} 0 1"], 0.0),                # a failed test reported as passed too
    (["{n} 1 1", "{n} 5 0"], 0.0),                # an index past the last, even failing
    (["{n} 2 1", "{n} 1 0", "{n} 0 1"], 2 / 3),   # in any order
    (["deadbeef 0 1", "{n} 1 1"], 1 / 3),         # another nonce: not the harness's
    (["{n} 0 1 x", "{n} 0", "{n} x 1", "{n} -1 1", "{n} 1 2", "{n} 1 01", "{n}  2   1"], 1 / 3),
])
def test_only_well_formed_results_count_and_a_forged_one_voids_the_run(monkeypatch, lines, score):
    monkeypatch.setattr(sandbox, "run_python", _Sandbox(lines))
    steps = [("test", "a"), ("test", "b"), ("test", "c")]
    assert run_tests("", steps, sandbox.Limits()) == pytest.approx(score)


def test_run_tests_without_tests_scores_0_without_a_run_and_a_harness_that_never_started_raises(monkeypatch):
    box = _Sandbox(["{n} 0 1"], start=False, stderr="  " + "x" * 600 + "bwrap: no namespaces \n")
    monkeypatch.setattr(sandbox, "run_python", box)
    assert run_tests("", [("setup", "import os")], sandbox.Limits()) == 0.0 and box.calls == []
    with pytest.raises(RuntimeError) as e:
        run_tests("", [("test", "assert 1")], sandbox.Limits())
    assert str(e.value) == "the sandbox did not start (bwrap): " + ("x" * 600 + "bwrap: no namespaces")[-500:]


def test_code_tests_scores_each_row_against_its_own_tests_with_the_limits_asked(monkeypatch):
    calls, order = [], []

    def run(files, main, limits, stdin=""):
        calls.append((files["solution.py"], json.loads(files["tests.json"]), limits))
        order.append("run")
        n = stdin.strip()
        steps = json.loads(files["tests.json"])
        results = [f"{n} {i} {int('ok' in text)}" for i, (_, text) in enumerate(s for s in steps if s[0] == "test")]
        return sandbox.Result(0, "\n".join([f"{n} start", *results]), "", False, "bwrap")

    monkeypatch.setattr(sandbox, "run_python", run)
    monkeypatch.setattr(sandbox, "isolation", lambda python=None: order.append("isolation") or "bwrap")
    comps = ["```python\nA\n```", "B", "C", "D"]
    tests = [["ok 1", "bad"], None, "def check(c):\n    ok\n", "assert ok\nx = 1\nassert bad"]
    out = code_tests(["p"] * 4, comps, tests=tests, entry_point=[None, None, "g", "h"], timeout_s="2",
                     memory_mb="512", max_procs=4.0, max_workers=1)
    assert out == [0.5, None, 1.0, 0.5]  # a row without tests has no score
    assert order == ["isolation", "run", "run", "run"]  # probed once, before the threads start
    limits = sandbox.Limits(timeout_s=2.0, memory_mb=512, max_procs=4)
    assert calls == [("A\n", [["test", "ok 1"], ["test", "bad"]], limits),
                     ("C", [["test", "def check(c):\n    ok\n\ncheck(g)"]], limits),
                     ("D", [["test", "assert ok"], ["setup", "x = 1"], ["test", "assert bad"]], limits)]
    assert all(type(v) is int for v in (calls[0][2].memory_mb, calls[0][2].max_procs))
    assert type(calls[0][2].timeout_s) is float
    del calls[:]
    assert code_tests(["p"], ["A"]) == [None] and calls == []  # no tests column: nothing to run
    code_tests(["p"], ["A"], tests=[["ok"]])
    assert calls[0][2] == sandbox.Limits(timeout_s=5.0, memory_mb=1024, max_procs=16)


def test_code_tests_runs_up_to_max_workers_samples_at_once_by_default_the_cpus_at_most_8(monkeypatch):
    made = []

    class Pool(code_exec.ThreadPoolExecutor):
        def __init__(self, max_workers):
            made.append(max_workers)
            super().__init__(max_workers=max_workers)

    monkeypatch.setattr(code_exec, "ThreadPoolExecutor", Pool)
    monkeypatch.setattr(sandbox, "isolation", lambda python=None: "bwrap")
    monkeypatch.setattr(sandbox, "run_python", _Sandbox(["{n} 0 1"]))
    for cpus, workers, expected in ((3, None, 3), (32, None, 8), (None, None, 1), (32, 0, 8), (3, 5, 5),
                                    (3, -2, 1), (3, "2", 2), (3, 2.5, 2)):
        monkeypatch.setattr(os, "cpu_count", lambda: cpus)
        assert code_tests(["p"], ["x"], tests=[["a"]], max_workers=workers) == [1.0]
        assert made.pop() == expected, (cpus, workers)


def test_code_tests_runs_the_samples_in_parallel_and_keeps_their_order(monkeypatch):
    both = threading.Barrier(2, timeout=5)  # each run waits for the other: they must run at once

    def run(files, main, limits, stdin=""):
        both.wait()
        n, ok = stdin.strip(), int(files["solution.py"] == "good")
        return sandbox.Result(0, f"{n} start\n{n} 0 {ok}\n", "", False, "bwrap")

    monkeypatch.setattr(sandbox, "run_python", run)
    monkeypatch.setattr(sandbox, "isolation", lambda python=None: "bwrap")
    assert code_tests(["p", "p"], ["bad", "good"], tests=[["a"], ["a"]], max_workers=2) == [0.0, 1.0]


def test_a_sandbox_that_fails_scores_none_and_says_so_in_the_log(monkeypatch, caplog):
    def broken(files, main, limits, stdin=""):
        if files["solution.py"] == "raise":
            raise OSError("cannot create namespace")
        return sandbox.Result(1, "", "bwrap: cannot create namespace", False, "bwrap")

    monkeypatch.setattr(sandbox, "run_python", broken)
    monkeypatch.setattr(sandbox, "isolation", lambda python=None: "bwrap")
    with caplog.at_level(logging.WARNING, logger="grpo.rewards"):
        assert code_tests(["p"] * 2, ["def f(): return 1", "raise"], tests=[["assert f() == 1"]] * 2) == [None, None]
    failures = [r for r in caplog.records if r.name == "grpo.rewards"]
    assert [r.getMessage() for r in failures] == ["code_tests: sandbox failure (the sample scores None)"] * 2
    assert {r.exc_info[0] for r in failures} == {RuntimeError, OSError}


def test_code_tests_is_registered_by_its_name():
    assert REWARDS.get("code_tests").__wrapped__ is code_tests
