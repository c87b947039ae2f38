"""Building a run from a validated config: the runtime, tokenizer, data, rewards, models, optimizer.

`preflight` checks everything a user can get wrong (data, reward functions, model path) before any model
loads; every mistake is a one-line `grpo.errors` error.
"""
from __future__ import annotations

import math
import random
import sys
import uuid
from pathlib import Path

import numpy as np
import torch

from grpo import data
from grpo.algorithm.policy_loss import get_policy_loss
from grpo.config.schema import Config, TrainerConfig
from grpo.engine.head_check import check_head
from grpo.errors import SetupError
from grpo.models import check_name, load_image_processor, load_model, load_reference, load_tokenizer
from grpo.rewards.score import RewardFunction
from grpo.rewards.score import build as build_rewards
from grpo.rollout import registry
from grpo.rollout.backends import HFBackend
from grpo.rollout.episodes import formats
from grpo.rollout.episodes.spec import Toolset, build_toolset, choose_format
from grpo.rollout.episodes.wiring import uses_chat
from grpo.runtime.base import Runtime
from grpo.sampler import build_sampler
from grpo.trainer.checkpoint import resolve_resume
from grpo.trainer.evaluate import check_sets
from grpo.trainer.logger import interactive
from grpo.trainer.pipeline import check as check_async
from grpo.trainer.run import Run
from grpo.trainer.settings import derive


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_runtime(cfg: Config) -> Runtime:
    if cfg.distributed.backend == "deepspeed":
        from grpo.runtime.base import RunShape
        from grpo.runtime.deepspeed import DeepSpeedRuntime

        shape = RunShape(cfg.rollout.prompts_per_step, cfg.algorithm.group_size, cfg.trainer.max_grad_norm,
                         cfg.model.dtype)
        return DeepSpeedRuntime(cfg.distributed, shape, cfg.trainer.device)
    from grpo.runtime.local import LocalRuntime

    return LocalRuntime(cfg.trainer.device)


def preflight(cfg: Config) -> tuple[list[RewardFunction], Toolset | None]:
    """Every check that needs no model: the command line runs it before a run directory exists (a mistake
    leaves nothing behind), and `build_run` runs it again. Returns the reward functions it resolved and
    checked (without a worker process: the sampler attaches one when ``reward.timeout_s`` > 0) and the toolset of
    a multi-turn run (None: single-turn)."""
    out = cfg.trainer.output_dir
    if not out:
        raise SetupError("trainer.output_dir is not set")
    if Path(out).exists() and not Path(out).is_dir():
        raise SetupError(f"trainer.output_dir={out!r} is an existing file; give a directory")
    device = cfg.trainer.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise SetupError("trainer.device=cuda but this machine has no usable CUDA device "
                         "(torch.cuda.is_available() is False); use trainer.device=auto or cpu")
    if cfg.engine.attention_kernel == "flex" and device != "cuda":
        raise SetupError(f"engine.attention_kernel=flex needs a CUDA device (this run is on {device}: "
                         "PyTorch's FlexAttention has no CPU backward); use auto or grouped")
    check_name(cfg.model.name_or_path)
    registry.check(cfg.rollout, cfg.model, device)  # what the backend refuses (vLLM missing, no server URL): now
    if cfg.trainer.resume not in (None, "", "auto"):
        try:
            resolve_resume(cfg.trainer.resume, out)  # a checkpoint that is not there: found before the model loads
        except FileNotFoundError as e:
            raise SetupError(str(e)) from None
    rewards = build_rewards(cfg.reward.functions)  # resolves every fn and checks its arguments
    toolset = build_toolset(cfg.rollout.tools, cfg.rollout.environment)  # imports and checks tools/environment
    if toolset is not None and toolset.env_reward and toolset.env_name in cfg.reward.functions:
        raise SetupError(f"reward.functions.{toolset.env_name}: the environment's reward() is logged under that name; "
                         "rename the reward function")
    data.check_source(cfg.data)
    check_sets(cfg.evaluation.sets, cfg.data, rewards)  # evaluation.sets: each reads, with the columns rewards read
    get_policy_loss(cfg.algorithm.policy_loss)  # a registered name, or a module:function that imports
    check_async(cfg)  # rollout.max_staleness > 0: what the backend does not sample ahead with yet
    return rewards, toolset


def build_run(cfg: Config) -> Run:
    rewards, toolset = preflight(cfg)
    runtime = make_runtime(cfg)  # a multi-process runtime checks the number of processes before any collective
    with runtime.peer_failures_as_errors():  # a collective that timed out or lost a rank: one line
        return _build(cfg, runtime, rewards, toolset)


def _build(cfg: Config, runtime: Runtime, rewards: list[RewardFunction], toolset: Toolset | None) -> Run:
    owner = owns_output_dir(runtime, cfg.trainer.output_dir)
    set_seed(cfg.trainer.seed + runtime.rank)
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    images = load_image_processor(cfg.model.name_or_path, tokenizer)  # None: a text model
    fmt = None
    if toolset is not None:
        toolset, note = choose_format(toolset, cfg.rollout.tool_format, tokenizer, cfg.data.chat_template)
        if note and runtime.is_main:
            print(f"[grpo] {note}", file=sys.stderr, flush=True)
        fmt = formats.of(toolset) if toolset.protocol == "tools" else None
    splits = data.build(cfg.data, tokenizer, tools=fmt.template_tools(list(toolset.schemas)) if fmt else None,
                        keep_turns=toolset is not None,
                        system_text=fmt.system_text(list(toolset.schemas)) if fmt else None, sets=cfg.evaluation.sets,
                        image_processor=images)
    if splits.dropped and runtime.is_main:
        print(f"[grpo] dropped {splits.dropped} prompts longer than data.max_prompt_tokens="
              f"{cfg.data.max_prompt_tokens}; {len(splits.train)} train / {len(splits.eval)} held-out remain",
              file=sys.stderr, flush=True)
    if splits.note and runtime.is_main:
        print(f"[grpo] {splits.note}", file=sys.stderr, flush=True)
    if 0 < len(splits.eval) < runtime.world_size:
        raise SetupError(f"the held-out split has {len(splits.eval)} prompts, fewer than the number of processes "
                         f"({runtime.world_size}); every rank evaluates a share: raise data.num_eval or set it to 0")
    vocab = len(tokenizer)
    policy = load_model(cfg.model, vocab, seed=cfg.trainer.seed)
    reference = load_reference(cfg.model, policy, vocab, seed=cfg.trainer.seed) if cfg.algorithm.beta > 0 else None
    if reference is not None:  # placed by the runtime (ZeRO-3: partitioned)
        reference = runtime.prepare_reference(reference)
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.trainer.lr, betas=tuple(cfg.trainer.adam_betas),
                                  weight_decay=cfg.trainer.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.trainer))
    runtime.setup(policy, optimizer, scheduler)
    # the engine's log-probs equal the model's own forward, under this runtime, or the run stops (one line)
    check_head(runtime.model, agree=lambda gap: runtime.all_max({"head_gap": gap})["head_gap"])
    from grpo.trainer.budget import plan as plan_memory  # sizes `auto`, refuses a prompt + completion that cannot fit
    longest = max((len(row["prompt_ids"]) for split in (splits.train, splits.eval) for row in split),
                  default=cfg.data.max_prompt_tokens)
    backend = registry.resolve(cfg.rollout.backend, torch.device(runtime.device).type)
    registry.check_images(cfg.rollout.backend, backend, splits.train,
                          zero3=cfg.distributed.backend == "deepspeed" and cfg.distributed.zero_stage == 3,
                          rollout=cfg.rollout, frozen_tower=cfg.model.freeze_vision_tower)
    settings = derive(cfg, plan_memory(cfg, splits, runtime), chat=uses_chat(cfg.data, tokenizer), backend=backend,
                      longest_prompt=longest)
    progress = runtime.is_main and interactive()
    sampler = build_sampler(settings.sampler, runtime, tokenizer, splits.train, toolset, rewards=rewards,
                            progress=progress)
    greedy = HFBackend(lambda: runtime.model, tokenizer, batch_size=settings.evaluation.batch_size,
                       progress=progress, context=runtime.generation_context, desc="eval",
                       keep_turns=toolset is not None)
    return Run(runtime, tokenizer, policy, reference, splits, sampler, settings, greedy, owns_output_dir=owner,
               toolset=toolset, image_processor=images)


def owns_output_dir(runtime: Runtime, output_dir: str) -> bool:
    """Whether this rank finalises the checkpoints in its ``output_dir``: rank 0 always; with many nodes and no
    shared filesystem (each node its own ``output_dir``), also the first rank of every node whose directory is
    not rank 0's, so that every node keeps a complete copy of what its ranks need to resume. A token that rank 0
    writes and every rank looks for tells which directories are rank 0's."""
    if runtime.world_size == 1:
        return True
    marker = Path(output_dir) / ".grpo-rank0"
    token = None
    if runtime.is_main:
        token = uuid.uuid4().hex
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(token)
    token = runtime.gather(token)[0]  # a collective: rank 0 has written the marker before anyone reads it
    shared = marker.exists() and marker.read_text() == token
    if not shared:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
    runtime.node_local_checkpoints(not shared)
    return runtime.is_main or (not shared and runtime.local_rank == 0)


def lr_lambda(tcfg: TrainerConfig):
    def f(step: int) -> float:
        if tcfg.warmup_steps and step < tcfg.warmup_steps:
            return (step + 1) / tcfg.warmup_steps
        if tcfg.lr_schedule == "constant":
            return 1.0
        span = max(tcfg.max_steps - tcfg.warmup_steps, 1)
        progress = min((step - tcfg.warmup_steps) / span, 1.0)
        if tcfg.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1 + math.cos(math.pi * progress))

    return f

