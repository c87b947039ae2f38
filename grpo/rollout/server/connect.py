"""Building the run's `ServerBackend` from its ``rollout.server`` section and runtime."""
from __future__ import annotations

import os
import socket
import urllib.parse

import torch

from grpo.engine.unwrap import unwrap_model
from grpo.rollout.base import eos_ids
from grpo.rollout.server.backend import ServerBackend
from grpo.rollout.server.client import ServerPool
from grpo.rollout.server.facts import model_facts
from grpo.rollout.server.gloo import GlooTransfer

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def trainer_host(urls: list[str], given: str | None) -> str:
    """The address the servers reach this process at: ``given``, loopback when every server is local, else the
    local address of the route to the first server."""
    if given:
        return given
    hosts = [urllib.parse.urlsplit(u).hostname or "" for u in urls]
    if all(h in LOOPBACK for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent: the route's local end
        s.connect((hosts[0], 9))
        return s.getsockname()[0]


def api_key(s) -> str | None:
    """The servers' API key: the environment variable ``rollout.server.api_key_env`` names (None: unset or empty)."""
    return os.environ.get(s.api_key_env) or None


def transfer_kind(given: str, device: str) -> str:
    return ("nccl" if device == "cuda" else "gloo") if given == "auto" else given


def for_runtime(runtime, tokenizer, s, model_name: str, max_model_len: int, check_ids: list[int],
                lora_sync: str = "auto", lora_keep: int = 1) -> ServerBackend:
    """The backend for this run: ``s`` is its `ServerConfig` (rollout.server); rank 0 sends the weights, every rank
    samples its own prompts from the servers. ``lora_sync``/``lora_keep``: rollout.vllm.lora_sync and
    rollout.max_staleness + 1 (`grpo.rollout.server.adapters`)."""
    rt = runtime
    base = unwrap_model(rt.model)
    device = torch.device(rt.device).type
    pool = ServerPool(list(s.urls), balance=s.balance, timeout_s=s.request_timeout_s, retries=s.retries,
                      connect_timeout_s=s.connect_timeout_s, api_key=api_key(s),
                      say=None if rt.is_main else (lambda msg: None))
    transfer = None
    if rt.is_main:
        host = trainer_host(list(s.urls), s.trainer_host)
        if transfer_kind(s.weight_transfer, device) == "nccl":
            from grpo.rollout.server.nccl import NCCLTransfer

            transfer = NCCLTransfer(host, s.tensor_parallel_size, device=rt.device)
        else:
            transfer = GlooTransfer(host, timeout_s=s.request_timeout_s, api_key=api_key(s))
    many = rt.world_size > 1
    return ServerBackend(rt.model, pool, model_name=model_name, facts=model_facts(base.config),
                         eos_ids=eos_ids(base, tokenizer), max_model_len=max_model_len, check_ids=check_ids,
                         tol=s.sync_check_tol, sync_every=s.sync_every, transfer=transfer,
                         full_weights=rt.full_weights, rank=rt.rank, barrier=rt.barrier if many else None,
                         all_max=rt.all_max if many else None, device=rt.device, lora_sync=lora_sync,
                         lora_keep=lora_keep, rejoin_every_s=s.rejoin_every_s)


def make(ctx) -> ServerBackend:
    """``rollout.backend=server`` (`grpo.rollout.registry`): ``ctx`` a `BackendContext`; the servers must hold the
    data's longest prompt + rollout.max_new_tokens."""
    r = ctx.rollout
    return for_runtime(ctx.runtime, ctx.tokenizer, r.server, ctx.model_name, ctx.longest_prompt + r.max_new_tokens,
                       ctx.check_ids, lora_sync=r.vllm.lora_sync, lora_keep=r.max_staleness + 1)
