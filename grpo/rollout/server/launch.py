"""What `grpo-serve` starts: vLLM's own OpenAI-compatible server for a run's model, nothing of ours but the extension.

`serve_command` turns the run's settings into vLLM's command line: the model (a local or embedded checkpoint as
it is; a tiny model as a config-and-tokenizer folder, ``load_format=dummy``, whose weights the trainer pushes at
connect), its dtype and max length, prefix caching on, log-probs after the temperature (``processed_logprobs``,
as the trainer computes them), the checkpoint's generation config ignored, vLLM's development endpoints on
(``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, ``/update_weight_version``, ``/reset_prefix_cache``, ...) and
our worker extension (`grpo.rollout.server.worker`) for the CPU weight path. On CUDA the server gets vLLM's
nccl weight transfer and its tensor-parallel size (its devices: ``CUDA_VISIBLE_DEVICES``). With an API key (the
variable ``rollout.server.api_key_env`` names) vLLM gets it as ``VLLM_API_KEY`` (in the environment, so no process
listing shows it) and `grpo.rollout.server.guard` asks it on every path but ``/health``; the weight channel's
handshake proves it (`grpo.runtime.transfer.WeightChannel.handshake`).
"""
from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grpo.rollout.vllm_images import MAX_IMAGES_PER_PROMPT

EXTENSION = "grpo.rollout.server.worker.GRPOWorkerExtension"
GUARD = "grpo.rollout.server.guard.RequireKey"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServeSettings:
    model: str                   # model.name_or_path (also the name the server serves it under)
    tiny: dict                   # model.tiny
    dtype: str                   # model.dtype
    max_model_len: int           # rollout.vllm.max_model_len, or data.max_prompt_tokens + the completion's tokens
    host: str
    port: int
    seed: int
    device: str                  # cpu | cuda
    kv_cache_gib: float          # CPU: VLLM_CPU_KVCACHE_SPACE
    enforce_eager: bool
    tensor_parallel_size: int = 1
    weight_transfer: str = "gloo"  # gloo (the extension) | nccl (vLLM's own engine)
    lora_rank: int = 0           # > 0: LoRA enabled up to this rank (the run's adapters are synced, not merged)
    max_loras: int = 1           # the adapter versions it holds at once (rollout.max_staleness + 1)
    vision: bool = False         # a vision-language model: its tokens-in route (images as inputs) on
    api_key: str | None = None     # the key every request but /health must carry (None: none; then loopback only)


def model_dir(s: ServeSettings, cache: Path) -> tuple[str, bool]:
    """(what vLLM loads, whether its weights are dummy). A tiny model: its config and the character tokenizer
    written once to a folder under ``cache`` named by its shape."""
    from grpo.models import load_image_processor, load_tokenizer, publish_folder, resolve_path, tiny_model
    from grpo.rollout.vllm_images import save_processor

    if not s.model.startswith("tiny:"):
        return resolve_path(s.model), False
    key = hashlib.sha256(json.dumps([s.model, s.tiny], sort_keys=True).encode()).hexdigest()[:12]
    out = cache / "serve" / f"{s.model.replace(':', '-')}-{key}"
    if not (out / "config.json").exists():
        tok, images = load_tokenizer(s.model), load_image_processor(s.model)  # a vision-language model's: both
        model = tiny_model(s.model.split(":", 1)[1], len(tok), **dict(s.tiny))
        model.config.architectures = [type(model).__name__]  # vLLM must build this class (it would guess)

        def write(tmp):
            model.config.save_pretrained(tmp)
            if images is not None:  # vLLM's input processing loads them (the placeholders, the image tokens' count)
                save_processor(str(tmp), tok, images)
            else:
                tok.save_pretrained(tmp)

        publish_folder(out, write, lambda d: (d / "config.json").exists())  # servers may start at once
    return str(out), True


def serve_command(s: ServeSettings, cache: Path, extra: list[str] = ()) -> tuple[list[str], dict]:
    """(argv, environment additions) of vLLM's server for these settings; ``extra``: more vLLM flags, as given."""
    path, dummy = model_dir(s, cache)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
            "--served-model-name", s.model, "--host", s.host, "--port", str(s.port), "--dtype", s.dtype,
            "--max-model-len", str(s.max_model_len), "--seed", str(s.seed), "--enable-prefix-caching",
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
            "--worker-extension-cls", EXTENSION, "--tensor-parallel-size", str(s.tensor_parallel_size),
            "--middleware", GUARD]
    if dummy:
        argv += ["--load-format", "dummy"]
    if s.enforce_eager:
        argv.append("--enforce-eager")
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if s.api_key:  # vLLM's --api-key (its /v1 routes) and our guard (every other route) read it; not on the argv
        env["VLLM_API_KEY"] = s.api_key
    if s.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{s.kv_cache_gib:g}"
        # vllm-cpu 0.32 fails a seeded request whose prompt was prefilled in chunks ("CPU Generator does not use
        # offset"): every prompt is prefilled whole
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(8192, s.max_model_len))]
    else:
        argv += ["--gpu-memory-utilization", "0.9"]  # the server's GPUs are its own (CUDA_VISIBLE_DEVICES)
    if s.weight_transfer == "nccl":
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if s.vision:  # prompts with images: token ids + the trainer's tower's features (`grpo.rollout.server.images`)
        argv += ["--enable-scale-out", "--enable-mm-embeds",
                 "--limit-mm-per-prompt", json.dumps({"image": MAX_IMAGES_PER_PROMPT, "video": 0})]
    if s.lora_rank:  # the trainer loads each version's adapter through vLLM's runtime LoRA endpoints
        argv += ["--enable-lora", "--max-lora-rank", str(s.lora_rank), "--max-loras", str(s.max_loras)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    return argv + list(extra), env
