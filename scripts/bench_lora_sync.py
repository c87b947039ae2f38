#!/usr/bin/env python
"""LoRA weight syncs into the in-process vLLM engine, merged weights against adapters, side by side in one run.

    .venv-vllm/bin/python scripts/bench_lora_sync.py                    # SmolLM2 (embedded), bf16, rank 16, 20 steps
    .venv-vllm/bin/python scripts/bench_lora_sync.py --steps 4 --model tiny --json out.json   # quick
    .venv-vllm/bin/python scripts/bench_lora_sync.py --shape-only       # the 7B-shaped rows only (no vLLM)

For the model (``--model``): the same LoRA policy (``--rank``, q/k/v/o, ``--dtype``) is trained ``--steps`` steps
(AdamW, ``--lr``, the log-likelihood of a fixed sequence: an update as small as early RL training's), once with
``rollout.vllm.lora_sync=merged`` and once with ``adapters``, the engines alternating, one alive at a time. Each
step's sync reports its bytes and seconds (`VLLMBackend.stats`: time/sync_s, sync/bytes) and the sync check's gap
(vllm/sync_logprob_gap: the engine's log-probs of the sequence against the trainer's); the first sync (the base
weights, B = 0: its gap is the engine-against-trainer noise floor of the dtype) is reported apart. For a
Llama-2-7B-shaped model (its config alone, built on the meta device: no memory) the bytes per sync of both paths
are counted; its seconds are the embedded model's measured bytes/s of the same path applied to them (an
extrapolation, labelled so). Prints one JSON line per row; ``--json`` writes them all.
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
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
TEXT = "Question: what is 12 + 7? Think step by step, then answer. 12 + 7 = 19. The answer is 19."
LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--model", default="embedded:smollm2-135m-instruct", help="a model name, or 'tiny' (the vLLM "
                   "tests' tiny llama)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--shape-only", action="store_true", help="only the 7B-shaped rows (counted, no engine)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def policy(name: str, dtype: str, rank: int):
    import torch

    from grpo.config.schema import LoraConfig, ModelConfig
    from grpo.models import apply_lora, char_tokenizer, load_model, load_tokenizer, tiny_model
    from tests.helpers import VLLM_TINY

    if name == "tiny":
        tok = char_tokenizer()
        model = tiny_model("llama", len(tok), seed=0, **VLLM_TINY).to(getattr(torch, dtype))
    else:
        tok = load_tokenizer(name)
        model = load_model(ModelConfig(name_or_path=name, dtype=dtype), len(tok))
    lora = LoraConfig(enabled=True, r=rank, alpha=2 * rank, target_modules=TARGETS)
    return apply_lora(model, lora), tok


def run_mode(mode: str, args, ids) -> dict:
    """``--steps`` optimizer steps of a fresh LoRA policy, each followed by a sync into an engine of ``mode``."""
    import torch

    from grpo.rollout.server.backend import trainer_logprobs
    from grpo.rollout.vllm import VLLMBackend

    torch.manual_seed(0)  # the same A for both modes
    model, tok = policy(args.model, args.dtype, args.rank)
    backend = VLLMBackend(model, eos_ids=[tok.eos_token_id], max_model_len=256, seed=0, lora_sync=mode,
                          check_ids=ids)
    first = backend.stats()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    x = torch.tensor([ids])
    rows = []
    try:
        for step in range(1, args.steps + 1):
            opt.zero_grad()
            logits = model(input_ids=x).logits[0, :-1].float()
            (-torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).mean()).backward()
            opt.step()
            backend.sync_weights(model, step)
            rows.append(backend.stats())
        with torch.no_grad(), model.disable_adapter():
            base = trainer_logprobs(model, ids)
        moved = float((trainer_logprobs(model, ids) - base).abs().max())
    finally:
        backend.close()
    t = [r["time/sync_s"] for r in rows]
    return {"model": args.model, "dtype": args.dtype, "rank": args.rank, "mode": mode, "steps": args.steps,
            "first_sync_bytes": first["sync/bytes"], "first_sync_s": round(first["time/sync_s"], 4),
            "logprob_gap_first": round(first["vllm/sync_logprob_gap"], 5),
            "sync_bytes": rows[-1]["sync/bytes"], "sync_s_median": round(statistics.median(t), 4),
            "logprob_gap_last": round(rows[-1]["vllm/sync_logprob_gap"], 5),
            "logprob_gap_max": round(max(r["vllm/sync_logprob_gap"] for r in rows), 5),
            "trainer_moved_from_base": round(moved, 5)}


def shape_rows(rank: int, dtype: str, rates: dict) -> list[dict]:
    """A Llama-2-7B-shaped model's bytes per sync, merged and adapters, from its config alone (meta device)."""
    import torch
    import transformers

    from grpo.config.schema import LoraConfig
    from grpo.models import apply_lora

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_7B)).to(
            getattr(torch, dtype))
        model = apply_lora(model, LoraConfig(enabled=True, r=rank, alpha=2 * rank, target_modules=TARGETS))
    size = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    lora = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n) * size
    base = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n) * size
    out = []
    for mode, nbytes in (("merged", base), ("adapters", lora)):
        rate = rates.get(mode)
        out.append({"model": "llama-2-7b-shaped (config only)", "dtype": dtype, "rank": rank, "mode": mode,
                    "sync_bytes": nbytes, "sync_s_extrapolated": round(nbytes / rate, 3) if rate else None})
    return out


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = []
    if not args.shape_only:
        from grpo.rollout.vllm import VLLMBackend  # noqa: F401  (vLLM's environment: fail here, not half way)

        _, tok = policy(args.model, args.dtype, args.rank)
        ids = tok(TEXT)["input_ids"]
        for mode in ("merged", "adapters"):
            t0 = time.time()
            rows.append(run_mode(mode, args, ids))
            rows[-1]["wall_s"] = round(time.time() - t0, 1)
            print(json.dumps(rows[-1]), flush=True)
    rates = {r["mode"]: r["sync_bytes"] / r["sync_s_median"] for r in rows if r.get("sync_s_median")}
    for r in shape_rows(args.rank, args.dtype, rates):
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
