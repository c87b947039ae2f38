#!/usr/bin/env python
"""The shared layout against the standard one for a vision-language model: CPU time and peak memory of the update's
forward + backward (grpo/engine/vision_logprobs.py), one prompt with one 448x448 picture, G=8 completions of 64
tokens, on a small Qwen2.5-VL-shaped model (Qwen2.5-VL's patch 14, 2x2 merge, windowed tower; narrow and shallow).

    python scripts/bench_vision.py                 # the figures of docs/benchmarks.md (a few minutes on one core)
    python scripts/bench_vision.py --quick         # seconds: a 56x56 picture, G=2, 4 tokens (the tests)

Each measurement runs in a fresh worker process (a CPU allocator keeps freed memory: only a fresh process has a
meaningful peak), one torch thread, the layouts alternated (standard, shared, then shared, standard, ...) so that a
change of the machine's load hits both; the machine's load (``uptime``) is printed before and after. The worker
builds the model (seeded), encodes the picture, resets the peak resident set (VmHWM), runs one forward + backward and
reports its CPU seconds, its peak RSS growth and how many images the vision tower encoded.
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

LAYOUTS = ("standard", "shared")
# the language model and the tower: Qwen2.5-VL's geometry (patch 14, temporal patch 2, 2x2 merge, 112-pixel windows,
# some full-attention blocks), at widths one CPU core runs in seconds
FULL = dict(size=448, G=8, S=64,
            text=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2),
            vision=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, patch_size=14,
                        spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3]))
QUICK = dict(size=56, G=2, S=4,
             text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2),
             vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                         spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1]))


def build(spec: dict):
    """(model, prompt): the seeded model of ``spec`` and builtin:shapes' first picture, encoded."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from grpo.models import load_tokenizer
    from grpo.tasks import get_task
    from grpo.tiny_models import SPECIAL_IDS
    from grpo.vision.images import encode
    from grpo.vision.models import VISION_TOKENS

    tok = load_tokenizer("tiny:qwen2_5_vl")
    v, t = spec["vision"], {**spec["text"], **SPECIAL_IDS, "vocab_size": len(tok), "tie_word_embeddings": False}
    half = t["hidden_size"] // t["num_attention_heads"] // 2
    hw = half * 3 // 8
    t["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [half - 2 * hw, hw, hw]}
    ids = {f"{n}_token_id": tok.convert_tokens_to_ids(x)
           for n, x in zip(("vision_start", "image", "vision_end", "video"), VISION_TOKENS)}
    config = transformers.Qwen2_5_VLConfig(text_config=t, vision_config={**v, "out_hidden_size": t["hidden_size"]},
                                           **ids)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    px = spec["size"] ** 2
    proc = Qwen2VLImageProcessorPil(patch_size=v["patch_size"], merge_size=v["spatial_merge_size"],
                                    temporal_patch_size=v["temporal_patch_size"], min_pixels=px, max_pixels=px)
    row = get_task("shapes")(1, seed=0, size=spec["size"])[0]
    return model, encode(row["prompt"], row["images"], tok, proc)


def measure(spec: dict, layout: str) -> dict:
    """One forward + backward in this (fresh) process: CPU seconds, peak RSS growth (MiB), the images the tower
    encoded, the prompt's length and the sum of the completions' log-probs."""
    import torch

    from grpo.engine.vision_logprobs import vision_token_logprobs

    torch.set_num_threads(1)
    model, prompt = build(spec)
    g = torch.Generator().manual_seed(0)
    comps = [[torch.randint(3, 99, (spec["S"],), generator=g).tolist() for _ in range(spec["G"])]]  # text tokens
    encoded = []
    model.model.visual.register_forward_hook(  # one grid per image
        lambda m, args, kwargs, out: encoded.append(len(kwargs.get("grid_thw", args[1:2] and args[1]))),
        with_kwargs=True)
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM: building the model does not count
        f.write("5")
    base, c0, w0 = _rss_kb("VmRSS:"), time.process_time(), time.perf_counter()
    lps = vision_token_logprobs(model, [prompt], comps, shared_prefix=layout == "shared")
    total = torch.stack([lp.sum() for lp in lps[0]]).sum()
    total.backward()
    return {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0,
            "peak_mib": max(0, _rss_kb("VmHWM:") - base) / 1024,  # per-thread RSS counts: never below 0
            "images_encoded": sum(encoded), "prompt_tokens": len(prompt), "logp_sum": float(total)}


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith(field)), 0)


def run_worker(spec: dict, layout: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps({"spec": spec, "layout": layout})]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"worker ({layout}) failed: {(out.stderr.strip().splitlines() or ['?'])[-1][:200]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_all(spec: dict, repeats: int) -> dict[str, list[dict]]:
    """``repeats`` measurements of each layout, alternated (standard first, then shared first, ...)."""
    results: dict[str, list[dict]] = {k: [] for k in LAYOUTS}
    for r in range(repeats):
        for layout in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
            results[layout].append(run_worker(spec, layout))
    return results


def table(spec: dict, results: dict[str, list[dict]]) -> str:
    std, sh = ({k: statistics.median(m[k] for m in results[lay]) for k in ("cpu_s", "peak_mib")}
               for lay in LAYOUTS)
    for lay in LAYOUTS:  # every worker of a layout did the same work
        if len({(m["images_encoded"], m["prompt_tokens"]) for m in results[lay]}) != 1:
            raise RuntimeError(f"the {lay} workers encoded different inputs: {results[lay]}")
    first = results["shared"][0]
    head = (f"1 picture of {spec['size']}x{spec['size']} ({first['prompt_tokens']} prompt tokens), G={spec['G']}, "
            f"S={spec['S']}; median of {len(results['shared'])} fresh processes per layout, 1 thread\n\n")
    rows = ["| layout | images through the tower | forward + backward, CPU s | peak memory growth, MiB |",
            "|---|---|---|---|"]
    for lay, m in (("standard", std), ("shared", sh)):
        rows.append(f"| {lay} | {results[lay][0]['images_encoded']} | {m['cpu_s']:.2f} | {m['peak_mib']:.0f} |")
    ratio = f"| standard / shared | | {std['cpu_s'] / max(sh['cpu_s'], 1e-9):.2f}x | " \
            f"{std['peak_mib'] / max(sh['peak_mib'], 1e-9):.2f}x |"
    return head + "\n".join(rows + [ratio]) + "\n"


def _uptime() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[:3].__str__()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 56x56 picture, G=2, S=4: seconds")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per layout (alternated)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        job = json.loads(a.worker)
        print(json.dumps(measure(job["spec"], job["layout"])))
        return 0
    spec = QUICK if a.quick else FULL
    print(f"# load average before: {_uptime()}")
    results = run_all(spec, a.repeats)
    print(table(spec, results))
    print(f"# load average after: {_uptime()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
