"""`grpo-eval` with rollout.backend=vllm (docs/evaluation.md: "with a vLLM backend when it is installed"): the same
model on the same held-out prompts scores the same with vLLM as with our decode loop, greedy and sampled (n=4; the
samples differ between backends, the keys and the greedy numbers do not). Runs in `make test-vllm`'s environment."""
import json

import pytest

from tests.helpers import VLLM_TINY, vllm_problem

pytestmark = pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))

TINY = [f"model.tiny.{k}={v}" for k, v in VLLM_TINY.items()]  # a head size vLLM's CPU attention serves
COMMON = ["recipe=smoke", "data.num_eval=6", "trainer.eval_max_new_tokens=8", "rollout.vllm.enforce_eager=true", *TINY]


def _eval(tmp_path, backend: str, *extra: str) -> dict:
    from grpo.eval import run_eval

    out = tmp_path / backend / "_".join(extra or ("greedy",))
    path = run_eval([*COMMON, f"rollout.backend={backend}", *extra, "--out", str(out)])
    assert path == out / "eval.json" and (out / "eval.md").read_text().startswith("# grpo-eval")
    return json.loads(path.read_text())


def test_grpo_eval_with_vllm_scores_like_the_decode_loop(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.chdir(tmp_path)
    greedy = {b: _eval(tmp_path, b) for b in ("hf", "vllm")}
    assert greedy["vllm"] == greedy["hf"]
    sampled = {b: _eval(tmp_path, b, "evaluation.n=4", "evaluation.temperature=1.0") for b in ("hf", "vllm")}
    assert sampled["vllm"].keys() == sampled["hf"].keys()
