#!/usr/bin/env python
"""Benchmark the shared-prefix engine on other families, and the reward model's shared-prompt scoring.

    python scripts/bench_families.py                       # qwen3_moe and gemma3_text at P=1024 S=64 G=8
    python scripts/bench_families.py --families mixtral --shapes 1024x64x8
    python scripts/bench_families.py --reward              # reward-model scoring, quickstart and long-prefix shapes
    python scripts/bench_families.py --families qwen3_5_text,bamba --memory   # hybrid: Gated DeltaNet, Mamba2
    python scripts/bench_families.py --quick               # seconds; what the test suite runs

Training rows: forward + backward of token_logprobs (weighted-sum loss, one group per step), shared layout against
the standard one, alternating in one process, median process CPU time of --repeats after a warm-up (1 thread; the
machine is shared, so CPU time, with the wall-clock ratio beside it). The models are random, mid-size (hidden 256,
4 layers, vocab 32000): qwen3_moe with 8 experts (top 2), gemma3_text with a 512-token window on 3 of its 4
layers (shorter than P + S, so the window is active in the shared layout); qwen3_5_text with 3 Gated DeltaNet
layers (2 key heads, 4 value heads of 128, kernel 4) and 1 attention layer; bamba with 3 Mamba2 layers (8 heads of
64, state 128, chunk 256) and 1 attention layer. Peak memory (MiB) of one step of each layout above what the model
holds: on CUDA max_memory_allocated over its steps, on CPU the peak resident memory of one step in a fresh process
(--memory; a CPU allocator keeps freed memory, so only a fresh process has a meaningful peak). Reward rows:
scoring G completions per prompt with grpo.rewards.reward_model's shared path against its per-row path (a random Llama
sequence-classification model of the same size), under inference_mode. The load average is printed with the
results.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BASE = dict(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
FAMILY = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "gemma3_text": dict(sliding_window=512, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "mistral": dict(sliding_window=512),
    "llama": {},
    "qwen3_5_text": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
                         linear_conv_kernel_dim=4),
    "bamba": dict(attn_layer_indices=[3], mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                  mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256),
}
QUICK = dict(BASE, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16)
REWARD_SHAPES = [(64, 16, 8, 8), (1200, 24, 8, 4)]  # P, S, G, prompts: quickstart and long-prefix recipes


def build(family: str, quick: bool, classifier: bool = False):
    import torch
    import transformers

    spec = dict(QUICK if quick else BASE, **FAMILY.get(family, {}))
    if quick and "sliding_window" in spec:
        spec["sliding_window"] = 8
    if quick and "layer_types" in spec:
        spec["layer_types"] = spec["layer_types"][-2:]
    if quick and "attn_layer_indices" in spec:
        spec.update(attn_layer_indices=[1], mamba_d_head=spec["mamba_expand"] * spec["hidden_size"] // 8)
    config = transformers.AutoConfig.for_model(family, **spec)
    torch.manual_seed(0)
    auto = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto.from_config(config, attn_implementation="sdpa")


def _alternate(fns: dict, repeats: int, peaks: dict | None = None) -> dict:
    """Each variant's (median CPU s, median wall s), variants alternating step by step; ``peaks`` gets each
    variant's peak CUDA memory in MiB (where CUDA is used)."""
    import torch

    cuda = torch.cuda.is_available()
    for fn in fns.values():
        fn()  # warm-up
    cpu = {k: [] for k in fns}
    wall = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            c, w = time.process_time(), time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
                if peaks is not None:
                    peaks[k] = max(peaks.get(k, 0), torch.cuda.max_memory_allocated() / 2**20)
            cpu[k].append(time.process_time() - c)
            wall[k].append(time.perf_counter() - w)
    return {k: (statistics.median(cpu[k]), statistics.median(wall[k])) for k in fns}


def _training_step(family: str, P: int, S: int, G: int, quick: bool):
    """(the model, step(shared)): one forward + backward of token_logprobs on one random group."""
    import torch

    from grpo.engine import token_logprobs

    model = build(family, quick).train()
    if torch.cuda.is_available():
        model = model.cuda()
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = [torch.randint(3, V, (P,), generator=g).tolist()]
    comps = [[torch.randint(3, V, (S,), generator=g).tolist() for _ in range(G)]]

    def step(shared):
        def run():
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                warnings.simplefilter("error" if shared else "ignore")  # the shared layout must really run
                lps = token_logprobs(model, prompt, comps, shared_prefix=shared)
            sum(x.sum() for x in lps[0]).backward()
        return run

    return model, step


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith(field)), 0)


def cpu_peak_mib(family: str, P: int, S: int, G: int, shared: bool, quick: bool) -> float:
    """Peak resident memory (MiB) of one step above what the model and its inputs hold (run in a fresh process)."""
    _, step = _training_step(family, P, S, G, quick)
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark: building the model does not count
        f.write("5")
    base = _rss_kb("VmRSS:")
    step(shared)()
    return (_rss_kb("VmHWM:") - base) / 1024


def _fresh_process_peaks(family: str, P: int, S: int, G: int, quick: bool) -> dict:
    import json
    import subprocess

    peaks = {}
    for name, shared in (("standard", False), ("shared", True)):
        job = json.dumps([family, P, S, G, shared, quick])
        out = subprocess.run([sys.executable, __file__, "--memory-worker", job], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"memory worker failed:\n{out.stderr[-3000:]}")
        peaks[name] = float(out.stdout.strip().splitlines()[-1])
    return peaks


def train_row(family: str, P: int, S: int, G: int, repeats: int, quick: bool, memory: bool = False) -> str:
    import torch

    model, step = _training_step(family, P, S, G, quick)
    peaks: dict = {}
    t = _alternate({"standard": step(False), "shared": step(True)}, repeats, peaks)
    (cs, ws), (ch, wh) = t["standard"], t["shared"]
    if memory and not torch.cuda.is_available():
        peaks = _fresh_process_peaks(family, P, S, G, quick)
    mem = " | ".join(f"{peaks[k]:.0f}" if k in peaks else "-" for k in ("standard", "shared"))
    return f"| {family} | {P} | {S} | {G} | {cs:.3f} | {ch:.3f} | {cs / ch:.2f}x | {ws / wh:.2f}x | {mem} |"


def reward_row(P: int, S: int, G: int, n_prompts: int, repeats: int, quick: bool) -> str:
    import torch

    from grpo.rewards.reward_model import _shared_scores

    model = build("llama", quick, classifier=True).eval()
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, V, (P,), generator=g).tolist() for _ in range(n_prompts)]
    rows = [p + torch.randint(3, V, (S,), generator=g).tolist() for p in prompts for _ in range(G)]
    names = [str(n // G) for n in range(len(rows))]

    def per_row():
        with torch.inference_mode():
            for i in range(0, len(rows), G):  # batches of G rows, as reward_model(batch_size=G) does
                model(input_ids=torch.tensor(rows[i:i + G])).logits[:, 0].tolist()

    def shared():
        _shared_scores(model, rows, names, G, 0)

    t = _alternate({"per_row": per_row, "shared": shared}, repeats)
    (cs, ws), (ch, wh) = t["per_row"], t["shared"]
    return f"| reward model | {P} | {S} | {G} | {cs:.3f} | {ch:.3f} | {cs / ch:.2f}x | {ws / wh:.2f}x | - | - |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="qwen3_moe,gemma3_text", help=f"comma-separated, of {', '.join(FAMILY)}")
    ap.add_argument("--shapes", default="1024x64x8", help="comma-separated PxSxG of the training rows")
    ap.add_argument("--reward", action="store_true", help="the reward-model rows instead (quickstart, long-prefix)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny models, small shapes (seconds)")
    ap.add_argument("--memory", action="store_true", help="on CPU, each layout's peak memory in a fresh process")
    ap.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    if args.memory_worker:
        import json

        torch.set_num_threads(1)
        print(cpu_peak_mib(*json.loads(args.memory_worker)))
        return 0
    torch.set_num_threads(1)
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| model | P | S | G | standard CPU s | shared CPU s | speedup (CPU) | speedup (wall) | standard MiB | "
          "shared MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    if args.reward:
        for P, S, G, n in ([(16, 4, 3, 2)] if args.quick else REWARD_SHAPES):
            print(reward_row(P, S, G, n, args.repeats, args.quick), flush=True)
    else:
        shapes = [(16, 4, 3)] if args.quick else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
        for family in args.families.split(","):
            for P, S, G in shapes:
                print(train_row(family, P, S, G, args.repeats, args.quick, args.memory), flush=True)
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
