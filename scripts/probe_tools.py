#!/usr/bin/env python
"""How often an untrained model calls a tool, per prompt variant: the signal GRPO would start from (no training).

    python scripts/probe_tools.py                                  # every variant, SmolLM2-135M, 4 problems x G=16
    python scripts/probe_tools.py --variants hermes,pythonic-shot --prompts 6 --group 16 --temperature 1.0

Runs the trainer's turn loop (`grpo.rollout.episodes.turns`, hf backend) on 3-digit multiplication problems (seed
99, not the recipe's data) with the ``calculate`` tool, for each named variant of the system prompt, tool format and
user prompt (``VARIANTS``). Prints one JSON line per variant: the fraction of episodes with a call that ran
(``call_rate``), with the right product as the tool's result (``right_call_rate``), with the right final answer
(``accuracy``), the mean reward of the calculator-tools recipe's terms, and the fraction of groups whose rewards are
all equal (``zero_std_frac``: those give GRPO nothing). ``--show N`` prints N episodes of each variant.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHOT = ("Example:\nuser: Compute 12 * 34.\nassistant: {call}\ntool: {result}\nassistant: The answer is 408.")
HERMES_CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "12 * 34"}}</tool_call>'
PY_CALL = 'calculate("12 * 34")'

CODE_SHOT = SHOT.format(call="```python\nprint(12 * 34)\n```", result="```output\n408\n```")
CALC, PY = "grpo.rollout.episodes.calculator:calculate", "grpo.rollout.episodes.calculator:python"

# name -> (rollout.tool_format, data.system_prompt, task template[, tool])
VARIANTS = {
    "code": ("code", None, "Compute {a} * {b}.", PY),
    "code-shot": ("code", CODE_SHOT, "Compute {a} * {b}.", PY),
    "code-hint": ("code", None, "Compute {a} * {b} with Python, then give the result.", PY),
    "code-shot-hint": ("code", CODE_SHOT, "Compute {a} * {b} with Python, then give the result.", PY),
    "hermes": ("hermes", None, None),
    "hermes-shot": ("hermes", SHOT.format(call=HERMES_CALL, result="<tool_response>\n408\n</tool_response>"), None),
    "pythonic": ("pythonic", None, "Compute {a} * {b}."),
    "pythonic-shot": ("pythonic", SHOT.format(call=PY_CALL, result="408"), "Compute {a} * {b}."),
    "pythonic-hint": ("pythonic", None, "Compute {a} * {b}. Call calculate(\"{a} * {b}\"), then give its result."),
    "pythonic-shot-hint": ("pythonic", SHOT.format(call=PY_CALL, result="408"),
                           "Compute {a} * {b}. Call calculate(\"{a} * {b}\"), then give its result."),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--new", type=int, default=48, help="max_new_tokens per turn")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    from grpo import data
    from grpo.config.schema import DataConfig, ModelConfig
    from grpo.models import load_model, load_tokenizer
    from grpo.rewards.final_answer import final_answer
    from grpo.rollout.backends import HFBackend
    from grpo.rollout.base import Sampling
    from grpo.rollout.episodes import formats
    from grpo.rollout.episodes.spec import build_toolset, choose_format
    from grpo.rollout.episodes.turns import EpisodeSettings, TurnLoop
    from grpo.rollout.episodes.worker import ToolWorker
    from grpo.tasks.multiplication import multiplication

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    model = load_model(ModelConfig(name_or_path=args.model), len(tok)).eval()
    backend = HFBackend(model, tok, batch_size=8)
    sampling = Sampling(max_new_tokens=args.new, temperature=args.temperature)
    for name in args.variants.split(","):
        fmt_name, system, template, *tool = VARIANTS[name]
        ts, _ = choose_format(build_toolset([tool[0] if tool else CALC], None), fmt_name, tok, True)
        fmt = formats.of(ts)
        dcfg = DataConfig(system_prompt=system)
        rows = multiplication(args.prompts, seed=99, tools=True, template=template)
        rows, _ = data.prepare(rows, dcfg, tok, tools=fmt.template_tools(list(ts.schemas)), keep_turns=True,
                               system_text=fmt.system_text(list(ts.schemas)))
        worker = ToolWorker(None, 10.0)
        loop = TurnLoop(backend.generate, tok, ts, worker, EpisodeSettings(2, 16, True, args.new))
        torch.manual_seed(0)
        t0 = time.time()
        try:
            eps = loop.run(rows, [r["prompt_ids"] for r in rows], args.group, sampling)
        finally:
            worker.kill()
        flat = [(r, e) for r, g in zip(rows, eps.groups) for e in g]
        ran = [e.tool_calls > 0 and e.tool_failures == 0 for _, e in flat]
        right = [any(s["role"] == "tool" and str(r["answer"]) in s["text"] for s in e.segments) for r, e in flat]
        acc = final_answer([], [""] * len(flat), [r["answer"] for r, _ in flat], episode=[e.segments for _, e in flat])
        rewards = [a + 0.25 * c for a, c in zip(acc, ran)]
        groups = [rewards[i:i + args.group] for i in range(0, len(rewards), args.group)]
        print(json.dumps({"variant": name, "format": fmt_name, "T": args.temperature, "episodes": len(flat),
                          "prompt_tokens": len(rows[0]["prompt_ids"]), "call_rate": round(sum(ran) / len(flat), 3),
                          "right_call_rate": round(sum(right) / len(flat), 3),
                          "accuracy": round(sum(acc) / len(flat), 3), "reward_mean": round(statistics.mean(rewards), 3),
                          "zero_std_frac": sum(max(g) == min(g) for g in groups) / len(groups),
                          "wall_s": round(time.time() - t0, 1)}), flush=True)
        for _, e in flat[:: max(1, len(flat) // max(args.show, 1))][: args.show]:
            print("   ", json.dumps(e.segments)[:400], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
