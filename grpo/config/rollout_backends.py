"""The config sections of the two sampling backends that run elsewhere than the policy: the in-process vLLM engine
(``rollout.vllm``) and the rollout servers (``rollout.server``). Part of the schema (`grpo.config.schema`, which
re-exports them); YAML: configs/rollout/*.yaml."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class VLLMConfig:
    # rollout.backend=vllm (docs/rollout.md): an in-process engine colocated with training, weights synced each step
    gpu_memory_utilization: float = 0.3  # CUDA: fraction of the GPU's memory vLLM may take (weights + KV cache)
    kv_cache_gib: float = 1.0        # CPU: KV cache size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE)
    max_model_len: Optional[int] = None  # null = the longest prompt of the data + rollout.max_new_tokens
    enforce_eager: bool = True       # no graph capture / compilation (fast start; false: CUDA graphs, faster decode)
    enable_prefix_caching: bool = True  # a group's prompt prefilled once, its KV blocks shared by the G samples
    sleep: bool = False              # CUDA: free the KV cache and offload the weights while the policy updates
    lora_sync: str = "auto"          # LoRA: auto | adapters | merged, what syncs send vLLM (docs/rollout.md#lora)


@dataclass
class ServerConfig:
    urls: list = field(default_factory=list)  # rollout.backend=server: its servers (grpo-serve), [http://H:PORT,...]
    host: str = "127.0.0.1"          # grpo-serve: the address the server listens on
    port: int = 8000                 # grpo-serve: its port
    tensor_parallel_size: int = 1    # grpo-serve on GPUs: GPUs one server spans (which: CUDA_VISIBLE_DEVICES)
    balance: str = "round_robin"     # round_robin | least_loaded: which server gets the next group
    sync_every: int = 1              # push the trainer's weights every N optimizer steps (1: always on-policy)
    sync_check_tol: float = 1.0e-3   # max |log p_server - log p_trainer| on the check sequence after a sync
    weight_transfer: str = "auto"    # auto | gloo | nccl: how weights travel (auto: nccl on CUDA, else gloo)
    trainer_host: Optional[str] = None  # the address servers reach the trainer at for weights (null: derived)
    connect_timeout_s: float = 300.0  # how long the trainer waits for a server that is not up yet
    request_timeout_s: float = 600.0  # one generation request (a whole group) at most
    retries: int = 2                 # extra tries of a request that failed to connect or timed out
    rejoin_every_s: Optional[float] = 30.0  # several servers: probe dropped ones this often, a restarted one rejoins
    api_key_env: str = "GRPO_SERVER_API_KEY"  # the variable holding the servers' API key (never a config value)
