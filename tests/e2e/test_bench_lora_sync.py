"""scripts/bench_lora_sync.py (docs/benchmarks.md#lora-weight-syncs): the 7B-shaped rows need no vLLM and no memory
(the model is built on the meta device); their bytes are checked against Llama-2-7B's published parameter count.
The engine rows run scaled down in tests/rollout/test_vllm_lora.py (make test-vllm)."""
import importlib.util
import json

from tests.helpers import ROOT

LLAMA_2_7B_PARAMS = 6_738_415_616  # Llama-2-7B's parameter count (its model card / config)


def _script():
    spec = importlib.util.spec_from_file_location("bench_lora_sync", ROOT / "scripts" / "bench_lora_sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_7b_shaped_rows_count_a_whole_model_merged_and_the_adapters_alone(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert _script().main(["--shape-only", "--rank", "16", "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert rows["merged"]["sync_bytes"] == 2 * LLAMA_2_7B_PARAMS  # bf16, every weight
    # rank 16 on q/k/v/o (4096 x 4096 each) of 32 layers: A (16 x 4096) + B (4096 x 16), bf16
    assert rows["adapters"]["sync_bytes"] == 32 * 4 * 2 * 16 * 4096 * 2
    assert rows["merged"]["sync_s_extrapolated"] is None  # nothing measured in this run: no seconds invented
    assert [json.loads(line)["mode"] for line in capsys.readouterr().out.splitlines()] == ["merged", "adapters"]
