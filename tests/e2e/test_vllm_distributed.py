"""The vLLM rollout backend under DeepSpeed: two CPU processes (gloo), one engine per rank (real vLLM; no mocks).

Run by torchrun, this file is also the worker (``python tests/e2e/test_vllm_distributed.py OUT_DIR CASE...``). Each
case builds the run as training does (``build_run``, then the rollout backend as the first rollout creates it),
then on every rank:

- vLLM's log-prob of a fixed completion equals the trainer's (the weights went in at start);
- one optimizer step through the runtime (ZeRO's backward and step); vLLM, not yet synced, now differs from the
  trainer (the step moved the log-probs, so a skipped sync would show);
- the sync the next rollout does (``run.sampler.backend.ready()``), then vLLM's log-probs equal the trainer's again;
- each rank samples its own completions (the rank is in the seed);
- after the engine is closed the runtime's process group still works (vLLM's shutdown must leave it alone).

Then two steps of the real training loop under ZeRO-3 with the vLLM backend.

Cases run one after another in the same two processes: ZeRO-2, ZeRO-2 with LoRA (adapters synced), ZeRO-3 (every
parameter gathered on its own while it is copied; ``stage3_param_persistence_threshold=0`` partitions even the
smallest ones), ZeRO-3 with LoRA (the base weights once, then each sync gathers one layer's A and B at a time).
Elsewhere than the vLLM environment with deepspeed, skipped, saying why.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXED_PROMPT, FIXED_COMPLETION = "What is 2+2?", " 4, surely"
CASES = {
    "zero2": ["distributed=zero2"],
    "zero2-lora": ["distributed=zero2", "model.lora.enabled=true", "model.lora.target_modules=[q_proj,v_proj]"],
    "zero3": ["distributed=zero3", "+distributed.ds_config.zero_optimization.stage3_param_persistence_threshold=0"],
    "zero3-lora": ["distributed=zero3", "+distributed.ds_config.zero_optimization.stage3_param_persistence_threshold=0",
                   "model.lora.enabled=true", "model.lora.target_modules=[q_proj,v_proj]"],
}


# ----------------------------------------------------------------------------------- the worker
def _check_case(out: Path, case: str) -> dict:
    import torch
    from omegaconf import OmegaConf

    from grpo.config.schema import load
    from grpo.engine import token_logprobs
    from grpo.rollout.backends import Sampling, step_seed
    from grpo.trainer.build import build_run
    from tests.helpers import VLLM_TINY, compose_recipe, vllm_logprobs_of

    tiny = [f"model.tiny.{k}={v}" for k, v in VLLM_TINY.items()]
    raw = compose_recipe("smoke", [f"trainer.output_dir={out / case}", "rollout.backend=vllm", "trainer.lr=1e-2",
                                   "rollout.vllm.max_model_len=128", *tiny, *CASES[case]])
    cfg = load(OmegaConf.to_container(raw, resolve=True))
    run = build_run(cfg)
    rt = run.runtime
    prompt = run.tokenizer(FIXED_PROMPT)["input_ids"]
    completion = run.tokenizer(FIXED_COMPLETION)["input_ids"] + [run.tokenizer.eos_token_id]

    def trainer(grad=False):
        with torch.set_grad_enabled(grad):
            return token_logprobs(rt.model, [prompt], [[completion]], shared_prefix=False)[0][0]

    def gap(a, b) -> float:
        return float((a.detach().float() - b.detach().float()).abs().max())

    backend = run.sampler.backend.ready()
    before = trainer()
    rec = {"start": gap(vllm_logprobs_of(backend, prompt, completion), before)}
    rt.expect_backwards(1)
    rt.backward(-trainer(grad=True).sum())
    _, stepped = rt.step(1.0)
    after = trainer()
    rec.update(stepped=stepped, moved=gap(after, before), stale=gap(vllm_logprobs_of(backend, prompt, completion),
                                                                     after))
    gathered = _count_gathered(backend)
    backend = run.sampler.backend.ready()  # what the next rollout does: the optimizer stepped, so the engine syncs
    rec["synced"] = gap(vllm_logprobs_of(backend, prompt, completion), after)
    rec["largest_gather"], rec["params"] = max(gathered), sum(_numel(p) for p in rt.model.parameters())
    rec["adapters"] = backend.stats()["sync/adapters"]
    got = backend.generate([prompt], 4, Sampling(max_new_tokens=12, temperature=1.0),
                           seed=step_seed(cfg.trainer.seed, rt.rank, 0, 0))
    rec["samples"] = got.ids[0]
    run.close()
    rec["group_after_close"] = rt.all_reduce({"ranks": 1.0})["ranks"]
    return rec


def _numel(p) -> int:
    return getattr(p, "ds_numel", p.numel())  # ZeRO-3: the full size of a partitioned parameter


def _count_gathered(backend) -> list[int]:
    """Wraps the backend's ``full_weights``: the number of elements made whole at once, per call."""
    import contextlib

    sizes, inner = [], backend.full_weights

    @contextlib.contextmanager
    def counting(params):
        sizes.append(sum(_numel(p) for p in params))
        with inner(params) as temporary:
            yield temporary

    backend.full_weights = counting
    return sizes


def _train(out: Path, case: str) -> dict:
    """The real training loop, two steps with rollout.backend=vllm under ZeRO-3: the sampler's log-probs are the
    trainer's at every step (the mismatch metric), and the final model is written after the engine closed."""
    import json as _json

    from omegaconf import OmegaConf

    from grpo.config.schema import load
    from grpo.trainer.loop import fit
    from tests.helpers import VLLM_TINY, compose_recipe

    tiny = [f"model.tiny.{k}={v}" for k, v in VLLM_TINY.items()]
    raw = compose_recipe("smoke", [f"trainer.output_dir={out / case}", "rollout.backend=vllm", "trainer.lr=1e-2",
                                   "rollout.vllm.max_model_len=128", "data.num_eval=0", "logging.sample_every=0",
                                   *tiny, *CASES["zero3"]])
    summary = fit(load(OmegaConf.to_container(raw, resolve=True)))
    rows = [_json.loads(line) for line in (out / case / "metrics.jsonl").read_text().splitlines()]
    return {"steps": summary["steps"], "final": (out / case / "final" / "config.json").exists(),
            "diffs": [r["rollout_is/logp_diff_abs_max"] for r in rows if "loss" in r]}


def _worker(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    out = Path(argv[0])
    records = {case: (_train if case == "train-zero3" else _check_case)(out, case) for case in argv[1:]}
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    _worker(sys.argv[1:])
    sys.exit(0)


# ------------------------------------------------------------------------------------ the test
import importlib.util  # noqa: E402

import pytest  # noqa: E402

from tests.helpers import vllm_problem  # noqa: E402


def _problem() -> str | None:
    if importlib.util.find_spec("deepspeed") is None:
        return "needs deepspeed (pip install -e '.[deepspeed]')"
    return vllm_problem()


pytestmark = pytest.mark.skipif(_problem() is not None, reason=str(_problem()))


@pytest.mark.slow
def test_each_rank_engine_gets_the_weights_after_a_zero_step(tmp_path):
    from tests.e2e.test_distributed import torchrun

    p = torchrun(str(Path(__file__)), str(tmp_path), *CASES, "train-zero3", cwd=tmp_path, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for case in CASES:
        for rec in (r[case] for r in ranks):
            assert rec["start"] < 1e-4, (case, rec)           # fp32: vLLM's log-probs are the trainer's
            assert rec["stepped"] and rec["moved"] > 1e-3, (case, rec)
            assert rec["stale"] > 1e-3, (case, rec)            # without the sync vLLM would sample the old policy
            assert rec["synced"] < 1e-4, (case, rec)
            assert rec["group_after_close"] == 2.0, (case, rec)
        assert ranks[0][case]["samples"] != ranks[1][case]["samples"], case  # each rank its own seed
    z3 = ranks[0]["zero3"]
    assert z3["largest_gather"] < z3["params"] / 4, z3       # ZeRO-3: one weight at a time, never the model
    assert z3["moved"] == pytest.approx(ranks[0]["zero2"]["moved"], rel=1e-4)  # the same step as ZeRO-2
    assert ranks[0]["zero3-lora"]["moved"] == pytest.approx(ranks[0]["zero2-lora"]["moved"], rel=1e-4)
    for case in CASES:  # LoRA: the adapters are synced (rollout.vllm.lora_sync=auto), the rest every weight
        assert [r[case]["adapters"] for r in ranks] == [float(case.endswith("lora"))] * 2, case
    # ZeRO-3 + LoRA: after the base weights went once, a sync gathers one layer's A and B, never a base weight
    assert ranks[0]["zero3-lora"]["largest_gather"] < z3["largest_gather"] / 4, (ranks[0]["zero3-lora"], z3)
    for rec in (r["train-zero3"] for r in ranks):
        assert rec["steps"] == 2 and rec["final"], rec
        assert len(rec["diffs"]) == 2 and max(rec["diffs"]) < 1e-4, rec  # step 2 samples the stepped weights
