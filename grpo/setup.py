"""Building a run from a validated config, and saving / restoring it.

`build_run` checks everything a user can get wrong (data, reward functions, model path) before the
model loads where it can, and turns each mistake into a one-line `SetupError`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import signal
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from grpo import checkpoint, data
from grpo.config import Config
from grpo.data import PromptSampler, Splits
from grpo.models import ModelError, check_name, load_model, load_reference, load_tokenizer
from grpo.rewards import RewardSpecError
from grpo.rewards.score import RewardFunction
from grpo.rewards.score import build as build_rewards


class SetupError(RuntimeError):
    """A problem that stops the run; the message is one line for the user."""


@dataclass
class Run:
    runtime: object
    tokenizer: object
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    splits: Splits
    rewards: list[RewardFunction]
    optimizer: torch.optim.Optimizer
    scheduler: object
    sampler: PromptSampler
    buffer: object = None                 # rollouts reused across num_iterations optimizer steps
    bad_steps: int = 0
    skipped_steps: int = 0
    failed_reward_steps: dict = field(default_factory=dict)
    stop_requested: bool = False
    previous_handlers: dict = field(default_factory=dict)
    stop_signalled: bool = False          # many processes: a signal seen here, agreed on at the next step
    max_failed_reward_steps: int = 3
    completion_format: str = "auto"       # what rewards receive: text | messages | auto (follow the data)
    owns_output_dir: bool = True          # finalises checkpoints in its output_dir (rank 0; a node's first rank
                                          # when that node's output_dir is not rank 0's, see `owns_output_dir`)

    @property
    def model(self):
        return self.runtime.model

    def reference_context(self):
        """Context in which `reference_model()` gives the frozen reference (LoRA: adapter disabled)."""
        if self.reference is None and hasattr(self.model, "disable_adapter"):
            return self.model.disable_adapter()
        return contextlib.nullcontext()

    def reference_model(self):
        return self.reference if self.reference is not None else self.model


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_runtime(cfg: Config):
    if cfg.distributed.backend == "deepspeed":
        from grpo.deepspeed_runtime import DeepSpeedRuntime

        return DeepSpeedRuntime(cfg)
    from grpo.distributed import LocalRuntime

    return LocalRuntime(cfg.trainer.device)


def preflight(cfg: Config) -> None:
    """Every check that needs no model, as one-line SetupErrors: the command line runs it before a run
    directory exists (a mistake leaves nothing behind), and `build_run` runs it again."""
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
    try:
        check_name(cfg.model.name_or_path)
        build_rewards(cfg.reward.functions)  # resolves every fn and checks its arguments
        data.check_source(cfg.data)
    except (RewardSpecError, ModelError, data.DataError) as e:
        raise SetupError(str(e)) from None


def build_run(cfg: Config) -> Run:
    preflight(cfg)
    runtime = make_runtime(cfg)
    owner = owns_output_dir(runtime, cfg.trainer.output_dir)
    set_seed(cfg.trainer.seed + runtime.rank)
    try:
        rewards = build_rewards(cfg.reward.functions, cfg.reward.timeout_s)
    except RewardSpecError as e:
        raise SetupError(str(e)) from None
    try:
        tokenizer = load_tokenizer(cfg.model.name_or_path)
        splits = data.build(cfg.data, tokenizer)
        if splits.dropped and runtime.is_main:
            print(f"[grpo] dropped {splits.dropped} prompts longer than data.max_prompt_tokens="
                  f"{cfg.data.max_prompt_tokens}; {len(splits.train)} train / {len(splits.eval)} held-out remain",
                  file=sys.stderr, flush=True)
    except ModelError as e:
        raise SetupError(str(e)) from None
    if runtime.world_size > 1 and cfg.rollout.prompts_per_step % runtime.world_size:
        raise SetupError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
                         f"number of processes ({runtime.world_size}) so that every group stays on one rank")
    if 0 < len(splits.eval) < runtime.world_size:
        raise SetupError(f"the held-out split has {len(splits.eval)} prompts, fewer than the number of processes "
                         f"({runtime.world_size}); every rank evaluates a share: raise data.num_eval or set it to 0")
    vocab = len(tokenizer)
    try:
        policy = load_model(cfg.model, vocab, seed=cfg.trainer.seed)
        reference = load_reference(cfg.model, policy, vocab, seed=cfg.trainer.seed) if cfg.algorithm.beta > 0 else None
    except ModelError as e:
        raise SetupError(str(e)) from None
    if reference is not None:  # multi-process runtimes place (ZeRO-3: partition) the reference themselves
        reference = runtime.prepare_reference(reference) if hasattr(runtime, "prepare_reference") \
            else reference.to(runtime.device)
    policy.train()
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.trainer.lr, betas=tuple(cfg.trainer.adam_betas),
                                  weight_decay=cfg.trainer.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.trainer))
    runtime.setup(policy, optimizer, scheduler)
    from grpo.memory import plan as plan_memory  # sizes `auto`, refuses a prompt + completion that cannot fit
    cfg.engine.max_tokens_per_micro_batch = plan_memory(cfg, policy, splits, runtime)
    sampler = PromptSampler(len(splits.train), seed=cfg.trainer.seed)
    run = Run(runtime, tokenizer, policy, reference, splits, rewards, runtime.optimizer, runtime.scheduler, sampler,
              max_failed_reward_steps=cfg.reward.max_failed_steps, completion_format=cfg.reward.completion_format,
              owns_output_dir=owner)
    if hasattr(runtime, "share_stop"):
        runtime.share_stop(run)
    _install_signal_handlers(run)
    return run


def owns_output_dir(runtime, output_dir: str) -> bool:
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


def lr_lambda(tcfg):
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


def _install_signal_handlers(run: Run) -> None:
    """First Ctrl-C / SIGTERM: finish the step, checkpoint, exit cleanly. A second Ctrl-C aborts."""

    def handler(signum, frame):
        if (run.stop_requested or run.stop_signalled) and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if run.runtime.world_size > 1:  # every rank must stop after the same step: the runtime agrees on it
            run.stop_signalled = True
        else:
            run.stop_requested = True

    try:
        run.previous_handlers = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread (e.g. some test harnesses)
        pass


def close_run(run: Run) -> None:
    """Give back what the run holds outside Python's reach: signal handlers, the reward worker, a rollout engine."""
    from grpo.rollout_backends import close_backend

    close_backend(run)
    for sig, old in getattr(run, "previous_handlers", {}).items():
        signal.signal(sig, old)
    for worker in {id(rf.worker): rf.worker for rf in run.rewards if rf.worker is not None}.values():
        worker.kill()


# ------------------------------------------------------------------------------- save / restore
# Keys that define the run: resuming with any of them changed is refused unless trainer.force_resume.
RUN_DEFINING = ["model.name_or_path", "model.lora", "data.source", "data.task_kwargs", "data.seed",
                "data.num_train", "data.num_eval", "data.split", "data.load_kwargs", "data.prompt_column",
                "data.answer_column", "data.system_prompt", "data.prompt_template", "data.chat_template",
                "data.max_prompt_tokens", "algorithm.group_size", "rollout.prompts_per_step", "trainer.seed",
                "reward.functions"]


def fingerprint(cfg: Config) -> dict:
    from dataclasses import asdict

    flat = asdict(cfg)
    out = {}
    for key in RUN_DEFINING:
        obj = flat
        for part in key.split("."):
            obj = obj[part]
        out[key] = json.loads(json.dumps(obj, sort_keys=True, default=str))
    return out


def save_checkpoint(run: Run, cfg: Config, step: int) -> Path:
    def write(tmp: Path) -> None:
        if run.runtime.world_size > 1:  # each rank's own sampling stream and rollouts (rank 0's are also below)
            run.runtime.barrier()       # rank 0 has created tmp
            torch.save({"rng": checkpoint.rng_state(), "buffer": run.buffer}, tmp / f"rank_{run.runtime.rank}.pt")
        run.runtime.save_model_state(tmp) if hasattr(run.runtime, "save_model_state") else _save_weights(run, tmp)
        if run.owns_output_dir:  # every node's copy holds the state (the same on every rank)
            checkpoint.save_state(tmp, {
                "step": step,
                "optimizer": None if hasattr(run.runtime, "save_model_state") else run.optimizer.state_dict(),
                "scheduler": run.scheduler.state_dict(), "sampler": run.sampler.state_dict(),
                "rng": checkpoint.rng_state(), "buffer": run.buffer, "skipped_steps": run.skipped_steps,
                "bad_steps": run.bad_steps, "failed_reward_steps": run.failed_reward_steps,
                "fingerprint": fingerprint(cfg), "config_hash": _hash(fingerprint(cfg)),
            })
        run.runtime.barrier()  # every rank has written its files before rank 0 marks the checkpoint complete

    path = checkpoint.save(cfg.trainer.output_dir, step, write, cfg.trainer.keep_last, owner=run.owns_output_dir)
    run.runtime.barrier()
    return path


def _save_weights(run: Run, path: Path) -> None:
    from safetensors.torch import save_file

    state = {n: p.detach().cpu().contiguous() for n, p in run.model.named_parameters() if p.requires_grad}
    save_file(state, str(path / "trainable.safetensors"))


def _load_weights(run: Run, path: Path) -> None:
    from safetensors.torch import load_file

    if not (path / "trainable.safetensors").exists() and (path / "deepspeed").is_dir():
        raise SetupError(f"checkpoint {path} was written by DeepSpeed; resume it with the same distributed= setting "
                         "and number of processes")
    state = load_file(str(path / "trainable.safetensors"))
    missing = [n for n, p in run.model.named_parameters() if p.requires_grad and n not in state]
    if missing:
        raise SetupError(f"checkpoint {path} does not match the model (missing {missing[0]}); "
                         "wrong model.name_or_path?")
    run.model.load_state_dict(state, strict=False)


def restore(run: Run, cfg: Config, log) -> int:
    """Load the checkpoint named by trainer.resume; returns the step to continue after (0 = fresh)."""
    try:
        ckpt = checkpoint.resolve_resume(cfg.trainer.resume, cfg.trainer.output_dir)
    except FileNotFoundError as e:
        raise SetupError(str(e)) from None
    existing = checkpoint.complete_checkpoints(cfg.trainer.output_dir)
    if run.runtime.world_size > 1:
        ckpt, existing = _agree_on_checkpoint(run.runtime, cfg, ckpt, existing)
    if ckpt is None:
        if existing:
            raise SetupError(f"trainer.output_dir={cfg.trainer.output_dir} already holds checkpoints of another run "
                             f"(newest {existing[-1].name}); continue it with trainer.resume=auto, or use a new "
                             "trainer.output_dir")
        return 0
    state = checkpoint.load_state(ckpt)
    now = fingerprint(cfg)
    # a key the checkpoint's version did not record is not compared (older checkpoints stay resumable)
    changed = [k for k in RUN_DEFINING if k in state["fingerprint"] and state["fingerprint"][k] != now.get(k)]
    if changed and not cfg.trainer.force_resume:
        k = changed[0]
        raise SetupError(f"cannot resume from {ckpt}: {k} changed ({state['fingerprint'].get(k)!r} -> {now[k]!r}); "
                         "set trainer.force_resume=true to resume anyway, or use a new trainer.output_dir")
    if hasattr(run.runtime, "load_model_state"):
        run.runtime.load_model_state(ckpt)
    else:
        _load_weights(run, ckpt)
        run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.sampler.load_state_dict(state["sampler"])
    checkpoint.set_rng_state(state["rng"])
    run.buffer = state["buffer"]
    own = ckpt / f"rank_{run.runtime.rank}.pt"
    if run.runtime.world_size > 1 and own.exists():
        mine = torch.load(own, map_location="cpu", weights_only=False)
        checkpoint.set_rng_state(mine["rng"])
        run.buffer = mine["buffer"]
    run.skipped_steps, run.bad_steps = state["skipped_steps"], state["bad_steps"]
    run.failed_reward_steps = state["failed_reward_steps"]
    log.truncate_after(state["step"])
    if run.owns_output_dir:  # later checkpoints belong to the abandoned continuation; never resume them
        checkpoint.drop_after(cfg.trainer.output_dir, state["step"])
    if run.runtime.is_main:
        print(f"[grpo] resumed from {ckpt} (step {state['step']})", file=sys.stderr, flush=True)
    return state["step"]


def _agree_on_checkpoint(runtime, cfg: Config, ckpt: Path | None, existing: list[Path]):
    """Every rank resumes the same step. With one output_dir per node each node reads its own copy, and a node
    that died while finalising a checkpoint may hold one fewer: take the newest step complete on every rank.
    Every rank decides from the same gathered view, so they all raise the same error or none does."""
    views = runtime.gather((ckpt.name if ckpt else None, [p.name for p in existing]))
    if len({v[0] for v in views}) == 1 and all(set(v[1]) == set(views[0][1]) for v in views):
        return ckpt, existing
    if not any(v[0] for v in views):  # a fresh start: refused if any rank's directory holds checkpoints
        return None, existing or [Path(cfg.trainer.output_dir) / "checkpoints" / next(n for v in views for n in v[1])]
    common = set.intersection(*(set(v[1]) for v in views))
    if not common:
        raise SetupError("the ranks have no checkpoint in common to resume from (each node reads its own "
                         "trainer.output_dir; see docs/distributed.md); resume with trainer.resume=<a step every node "
                         "holds> or start a new trainer.output_dir")
    step = max(common, key=lambda name: int(name.split("_")[1]))
    return checkpoint.checkpoints_dir(cfg.trainer.output_dir) / step, existing


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def save_final(run: Run, cfg: Config) -> Path:
    """``<output_dir>/final``: a directory `AutoModelForCausalLM.from_pretrained` loads (or the
    LoRA adapter with model.lora.merge_on_save=false)."""
    out = Path(cfg.trainer.output_dir) / "final"
    tmp = out.with_name(".tmp-final")
    if hasattr(run.runtime, "save_final"):
        run.runtime.save_final(tmp, run.tokenizer, cfg)
    elif run.runtime.is_main:
        import shutil

        if tmp.exists():
            shutil.rmtree(tmp)
        model = run.model
        if cfg.model.lora.enabled and cfg.model.lora.merge_on_save:
            model = model.merge_and_unload()
        model.save_pretrained(tmp)
        run.tokenizer.save_pretrained(tmp)
    if run.runtime.is_main:
        import shutil

        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    run.runtime.barrier()
    return out
