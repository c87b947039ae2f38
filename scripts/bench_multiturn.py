#!/usr/bin/env python
"""Where the time of a multi-turn rollout with the hf backend goes, and the later turns' two paths (CPU seconds).

    python scripts/bench_multiturn.py                      # SmolLM2-135M, 4 multiplication prompts x G=8, 3 turns
    python scripts/bench_multiturn.py --paths kept,shared,kept,shared \
        --env grpo.rollout.episodes.calculator:Calculator

Runs the trainer's turn loop (`grpo.rollout.episodes.turns`) on the hf backend with an environment (default
``tests.tool_fixtures:Echo``: every episode gets an observation back and runs all 3 turns). ``--paths``, alternated in
one process: ``kept`` is the trainer's path (the K/V of every row kept from one turn to the next,
`grpo.rollout.turn_cache`: a later turn prefills only each episode's new tokens); ``shared`` the one before it
(later turns pass each prompt with its live episodes as suffixes: the prompt prefilled once per turn, each episode
its own tokens again); ``whole`` the first one (every live episode's whole context prefilled, ``batch_size``
contexts at a time). Prints one JSON line per run: process CPU seconds in
prefill and decode, turn 1 and later turns apart, and the prompt tokens prefilled (padding not counted). ``--model
tiny``: a random tiny Llama with the character tokenizer (no chat template), for a quick check.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load(name: str):
    from grpo.config.schema import ModelConfig
    from grpo.models import char_tokenizer, load_model, load_tokenizer, tiny_model

    if name == "tiny":
        tok = char_tokenizer()
        return tiny_model("llama", len(tok), seed=0).eval(), tok
    tok = load_tokenizer(name)
    return load_model(ModelConfig(name_or_path=name), len(tok)).eval(), tok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--env", default="tests.tool_fixtures:Echo")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=32, help="max_new_tokens per turn")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="rollout.batch_size (prompts generated together)")
    ap.add_argument("--paths", default="kept,shared")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    import grpo.rollout.hf as rollout
    from grpo.rollout.backends import HFBackend
    from grpo.rollout.base import Completions, Sampling
    from grpo.rollout.episodes.spec import build_toolset
    from grpo.rollout.episodes.turns import EpisodeSettings, TurnLoop
    from grpo.rollout.episodes.worker import ToolWorker
    from grpo.tasks.multiplication import multiplication

    torch.set_num_threads(args.threads)
    model, tok = load(args.model)
    chat = bool(getattr(tok, "chat_template", None))
    rows = multiplication(args.prompts, seed=0)
    for r in rows:
        text = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                       add_generation_prompt=True) if chat else r["prompt"]
        r["prompt_ids"] = tok(text, add_special_tokens=False)["input_ids"]
    acc, turn = {}, [1]

    def timed(name, fn):
        def wrapper(model, input_ids, attention, *a, **k):
            c0 = time.process_time()
            out = fn(model, input_ids, attention, *a, **k)
            key = f"{name}_{'turn1' if turn[0] == 1 else 'later'}"
            acc[f"{key}_s"] = acc.get(f"{key}_s", 0.0) + time.process_time() - c0
            if name == "prefill":  # the tokens it ran (all but the last column), padding not counted
                ran = int(attention[:, -input_ids.shape[1]:-1].sum())
                acc[f"{key}_tokens"] = acc.get(f"{key}_tokens", 0) + ran
            return out
        return wrapper

    rollout.prefill, rollout.decode = timed("prefill", rollout.prefill), timed("decode", rollout.decode)
    backend = HFBackend(model, tok, batch_size=args.batch_size)
    keeping = HFBackend(model, tok, batch_size=args.batch_size, keep_turns=True)

    def generate(path):
        def fn(prompt_ids, group_size, sampling, seed=None, suffixes=None):
            turn[0] = 1 if suffixes is None else 2
            if path == "kept":
                return keeping.generate(prompt_ids, group_size, sampling, seed, suffixes=suffixes)
            if suffixes is None or path == "shared":
                return backend.generate(prompt_ids, group_size, sampling, seed, suffixes=suffixes)
            out = backend.generate(rollout.flatten(prompt_ids, suffixes), 1, sampling, seed)  # the former path
            return Completions(*(rollout.regroup([g[0] for g in x], suffixes) for x in (out.ids, out.truncated)))
        return fn

    ts = build_toolset([], args.env)
    worker = ToolWorker(ts.environment, 10.0)
    sampling = Sampling(max_new_tokens=args.new, temperature=0.8)
    try:
        for path in args.paths.split(","):
            loop = TurnLoop(generate(path), tok, ts, worker, EpisodeSettings(args.turns, 32, chat, args.new))
            acc.clear()
            torch.manual_seed(0)
            c0 = time.process_time()
            eps = loop.run(rows, [r["prompt_ids"] for r in rows], args.group, sampling)
            keeping.sleep()
            flat = [e for g in eps.groups for e in g]
            rec = {"path": path, "cpu_s": round(time.process_time() - c0, 3),
                   **{k: round(v, 3) for k, v in sorted(acc.items())},
                   "turns_mean": sum(e.turns for e in flat) / len(flat),
                   "prompt_len_mean": sum(map(len, eps.prompt_ids)) / len(eps.prompt_ids),
                   "sampled_tokens": sum(sum(e.mask) for e in flat)}
            print(json.dumps(rec), flush=True)
    finally:
        worker.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
