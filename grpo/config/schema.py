"""The typed config schema. YAML in configs/ and recipes/ mirrors these dataclasses one to one.

`load(cfg)` turns Hydra's composed DictConfig into a validated `Config`; every mistake becomes a
`ConfigError` whose message is one line naming the key and what is allowed.
"""
from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grpo.config.checks import check_distributed, check_server, check_tools, check_trainer
from grpo.config.evaluation import RANGES, AlarmsConfig, EvalConfig, check_evaluation
from grpo.config.rollout_backends import ServerConfig, VLLMConfig
from grpo.config.theirs import NOT_HERE, ours_for
from grpo.errors import ConfigError


@dataclass
class LoraConfig:
    enabled: bool = False            # train LoRA adapters instead of all weights; reference = the base model
    r: int = 16                      # rank
    alpha: int = 32                  # scaling numerator: the update is scaled by alpha / r
    dropout: float = 0.0             # dropout on the LoRA input
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])  # adapted modules
    merge_on_save: bool = True       # final/ holds a merged model (True) or the adapter only (False)


@dataclass
class ModelConfig:
    # a local HF directory, a hub id, "embedded:smollm2-135m-instruct", or "tiny:<family>" (llama, gemma2, ...)
    name_or_path: str = "embedded:smollm2-135m-instruct"
    dtype: str = "float32"           # float32 | bfloat16 | float16
    attn_implementation: str = "sdpa"  # sdpa | eager | flex_attention | flash_attention_2
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more compute
    tiny: dict = field(default_factory=dict)  # config overrides for tiny:<family> models (hidden_size, ...)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA settings (model.lora.*)
    freeze_vision_tower: bool = False  # a vision-language model's vision tower is not trained (docs/vision-language.md)


@dataclass
class DataConfig:
    source: str = "builtin:arithmetic"  # builtin:<task>, a .jsonl/.parquet/.csv path, or a hub dataset name
    task_kwargs: dict = field(default_factory=dict)  # for builtin tasks, e.g. {level: 2}
    split: str = "train"             # hub/file split
    load_kwargs: dict = field(default_factory=dict)  # extra datasets.load_dataset arguments
    prompt_column: str = "prompt"    # the column holding the prompt text
    answer_column: str = "answer"    # the reference column; rewards receive it as `answer`
    image_column: str = "images"     # a row's images (one or a list: PIL, path, bytes); docs/vision-language.md
    system_prompt: Optional[str] = None  # a system message (without a chat template: a first paragraph)
    prompt_template: str = "{prompt}"  # applied before the chat template; any column by name
    chat_template: bool = True       # use the tokenizer's chat template when it has one
    max_prompt_tokens: int = 512     # longer prompts are dropped (and counted), never truncated
    num_train: int = 2000            # builtin tasks: how many training prompts to generate
    num_eval: int = 100              # held-out prompts (never seen in training)
    seed: int = 1234                 # seed of the built-in task generators (which prompts exist)


@dataclass
class RewardConfig:
    # name -> {fn: builtin or "package.module:function", weight: float, ...kwargs passed to fn}
    functions: dict = field(default_factory=lambda: {"accuracy": {"fn": "arithmetic", "weight": 1.0}})
    timeout_s: float = 0.0           # > 0: run rewards in a worker process, hard-killed after this
    max_failed_steps: int = 3        # stop when a function fails on every sample this many steps in a row
    # what rewards receive (TRL's rule): messages = prompts as message lists and completions as
    # [{"role": "assistant", "content": text}]; text = strings; auto = messages for a conversational dataset
    completion_format: str = "auto"  # auto | text | messages


@dataclass
class RolloutConfig:
    prompts_per_step: int = 8        # prompts per optimizer step (each gets group_size completions)
    max_new_tokens: int = 64         # completion length cap; longer completions are cut (truncated)
    temperature: float = 1.0         # sampling temperature (the loss's log-probs use it too)
    top_p: float = 1.0               # nucleus sampling; 1 = off
    top_k: int = 0                   # sample from the k most likely tokens; 0 = off
    batch_size: int = 8              # prompts generated together (each with G samples)
    share_prompt: bool = True        # prefill each prompt once and fork its KV cache for the G samples
    # auto | hf | vllm | server | a registered one (grpo.rollout.registry): hf = our decode loop on the training model;
    # vllm = a vLLM engine in this process (pip install -e '.[vllm]'); server = vLLM servers (grpo-serve); auto =
    # vllm on CUDA if installed, else hf
    backend: str = "auto"
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # vLLM engine settings (rollout.vllm.*)
    server: ServerConfig = field(default_factory=ServerConfig)  # rollout.backend=server: vLLM servers (grpo-serve)
    # multi-turn episodes (docs/tools-and-environments.md): functions the model may call, 'package.module:function'
    tools: list = field(default_factory=list)
    tool_format: str = "auto"        # template | hermes | pythonic | code | auto: template if the template shows tools
    # 'package.module:Class', one instance per sample: reset(row), public methods = tools, optional reward();
    # or the plain-text protocol: step(completion_text) -> observation text, or None when the episode is done
    environment: Optional[str] = None
    max_turns: int = 4               # model turns per episode at most (tools/environment); each up to max_new_tokens
    tool_timeout_s: float = 10.0     # a tool/environment call running longer is killed; the model sees an error
    max_tool_tokens: int = 256       # a tool result or observation longer than this many tokens is cut
    max_staleness: int = 0           # K > 0: generators (one per rank, or the servers) sample step t with version t-1-K


@dataclass
class AlgorithmConfig:
    group_size: int = 8              # G completions per prompt
    beta: float = 0.04               # KL coefficient; 0 = no reference model at all
    kl_estimator: str = "k3"         # k1 | k2 | k3
    kl_in_reward: bool = False       # subtract beta*KL(seq) from the reward instead of the loss
    epsilon: float = 0.2             # lower clip
    epsilon_high: Optional[float] = None  # upper clip (clip-higher, DAPO 0.28); None = epsilon
    delta: Optional[float] = None    # cap on the ratio for negative advantages (two-sided clip)
    loss_agg: str = "seq_mean_token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum | dr_grpo
    scale_rewards: str = "group"     # group | batch | none
    adv_eps: float = 1e-4            # added to the std that divides the advantages
    num_iterations: int = 1          # mu: optimiser passes over each batch of rollouts
    importance_sampling: str = "token"  # token | sequence (GSPO)
    policy_loss: str = "ppo_clip"    # a @register_policy_loss name (ppo_clip: the clip above) or module:function
    filter_zero_std_groups: bool = False  # drop groups whose rewards are all equal (DAPO dynamic sampling)
    resample_zero_std: int = 0       # with filtering: at most this many extra rollout rounds to refill the batch
    mask_truncated: bool = False     # completions cut at max_new_tokens do not contribute
    # correction for a sampler whose log-probs differ from the trainer's (vLLM; hf samples exactly on-policy):
    # none | token_truncate | token_mask | sequence_truncate | sequence_mask (docs/rollout.md#the-correction)
    rollout_is: str = "token_truncate"
    rollout_is_cap: float = 2.0      # C: the cap on pi_old / pi_sampler (truncate) or the cut-off (mask)


@dataclass
class EngineConfig:
    shared_prefix: bool = True       # encode each prompt once per group
    # tokens per forward/backward chunk (gradients accumulate into one step): auto = sized from the model, dtype,
    # checkpointing and the free memory at start (docs/recipes.md#memory); a number wins
    max_tokens_per_micro_batch: Any = "auto"
    memory_limit_gib: Optional[float] = None  # auto plans for at most this much memory (null = what is free at start)
    # auto | grouped | flex: shared-layout attention (flex: CUDA, opt-in; auto = grouped)
    attention_kernel: str = "auto"


@dataclass
class TrainerConfig:
    max_steps: int = 100             # optimizer steps (each: prompts_per_step x group_size completions)
    seed: int = 0                    # sampling, prompt order, tiny-model init (data.seed picks the prompts)
    lr: float = 1e-6                 # AdamW learning rate (the peak, after warmup)
    weight_decay: float = 0.0        # AdamW weight decay
    adam_betas: list = field(default_factory=lambda: [0.9, 0.99])  # AdamW (beta1, beta2)
    warmup_steps: int = 0            # linear warmup from lr/warmup_steps up to lr
    lr_schedule: str = "constant"    # constant | cosine | linear
    max_grad_norm: float = 1.0       # clip the gradient norm to this; 0 = no clipping
    output_dir: str = "outputs/run"  # metrics, checkpoints, final/ (configs/trainer sets null: Hydra's run dir)
    save_every: int = 0              # 0 = only at the end
    keep_last: int = 2               # checkpoints kept; older ones are deleted
    resume: Optional[str] = None     # None | auto | <checkpoint path>
    force_resume: bool = False       # resume even if the run-defining config changed
    eval_every: int = 0              # 0 = evaluate only before and after training
    eval_max_new_tokens: Optional[int] = None  # None = rollout.max_new_tokens
    max_bad_steps: int = 3           # stop after this many non-finite steps in a row
    stop_on_alarm: bool = False      # an alarm that fires (alarms.*) checkpoints and stops the run
    device: str = "auto"             # auto | cpu | cuda


@dataclass
class LoggingConfig:
    log_every: int = 1               # console line every N steps (metrics.jsonl gets every step)
    sample_every: int = 10           # print/log sample completions every N steps (0 = never)
    num_samples: int = 2             # sample completions shown each time
    plot: bool = True                # write reward_curve.png at the end
    # Weights & Biases: mode online | offline | disabled (the WANDB_MODE variable overrides it), project, name
    wandb: dict = field(default_factory=lambda: {"mode": "offline", "project": "grpo", "name": None})


@dataclass
class DistributedConfig:
    backend: str = "none"            # none | deepspeed (start with a launcher; see docs/distributed.md)
    zero_stage: int = 0              # deepspeed: 0-3 (configs: zero2, zero3)
    offload_optimizer: bool = False  # optimizer states (and the fp32 master weights) in CPU memory
    offload_params: bool = False     # ZeRO-3 only: weights in CPU memory between uses
    bf16: bool = False               # compute in bf16, fp32 master weights (also on with model.dtype=bfloat16)
    gather_for_generation: bool = True  # ZeRO-3: gather the full weights for generation (fast) or fetch per layer
    ds_config: dict = field(default_factory=dict)  # merged over the derived DeepSpeed config (bucket sizes, ...)
    timeout_s: float = 1800.0        # longest wait of a rank in any collective; then every rank stops


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)


# --------------------------------------------------------------------------------------- checking
# the off-policy corrections of grpo/algorithm/rollout_is.py (docs/rollout.md#the-correction)
ROLLOUT_IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
_ABSENT = object()  # a key the raw config does not give (`load`)
_CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.attn_implementation": ("sdpa", "eager", "flex_attention", "flash_attention_2"),
    "algorithm.kl_estimator": ("k1", "k2", "k3"),
    "algorithm.loss_agg": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"),
    "algorithm.scale_rewards": ("group", "batch", "none"),
    "algorithm.importance_sampling": ("token", "sequence"),
    "algorithm.rollout_is": ROLLOUT_IS_MODES,
    "rollout.server.balance": ("round_robin", "least_loaded"),
    "rollout.server.weight_transfer": ("auto", "gloo", "nccl"),
    "rollout.tool_format": ("auto", "template", "hermes", "pythonic", "code"),  # grpo.rollout.episodes.formats.FORMATS
    "trainer.lr_schedule": ("constant", "cosine", "linear"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "distributed.backend": ("none", "deepspeed"),
    "engine.attention_kernel": ("auto", "grouped", "flex"), "rollout.vllm.lora_sync": ("auto", "adapters", "merged"),
    "reward.completion_format": ("auto", "text", "messages"),
}

# key -> (predicate, what is allowed)
_RANGES = {
    "algorithm.group_size": (lambda v: v >= 2, "an integer >= 2 (GRPO needs a group to compare)"),
    "algorithm.beta": (lambda v: v >= 0, ">= 0"),
    "algorithm.epsilon": (lambda v: 0 < v < 1, "in (0, 1)"),
    "algorithm.epsilon_high": (lambda v: v is None or v > 0, "> 0 or null"),
    "algorithm.delta": (lambda v: v is None or v > 1, ">= 1 + epsilon_high, or null"),
    "algorithm.num_iterations": (lambda v: v >= 1, ">= 1"),
    "algorithm.adv_eps": (lambda v: v >= 0, ">= 0"),
    "algorithm.resample_zero_std": (lambda v: v >= 0, ">= 0 (extra rollout rounds per step; 0 = never resample)"),
    "rollout.prompts_per_step": (lambda v: v >= 1, ">= 1"),
    "rollout.max_new_tokens": (lambda v: v >= 1, ">= 1"),
    "rollout.temperature": (lambda v: v > 0, "> 0 (use a small value such as 0.01 for near-greedy)"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "rollout.top_k": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "rollout.batch_size": (lambda v: v >= 1, ">= 1"),
    "rollout.max_turns": (lambda v: v >= 1, ">= 1"),
    "rollout.tool_timeout_s": (lambda v: v > 0 and math.isfinite(v), "> 0 (seconds)"),
    "rollout.max_tool_tokens": (lambda v: v >= 1, ">= 1"),
    "rollout.max_staleness": (lambda v: v >= 0, ">= 0 (0 = synchronous; K > 0: docs/async.md)"),
    "rollout.vllm.gpu_memory_utilization": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "rollout.vllm.kv_cache_gib": (lambda v: v > 0, "> 0"),
    "rollout.vllm.max_model_len": (lambda v: v is None or v >= 2, ">= 2 or null"),
    "rollout.server.port": (lambda v: 0 < v < 65536, "a TCP port in 1..65535"),
    "rollout.server.tensor_parallel_size": (lambda v: v >= 1, ">= 1"),
    "rollout.server.sync_every": (lambda v: v >= 1, ">= 1 (optimizer steps between weight pushes)"),
    "rollout.server.sync_check_tol": (lambda v: v > 0 and math.isfinite(v), "> 0"),
    **{f"rollout.server.{k}_timeout_s": (lambda v: v > 0 and math.isfinite(v), "> 0 (seconds)")
       for k in ("connect", "request")},
    "rollout.server.retries": (lambda v: v >= 0, ">= 0"),
    "rollout.server.rejoin_every_s": (lambda v: v is None or (v >= 0 and math.isfinite(v)),
                                      ">= 0 (seconds between probes of dropped servers) or null (never)"),
    "algorithm.rollout_is_cap": (lambda v: v >= 1, ">= 1"),
    "engine.max_tokens_per_micro_batch": (
        lambda v: v == "auto" or (not isinstance(v, bool) and isinstance(v, (int, str)) and str(v).isdigit()
                                  and int(v) >= 1), "auto or an integer >= 1"),
    "trainer.max_steps": (lambda v: v >= 0, ">= 0"),
    "trainer.lr": (lambda v: v > 0 and math.isfinite(v), "> 0"),
    "trainer.weight_decay": (lambda v: v >= 0, ">= 0"),
    "trainer.warmup_steps": (lambda v: v >= 0, ">= 0"),
    "trainer.max_grad_norm": (lambda v: v >= 0, ">= 0 (0 = no clipping)"),
    "trainer.save_every": (lambda v: v >= 0, ">= 0 (0 = only at the end)"),
    "trainer.keep_last": (lambda v: v >= 1, ">= 1"),
    "trainer.eval_every": (lambda v: v >= 0, ">= 0"),
    "trainer.max_bad_steps": (lambda v: v >= 1, ">= 1"),
    "logging.log_every": (lambda v: v >= 1, ">= 1 (a console line every N steps)"),
    "logging.sample_every": (lambda v: v >= 0, ">= 0 (0 = never)"),
    "logging.num_samples": (lambda v: v >= 0, ">= 0"),
    "data.max_prompt_tokens": (lambda v: v >= 1, ">= 1"),
    "data.num_train": (lambda v: v >= 1, ">= 1"),
    "data.num_eval": (lambda v: v >= 0, ">= 0"),
    "model.lora.r": (lambda v: v >= 1, ">= 1"),
    "distributed.zero_stage": (lambda v: v in (0, 1, 2, 3), "0, 1, 2 or 3"),
    "distributed.timeout_s": (lambda v: v > 0 and math.isfinite(v), "> 0 (seconds a rank waits in a collective)"),
    "reward.timeout_s": (lambda v: v >= 0, ">= 0 (0 = run in-process, no timeout)"),
    **RANGES,
}


def _walk(cls=Config, prefix: str = ""):
    """(dotted key, default) of every leaf of the schema."""
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            yield from _walk(type(default), key + ".")
        else:
            yield key, default


def schema_keys() -> list[str]:
    """Every dotted key of the schema (``trainer.lr``, ...)."""
    return [key for key, _ in _walk()]


def open_dict_keys() -> set[str]:
    """Free-form dict fields (``reward.functions``, ``data.task_kwargs``, ...): their sub-keys are open, and a
    value given for one replaces the schema's default instead of being merged into it."""
    return {key for key, default in _walk() if isinstance(default, dict)}


def suggest(key: str) -> str:
    candidates = schema_keys() + [f.name for f in fields(Config)]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    close = ["algorithm.beta"] if key.split(".")[-1] == "kl_coef" else close  # the KL coefficient has one name
    return f": {NOT_HERE[key]}" if key in NOT_HERE else f" (did you mean '{close[0]}'?)" if close else ""


def _get(cfg: Config, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


def validate(cfg: Config) -> Config:
    """Range and choice checks; raises ConfigError with one line."""
    for key, allowed in _CHOICES.items():
        v = _get(cfg, key)
        if v not in allowed:
            raise ConfigError(f"{key}={v!r} is not allowed; choose one of: {', '.join(allowed)}{ours_for(key, v)}")
    for key, (ok, allowed) in _RANGES.items():
        v = _get(cfg, key)
        if not ok(v):
            raise ConfigError(f"{key}={v!r} is out of range; allowed: {allowed}")
    for name, spec in cfg.reward.functions.items():
        if not isinstance(spec, dict) or "fn" not in spec:
            raise ConfigError(f"reward.functions.{name} needs an 'fn' (a built-in name or 'package.module:function')")
        w = spec.get("weight", 1.0)
        if not isinstance(w, (int, float)):
            raise ConfigError(f"reward.functions.{name}.weight={w!r} must be a number")
    check_trainer(cfg)
    if not cfg.reward.functions:
        raise ConfigError("reward.functions is empty; give at least one reward function")
    if (mode := (cfg.logging.wandb or {}).get("mode", "disabled")) not in ("online", "offline", "disabled"):
        raise ConfigError(f"logging.wandb.mode={mode!r} is not allowed; choose one of: online, offline, disabled")
    if cfg.algorithm.resample_zero_std and not cfg.algorithm.filter_zero_std_groups:
        raise ConfigError(f"algorithm.resample_zero_std={cfg.algorithm.resample_zero_std} needs "
                          "algorithm.filter_zero_std_groups=true (only filtered groups are resampled)")
    a = cfg.algorithm  # a cap below 1 + epsilon_high zeroes the gradient of A > 0 tokens with ratio above it
    high = a.epsilon if a.epsilon_high is None else a.epsilon_high
    if a.delta is not None and a.delta < 1 + high:
        raise ConfigError(f"algorithm.delta={a.delta} must be >= 1 + epsilon_high = {1 + high:g} or null (a smaller "
                          "cap silently zeroes the gradient of positive-advantage tokens whose ratio is above delta)")
    check_distributed(cfg)
    check_tools(cfg)
    check_server(cfg)
    check_evaluation(cfg)
    return cfg


def _list_example(key: str) -> str:
    """What goes between the brackets of ``key=[...]``: the default's items, "a,b" where it has none."""
    return ",".join(map(str, d)) if isinstance(d := dict(_walk()).get(key), list) and d else "a,b"


def _not_a_mapping(raw, cls=Config, prefix: str = "") -> str:
    """The dotted key of the first section or free-form dict that ``raw`` gives as something other than a mapping
    (OmegaConf's merge error for it names no key); "" when there is none."""
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if f.name not in raw or not (is_dataclass(default) or isinstance(default, dict)):
            continue
        key, value = prefix + f.name, raw[f.name]
        if not isinstance(value, (dict, DictConfig)):
            return key
        if is_dataclass(default) and (inner := _not_a_mapping(value, type(default), key + ".")):
            return inner
    return ""


def load(raw: DictConfig | dict) -> Config:
    """Merge ``raw`` onto the schema (type and unknown-key checks), then validate values."""
    if isinstance(raw, dict):
        raw = OmegaConf.create(raw)
    known = {f.name for f in fields(Config)}
    for k in raw.keys():
        if k not in known and k not in ("recipe", "hydra"):
            raise ConfigError(f"unknown config key '{k}'{suggest(str(k))}")
    raw = OmegaConf.masked_copy(raw, [k for k in raw.keys() if k in known])
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
        for key in open_dict_keys():  # a dict given replaces the default: a deleted reward stays deleted
            given = OmegaConf.select(raw, key, default=_ABSENT)
            if given is not _ABSENT:
                OmegaConf.update(merged, key, given, merge=False)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = e.full_key or _not_a_mapping(raw)
        msg = str(e).splitlines()[0]
        if "not in" in msg:
            raise ConfigError(f"unknown config key '{key}'{suggest(key)}") from None
        if "is not a ListConfig" in msg:
            raise ConfigError(f"{key} must be a list, e.g. {key}=[{_list_example(key)}]") from None
        raise ConfigError(f"bad value for '{key}': {msg}") from None
    assert isinstance(cfg, Config)
    return validate(cfg)
