#!/usr/bin/env python
"""How the shared-prefix engine's cost grows with the prompt length P and the group size G, against the standard
layout: time and peak memory of forward + backward of token_logprobs, a markdown table and a plot.

    python scripts/bench_prefix_scaling.py                     # P in {512, 2048, 8192} x G in {4, 16, 64}, S=256
    python scripts/bench_prefix_scaling.py --md docs/prefix-scaling.md --plot docs/prefix-scaling.png
    python scripts/bench_prefix_scaling.py --quick --md /tmp/x.md --plot /tmp/x.png     # seconds (the tests)
    python scripts/bench_prefix_scaling.py --dry-run           # the plan and which runs the memory cap skips

Every (P, G, layout) runs in a fresh worker process (a CPU allocator keeps freed memory, so only a fresh process
has a meaningful peak): the model is built, the peak resident set (VmHWM) is reset, one forward + backward runs,
and the worker reports its peak RSS growth and its CPU time (one thread; the first step of a fresh process, so page
faults of first touch are included, as in a real first step). Layouts: ``standard`` (G rows [P; R_i]),
``shared`` (the engine) and ``shared+ckpt`` (the engine with the model's gradient checkpointing).

Runs whose peak would exceed --max-gib are not started: the peak of each layout is predicted from its bytes per
token in the runs already measured (smallest first), and the table says "skipped (~N GiB)". Each worker also gets
an address-space limit of --max-gib + 6 GiB as a safety net. The FLOP model beside the measured time is the
analytic FLOP count (linear layers, causal attention pairs, completion-only lm_head; scripts/bench_prefix.py) at one
constant rate per layout, the rate fitted over that layout's runs: where a measured point lies above its curve, the
step was slower than its FLOPs explain.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_prefix import QUICK_LLAMA, TINY_LLAMA, _rss_kb, load_model  # noqa: E402

LAYOUTS = ("standard", "shared", "shared+ckpt")
GRID = dict(P=(512, 2048, 8192), G=(4, 16, 64), S=256)
QUICK_GRID = dict(P=(16, 32), G=(2, 4), S=8)


def tokens(layout: str, P: int, S: int, G: int) -> int:
    return G * (P + S) if layout == "standard" else P + G * S


def forward_flops(cfg: dict, layout: str, P: int, S: int, G: int) -> float:
    """Forward FLOPs of one group (the model of scripts/bench_prefix.py's ceilings)."""
    h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, Hkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    D = cfg.get("head_dim") or h // H
    lin = 2 * (2 * h * H * D + 2 * h * Hkv * D + 3 * h * inter)
    pairs = G * (P + S) ** 2 / 2 if layout == "standard" else (P * P + G * S * (2 * P + S)) / 2
    return L * (lin * tokens(layout, P, S, G) + 4 * H * D * pairs) + 2 * h * V * G * S


# ----------------------------------------------------------------------------------------------- worker
def measure(cfg: dict, layout: str, P: int, S: int, G: int) -> dict:
    """One forward + backward in this (fresh) process: peak RSS growth (MiB) and CPU seconds."""
    import torch

    from grpo import token_logprobs

    model = load_model({"config": cfg}, "cpu")
    if layout == "shared+ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    V = cfg["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompt = [torch.randint(0, V, (P,), generator=g).tolist()]
    comps = [[torch.randint(0, V, (S,), generator=g).tolist() for _ in range(G)]]
    weights = torch.randn(G, S, generator=g)
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM: building the model does not count
        f.write("5")
    base, c0 = _rss_kb("VmRSS:"), time.process_time()
    lps = token_logprobs(model, prompt, comps, shared_prefix=layout != "standard")
    (torch.stack(lps[0]) * weights).sum().backward()
    # The kernel batches RSS counts per thread, so VmHWM can read a few pages below an earlier VmRSS: no growth.
    return {"cpu_s": time.process_time() - c0, "peak_mib": max(0, _rss_kb("VmHWM:") - base) / 1024}


def run_worker(job: dict, max_gib: float) -> dict:
    def limit():  # a safety net: the worker fails with MemoryError instead of pushing the machine into OOM
        cap = int((max_gib + 6) * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    cmd = [sys.executable, __file__, "--worker", json.dumps(job)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         preexec_fn=limit)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["?"]
        return {"error": tail[0][:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------- plan and run
def plan(grid: dict, layouts) -> list[tuple]:
    """(layout, P, S, G) of every run, each layout's smallest runs first (their bytes per token predict the rest)."""
    runs = [(lay, P, grid["S"], G) for lay in layouts for P in grid["P"] for G in grid["G"]]
    return sorted(runs, key=lambda r: (layouts.index(r[0]), tokens(*r)))


def run_all(cfg: dict, runs: list[tuple], max_gib: float, dry: bool, max_seconds: float | None = None,
            save: str | None = None) -> dict:
    """Measure ``runs`` in order (or plan them, ``dry``); with ``save``, the results so far are rewritten to that
    JSON file after every run (``--render`` makes the table and plot from it); runs already in that file are kept,
    not measured again."""
    results = {}
    if save and Path(save).exists():
        results = {tuple(r): v for r, v in json.loads(Path(save).read_text()) if "cpu_s" in v}
    for run in runs:
        layout = run[0]
        n = tokens(*run)
        if run in results:
            continue
        predicted = predict_gib(results, layout, n)
        rate = fitted_rates(cfg, results).get(layout)
        seconds = 3 * forward_flops(cfg, *run) / rate if rate else 0.0
        if predicted > max_gib:
            results[run] = {"skipped": predicted}
        elif max_seconds is not None and seconds > max_seconds:
            results[run] = {"too_long": seconds}
        elif dry:
            results[run] = {"planned": predicted}
        else:
            results[run] = run_worker({"cfg": cfg, "layout": layout, "P": run[1], "S": run[2], "G": run[3]}, max_gib)
        print(f"# {layout:12s} P={run[1]:5d} S={run[2]} G={run[3]:3d} tokens={n:7d} -> {results[run]}",
              file=sys.stderr, flush=True)
        if save:
            Path(save).write_text(json.dumps([[list(r), v] for r, v in results.items()], indent=0))
    return results


def predict_gib(results: dict, layout: str, n: int) -> float:
    """Peak (GiB) of ``layout`` at ``n`` tokens, extrapolated along the line through its two largest measured runs
    (the activations grow linearly in tokens), at least the largest measured peak; 0 before any run."""
    done = sorted((tokens(*r), v["peak_mib"]) for r, v in results.items() if r[0] == layout and "peak_mib" in v)
    if not done:
        return 0.0
    (n1, p1), (n2, p2) = done[-2] if len(done) > 1 else (0, 0.0), done[-1]
    slope = (p2 - p1) / (n2 - n1) if n2 > n1 else p2 / n2
    return max(p2, p2 + slope * (n - n2)) / 1024


def fitted_rates(cfg: dict, results: dict) -> dict:
    """FLOPs (forward + backward = 3x forward) per CPU second of each layout over all its measured runs."""
    rates = {}
    for layout in LAYOUTS:
        done = [(r, v) for r, v in results.items() if r[0] == layout and "cpu_s" in v]
        if done:
            rates[layout] = sum(3 * forward_flops(cfg, *r) for r, _ in done) / sum(v["cpu_s"] for _, v in done)
    return rates


# ----------------------------------------------------------------------------------------------- report
def _cell(v: dict | None, key: str, fmt: str) -> str:
    if v is None:
        return "-"
    if "skipped" in v:
        return f"skipped (~{v['skipped']:.0f} GiB)"
    if "planned" in v:
        return "planned"
    if "too_long" in v:
        return f"not run (~{v['too_long']:.0f} s)"
    if "error" in v:
        return "failed"
    return format(v[key], fmt)


def table(cfg: dict, grid: dict, results: dict, layouts) -> str:
    rates = fitted_rates(cfg, results)
    cols = ["P", "S", "G", "tokens std / shared"] + [f"{lay} s" for lay in layouts] + [
        "speedup", "FLOP ceiling", "FLOP model s std / shared"] + [f"{lay} MiB" for lay in layouts]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    S = grid["S"]
    for P in grid["P"]:
        for G in grid["G"]:
            got = {lay: results.get((lay, P, S, G)) for lay in layouts}
            std, sh = got.get("standard") or {}, got.get("shared") or {}
            speedup = f"{std['cpu_s'] / sh['cpu_s']:.2f}x" if "cpu_s" in std and "cpu_s" in sh else "-"
            ceiling = forward_flops(cfg, "standard", P, S, G) / forward_flops(cfg, "shared", P, S, G)
            model = " / ".join(f"{3 * forward_flops(cfg, lay, P, S, G) / rates[lay]:.3g}" if lay in rates else "-"
                               for lay in ("standard", "shared"))
            row = [str(P), str(S), str(G), f"{tokens('standard', P, S, G)} / {tokens('shared', P, S, G)}"]
            row += [_cell(got[lay], "cpu_s", ".3g") for lay in layouts]
            row += [speedup, f"{ceiling:.2f}x", model] + [_cell(got[lay], "peak_mib", ".0f") for lay in layouts]
            lines.append("| " + " | ".join(row) + " |")
    rate_text = ", ".join(f"{lay} {r / 1e9:.1f}" for lay, r in rates.items())
    lines.append(f"\nFLOP model: analytic FLOPs x 3 (forward + backward) at the fitted rate per layout (GFLOP/s: "
                 f"{rate_text or 'none measured'}).")
    return "\n".join(lines)


def plot(cfg: dict, grid: dict, results: dict, layouts, path: str) -> bool:
    """Time and peak memory vs P (middle G) and vs G (middle P), measured points and the FLOP-model curves."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed: no plot", file=sys.stderr)
        return False
    rates = fitted_rates(cfg, results)
    S, P_mid, G_mid = grid["S"], grid["P"][len(grid["P"]) // 2], grid["G"][len(grid["G"]) // 2]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, (axis, xs, fixed) in enumerate((("P", grid["P"], G_mid), ("G", grid["G"], P_mid))):
        for lay in layouts:
            keys = [(lay, x, S, fixed) if axis == "P" else (lay, fixed, S, x) for x in xs]
            pts = [(x, results.get(k, {})) for x, k in zip(xs, keys)]
            t = [(x, v["cpu_s"]) for x, v in pts if "cpu_s" in v]
            m = [(x, v["peak_mib"]) for x, v in pts if "peak_mib" in v]
            line = axes[0][col].plot(*zip(*t), "o-", label=f"{lay} measured")[0] if t else None
            if lay in rates:
                model = [3 * forward_flops(cfg, *k) / rates[lay] for k in keys]
                axes[0][col].plot(xs, model, "--", color=line.get_color() if line else None,
                                  label=f"{lay} FLOP model")
            if m:
                axes[1][col].plot(*zip(*m), "o-", label=lay)
        other = f"G={G_mid}" if axis == "P" else f"P={P_mid}"
        axes[0][col].set(xscale="log", yscale="log", xlabel=axis, ylabel="CPU s (fwd+bwd)",
                         title=f"time vs {axis} ({other}, S={S})")
        axes[1][col].set(xscale="log", yscale="log", xlabel=axis, ylabel="peak RSS growth MiB",
                         title=f"memory vs {axis} ({other}, S={S})")
        for ax in (axes[0][col], axes[1][col]):
            ax.legend(fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model and grid (seconds)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    ap.add_argument("--max-gib", type=float, default=8.0, help="skip runs whose predicted peak exceeds this")
    ap.add_argument("--max-seconds", type=float,
                    help="skip runs predicted (FLOPs at the layout's rate so far) to take longer than this")
    ap.add_argument("--results", help="JSON file of the results, rewritten after every run")
    ap.add_argument("--render", action="store_true", help="run nothing: the table and plot from --results")
    ap.add_argument("--md", help="write the markdown table (with the command and the plan) here")
    ap.add_argument("--plot", help="write the plot (png) here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(measure(**json.loads(args.worker))))
        return 0
    layouts = tuple(x for x in args.layouts.split(",") if x)
    if not layouts or set(layouts) - set(LAYOUTS):
        ap.error(f"--layouts: choose from {', '.join(LAYOUTS)}")
    cfg, grid = (QUICK_LLAMA, QUICK_GRID) if args.quick else (TINY_LLAMA, GRID)
    runs = plan(grid, layouts)
    print(f"# plan: {len(runs)} runs, layouts {', '.join(layouts)}, P {grid['P']}, G {grid['G']}, S {grid['S']}, "
          f"cap {args.max_gib} GiB, {args.max_seconds or 'no'} s")
    if args.render:
        results = {tuple(r): v for r, v in json.loads(Path(args.results).read_text())}
    else:
        results = run_all(cfg, runs, args.max_gib, args.dry_run, args.max_seconds, args.results)
    text = table(cfg, grid, results, layouts)
    print(text)
    if args.md:
        cmd = "python scripts/bench_prefix_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.md).write_text(f"<!-- written by: {cmd.strip()} -->\n{text}\n")
    if args.plot and not args.dry_run:
        plot(cfg, grid, results, layouts, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
