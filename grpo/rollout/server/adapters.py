"""LoRA adapters into the servers (``rollout.backend=server``, `grpo.rollout.lora_sync`): the base weights once, then
each version's A and B only.

1. **At connect** (`connect_adapters`): the servers' LoRA settings (``grpo_model_info``: max_lora_rank, max_loras,
   the folder it writes adapters to). A server started without LoRA, a rank above its ``--max-lora-rank``, or fewer
   adapter slots than ``rollout.max_staleness + 1`` is refused in one line (``rollout.vllm.lora_sync=adapters``);
   ``auto`` syncs merged weights then, saying why once.
2. **Push** (`ServerAdapters.push`): the tensors through the weight channel (``grpo_receive_adapter``: the server
   writes them as a PEFT folder of its own), then vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter``
   names it ``MODEL@vN``, ``/v1/unload_lora_adapter`` drops the versions beyond the newest ``keep``. Requests name
   ``MODEL@vN``, the version they sample with (`ServerAdapters.served`).
"""
from __future__ import annotations

import json

from grpo.errors import SetupError
from grpo.rollout.lora_sync import Adapter, active_adapter, choose, say_once, served_rank


def refusal(server, info: dict, rank: int, keep: int) -> str | None:
    """Why ``server`` cannot hold this run's adapters (None: it can)."""
    fix = "restart it with grpo-serve and the run's recipe (model.lora.enabled=true and the run's rollout settings)"
    if not info.get("max_lora_rank"):
        return f"rollout server {server.url} was started without LoRA (--enable-lora); {fix}"
    if rank > info["max_lora_rank"]:
        return f"rollout server {server.url} serves LoRA ranks up to {info['max_lora_rank']} (--max-lora-rank), " \
               f"model.lora.r={rank}; {fix}"
    if keep > info.get("max_loras", 0):
        return f"rollout server {server.url} holds {info.get('max_loras')} adapters (--max-loras), the run keeps " \
               f"{keep} versions (rollout.max_staleness + 1); {fix}"
    return None


def connect_adapters(model, servers, infos: list[dict], mode: str, keep: int, gloo: bool,
                     say=None) -> "ServerAdapters | None":
    """The run's `ServerAdapters`, or None when merged weights are synced (no LoRA, ``merged``, or what ``auto``
    falls back on, said once). ``infos``: each server's ``grpo_model_info`` (`grpo.rollout.server.client.model_info`:
    its LoRA settings among them); ``gloo``: the weights go through the gloo channel (vLLM's nccl engine takes full
    weights only)."""
    if not choose(mode, model, say=say):
        return None
    rank = active_adapter(model)[1].r
    served_rank(rank)
    why = None if gloo else "the adapters go through the gloo weight channel (rollout.server.weight_transfer=gloo)"
    why = why or next((w for s, i in zip(servers, infos) if (w := refusal(s, i, rank, keep))), None)
    if why is None:
        return ServerAdapters(keep, {s.url: i.get("lora_dir") for s, i in zip(servers, infos)})
    if mode == "adapters":
        raise SetupError(f"rollout.vllm.lora_sync=adapters: {why}; or rollout.vllm.lora_sync=auto (merged weights)")
    (say or say_once)(f"LoRA: the merged weights go to the rollout servers at every sync, not the adapters: {why}")
    return None


class ServerAdapters:
    """The adapter versions the servers hold (``keep`` newest), loaded by name through vLLM's runtime LoRA API."""

    def __init__(self, keep: int, dirs: dict[str, str | None]):
        self.keep, self.dirs = keep, dirs
        self.base_loaded = False
        self.resident: list[int] = []

    @staticmethod
    def served(model_name: str, version: int) -> str:
        return f"{model_name}@v{version}"

    def push(self, adapter: Adapter, version: int, transfer, servers, model_name: str) -> dict[str, str]:
        """``adapter`` into every server as ``MODEL@v{version}``; the versions beyond the newest ``keep`` unloaded.
        Returns {url: why} of the servers that lost the push (the caller drops them)."""
        spec = json.dumps({"version": int(version), "config": adapter.config, "keep": self.keep})
        failed = dict(transfer.send(iter(adapter.tensors.items()), servers, method="grpo_receive_adapter",
                                    args=[spec]))
        servers = [s for s in servers if s.url not in failed]
        name = self.served(model_name, version)
        for s in servers:
            folder = self.dirs[s.url]
            if version in self.resident:
                s.post("/v1/unload_lora_adapter", {"lora_name": name})
            s.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": f"{folder}/v{version}"})
        self.resident = [v for v in self.resident if v != version] + [version]
        for old in self.resident[:-self.keep]:
            for s in servers:
                s.post("/v1/unload_lora_adapter", {"lora_name": self.served(model_name, old)})
        self.resident = self.resident[-self.keep:]
        return failed
