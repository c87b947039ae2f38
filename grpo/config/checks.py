"""Checks of `grpo.config.schema.validate` that span several keys of one section (``cfg`` is the root `Config`):
each raises ConfigError with one line naming the key and what to do."""
from __future__ import annotations

from grpo.errors import ConfigError


def check_tools(cfg) -> None:
    r = cfg.rollout
    if not isinstance(r.tools, (list, tuple)) or not all(isinstance(t, str) and ":" in t for t in r.tools):
        raise ConfigError(f"rollout.tools={list(r.tools) if isinstance(r.tools, (list, tuple)) else r.tools!r} must "
                          "be a list of 'package.module:function' strings")
    if r.environment is not None and (not isinstance(r.environment, str) or ":" not in r.environment):
        raise ConfigError(f"rollout.environment={r.environment!r} must be 'package.module:Class' or null")


def check_server(cfg) -> None:
    """The URLs of rollout.server (the backend that needs them says so: `grpo.rollout.registry`) and the name of its
    API key's variable (the key itself is never echoed)."""
    for u in cfg.rollout.server.urls:
        if not isinstance(u, str) or not u.startswith(("http://", "https://")) or len(u.split("://", 1)[1]) == 0:
            raise ConfigError(f"rollout.server.urls: {u!r} is not a URL; give http://HOST:PORT")
    if not (cfg.rollout.server.api_key_env.isidentifier() and cfg.rollout.server.api_key_env.isascii()):
        raise ConfigError("rollout.server.api_key_env must be the NAME of an environment variable; put the key itself "
                          "in that variable, never in the config")


def check_distributed(cfg) -> None:
    d = cfg.distributed
    if d.backend == "none":
        on = [k for k in ("offload_optimizer", "offload_params", "bf16") if getattr(d, k)]
        if d.zero_stage or on or d.ds_config:
            key = f"distributed.zero_stage={d.zero_stage}" if d.zero_stage else \
                (f"distributed.{on[0]}=true" if on else "distributed.ds_config")
            raise ConfigError(f"{key} needs distributed.backend=deepspeed (use distributed=zero2 or distributed=zero3)")
        return
    if d.offload_params and d.zero_stage != 3:
        raise ConfigError(f"distributed.offload_params=true needs distributed.zero_stage=3 (got {d.zero_stage}); "
                          "use distributed=zero3")
    if d.offload_optimizer and d.zero_stage == 0:
        raise ConfigError("distributed.offload_optimizer=true needs distributed.zero_stage >= 1")
    if cfg.model.dtype == "float16":
        raise ConfigError("model.dtype=float16 is not supported with distributed.backend=deepspeed (no loss scaling); "
                          "use model.dtype=bfloat16 or distributed.bf16=true")


def check_trainer(cfg) -> None:
    t = cfg.trainer
    if len(t.adam_betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in t.adam_betas):
        raise ConfigError(f"trainer.adam_betas={list(t.adam_betas)} must be two numbers in [0, 1), "
                          "e.g. trainer.adam_betas=[0.9,0.99]")
    if t.resume is not None and not isinstance(t.resume, str):  # "auto" and a path are strings
        raise ConfigError("trainer.resume must be null, 'auto' or a checkpoint path")
