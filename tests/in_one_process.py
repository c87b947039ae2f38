"""Several ``python -m MODULE args...`` commands run one after the other in ONE process (``python
tests/in_one_process.py PLAN.json``), so that they pay the interpreter's start and the imports (torch, transformers:
about 4 CPU seconds a command) once instead of once each.

PLAN.json: ``{"path": DIR, "runs": [{"cwd": DIR, "argv": [MODULE, ARG, ...], "out": PREFIX, "env": {...}}, ...]}``
(``env``: optional, variables set for that run only). Each run is what ``python -m MODULE`` (or the console script)
does with that command line: the working directory is its ``cwd``,
which is first on sys.path, then ``path`` (a checkout: its ``grpo`` is the one imported, as when ``python -m`` runs
from there), ``sys.argv`` its arguments, and ``MODULE.main()`` is called; its exit status (SystemExit's code, 1 for an
exception, whose traceback goes to its stderr, as the interpreter does) and everything written to the process's file
descriptors 1 and 2 while it ran (PREFIX.stdout, PREFIX.stderr) are what a separate process would have given. As each
run ends, its status is written to PREFIX.rc and the paths its working directory then holds to PREFIX.files (one a
line, relative). Only the standard library is imported before the first run.
"""
import importlib
import json
import os
import sys
import traceback


def run_one(module: str, args: list[str]) -> int:
    sys.argv = [module, *args]
    try:
        code = importlib.import_module(module).main()
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception: traceback, status 1
        traceback.print_exc()
        return 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)  # sys.exit("message"): printed, status 1
    return 1


def main(plan_path: str) -> None:
    plan = json.loads(open(plan_path).read())
    sys.path[0:1] = ["", plan["path"]]  # in place of this file's folder (tests/)
    saved = os.dup(1), os.dup(2)
    for run in plan["runs"]:
        os.chdir(run["cwd"])
        sys.path[0] = run["cwd"]
        environ = dict(os.environ)
        os.environ.update(run.get("env", {}))
        with open(run["out"] + ".stdout", "wb") as out, open(run["out"] + ".stderr", "wb") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                rc = run_one(run["argv"][0], run["argv"][1:])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.environ.clear()
                os.environ.update(environ)
        with open(run["out"] + ".files", "w") as f:
            f.writelines(os.path.relpath(os.path.join(d, name), run["cwd"]) + "\n"
                         for d, dirs, files in sorted(os.walk(run["cwd"])) for name in sorted(dirs + files))
        with open(run["out"] + ".rc", "w") as f:
            f.write(str(rc))


if __name__ == "__main__":
    main(sys.argv[1])
