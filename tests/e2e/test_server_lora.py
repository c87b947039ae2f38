"""LoRA against a real `grpo-serve` (vLLM's server, 127.0.0.1, the tiny model; no mocks): the server is started with
LoRA by the run's own recipe (docs/rollout.md#lora), the base weights go once and every version after that is an
adapter of its own, loaded through vLLM's runtime LoRA endpoints and named by the requests. One server serves the
module: a synchronous run, then asynchronous GRPO with ``rollout.max_staleness=2`` (three versions resident).

Runs where vLLM imports (``make test-vllm``); elsewhere skipped, saying why."""
from __future__ import annotations

import json
import shutil
import urllib.request

import pytest

from tests.e2e.test_server import SCALE, Server, _free_port, steps, train
from tests.helpers import vllm_problem

pytestmark = pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))

LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8", "rollout.max_staleness=2"]
# the tiny model (hidden 128, 2 layers, kv heads 1 of 64): rank-4 A and B of q/k/v/o in fp32, bytes per version
ADAPTER_BYTES = 2 * 4 * 4 * ((128 + 128) + (128 + 64) + (128 + 64) + (128 + 128))


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server-lora")
    port = _free_port()
    server = Server(port, tmp / "server.log", ["recipe=quickstart", f"rollout.server.port={port}", *SCALE, *LORA])
    state = {"tmp": tmp, "server": server.start()}
    yield state
    folder = server.info().get("lora_dir") if server.up() else None
    server.kill()  # a killed server leaves its adapter folder behind
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def _adapters(server) -> list[str]:
    with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as r:
        return sorted(m["id"] for m in json.loads(r.read())["data"] if "@v" in m["id"])


@pytest.mark.parametrize("lag", [0, 2])
def test_a_lora_run_syncs_only_adapters_into_the_server(ctx, lag):
    server = ctx["server"].serving()
    assert server.info()["max_lora_rank"] == 8 and server.info()["max_loras"] == 3
    name = f"lag{lag}"
    p = train(ctx, name, *LORA[:3], f"rollout.max_staleness={lag}", "trainer.max_steps=4", "trainer.lr=1e-2")
    assert p.returncode == 0, p.stderr[-4000:]
    assert "merged weights" not in p.stderr
    rows = steps(ctx["tmp"] / name)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["server/sync_logprob_gap"] < 1e-3, r  # the server samples the trainer's adapter, version by version
        if r.get("sync/adapters") is not None:
            assert r["sync/adapters"] == 1.0 and r["sync/bytes"] == ADAPTER_BYTES, r
    assert any("sync/bytes" in r for r in rows)
    resident = _adapters(server)
    assert 1 <= len(resident) <= 3 and all(n.startswith("tiny:llama@v") for n in resident), resident
