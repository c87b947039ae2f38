"""``grpo-serve recipe=NAME key=value ... [--print] [-- VLLM_FLAGS]``: vLLM's server for a run's model.

Takes the recipe and overrides `grpo-train` takes, so the model, its dtype, the max length and the sampling limits
agree with the trainer's by construction, plus ``rollout.server.host``/``port`` (on GPUs ``tensor_parallel_size``;
its devices are ``CUDA_VISIBLE_DEVICES``'s). The API key comes from the environment variable
``rollout.server.api_key_env`` names (``$GRPO_SERVER_API_KEY``); listening beyond loopback without one is warned
about. It then replaces itself with vLLM's OpenAI-compatible server
(`grpo.rollout.server.launch`); ``GET /health`` answers once it is ready. ``--print``: print the command instead.
Runs in the environment that has vLLM (``.venv-vllm/bin/grpo-serve``; docs/rollout.md#the-server-backend).
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import sys

from grpo.errors import GRPOError, SetupError, show_warnings_as_lines
from grpo.rollout.server.launch import LOOPBACK

# what vLLM's log shows on a healthy server of ours, said once before it starts (its own lines are vLLM's to word)
EXPECTED_IN_VLLM_LOG = ("[grpo] expected in vLLM's log below, on a healthy server: a 'Chat template warmup failed' "
                        "traceback (the server is sent token ids and has no tokenizer) and 'RotaryEmbedding: Failed to "
                        "load weights' after each weight push (the pushed weights hold nothing for it); the trainer's "
                        "sync check says whether the weights arrived")


def settings(cfg, device: str):
    from grpo.rollout.episodes.spec import max_completion_tokens
    from grpo.rollout.server.connect import api_key, transfer_kind
    from grpo.rollout.server.launch import ServeSettings

    r, s = cfg.rollout, cfg.rollout.server
    return ServeSettings(model=cfg.model.name_or_path, tiny=dict(cfg.model.tiny), dtype=cfg.model.dtype,
                         max_model_len=r.vllm.max_model_len or cfg.data.max_prompt_tokens + max_completion_tokens(r),
                         host=s.host, port=s.port, seed=cfg.trainer.seed, device=device,
                         kv_cache_gib=r.vllm.kv_cache_gib, enforce_eager=r.vllm.enforce_eager,
                         tensor_parallel_size=s.tensor_parallel_size,
                         weight_transfer=transfer_kind(s.weight_transfer, device), api_key=api_key(s),
                         vision=vision(cfg.model.name_or_path), **lora_settings(cfg, device))


def vision(name: str) -> bool:
    """Whether ``name`` is a vision-language model the server takes images for (refused in one line: one it does
    not)."""
    from grpo.models import checkpoint_family
    from grpo.rollout.vllm_images import VLLM_VISION_FAMILIES
    from grpo.vision.models import TINY_VLM_FAMILIES

    tiny = name.split(":", 1)[1] if name.startswith("tiny:") else None
    family = (tiny if tiny in TINY_VLM_FAMILIES else None) if tiny is not None else checkpoint_family(name)
    if family is None:  # a text model
        return False
    if family not in VLLM_VISION_FAMILIES:
        raise SetupError(f"grpo-serve takes images for {', '.join(VLLM_VISION_FAMILIES)} only (model.name_or_path="
                         f"{name}); use rollout.backend=hf for this model (docs/vision-language.md)")
    return True


def lora_settings(cfg, device: str) -> dict:
    """LoRA enabled on the server (its rank, its adapter slots) when the run syncs adapters
    (`grpo.rollout.server.adapters`): model.lora.enabled, rollout.vllm.lora_sync not merged, an adapter vLLM serves,
    the gloo weight channel."""
    from grpo.rollout.lora_sync import config_refusal, served_rank
    from grpo.rollout.server.connect import transfer_kind

    lora, r = cfg.model.lora, cfg.rollout
    if not lora.enabled or r.vllm.lora_sync == "merged" or config_refusal(lora) is not None or \
            transfer_kind(r.server.weight_transfer, device) != "gloo":
        return {}
    return {"lora_rank": served_rank(lora.r), "max_loras": r.max_staleness + 1}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    show_warnings_as_lines()
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    dry = "--print" in ours
    if {"-h", "--help"} & set(ours):
        from grpo.cli import usage

        print(usage("grpo-serve"))
        return
    overrides = [a for a in ours if a != "--print"]
    try:
        from grpo.cli import check_argv
        from grpo.config.compose import compose
        from grpo.config.schema import load
        from grpo.models import cache_dir

        check_argv(overrides)  # a typo: one line naming the key, as grpo-train says it
        raw = compose(overrides)
        raw.trainer.output_dir = "unused"  # nothing of the run is written by a server
        cfg = load(raw)
        if not dry and importlib.util.find_spec("vllm") is None:
            raise SetupError("grpo-serve needs vLLM: run it from the vLLM environment (make setup-vllm, then "
                             ".venv-vllm/bin/grpo-serve ...; docs/rollout.md)")
        device = cfg.trainer.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        from grpo.models import check_name
        from grpo.rollout.registry import check_vllm_cpu
        from grpo.rollout.server.launch import serve_command

        check_name(cfg.model.name_or_path)  # what the in-process vLLM backend refuses, refused before vLLM starts
        if device == "cpu":
            check_vllm_cpu(cfg.model.name_or_path, cfg.model.tiny, who="grpo-serve")

        if "--api-key" in extra:
            raise SetupError("grpo-serve: give the API key in the environment variable rollout.server.api_key_env "
                             f"names (${cfg.rollout.server.api_key_env}), not as vLLM's --api-key: the trainer reads "
                             "it there, and a command line is visible to every user of the machine")
        run = settings(cfg, device)
        cmd, env = serve_command(run, cache_dir(), extra)
    except GRPOError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if run.api_key is None and run.host not in LOOPBACK:
        print(f"[grpo] warning: grpo-serve listens on {run.host}, beyond this machine, without an API key: anyone who "
              "reaches the port can sample from the model and push weights into it; set "
              f"${cfg.rollout.server.api_key_env} (rollout.server.api_key_env) here and on the trainers",
              file=sys.stderr, flush=True)
    if dry:
        shown = {k: ("***" if k == "VLLM_API_KEY" else v) for k, v in env.items()}
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items()), shlex.join(cmd))
        return
    print(f"[grpo] serving {cfg.model.name_or_path} at http://{cfg.rollout.server.host}:{cfg.rollout.server.port} "
          "(vLLM's OpenAI-compatible server; GET /health answers when it is ready)", file=sys.stderr, flush=True)
    print(EXPECTED_IN_VLLM_LOG, file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    main()
