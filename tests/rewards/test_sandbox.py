"""The code sandbox against hostile programs, in every isolation mode this machine supports.

Each hostile program must be contained and score 0, and this process must be unharmed. Modes
without bubblewrap promise less; the checks they cannot pass are skipped with the reason.
"""
import io
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo.rewards import sandbox
from grpo.rewards.code_exec import code_tests
from tests.under_mutmut import bounded_under_mutmut  # noqa: F401  (a mutant's endless loop: 3 s)

ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 2.0


@pytest.fixture(params=sandbox.MODES)
def mode(request, monkeypatch):
    # probed when a test asks for the mode, not at collection: the unit tests of this file start no process
    if request.param != "rlimits" and not sandbox._works(request.param, sandbox.default_python()):
        pytest.skip(f"{request.param} isolation does not work on this machine")
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


def test_chatty_solution_keeps_its_results(mode):
    code = "print('x' * 3_000_000)\ndef f():\n    print('debug ' * 1000)\n    return 1"
    assert score(code, ["assert f() == 1", "assert f() == 2"]) == 0.5


# The sandbox's parts without a process (`make mutate` selects these by name; the tests above start real ones):
# the command and limits it builds, its waits and kills over stand-ins for the system calls, its probe and defaults.

class _Clock:
    """time.monotonic / time.sleep: ``monotonic`` answers ``times`` in turn (then the last), sleeps are recorded."""

    def __init__(self, *times):
        self.times, self.slept = list(times), []

    def monotonic(self):
        return self.times.pop(0) if len(self.times) > 1 else self.times[0]

    def sleep(self, s):
        self.slept.append(s)


def test_world_usable_needs_execute_for_others_on_the_file_and_every_parent_after_links():
    top = Path(tempfile.mkdtemp(dir="/tmp"))  # /tmp and / are searchable by everyone
    try:
        top.chmod(0o755)
        exe = top / "python"
        exe.write_text("")
        exe.chmod(0o755)
        assert sandbox._world_usable(str(exe))
        exe.chmod(0o754)
        assert not sandbox._world_usable(str(exe))  # others may not execute it
        sub = top / "sub"
        sub.mkdir()
        inner = sub / "python"
        inner.write_text("")
        inner.chmod(0o755)
        sub.chmod(0o750)
        assert not sandbox._world_usable(str(inner))  # a parent others cannot search
        sub.chmod(0o711)
        assert sandbox._world_usable(str(inner))  # searching (x) is enough, reading is not needed
        hidden = top / "hidden"
        hidden.mkdir(mode=0o700)
        (hidden / "link").symlink_to(inner)
        assert sandbox._world_usable(str(hidden / "link"))  # judged where the link leads
        assert not sandbox._world_usable(str(top / "missing"))
    finally:
        shutil.rmtree(top)


def test_default_python_is_the_base_interpreter_else_a_system_one_that_others_can_run(monkeypatch):
    system = {c: os.path.realpath(c) for c in ("/usr/bin/python3", "/usr/local/bin/python3")}
    exists, usable = set(), set()
    monkeypatch.setattr(os.path, "exists", lambda p: p in exists)
    monkeypatch.setattr(sandbox, "_world_usable", lambda p: p in usable)
    monkeypatch.setattr(sandbox, "sys", SimpleNamespace(_base_executable="/nowhere/base/python",
                                                        executable="/nowhere/venv/python"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert sandbox.default_python() == "/nowhere/base/python"  # not a candidate that exists: the base anyway
    exists.update({"/nowhere/base/python", "/usr/bin/python3"})
    assert sandbox.default_python() == "/nowhere/base/python"  # a user runs its own interpreter, usable or not
    monkeypatch.setattr(sandbox, "sys", SimpleNamespace(_base_executable=None, executable="/nowhere/venv/python"))
    exists.add("/nowhere/venv/python")
    assert sandbox.default_python() == "/nowhere/venv/python"  # no base interpreter recorded: this one
    monkeypatch.setattr(sandbox, "sys", SimpleNamespace(executable="/nowhere/venv/python"))
    assert sandbox.default_python() == "/nowhere/venv/python"  # a Python without the attribute at all
    monkeypatch.setattr(sandbox, "sys", SimpleNamespace(_base_executable="/nowhere/base/python",
                                                        executable="/nowhere/venv/python"))
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root: the code runs as another uid, which must reach it
    usable.add(system["/usr/bin/python3"])
    usable.add("/usr/bin/python3")
    assert sandbox.default_python() == system["/usr/bin/python3"]
    usable.add("/nowhere/base/python")
    assert sandbox.default_python() == "/nowhere/base/python"
    usable.clear()
    exists.discard("/usr/bin/python3")
    exists.add("/usr/local/bin/python3")
    usable.add("/usr/local/bin/python3")
    assert sandbox.default_python() == system["/usr/local/bin/python3"]
    usable.clear()
    assert sandbox.default_python() == "/nowhere/base/python"  # none usable: the base, which then fails loudly


def test_a_root_trainer_gives_each_run_its_own_uid_and_a_user_none(monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 2_000_005)
    monkeypatch.setattr(sandbox, "_uids", itertools.count(1023))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    base = 1_000_000 + 5 * 1024  # one block of 1024 uids per trainer process id
    assert [sandbox._sandbox_uid() for _ in range(3)] == [base + 1023, base, base + 1]
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert sandbox._sandbox_uid() is None


def _proc_tree(root: Path, entries: dict) -> str:
    """A stand-in /proc: pid -> (number of tasks or None for no task folder, the stat line or None)."""
    for pid, (tasks, stat_line) in entries.items():
        d = root / pid
        d.mkdir()
        if tasks is not None:
            (d / "task").mkdir()
            for t in range(tasks):
                (d / "task" / str(t)).mkdir()
        if stat_line is not None:
            (d / "stat").write_text(stat_line)
    (root / "self").mkdir()  # not a process id
    (root / "self" / "task").mkdir()
    (root / "9999").symlink_to(root / "gone")  # a process that ended while /proc was read
    return str(root)


def test_the_tasks_of_a_uid_are_the_task_folders_of_its_processes(tmp_path):
    proc = _proc_tree(tmp_path, {"12": (3, None), "40": (1, None), "41": (None, None)})
    me = os.stat(tmp_path).st_uid
    assert sorted(sandbox._owned(me, proc)) == ["12", "40", "41"]
    assert sandbox._tasks_of(me, proc) == 4  # 41 has no task folder (it ended): none counted
    assert sandbox._owned(me + 1, proc) == [] and sandbox._tasks_of(me + 1, proc) == 0
    assert sandbox._tasks_of(os.geteuid()) >= 1  # the real /proc by default: this process at least


def test_kill_uid_kills_every_live_process_round_after_round_until_none_is_left(tmp_path, monkeypatch):
    proc = _proc_tree(tmp_path, {"12": (1, "12 (py) R 1 2"), "13": (1, "13 (zombie) Z 1 2"),
                                 "14": (1, "14 (a) Z b) S 1 2"), "15": (1, "garbage"), "16": (1, "16 (x) S 1")})
    me = os.stat(tmp_path).st_uid
    killed, clock = [], _Clock(0.0)
    respawned = []

    def kill(pid, sig):
        killed.append((pid, sig))
        if pid == 16:
            shutil.rmtree(tmp_path / "16")
            raise ProcessLookupError(pid)  # it exited just now
        if pid == 12 and not respawned:  # its first kill: it had forked a child
            respawned.append(1)
            (tmp_path / "17").mkdir()
            (tmp_path / "17" / "stat").write_text("17 (py) S 12")
        shutil.rmtree(tmp_path / str(pid))

    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setattr(sandbox, "time", clock)
    sandbox._kill_uid(me + 1, proc)
    assert killed == [] and clock.slept == []  # another uid's processes are left alone
    sandbox._kill_uid(me, proc)
    # 13 is a zombie (dead already); 14's name holds ") Z ": its state is S; 15's stat cannot be read
    assert sorted(killed[:3]) == [(12, signal.SIGKILL), (14, signal.SIGKILL), (16, signal.SIGKILL)]
    assert killed[3:] == [(17, signal.SIGKILL)] and clock.slept == [0.005, 0.005]
    assert not sandbox._live(proc, "13") and not sandbox._live(proc, "15") and not sandbox._live(proc, "99")
    del killed[:]
    sandbox._kill_uid(2_000_000_000)  # the real /proc by default: no process of that uid, nothing killed
    assert killed == []


def test_kill_uid_gives_up_after_100_rounds_on_a_process_that_does_not_die(tmp_path, monkeypatch):
    proc = _proc_tree(tmp_path, {"12": (1, "12 (py) D 1 2")})
    killed, clock = [], _Clock(0.0)
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(pid))
    monkeypatch.setattr(sandbox, "time", clock)
    sandbox._kill_uid(os.stat(tmp_path).st_uid, proc)
    assert killed == [12] * 100 and clock.slept == [0.005] * 100


def test_kill_group_kills_the_whole_group_and_a_group_gone_or_not_ours_is_no_error(monkeypatch):
    calls = []

    def killpg(pid, sig):
        calls.append((pid, sig))
        if pid != 4321:
            raise {1: ProcessLookupError, 2: PermissionError}[pid](pid)

    monkeypatch.setattr(os, "killpg", killpg)
    sandbox._kill_group(4321)
    sandbox._kill_group(1)
    sandbox._kill_group(2)
    assert calls == [(4321, signal.SIGKILL), (1, signal.SIGKILL), (2, signal.SIGKILL)]


def test_wait_polls_without_reaping_backing_off_to_20_ms_and_stops_at_the_deadline(monkeypatch):
    polls = []

    def waitid(idtype, pid, options, answers):
        polls.append((idtype, pid, options))
        answer = answers.pop(0)
        if isinstance(answer, type):
            raise answer()
        return answer

    answers = [None] * 8 + ["exited"]
    monkeypatch.setattr(os, "waitid", lambda *a: waitid(*a, answers))
    clock = _Clock(0.0)
    monkeypatch.setattr(sandbox, "time", clock)
    assert sandbox._wait(77, 5.0) is True
    assert polls == [(os.P_PID, 77, os.WEXITED | os.WNOHANG | os.WNOWAIT)] * 9
    assert clock.slept == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.016, 0.02, 0.02, 0.02])

    polls.clear()
    answers[:] = [None] * 10
    clock = _Clock(10.0, 10.0, 11.0, 12.0, 13.0)  # the deadline is 12.0: the third poll is the last
    monkeypatch.setattr(sandbox, "time", clock)
    assert sandbox._wait(77, 2.0) is False
    assert len(polls) == 3 and len(clock.slept) == 2

    answers[:] = [ChildProcessError]  # reaped elsewhere: it is gone
    assert sandbox._wait(77, 2.0) is True


def test_read_keeps_the_first_bytes_from_the_start_and_replaces_bad_utf8():
    f = io.BytesIO()
    f.write("h\xe9".encode() + b"\xff tail")
    assert sandbox._read(f, 4) == "h\xe9\ufffd"
    assert sandbox._read(f, 100) == "h\xe9\ufffd tail"


def test_the_work_directory_holds_the_files_owned_by_the_runs_uid(tmp_path, monkeypatch):
    owned, opened = [], []

    def recording_open(path, mode="r", **kw):
        opened.append((os.path.basename(path), mode, kw))
        return open(path, mode, **kw)

    monkeypatch.setattr(sandbox, "open", recording_open, raising=False)
    monkeypatch.setattr(os, "chown", lambda p, u, g: owned.append((p, u, g)))
    monkeypatch.setattr(os, "chmod", lambda p, m: owned.append((p, oct(m))))
    files = {"main.py": "print('h\xe9')\n", "data.txt": "x"}
    (tmp_path / "a").mkdir()
    work = sandbox._workdir(str(tmp_path / "a"), files, None)
    assert work == str(tmp_path / "a" / "work") and owned == []
    assert (tmp_path / "a" / "work" / "main.py").read_bytes() == "print('h\xe9')\n".encode()
    assert sorted(os.listdir(work)) == ["data.txt", "main.py"]
    assert opened == [("main.py", "w", {"encoding": "utf-8"}), ("data.txt", "w", {"encoding": "utf-8"})]  # any locale
    (tmp_path / "b").mkdir()
    work = sandbox._workdir(str(tmp_path / "b"), files, 1_000_123)
    assert owned == [(str(tmp_path / "b"), oct(0o711)), (work, 1_000_123, 1_000_123),
                     (os.path.join(work, "main.py"), 1_000_123, 1_000_123),
                     (os.path.join(work, "data.txt"), 1_000_123, 1_000_123)]
    for i, bad in enumerate(["../m.py", "sub/m.py", "/etc/m.py"]):
        (tmp_path / f"c{i}").mkdir()
        with pytest.raises(ValueError, match="plain name"):
            sandbox._workdir(str(tmp_path / f"c{i}"), {bad: ""}, None)


ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
       "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LIMITS = sandbox.Limits(timeout_s=2.7, memory_mb=3, max_procs=5, max_file_mb=2, max_open_files=9)
RLIMITS = {"RLIMIT_CPU": 4, "RLIMIT_AS": 3 * 2**20, "RLIMIT_FSIZE": 2 * 2**20, "RLIMIT_NOFILE": 9, "RLIMIT_CORE": 0}


def test_the_launch_config_without_namespaces_counts_this_users_tasks_into_the_process_limit(monkeypatch):
    asked = []
    monkeypatch.setattr(sandbox, "_tasks_of", lambda uid: asked.append(uid) or 7)
    cfg = sandbox._launch_config("rlimits", "/py/bin/python3", "/t/work", "m.py", LIMITS, None)
    assert cfg == {"rlimits": {**RLIMITS, "RLIMIT_NPROC": 5 + 7}, "unshare": 0, "uid": None,
                   "argv": ["/py/bin/python3", "-I", "-X", "utf8", "/t/work/m.py"],
                   "env": {**ENV, "HOME": "/t/work", "TMPDIR": "/t/work"}}
    assert asked == [os.geteuid()]


def test_the_launch_config_of_unshare_asks_a_network_namespace_and_a_user_one_without_a_uid(monkeypatch):
    monkeypatch.setattr(sandbox, "_tasks_of", lambda uid: 7)
    cfg = sandbox._launch_config("unshare", "/py", "/t/work", "m.py", LIMITS, None)
    assert cfg["unshare"] == 0x40000000 | 0x10000000 and cfg["rlimits"]["RLIMIT_NPROC"] == 12  # CLONE_NEW{NET,USER}
    cfg = sandbox._launch_config("unshare", "/py", "/t/work", "m.py", LIMITS, 1_000_001)
    assert cfg == {"rlimits": {**RLIMITS, "RLIMIT_NPROC": 5}, "unshare": 0x40000000, "uid": 1_000_001,
                   "argv": ["/py", "-I", "-X", "utf8", "/t/work/m.py"],
                   "env": {**ENV, "HOME": "/t/work", "TMPDIR": "/t/work"}}
    timed = sandbox._launch_config("unshare", "/py", "/t", "m.py", sandbox.Limits(timeout_s=0.5), 1)
    assert timed["rlimits"]["RLIMIT_CPU"] == 2  # whole seconds, two over the wall-clock limit


def test_the_launch_config_of_bwrap_runs_the_code_at_sandbox_inside_bubblewrap(monkeypatch):
    monkeypatch.setattr(sandbox, "_bwrap_argv", lambda *a: ["bwrap", *map(str, a[:2]), *a[2], str(a[3])])
    cfg = sandbox._launch_config("bwrap", "/py", "/t/work", "m.py", LIMITS, 1_000_001)
    assert cfg == {"rlimits": {**RLIMITS, "RLIMIT_NPROC": 5}, "unshare": 0, "uid": 1_000_001,
                   "argv": ["bwrap", "/py", "/t/work", "/py", "-I", "-X", "utf8", "/sandbox/m.py", str(2 << 22)],
                   "env": {**ENV, "HOME": "/sandbox", "TMPDIR": "/tmp"}}


def test_bwrap_binds_the_system_read_only_and_the_work_directory_alone(monkeypatch):
    links, dirs = {"/bin": "usr/bin", "/lib64": "usr/lib64"}, {"/lib", "/sbin"}
    monkeypatch.setattr(os.path, "islink", lambda p: p in links)
    monkeypatch.setattr(os.path, "isdir", lambda p: p in dirs or p in links)
    monkeypatch.setattr(os, "readlink", lambda p: links[p])
    monkeypatch.setattr(sandbox, "shutil", SimpleNamespace(which=lambda name: f"/opt/{name}"))
    etc = ["/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives"]
    head = ["/opt/bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/bin", "/bin", "--ro-bind", "/sbin", "/sbin", "--ro-bind", "/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", *[a for f in etc for a in ("--ro-bind-try", f, f)]]
    tail = ["--proc", "/proc", "--dev", "/dev", "--size", "123", "--tmpfs", "/tmp", "--bind", "/t/work", "/sandbox",
            "--remount-ro", "/", "--chdir", "/sandbox", "--"]
    argv = ["ignored", "-I", "/sandbox/m.py"]
    assert sandbox._bwrap_argv("/usr/bin/python3", "/t/work", argv, 123) == [*head, *tail, "/usr/bin/python3",
                                                                              "-I", "/sandbox/m.py"]
    # an interpreter outside /usr: its prefix is bound (read-only) too; /usrx is outside /usr
    for python, prefix in (("/opt/py/bin/python3", "/opt/py"), ("/usrx/bin/python3", "/usrx")):
        assert sandbox._bwrap_argv(python, "/t/work", argv, 123) == [*head, "--ro-bind", prefix, prefix, *tail,
                                                                     python, "-I", "/sandbox/m.py"]
    monkeypatch.setattr(sandbox, "shutil", SimpleNamespace(which=lambda name: None))
    local = sandbox._bwrap_argv("/usr/local/bin/python3", "/t/work", argv, 123)  # under /usr: bound already
    assert local == ["bwrap", *head[1:], *tail, "/usr/local/bin/python3", "-I", "/sandbox/m.py"]  # bwrap from PATH


class _Popen:
    """subprocess.Popen: records how it was started and what stdin held, writes canned output, exits with 3."""

    def __init__(self, events, out=b"out", err=b"err\xff"):
        self.events, self.out, self.err = events, out, err

    def __call__(self, args, **kw):
        self.args, self.kw = args, kw
        self.stdin = kw["stdin"].read()
        kw["stdout"].write(self.out)
        kw["stderr"].write(self.err)
        self.pid, self.returncode = 4321, None
        self.events.append("start")
        return self

    def wait(self):
        self.events.append("reap")
        self.returncode = 3


def _execute(monkeypatch, finished: bool, uid, limits=LIMITS):
    events = []
    popen = _Popen(events)
    monkeypatch.setattr(sandbox, "subprocess", SimpleNamespace(Popen=popen))
    monkeypatch.setattr(sandbox, "_wait", lambda pid, t: events.append(("wait", pid, t)) or finished)
    monkeypatch.setattr(sandbox, "_kill_group", lambda pid: events.append(("killpg", pid)))
    monkeypatch.setattr(sandbox, "_kill_uid", lambda u: events.append(("kill_uid", u)))
    cfg = {"uid": uid, "env": {"HOME": "/w"}, "argv": ["x"]}
    return sandbox._execute("unshare", "/py", cfg, "/t/work", "nonce\n", limits), popen, events, cfg


def test_execute_starts_the_launcher_in_its_own_session_and_kills_its_group_before_reaping_it(monkeypatch):
    res, popen, events, cfg = _execute(monkeypatch, True, 1_000_001)
    assert popen.args == ["/py", "-I", "-S", "-c", sandbox._LAUNCHER, json.dumps(cfg)]
    assert {k: v for k, v in popen.kw.items() if k not in ("stdin", "stdout", "stderr")} == {
        "cwd": "/t/work", "env": {"HOME": "/w"}, "start_new_session": True, "close_fds": True}
    assert popen.stdin == b"nonce\n"
    assert events == ["start", ("wait", 4321, 2.7), ("killpg", 4321), "reap", ("kill_uid", 1_000_001)]
    assert res == sandbox.Result(3, "out", "err\ufffd", False, "unshare")


def test_execute_at_the_timeout_has_no_returncode_and_keeps_what_was_written(monkeypatch):
    res, _, events, _ = _execute(monkeypatch, False, None, sandbox.Limits(timeout_s=1.0, max_output=2))
    assert events == ["start", ("wait", 4321, 1.0), ("killpg", 4321), "reap"]  # no uid of its own to kill
    assert res == sandbox.Result(None, "ou", "er", True, "unshare")


def test_run_gives_the_work_directory_and_config_to_execute_and_removes_them(monkeypatch):
    seen, owned = {}, []

    def execute(mode, python, cfg, work, stdin, limits):
        seen.update(mode=mode, python=python, cfg=cfg, work=work, stdin=stdin, limits=limits,
                    files={n: open(os.path.join(work, n)).read() for n in os.listdir(work)})
        if stdin == "boom":
            raise OSError("no launcher")
        if stdin == "gone":
            shutil.rmtree(os.path.dirname(work))  # removing what is already gone is no error
        return "result"

    monkeypatch.setattr(sandbox, "_execute", execute)
    monkeypatch.setattr(sandbox, "_sandbox_uid", lambda: 1_000_123)
    monkeypatch.setattr(os, "chown", lambda p, u, g: owned.append((os.path.basename(p), u)))
    assert sandbox._run("unshare", {"m.py": "pass"}, "m.py", LIMITS, "/py", "in") == "result"
    work = seen["work"]
    assert os.path.basename(os.path.dirname(work)).startswith("grpo-sandbox-") and seen["files"] == {"m.py": "pass"}
    assert owned == [("work", 1_000_123), ("m.py", 1_000_123)]  # the run's own uid
    assert seen["cfg"] == sandbox._launch_config("unshare", "/py", work, "m.py", LIMITS, 1_000_123)
    assert (seen["mode"], seen["python"], seen["stdin"], seen["limits"]) == ("unshare", "/py", "in", LIMITS)
    assert not os.path.exists(os.path.dirname(work))
    with pytest.raises(OSError):
        sandbox._run("rlimits", {"m.py": "pass"}, "m.py", LIMITS, "/py", "boom")
    assert not os.path.exists(os.path.dirname(seen["work"]))
    assert sandbox._run("rlimits", {"m.py": "pass"}, "m.py", LIMITS, "/py", "gone") == "result"


def test_isolation_probes_each_mode_once_and_warns_once_below_bwrap(monkeypatch):
    probes, answers = [], {}

    def run(mode, files, main, limits, python, stdin):
        probes.append((mode, files, main, limits, python, stdin))
        answer = answers[mode]
        if isinstance(answer, Exception):
            raise answer
        return sandbox.Result(*answer, False, mode)

    monkeypatch.setattr(sandbox, "_run", run)
    monkeypatch.setattr(sandbox, "_probed", {})
    monkeypatch.setattr(sandbox, "_warned", False)
    monkeypatch.setattr(sandbox, "default_python", lambda: "/py")
    monkeypatch.setattr(sandbox, "shutil", SimpleNamespace(which={"bwrap": "/usr/bin/bwrap"}.get))
    answers.update(bwrap=(0, " ok\n", ""), unshare=(0, "ok\n", ""))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sandbox.isolation() == "bwrap" and sandbox.isolation() == "bwrap"
        assert probes == [("bwrap", {"probe.py": "print('ok')"}, "probe.py", sandbox.Limits(timeout_s=20), "/py", "")]
        assert caught == []
        answers.update(bwrap=(1, "ok\n", ""))  # a probe per interpreter
        assert sandbox.isolation("/other") == "unshare" and [p[0] for p in probes[1:]] == ["bwrap", "unshare"]
        assert probes[2][4] == "/other" and len(caught) == 1
        assert caught[0].category is RuntimeWarning and "runs with unshare isolation" in str(caught[0].message)
        answers.update(bwrap=(0, "ko\n", ""), unshare=RuntimeError("no namespaces"))
        assert sandbox.isolation("/third") == "rlimits" and len(caught) == 1  # warned once a process
        assert sandbox._works("unshare", "/third") is False and sandbox._works("bwrap", "/third") is False
    monkeypatch.setattr(sandbox, "shutil", SimpleNamespace(which=lambda name: None))
    monkeypatch.setattr(sandbox, "_probed", {})
    del probes[:]
    answers.update(unshare=(0, "ok", ""))
    assert sandbox.isolation() == "unshare" and [p[0] for p in probes] == ["unshare"]  # no bwrap: not probed


def test_run_python_runs_in_the_strongest_mode_with_default_limits_or_the_ones_given(monkeypatch):
    calls = []
    monkeypatch.setattr(sandbox, "default_python", lambda: "/py")
    monkeypatch.setattr(sandbox, "isolation", lambda python=None: calls.append(("isolation", python)) or "unshare")
    monkeypatch.setattr(sandbox, "_run", lambda *a: calls.append(a) or "result")
    assert sandbox.run_python({"m.py": ""}, "m.py") == "result"
    assert calls == [("isolation", "/py"), ("unshare", {"m.py": ""}, "m.py", sandbox.Limits(), "/py", "")]
    del calls[:]
    limits = sandbox.Limits(timeout_s=1)
    assert sandbox.run_python({"m.py": ""}, "m.py", limits, "/q", "in", "rlimits") == "result"
    assert calls == [("rlimits", {"m.py": ""}, "m.py", limits, "/q", "in")]
    with pytest.raises(ValueError, match="sandbox mode must be one of"):
        sandbox.run_python({"m.py": ""}, "m.py", mode="docker")
