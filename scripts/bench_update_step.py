#!/usr/bin/env python
"""Time and memory of one update micro-batch as grpo.update runs it: token_logprobs forward + backward with the
entropy returned and only logged (detached), the loss on the log-probs.

    PYTHONPATH=. python scripts/bench_update_step.py                         # SmolLM2, one countdown group
    PYTHONPATH=. python scripts/bench_update_step.py --shape 122x256x8 --repeats 2
    PYTHONPATH=. python scripts/bench_update_step.py --quick                 # a tiny model, seconds

Time: median CPU seconds (process_time, 1 thread) of --repeats steps after a warm-up. Memory: the peak resident
set growth of one step in a fresh process (VmHWM reset after the model is built), and the bytes autograd keeps
for backward (parameters excluded). grpo is imported from PYTHONPATH, so the same command measures any checkout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

TINY = dict(vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
QUICK = dict(TINY, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2)


def _rss_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def _setup(model_name: str, P: int, S: int, G: int):
    import torch
    import transformers

    from grpo import token_logprobs

    torch.manual_seed(0)
    if model_name == "smollm2":
        from grpo.config.schema import ModelConfig
        from grpo.models import load_model

        model = load_model(ModelConfig(), 49152, seed=0)
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(QUICK if model_name == "quick" else TINY)))
    model.train()
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = [torch.randint(0, V, (P,), generator=g).tolist()]
    comps = [[torch.randint(0, V, (S,), generator=g).tolist() for _ in range(G)]]
    weights = torch.randn(G, S, generator=g)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    def step(count_saved=False):
        model.zero_grad(set_to_none=True)
        saved.clear()
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved else _null()
        with hooks:
            lps, ents = token_logprobs(model, prompt, comps, return_entropy=True)
        float(sum(e.detach().sum() for e in ents[0]))  # logged, as grpo.update does
        (torch.stack(lps[0]) * weights).sum().backward()
        return sum(saved.values())

    return step


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def worker(job: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    step = _setup(job["model"], job["P"], job["S"], job["G"])
    if job["kind"] == "memory":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _rss_kb("VmRSS:")
        saved = step(count_saved=True)
        return {"peak_mib": (_rss_kb("VmHWM:") - base) / 1024, "saved_mib": saved / 2**20}
    step()
    times = []
    for _ in range(job["repeats"]):
        c0 = time.process_time()
        step()
        times.append(time.process_time() - c0)
    return {"cpu_s": statistics.median(times), "all": times}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--shape", default="122x256x8", help="PxSxG: prompt length, completion length, group size")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a tiny model and shape (what the test runs)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(json.loads(a.worker))))
        return 0
    model, (P, S, G) = ("quick", (16, 8, 4)) if a.quick else (a.model, map(int, a.shape.split("x")))
    job = {"model": model, "P": P, "S": S, "G": G, "repeats": 1 if a.quick else a.repeats}
    res = {}
    for kind in ("time", "memory"):  # each in a fresh process: only a fresh process has a meaningful peak
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps({**job, "kind": kind})],
                             capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        res.update(json.loads(out.stdout.strip().splitlines()[-1]))
    import grpo

    print(f"| {model} | {P} | {S} | {G} | {res['cpu_s']:.3g} | {res['peak_mib']:.0f} | {res['saved_mib']:.1f} | "
          f"{grpo.__file__.rsplit('/grpo/', 1)[0]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
