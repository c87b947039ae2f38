"""The code sandbox against hostile programs, in every isolation mode this machine supports.

Each hostile program must be contained and score 0, and this process must be unharmed. Modes
without bubblewrap promise less; the checks they cannot pass are skipped with the reason.
"""
import os
import random
import shutil
import socket
import subprocess
import time
import warnings
from pathlib import Path

import pytest

from grpo.rewards import sandbox
from grpo.rewards.code_exec import code_tests, extract_code, parse_tests

ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 2.0


def _modes():
    python = sandbox.default_python()
    return [m for m in sandbox.MODES if m == "rlimits" or sandbox._works(m, python)]


@pytest.fixture(params=_modes())
def mode(request, monkeypatch):
    monkeypatch.setattr(sandbox, "isolation", lambda python=None: request.param)
    return request.param


def score(code: str, tests, **kw) -> float:
    kw.setdefault("timeout_s", TIMEOUT)
    return code_tests(["p"], [f"```python\n{code}\n```"], tests=[tests], **kw)[0]


def test_correct_and_partial_programs(mode):
    good = "def add(a, b):\n    return a + b"
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]
    assert score(good, tests) == 1.0
    partial = "def add(a, b):\n    return a + b if a != 0 else 0"
    assert score(partial, tests) == 0.75
    assert score("def add(a, b): return a * b", tests) == 0.25
    assert score("def add(a, b) return", tests) == 0.0       # syntax error
    assert score("", tests) == 0.0


def test_batch_in_parallel_and_rows_without_tests(mode):
    comps = ["```python\ndef f(x):\n    return x * 2\n```", "def f(x): return x", "no code at all", ""]
    tests = ["assert f(2) == 4\nassert f(0) == 0", ["assert f(1) == 1"], None, ["assert f(1) == 2"]]
    start = time.monotonic()
    assert code_tests(["p"] * 4, comps, tests=tests, max_workers=4) == [1.0, 1.0, None, 0.0]
    assert time.monotonic() - start < 30


def test_infinite_loop_is_killed_at_the_timeout(mode):
    start = time.monotonic()
    code = "def f():\n    return 1\nassert True\nwhile True:\n    pass"
    assert score(code, ["assert f() == 1"]) == 0.0
    assert time.monotonic() - start < TIMEOUT + 5


def test_hang_in_a_later_test_keeps_earlier_credit(mode):
    code = "def f(x):\n    while x == 3:\n        pass\n    return x"
    assert score(code, ["assert f(1) == 1", "assert f(2) == 2", "assert f(3) == 3", "assert f(4) == 4"]) == 0.5


def _processes_with(marker: str) -> list[str]:
    found = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                found.append(cmd)
    return found


def _gone(marker: str, wait_s: float = 3.0) -> bool:
    deadline = time.monotonic() + wait_s
    while _processes_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_fork_bomb_is_contained(mode):
    if not ROOT and mode != "bwrap":
        pytest.skip("without root or bwrap, RLIMIT_NPROC counts all of this user's processes")
    marker = f"{random.randint(10**8, 10**9)}.5"
    code = ("import os\n"
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
            "def f():\n    return 1")
    start = time.monotonic()
    assert score(code, ["assert f() == 1"], max_procs=16) == 0.0
    assert time.monotonic() - start < TIMEOUT + 10
    assert _gone(marker), "fork-bomb processes survived the run"
    assert subprocess.run(["true"]).returncode == 0  # this process can still start processes


def test_escaped_background_process_is_killed(mode):
    if not ROOT and mode != "bwrap":
        pytest.skip("without root or bwrap a process that calls setsid() can outlive the run")
    marker = f"{random.randint(10**8, 10**9)}.25"
    code = ("import os\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            f"    os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
            "def f():\n    return 1")
    assert score(code, ["assert f() == 1"]) == 1.0
    assert _gone(marker), "a daemonised child outlived the sandbox"


def test_memory_bomb_is_contained(mode):
    code = "blob = bytearray(8 << 30)\ndef f():\n    return len(blob)"
    assert score(code, ["assert f() > 0"], memory_mb=512) == 0.0
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))"
    assert score(code, ["assert True is False"], memory_mb=512) == 0.0
    assert len(bytearray(10 << 20)) == 10 << 20  # and we can still allocate


def test_cannot_write_outside_its_directory(mode, tmp_path):
    if not ROOT and mode != "bwrap":
        pytest.skip("without root or bwrap the code writes wherever this user can")
    target = tmp_path / "outside"
    target.mkdir(mode=0o755)
    repo_file = REPO / f"pwned_{random.randint(0, 10**9)}.txt"
    code = ("import os\n"
            "def write(path):\n"
            "    with open(path, 'w') as f:\n"
            "        f.write('pwned')\n"
            "    return True\n"
            "ok = os.path.exists('.') and open('inside.txt', 'w').write('fine') == 4\n")
    tests = [f"assert write({str(target / 'x.txt')!r})", f"assert write({str(repo_file)!r})",
             f"assert write({os.path.expanduser('~/.pwned_by_sandbox')!r})", "assert write('/etc/pwned')",
             "assert write('/pwned')", "assert ok"]
    try:
        assert score(code, tests) == pytest.approx(1 / 6)  # only writing inside its own directory works
        assert not (target / "x.txt").exists() and not repo_file.exists()
        assert not Path("/etc/pwned").exists() and not Path("/pwned").exists()
        assert not Path(os.path.expanduser("~/.pwned_by_sandbox")).exists()
    finally:
        repo_file.unlink(missing_ok=True)


def test_cannot_read_the_users_files(mode, tmp_path):
    if not ROOT and mode != "bwrap":
        pytest.skip("without root or bwrap the code reads whatever this user can")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    secret = home / "secret.txt"
    secret.write_text("hunter2")
    secret.chmod(0o600)
    tests = [f"assert 'hunter2' in open({str(secret)!r}).read()",
             f"assert os.listdir({os.path.expanduser('~')!r}) is not None"]
    assert score("import os", tests) == 0.0
    # bubblewrap hides everything but /usr; the fallbacks (other uid) still read world-readable files
    repo_visible = score("import os", [f"assert open({str(REPO / 'pyproject.toml')!r}).read()"])
    assert repo_visible == (0.0 if mode == "bwrap" else 1.0)


def test_no_network(mode):
    if mode == "rlimits":
        pytest.skip("rlimits mode has no network namespace")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = ("import socket\n"
                "def reach(host, port):\n"
                "    try:\n"
                "        socket.create_connection((host, port), timeout=1).close()\n"
                "        return True\n"
                "    except OSError:\n"
                "        return False")
        tests = [f"assert reach('127.0.0.1', {port})", "assert reach('1.1.1.1', 53)",
                 "assert reach('8.8.8.8', 443)"]
        assert score(code, tests) == 0.0
    finally:
        server.close()


def test_output_flood_and_forged_results(mode):
    flood = "import sys\nwhile True:\n    sys.stdout.write('0 0 1\\n' * 1000)"
    assert score(flood, ["assert True"]) == 0.0
    forge = ("import os, sys\n"
             "for i in range(3):\n"
             "    print('deadbeef', i, 1)\n"
             "sys.stdout.flush()\n"
             "os._exit(0)")
    assert score(forge, ["assert False", "assert False", "assert False"]) == 0.0
    cheat = "import sys\nprint(sys.stdin.read(), sys.argv)\nimport os\nprint(dict(os.environ))"
    assert score(cheat, ["assert False"]) == 0.0


def test_exit_and_input_do_not_break_the_harness(mode):
    code = "x = input() if False else 1\ndef f():\n    return 1\nraise SystemExit(0)"
    assert score(code, ["assert f() == 1", "exit(0)", "assert f() == 2"]) == pytest.approx(1 / 3)
    code = "def f():\n    return input()"
    assert score(code, ["assert f() == ''"]) == 0.0  # stdin is at EOF


def test_run_python_reports_timeouts(mode):
    res = sandbox.run_python({"m.py": "import time; print('hi', flush=True); time.sleep(60)"}, "m.py",
                             sandbox.Limits(timeout_s=1))
    assert res.timed_out and res.returncode is None and res.stdout == "hi\n" and res.mode == mode
    res = sandbox.run_python({"m.py": "import sys; sys.exit(3)"}, "m.py", sandbox.Limits(timeout_s=5))
    assert not res.timed_out and res.returncode == 3
    with pytest.raises(ValueError):
        sandbox.run_python({"../m.py": "pass"}, "m.py")


def test_without_bwrap_falls_back_and_warns_once(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    monkeypatch.setattr(sandbox, "_probed", {})
    monkeypatch.setattr(sandbox, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sandbox.isolation() in ("unshare", "rlimits")
        sandbox.isolation()
    assert len([w for w in caught if "bubblewrap" in str(w.message)]) == 1
    assert score("def f():\n    return 1", ["assert f() == 1"]) == 1.0


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_bwrap_is_chosen_when_installed():
    assert sandbox.isolation() == "bwrap"


def test_extract_code_and_test_steps():
    text = "<think>```python\nwrong()\n```</think>Here:\n```py\ndef f():\n    return 1\n```\nand ```python\nx = 2\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("```python\ndef f(): return 1") == "def f(): return 1"  # cut-off fence
    assert extract_code("def f(): return 1") == "def f(): return 1"
    steps = parse_tests("import math\nassert f(1) == 1\nx = 2; assert f(x) == 2\n")
    assert [k for k, _ in steps] == ["setup", "test", "setup", "test"]
    assert parse_tests("def check(candidate):\n    assert candidate(1)\n", "f")[0][1].endswith("check(f)")
    assert parse_tests("this is not python (") == [("test", "this is not python (")]
    assert parse_tests(None) == [] and parse_tests([]) == []


def test_chatty_solution_keeps_its_results(mode):
    code = "print('x' * 3_000_000)\ndef f():\n    print('debug ' * 1000)\n    return 1"
    assert score(code, ["assert f() == 1", "assert f() == 2"]) == 0.5


def test_sandbox_failure_scores_none(monkeypatch):
    def broken(*args, **kwargs):
        return sandbox.Result(1, "", "bwrap: cannot create namespace", False, "bwrap")

    monkeypatch.setattr(sandbox, "run_python", broken)
    assert code_tests(["p"], ["def f(): return 1"], tests=[["assert f() == 1"]]) == [None]
