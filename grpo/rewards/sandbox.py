"""Run untrusted Python (model-written code) in a throwaway sandbox with a hard timeout.

Every run gets a fresh temporary directory and a separate process with resource limits
(RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE, no core files), a clean
environment and stdin at EOF. At the timeout the whole process group is SIGKILLed. The strongest
isolation this machine supports is chosen once, by a probe, in this order:

``bwrap``    bubblewrap: new user/pid/net/ipc/uts namespaces (no network at all), a read-only view
             of ``/usr`` and the few ``/etc`` files the dynamic loader needs, empty ``/tmp``; the
             work directory is the only writable path and no home, repository or other user file
             is visible. Killing bwrap kills every process in the sandbox.
``unshare``  no bwrap: a private network namespace (no network), rlimits, cwd in the temp dir.
``rlimits``  neither works: rlimits, cwd in the temp dir, clean environment only (a warning says so).

When the trainer runs as root, the code also runs under a fresh unprivileged uid (never shared by
two concurrent runs): it cannot read ``/root`` or write outside its directory and world-writable
places, RLIMIT_NPROC applies (root is exempt from it) and every process of that uid is killed
when the run ends, including ones that left the process group.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000
_LAUNCHER = r"""
import json, os, resource, sys, ctypes
c = json.loads(sys.argv[1])
for name, v in c["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (v, v))
libc = ctypes.CDLL(None, use_errno=True)
if c["unshare"] and libc.unshare(c["unshare"]) != 0:
    sys.exit(97)
if c["uid"] is not None:
    os.setgroups([]); os.setgid(c["uid"]); os.setuid(c["uid"])
libc.prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL: die with the trainer
os.execve(c["argv"][0], c["argv"], c["env"])
"""
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
              "/etc/alternatives")
MODES = ("bwrap", "unshare", "rlimits")


@dataclass
class Limits:
    timeout_s: float = 5.0     # wall clock; the process group is SIGKILLed then
    memory_mb: int = 1024      # RLIMIT_AS, per process
    max_procs: int = 16        # RLIMIT_NPROC (processes and threads)
    max_file_mb: int = 16      # RLIMIT_FSIZE: largest file it may write
    max_open_files: int = 64   # RLIMIT_NOFILE
    max_output: int = 1 << 20  # bytes of stdout / stderr kept


@dataclass
class Result:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    mode: str


_uids = itertools.count()
_lock = threading.Lock()
_probed: dict[str, bool] = {}
_warned = False


def _world_usable(path: str) -> bool:
    """True when an unprivileged uid can execute ``path`` (every parent directory searchable)."""
    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        d = os.path.dirname(path)
        while d != "/":
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            d = os.path.dirname(d)
    except OSError:
        return False
    return True


def default_python() -> str:
    """The interpreter for sandboxed code: this Python's base interpreter (not the virtualenv, so
    none of the project's packages) when others can run it, else the system ``python3``."""
    base = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    for cand in (base, "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand) and (os.geteuid() != 0 or _world_usable(cand)):
            return os.path.realpath(cand)
    return base


def _sandbox_uid() -> int | None:
    if os.geteuid() != 0:
        return None
    return 1_000_000 + (os.getpid() % 1_000_000) * 1024 + next(_uids) % 1024


def _owned(uid: int, proc: str) -> list[str]:
    """The process ids (entries of ``proc``) of ``uid``'s processes."""
    pids = []
    for p in os.listdir(proc):
        if p.isdigit():
            try:
                if os.stat(f"{proc}/{p}").st_uid == uid:
                    pids.append(p)
            except OSError:  # it ended meanwhile
                pass
    return pids


def _tasks_of(uid: int, proc: str = "/proc") -> int:
    """How many tasks (processes and threads, what RLIMIT_NPROC counts) ``uid`` runs."""
    n = 0
    for p in _owned(uid, proc):
        try:
            n += len(os.listdir(f"{proc}/{p}/task"))
        except OSError:
            pass
    return n


def _bwrap_argv(python: str, workdir: str, argv: list[str], tmp_bytes: int) -> list[str]:
    cmd = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
           "--ro-bind", "/usr", "/usr"]
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            cmd += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            cmd += ["--ro-bind", d, d]
    for f in _ETC_FILES:
        cmd += ["--ro-bind-try", f, f]
    prefix = os.path.dirname(os.path.dirname(python))
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        cmd += ["--ro-bind", prefix, prefix]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_bytes), "--tmpfs", "/tmp",
            "--bind", workdir, "/sandbox", "--remount-ro", "/", "--chdir", "/sandbox", "--"]
    return cmd + [python, *argv[1:]]


def _live(proc: str, pid: str) -> bool:
    """Whether process ``pid`` still runs: not a zombie (dead, its parent reaps it), nor gone."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # the state follows the name, which may hold ")"
    except (OSError, IndexError):
        return False


def _kill_uid(uid: int, proc: str = "/proc") -> None:
    """SIGKILL every live process of ``uid`` until none is left (at most 100 rounds)."""
    for _ in range(100):
        live = [int(p) for p in _owned(uid, proc) if _live(proc, p)]
        if not live:
            return
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # it ended meanwhile
                pass
        time.sleep(0.005)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone, or its processes switched uid
        pass


def _wait(pid: int, timeout_s: float) -> bool:
    """Wait for ``pid`` to exit without reaping it (so its group id cannot be reused); False on timeout."""
    deadline, pause = time.monotonic() + timeout_s, 0.001
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def _read(f, limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode("utf-8", "replace")


def _workdir(root: str, files: dict[str, str], uid: int | None) -> str:
    """``root``/work holding ``files``, owned by ``uid`` (when the code runs under one of its own)."""
    work = os.path.join(root, "work")
    os.mkdir(work)
    for name, text in files.items():
        path = os.path.join(work, name)
        if os.path.dirname(os.path.abspath(path)) != work:
            raise ValueError(f"sandbox file name must be a plain name, got {name!r}")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    if uid is not None:
        os.chmod(root, 0o711)
        for p in [work, *(os.path.join(work, n) for n in files)]:
            os.chown(p, uid, uid)
    return work


def _launch_config(mode: str, python: str, work: str, main: str, limits: Limits, uid: int | None) -> dict:
    """What the launcher (``_LAUNCHER``) applies before it execs the code: rlimits, namespaces, uid, argv, env."""
    inside = "/sandbox" if mode == "bwrap" else work
    argv = [python, "-I", "-X", "utf8", os.path.join(inside, main)]
    if mode == "bwrap":
        argv = _bwrap_argv(python, work, argv, limits.max_file_mb << 22)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": inside,
           "TMPDIR": "/tmp" if mode == "bwrap" else work, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    # RLIMIT_NPROC counts every process of the uid: under this user's own uid, its running tasks come on top
    nproc = limits.max_procs + (_tasks_of(os.geteuid()) if uid is None else 0)
    cpu = int(limits.timeout_s) + 2
    return {"rlimits": {"RLIMIT_CPU": cpu, "RLIMIT_AS": limits.memory_mb << 20,
                        "RLIMIT_NPROC": nproc, "RLIMIT_FSIZE": limits.max_file_mb << 20,
                        "RLIMIT_NOFILE": limits.max_open_files, "RLIMIT_CORE": 0},
            "unshare": 0 if mode != "unshare" else _CLONE_NEWNET | (_CLONE_NEWUSER if uid is None else 0),
            "uid": uid, "argv": argv, "env": env}


def _execute(mode: str, python: str, cfg: dict, work: str, stdin: str, limits: Limits) -> Result:
    """Start the launcher with ``cfg`` in its own session, wait up to the timeout, then kill what is left."""
    with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
        fin.write(stdin.encode())
        fin.seek(0)
        proc = subprocess.Popen([python, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
                                stdin=fin, stdout=fout, stderr=ferr, cwd=work, env=cfg["env"],
                                start_new_session=True, close_fds=True)
        finished = _wait(proc.pid, limits.timeout_s)
        _kill_group(proc.pid)  # before the leader is reaped: its group id cannot have been reused
        proc.wait()
        if cfg["uid"] is not None:
            _kill_uid(cfg["uid"])
        return Result(proc.returncode if finished else None, _read(fout, limits.max_output),
                      _read(ferr, limits.max_output), not finished, mode)


def _run(mode: str, files: dict[str, str], main: str, limits: Limits, python: str,
         stdin: str) -> Result:
    root = tempfile.mkdtemp(prefix="grpo-sandbox-")
    uid = _sandbox_uid()
    try:
        work = _workdir(root, files, uid)
        return _execute(mode, python, _launch_config(mode, python, work, main, limits, uid), work, stdin, limits)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _works(mode: str, python: str) -> bool:
    if mode == "bwrap" and not shutil.which("bwrap"):
        return False
    with _lock:
        key = f"{mode}:{python}"
        if key not in _probed:
            try:
                r = _run(mode, {"probe.py": "print('ok')"}, "probe.py", Limits(timeout_s=20), python, "")
                _probed[key] = r.returncode == 0 and r.stdout.strip() == "ok"
            except Exception:
                _probed[key] = False
        return _probed[key]


def isolation(python: str | None = None) -> str:
    """The strongest mode that works here (``bwrap``, ``unshare`` or ``rlimits``)."""
    global _warned
    python = python or default_python()
    for mode in MODES[:-1]:
        if _works(mode, python):
            break
    else:
        mode = "rlimits"
    if mode != "bwrap" and not _warned:
        _warned = True
        warnings.warn(f"bubblewrap (bwrap) is not usable here: untrusted code runs with {mode} "
                      "isolation only (it can see this machine's files). Install it with "
                      "`apt-get install bubblewrap`.", RuntimeWarning, stacklevel=2)
    return mode


def run_python(files: dict[str, str], main: str, limits: Limits | None = None,
               python: str | None = None, stdin: str = "", mode: str | None = None) -> Result:
    """Write ``files`` (plain names -> text) into a fresh directory and run ``python main`` there.

    ``mode`` forces an isolation level (tests use it); by default the strongest that works.
    ``returncode`` is None when the run hit the timeout (then ``timed_out`` is True).
    """
    python = python or default_python()
    mode = mode or isolation(python)
    if mode not in MODES:
        raise ValueError(f"sandbox mode must be one of {MODES}, got {mode!r}")
    return _run(mode, files, main, limits or Limits(), python, stdin)
