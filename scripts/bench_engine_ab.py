#!/usr/bin/env python
"""The shared-prefix engine of two trees, side by side: did a change make the attention-only path slower?

    python scripts/bench_engine_ab.py            # b7ec722 (before the families rework) against this tree
    python scripts/bench_engine_ab.py --old REV --new REV --rounds 4 --shape 4096x256x16 --threads 2
    python scripts/bench_engine_ab.py --ops 256x32x4                   # op counts instead (independent of load)

Timing: each round runs ``scripts/bench_prefix.py`` of the old tree, then of the new one (the order flips every
round, ABBA...), each in a fresh process with the same Python environment: tiny Llama (vocab 49152, hidden 256, 4
layers), fp32, forward + backward of ``token_logprobs``, the standard (TRL-style right-padded rows) and shared
layouts alternating inside each run; it prints every round and the medians of the standard and shared CPU
seconds and of the speedup per tree. Run it on an idle machine: 4096x256x16 takes about 3-4 minutes a run on 2
threads. ``--ops``: one forward + backward per layout of each tree under torch.profiler at a small shape, and
the aten operators whose call counts differ (none: the trees run the same kernels, whatever the load).
A tree given as a revision is exported with ``git archive`` into a temporary folder (the repository is not
changed); ``--new`` defaults to this working tree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD = "b7ec722"  # main just before 5143fce, "engine: share the prefix for every family ..."

_OPS = r"""
import json, sys, torch, transformers
sys.path.insert(0, ".")
from grpo.engine.logprobs import token_logprobs
P, S, G = map(int, sys.argv[1].split("x"))
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(3, 1024, (P,), generator=g).tolist()]
comps = [[torch.randint(3, 1024, (S,), generator=g).tolist() for _ in range(G)]]
out = {}
for shared in (False, True):
    token_logprobs(model, prompts, comps, shared_prefix=shared)  # warm-up (lazy imports, registration)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        lps = token_logprobs(model, prompts, comps, shared_prefix=shared)
        sum(lp.sum() for lp in lps[0]).backward()
    layout = "shared" if shared else "standard"
    out.update({f"{layout} {e.key}": e.count for e in prof.key_averages() if e.key.startswith("aten::")})
print(json.dumps(out))
"""


def export(rev: str, into: Path) -> Path:
    """The tree of ``rev`` as files under ``into`` (``git archive``: the repository is left as it is)."""
    into.mkdir(parents=True)
    archive = into.with_suffix(".tar")
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev], stdout=f, check=True)
    with tarfile.open(archive) as t:
        t.extractall(into, filter="data")
    archive.unlink()
    return into


def bench_row(tree: Path, shape: str, threads: int, repeats: int) -> dict:
    """standard s, shared s and speedup of one run of ``tree``'s scripts/bench_prefix.py at ``shape``."""
    out = subprocess.run([sys.executable, "scripts/bench_prefix.py", "--no-smollm2", "--no-memory", "--threads",
                          str(threads), "--repeats", str(repeats), "--shapes", shape], cwd=tree, capture_output=True,
                         text=True, check=True).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    cols = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    std, sh = float(cells[cols.index("standard s")]), float(cells[cols.index("shared s")])
    return {"standard": std, "shared": sh, "speedup": std / sh}


def op_counts(tree: Path, shape: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _OPS, shape], cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=OLD, help=f"revision of the old tree (default {OLD})")
    ap.add_argument("--new", help="revision of the new tree (default: this working tree)")
    ap.add_argument("--shape", default="4096x256x16", help="PxSxG")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="runs of each tree, alternated")
    ap.add_argument("--repeats", type=int, default=1, help="timed repeats inside each run (after a warm-up)")
    ap.add_argument("--ops", metavar="PxSxG", help="compare torch.profiler op counts at this shape instead")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="grpo-ab-") as tmp:
        trees = {"old": export(args.old, Path(tmp) / "old"),
                 "new": export(args.new, Path(tmp) / "new") if args.new else ROOT}
        names = {"old": args.old, "new": args.new or "working tree"}
        if args.ops:
            counts = {k: op_counts(t, args.ops) for k, t in trees.items()}
            diff = {op: (counts["old"].get(op, 0), counts["new"].get(op, 0))
                    for op in sorted(set(counts["old"]) | set(counts["new"]))
                    if counts["old"].get(op, 0) != counts["new"].get(op, 0)}
            total = {k: {lay: sum(n for op, n in c.items() if op.startswith(lay)) for lay in ("standard", "shared")}
                     for k, c in counts.items()}
            print(f"# aten op calls of one forward + backward per layout at {args.ops}: old {names['old']} "
                  f"{total['old']}, new {names['new']} {total['new']}")
            for op, (a, b) in diff.items():
                print(f"{op}: {a} -> {b}")
            print("# no difference" if not diff else f"# {len(diff)} operators differ")
            return 0
        runs: dict[str, list] = {"old": [], "new": []}
        print(f"# {args.shape}, {args.threads} threads, CPU s of forward + backward (scripts/bench_prefix.py); "
              f"old = {names['old']}, new = {names['new']}", flush=True)
        for r in range(args.rounds):
            for k in (("old", "new") if r % 2 == 0 else ("new", "old")):
                row = bench_row(trees[k], args.shape, args.threads, args.repeats)
                runs[k].append(row)
                print(f"round {r + 1} {k}: standard {row['standard']:.2f} s, shared {row['shared']:.2f} s, "
                      f"speedup {row['speedup']:.2f}x", flush=True)
        for k, rows in runs.items():
            med = {m: statistics.median(x[m] for x in rows) for m in ("standard", "shared", "speedup")}
            print(f"{k} ({names[k]}): median standard {med['standard']:.2f} s, shared {med['shared']:.2f} s, "
                  f"speedup {med['speedup']:.2f}x (range {min(x['speedup'] for x in rows):.2f}-"
                  f"{max(x['speedup'] for x in rows):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
