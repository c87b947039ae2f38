"""The report of a `make mutate` run (docs/testing.md): the mutation score of the core modules and every mutant that
survived, with its diff, from mutmut's results under ``mutants/``.

    python scripts/mutate_report.py [--mutants mutants] [--out mutants/report.md] [--min-score 95]

A survivor is either a missing test (add one), an equivalent mutant (list it in docs/mutation-equivalents.txt with
the reason), or dead code (remove it). The score leaves the listed equivalent mutants out:
killed / (mutants - equivalent - not run). It exits 1 when the score is below ``--min-score`` or a survivor is
neither killed nor listed, so the number cannot drop unnoticed."""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENTS = ROOT / "docs" / "mutation-equivalents.txt"
# mutmut 3's exit codes (mutmut/stats.py): 1 and 3 killed, 0 survived, 5/33 no test reached it, 36 and the SIGXCPU
# codes timed out (the mutant made a test hang: caught), 34 skipped, None not run yet
KILLED, TIMEOUT, NO_TESTS = {1, 3}, {36, 24, -24, 152, 255}, {5, 33}


def status(code) -> str:
    if code in KILLED:
        return "killed"
    if code in TIMEOUT:
        return "timeout"
    if code == 0:
        return "survived"
    if code in NO_TESTS:
        return "no tests"
    return "not run" if code is None or code in (2, 34) else "suspicious"


def load(mutants: Path) -> dict[str, dict[str, str]]:
    """module path (grpo/x.py) -> {mutant name: status}."""
    out = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if codes:
            out[str(meta.relative_to(mutants))[: -len(".meta")]] = {k: status(v) for k, v in codes.items()}
    return out


def key(diff: str) -> str:
    """A mutant's stable name for the equivalents list: module:function: the mutated line(s) as the mutant reads."""
    head = next((line[4:].strip() for line in diff.splitlines() if line.startswith("+++ ")), "?")
    added = " | ".join(line[1:].strip() for line in diff.splitlines() if line.startswith("+") and
                       not line.startswith("+++"))
    return f"{head}: {added}"


def equivalents(path: Path = EQUIVALENTS) -> dict[str, str]:
    """``key  # reason`` per line of the equivalents list (blank lines and lines starting with # ignored)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                k, _, reason = line.rpartition("  # ")
                out[k.strip()] = reason.strip()
    return out


def diff_of(name: str, module: str, mutants: Path) -> str:
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    try:
        return get_diff_for_mutant(name, path=Path(module))
    except Exception as e:  # noqa: BLE001 - a report line, not a crash
        return f"(no diff: {type(e).__name__}: {e})"


def report(mutants: Path, min_score: float) -> tuple[str, bool]:
    import os

    results = load(mutants)
    known = equivalents()
    lines, totals, untriaged = ["# Mutation testing report", ""], Counter(), 0
    survivors = defaultdict(list)
    cwd = os.getcwd()
    for module, by_name in results.items():
        for name, st in by_name.items():
            if st in ("survived", "no tests"):
                os.chdir(mutants.parent)
                try:
                    d = diff_of(name, module, mutants)
                finally:
                    os.chdir(cwd)
                k = key(d)
                st = "equivalent" if k in known else st
                survivors[module].append((name, st, k, d, known.get(k, "")))
            totals[(module, st)] += 1
            totals[st] += 1
    counted = sum(totals[s] for s in ("killed", "timeout", "survived", "no tests", "suspicious"))
    score = 100.0 * (totals["killed"] + totals["timeout"]) / max(counted, 1)
    lines += [f"Score: **{score:.1f}%** of {counted} non-equivalent mutants killed "
              f"({totals['killed']} killed, {totals['timeout']} timed out, {totals['survived']} survived, "
              f"{totals['no tests']} reached by no test, {totals['suspicious']} suspicious, "
              f"{totals['equivalent']} equivalent, {totals['not run']} not run)", "",
              "| module | killed | survived | no tests | equivalent |", "| --- | --- | --- | --- | --- |"]
    for module in results:
        lines.append(f"| {module} | {totals[(module, 'killed')] + totals[(module, 'timeout')]} | "
                     f"{totals[(module, 'survived')]} | {totals[(module, 'no tests')]} | "
                     f"{sum(1 for s in survivors[module] if s[1] == 'equivalent')} |")
    for module, items in survivors.items():
        lines += ["", f"## {module}"]
        for name, st, k, d, reason in items:
            untriaged += st != "equivalent"
            lines += ["", f"### {name}: {st}" + (f" ({reason})" if reason else ""), f"key: `{k}`", "", "```diff",
                      d, "```"]
    ok = score >= min_score and untriaged == 0
    lines += ["", f"{untriaged} survivor(s) neither killed nor listed in {EQUIVALENTS.relative_to(ROOT)}."]
    return "\n".join(lines) + "\n", ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", type=Path, default=Path("mutants"))
    ap.add_argument("--out", type=Path, default=None, help="default: MUTANTS/report.md")
    ap.add_argument("--min-score", type=float, default=95.0)
    args = ap.parse_args(argv)
    if not args.mutants.is_dir():
        print(f"no {args.mutants}/ here: run `make mutate` first", file=sys.stderr)
        return 2
    text, ok = report(args.mutants.resolve(), args.min_score)
    out = args.out or args.mutants / "report.md"
    out.write_text(text)
    print(text.split("\n\n| module")[0].splitlines()[-1] if "Score" in text else text)
    print(f"report: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
