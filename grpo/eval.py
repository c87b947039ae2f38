"""``grpo-eval``: the held-out evaluation of a training run (`grpo.trainer.evaluate`) for saved models, no training.

    grpo-eval recipe=quickstart --model embedded:smollm2-135m-instruct --model outputs/quickstart/final \\
        evaluation.n=8 evaluation.temperature=0.6 --out eval-results

The config is composed as for ``grpo-train`` (a recipe, config groups, ``key=value``): its data's held-out split and
its evaluation.sets, its rewards, its evaluation.* sampling. Each ``--model`` is a run directory (its ``final/``), a
checkpoint directory (``checkpoints/step_N``: the config's model with the checkpoint's weights), a Hugging Face
directory, a hub id, ``embedded:...`` or ``tiny:<family>``; without one, the config's model.name_or_path. Every model
sees the same prompts with the same seeds. Writes ``eval.json`` and ``eval.md`` (a table: one column per model, and
the difference when there are two) into ``--out``. The rollout backend is rollout.backend's (``hf``; ``vllm`` when it
is installed), called through the backend interface.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from grpo.config.schema import Config
from grpo.errors import GRPOError, SetupError

USAGE = "grpo-eval [recipe=NAME] [key=value ...] [--model PATH_OR_NAME]... [--out DIR]"


@dataclass
class EvalRun:
    """What `grpo.trainer.evaluate.evaluate` reads of a run, for one saved model."""
    runtime: object
    tokenizer: object
    splits: object
    settings: object
    eval_backend: object
    sampler: object                     # what scores: the tokenizer, the rewards, the completion format, no turn loop


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="grpo-eval", usage=USAGE, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", default=[], help="a model to evaluate (repeat to compare)")
    ap.add_argument("--out", default="eval-results", help="where eval.json and eval.md go (default: eval-results)")
    args, rest = ap.parse_known_args(argv)
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        raise SetupError(f"grpo-eval: unknown option {flags[0]}; usage: {USAGE}")
    return args, rest


def load_config(overrides: list[str]) -> Config:
    """The config ``grpo-train`` would compose from ``overrides``, checked (one line per mistake)."""
    from omegaconf import OmegaConf

    from grpo.cli import check_argv
    from grpo.config.compose import compose, normalize
    from grpo.config.schema import load

    check_argv(overrides)
    raw = OmegaConf.to_container(compose(normalize(overrides)), resolve=False)
    raw.pop("hydra", None)
    raw["trainer"]["output_dir"] = raw["trainer"].get("output_dir") or "outputs"
    cfg = load(OmegaConf.to_container(OmegaConf.create(raw), resolve=True))
    if cfg.rollout.tools or cfg.rollout.environment:
        raise SetupError("grpo-eval does not run multi-turn episodes (rollout.tools / rollout.environment); evaluate "
                         "such a model with grpo-train ... trainer.max_steps=0 (held-out before and after, no step)")
    from grpo.rollout import registry

    if cfg.rollout.backend != "auto" and registry.capabilities(cfg.rollout.backend).remote:
        raise SetupError(f"grpo-eval runs the model in this process, not rollout.backend={cfg.rollout.backend}: it "
                         "samples here: use rollout.backend=hf or vllm")
    return cfg


def resolve_model(spec: str) -> tuple[str, Path | None]:
    """(the model directory or name to load, a checkpoint whose trainable weights go into the config's model)."""
    from grpo.runtime.local import WEIGHTS
    from grpo.trainer import checkpoint

    path = Path(spec).expanduser()
    if (path / "final").is_dir():
        return str(path / "final"), None
    if (path / WEIGHTS).is_file():
        return "", path
    if (path / "deepspeed").is_dir():
        raise SetupError(f"--model {spec}: a DeepSpeed checkpoint; evaluate the run's final/ instead")
    if path.is_dir() and not (path / "config.json").is_file():
        last = checkpoint.latest(path)
        if last is not None:
            return "", last
        raise SetupError(f"--model {spec}: neither a run (final/, checkpoints/), a checkpoint ({WEIGHTS}) nor a model "
                         "directory (config.json)")
    return spec, None


def load_policy(cfg: Config, spec: str, device: str):
    """(tokenizer, model in eval mode) for ``spec`` (`resolve_model`)."""
    import torch

    from grpo.models import load_model, load_tokenizer

    name, ckpt = resolve_model(spec)
    plain = type(cfg.model.lora)()  # no adapter of its own
    mcfg = replace(cfg.model, gradient_checkpointing=False)  # decoding keeps its K/V cache
    adapter = ckpt is None and (Path(name) / "adapter_config.json").is_file()  # final/ of merge_on_save=false
    if ckpt is None:
        mcfg = replace(mcfg, lora=plain) if adapter else replace(mcfg, name_or_path=name, lora=plain)
    tokenizer = load_tokenizer(name if ckpt is None else cfg.model.name_or_path)
    model = load_model(mcfg, len(tokenizer), seed=cfg.trainer.seed)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, name)
    if ckpt is not None:
        from safetensors.torch import load_file

        state = load_file(str(ckpt / "trainable.safetensors"))
        missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in state]
        if missing:
            raise SetupError(f"--model {spec}: the checkpoint has no {missing[0]} for the config's model "
                             f"{cfg.model.name_or_path} (give the recipe and model.* the run was trained with)")
        model.load_state_dict(state, strict=False)
    return tokenizer, model.to(torch.device(device)).eval().requires_grad_(False)


def backend_for(cfg: Config, runtime, tokenizer, splits, settings):
    """The rollout backend rollout.backend names, through the backend interface (grpo.rollout.backends)."""
    import dataclasses

    from grpo.rollout import registry
    from grpo.sampler import SYNC_CHECK_TOKENS
    from grpo.trainer.logger import interactive

    rows = [r for s in (splits.eval, *splits.sets.values()) for r in s]
    # the backend as training makes it, with the evaluation's token budget and seed
    rollout = dataclasses.replace(cfg.rollout, max_new_tokens=settings.max_new_tokens, batch_size=settings.batch_size)
    ctx = registry.BackendContext(runtime, tokenizer, rollout, cfg.model.name_or_path, cfg.evaluation.seed,
                                  longest_prompt=max(len(r["prompt_ids"]) for r in rows),
                                  check_ids=list(rows[0]["prompt_ids"][:SYNC_CHECK_TOKENS]), progress=interactive())
    backend = registry.make(registry.resolve(cfg.rollout.backend, runtime.device.type), ctx)
    backend.desc = "eval"
    return backend


def evaluate_model(cfg: Config, spec: str, rewards: list) -> dict:
    """``{"eval/<metric>": value}`` of one model on the config's held-out split and evaluation.sets."""
    import torch

    from grpo import data
    from grpo.runtime.local import LocalRuntime
    from grpo.trainer.evaluate import evaluate
    from grpo.trainer.settings import eval_settings

    runtime = LocalRuntime(cfg.trainer.device)
    tokenizer, model = load_policy(cfg, spec, str(runtime.device))
    runtime.setup(model, None, None)
    splits = data.build(cfg.data, tokenizer, sets=cfg.evaluation.sets)
    if not splits.eval and not splits.sets:
        raise SetupError("nothing to evaluate: data.num_eval=0 and no evaluation.sets")
    settings = eval_settings(cfg)
    backend = backend_for(cfg, runtime, tokenizer, splits, settings)
    scorer = SimpleNamespace(tokenizer=tokenizer, rewards=rewards, completion_format=cfg.reward.completion_format,
                             turn_loop=None)  # multi-turn episodes are refused (`load_config`)
    run = EvalRun(runtime, tokenizer, splits, SimpleNamespace(evaluation=settings), backend, scorer)
    try:
        with torch.no_grad():
            return {f"eval/{k}": v for k, v in evaluate(run, spec).items()}
    finally:
        backend.close()


def markdown(models: list[str], results: list[dict]) -> str:
    """One row per metric, one column per model (and their difference when there are two)."""
    keys = list(dict.fromkeys(k for r in results for k in r))
    two = len(models) == 2
    head = ["metric", *(f"`{m}`" for m in models), *(["difference"] if two else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    for k in keys:
        vals = [r.get(k) for r in results]
        diff = [fmt(vals[1] - vals[0]) if None not in vals else "–"] if two else []
        lines.append("| " + " | ".join([f"`{k}`", *map(fmt, vals), *diff]) + " |")
    return "\n".join(lines) + "\n"


def run_eval(argv: list[str]) -> Path:
    """``grpo-eval`` without the exit: returns the path of eval.json."""
    from grpo.rewards.score import build as build_rewards
    from grpo.trainer.evaluate import check_sets
    from grpo.trainer.logger import quiet_when_not_interactive

    args, overrides = parse(argv)
    cfg = load_config(overrides)
    rewards = build_rewards(cfg.reward.functions, cfg.reward.timeout_s)
    check_sets(cfg.evaluation.sets, cfg.data, rewards)  # before any model loads
    models = args.model or [cfg.model.name_or_path]
    for spec in models:
        resolve_model(spec)
    quiet_when_not_interactive()
    try:
        results = [evaluate_model(cfg, spec, rewards) for spec in models]
    finally:
        for worker in {id(rf.worker): rf.worker for rf in rewards if rf.worker is not None}.values():
            worker.kill()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"models": [{"model": m, "metrics": r} for m, r in zip(models, results)],
           "evaluation": asdict(cfg.evaluation), "data": asdict(cfg.data), "reward": cfg.reward.functions,
           "max_new_tokens": cfg.trainer.eval_max_new_tokens or cfg.rollout.max_new_tokens}
    (out / "eval.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "eval.md").write_text(f"# grpo-eval: {', '.join(models)}\n\n" + markdown(models, results))
    return out / "eval.json"


def main(argv: list[str] | None = None) -> None:
    try:
        path = run_eval(sys.argv[1:] if argv is None else argv)
    except (GRPOError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"wrote {path} and {path.with_name('eval.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
