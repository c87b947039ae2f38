"""Two CPU processes (gloo) through DeepSpeed ZeRO-2 and ZeRO-3 on the smoke recipe.

Run by torchrun, this file is also the worker (``python tests/e2e/test_distributed.py MODE OUT_DIR args...``):

- ``update``: build the run, then three `policy_update` calls on a fixed global batch (every rank takes
  its groups, as `experience.collect` does; rank 0's groups are long and rank 1's short, so rank 1 runs
  idle micro-batches); the third has NaN advantages and must be skipped. Each rank writes its (gathered)
  parameters after every call. Run without a launcher (distributed=none) it is the one-process reference.
- ``train``: the real command line (``grpo.train.main``), with ``save_final`` wrapped so that every rank
  also writes its gathered parameters next to the final model; ``cli``: ``update`` then ``train``.
- ``resume``: OUT_DIR is a finished run's directory; rank 0 copies it, less ``final/`` and the parameters the
  wrapper wrote (a run stopped after its last checkpoint), to the ``trainer.output_dir`` in the arguments, then
  ``train`` runs there: the run is built afresh and loads every rank's state from the copied checkpoint on disk.

Several phases (``MODE OUT_DIR args...``, separated by ``--then``) run one after the other in one launch: the
processes start, import (deepspeed, transformers, peft: about 12 CPU seconds each) and join the group once.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, G, BUDGET = 4, 4, 64   # fixed batch: 4 prompts x 4 completions, 64-token micro-batches
SMOKE = ["recipe=smoke", "logging.sample_every=0", "logging.plot=false"]
ZERO3 = ["distributed=zero3", "+distributed.ds_config.zero_optimization.stage3_param_persistence_threshold=0"]


# ----------------------------------------------------------------------------------- the worker
def _params(rt) -> dict:
    return rt.full_parameters()


def fixed_batch_updates(overrides: list[str], out: Path, dropped: tuple[int, ...] = (), recipe: str = "smoke") -> None:
    from omegaconf import OmegaConf

    from grpo.algorithm.advantages import compute_advantages
    from grpo.batch import Batch
    from grpo.config.schema import load
    from grpo.engine.batch_logprobs import nested_logprobs
    from grpo.engine.batch_logprobs import plan as _plan
    from grpo.engine.unwrap import unwrap_model
    from grpo.trainer.build import build_run
    from grpo.trainer.settings import derive
    from grpo.update import policy_update
    from tests.helpers import compose_recipe

    raw = compose_recipe(recipe, [f"trainer.output_dir={out / 'update-run'}", f"rollout.prompts_per_step={PROMPTS}",
                                   f"algorithm.group_size={G}", f"engine.max_tokens_per_micro_batch={BUDGET}",
                                   *overrides])
    cfg = load(OmegaConf.to_container(raw, resolve=True))
    run = build_run(cfg)
    rt = run.runtime
    gen = torch.Generator().manual_seed(1234)
    vocab = len(run.tokenizer)
    rows = run.splits.train[:PROMPTS]
    comps = [[torch.randint(3, vocab, (int(n),), generator=gen).tolist()
              for n in torch.randint(12, 17, (G,), generator=gen) // (1 if g < PROMPTS // 2 else 6)]
             for g in range(PROMPTS)]
    rewards = torch.rand(PROMPTS * G, generator=gen)
    per = PROMPTS // rt.world_size
    # groups in `dropped` are left out on every process count (zero-std filtering that empties rank 1)
    mine = [i for i in range(rt.rank * per, (rt.rank + 1) * per) if i not in dropped]
    flat = [i * G + j for i in mine for j in range(G)]
    batch = Batch([rows[i] for i in mine], [rows[i]["prompt_ids"] for i in mine], [comps[i] for i in mine],
                  [[j == 1 for j in range(G)] for _ in mine], rewards[flat], torch.zeros(len(flat)))
    batch.advantages = compute_advantages(batch.rewards, batch.group_sizes, cfg.algorithm.scale_rewards,
                                          cfg.algorithm.adv_eps)
    with run.reference_context():
        batch.ref_logps = nested_logprobs(rt, run.reference_model(), batch, cfg.engine, cfg.rollout.temperature)
    if cfg.algorithm.num_iterations > 1:  # pi_old: the weights before the first update, for both updates
        batch.old_logps = nested_logprobs(rt, rt.model, batch, cfg.engine, cfg.rollout.temperature)
    record = {"micro_batches": len(_plan(batch, cfg.engine)), "stats": [], "params": [_params(rt)],
              # per parameter: (elements this rank holds, elements in all); ZeRO-3 holds a partition
              "held": {n: (getattr(p, "ds_tensor", p).numel(), getattr(p, "ds_numel", p.numel()))
                       for n, p in rt.unwrap().named_parameters()}}
    # forwards of the first softmax-attention layer in the first update: twice per micro-batch with checkpointing
    core = unwrap_model(rt.model).model
    layers = getattr(core, "language_model", core).layers  # a vision-language model: its language model's
    layer = next(m.self_attn for m in layers if hasattr(m, "self_attn"))  # hybrids: not layer 0
    calls = []
    hook = layer.register_forward_hook(lambda *_: calls.append(1))
    for k in range(3):
        if k == 2:
            batch.advantages = torch.full_like(batch.advantages, float("nan"))
        stats = policy_update(rt, batch, derive(cfg).update)
        record.setdefault("layer_calls", len(calls))
        hook.remove()
        record["stats"].append(stats)
        record["params"].append(_params(rt))
    out.mkdir(parents=True, exist_ok=True)
    torch.save(record, out / f"update_rank{rt.rank}.pt")
    run.close()


def update(args: list[str], out: Path) -> None:
    """``update`` with a phase's arguments: the config overrides it takes, ``drop=G,...`` (groups left out) and
    ``recipe=NAME`` (default: smoke)."""
    drop = [a for a in args if a.startswith("drop=")]
    dropped = tuple(int(g) for g in drop[0][5:].split(",")) if drop else ()
    recipe = next((a.split("=", 1)[1] for a in args if a.startswith("recipe=")), "smoke")
    keys = ("distributed", "+distributed", "algorithm.", "model.", "engine.")
    fixed_batch_updates([a for a in args if a.startswith(keys)], out, dropped, recipe)


def _saving_params(save_final):
    def save(run, cfg):
        torch.save(_params(run.runtime), Path(cfg.trainer.output_dir) / f"params_rank{run.runtime.rank}.pt")
        return save_final(run, cfg)

    return save


def train(args: list[str], out: Path | None = None) -> None:
    """The real command line with ``args``."""
    import grpo.train

    sys.argv = ["grpo.train", *args]
    grpo.train.main()


def resume(args: list[str], src: Path) -> None:
    """``src`` as a run stopped after its last checkpoint: copied by rank 0 into the arguments' trainer.output_dir
    without ``final/`` and the wrapper's parameters (every rank waits for the copy), then trained there."""
    import shutil

    import torch.distributed as dist

    dst = next(a.split("=", 1)[1] for a in args if a.startswith("trainer.output_dir="))
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("final", "params_rank*.pt"))
    if dist.is_initialized():
        dist.barrier()
    train(args)


def update_then_train(args: list[str], out: Path) -> None:
    update(args, out)
    train(args)


PHASES = {"update": update, "cli": update_then_train, "train": train, "resume": resume}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    import grpo.trainer.loop
    from tests.helpers import run_phases

    grpo.trainer.loop.save_final = _saving_params(grpo.trainer.loop.save_final)
    run_phases(sys.argv[1:], PHASES)
    sys.exit(0)


# ------------------------------------------------------------------------------------ the tests
import importlib.util  # noqa: E402

import pytest  # noqa: E402

from tests.helpers import THEN  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="distributed tests need deepspeed (pip install 'grpo[deepspeed]')")

from transformers import AutoModelForCausalLM  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def torchrun(*args: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=_env(), timeout=timeout)


def launch(script: Path, *phases, cwd: Path, phase_s: int = 240) -> subprocess.CompletedProcess:
    """One 2-process launch of a worker file (``MODE OUT_DIR args...``, further phases after `THEN`) that must
    succeed; ``phase_s`` seconds allowed per phase."""
    p = torchrun(str(script), *map(str, phases), cwd=cwd, timeout=phase_s * (1 + phases.count(THEN)))
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def worker(mode: str, out: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """One 2-process launch of this file's worker; ``args`` may hold further phases after `THEN`."""
    return launch(Path(__file__), mode, out, *args, cwd=cwd)


def one_process(out: Path, *args: str) -> dict:
    """The one-process reference: ``update`` without a launcher, run in this (test) process."""
    update(list(args), out)
    return torch.load(out / "update_rank0.pt", weights_only=False)


@pytest.fixture(scope="module")
def default_reference(tmp_path_factory) -> dict:
    return one_process(tmp_path_factory.mktemp("one"))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _check_updates(out: Path, ref: dict, rank1_groups: bool = True) -> None:
    ranks = [torch.load(out / f"update_rank{r}.pt", weights_only=False) for r in (0, 1)]
    # the fixed batch gives rank 0 more micro-batches than rank 1 (none when its groups are dropped), so rank 1
    # ran idle ones
    assert ranks[0]["micro_batches"] > ranks[1]["micro_batches"] >= int(rank1_groups)
    for r in ranks:
        for k in range(4):  # every rank holds the same parameters after every step
            assert _max_diff(r["params"][k], ranks[0]["params"][k]) == 0.0
    got = ranks[0]
    assert _max_diff(got["params"][0], ref["params"][0]) == 0.0       # same start
    for k in range(2):  # same gradient norm, loss and update as one process with the global batch
        assert got["stats"][k]["skipped"] is False
        assert got["stats"][k]["grad_norm"] == pytest.approx(ref["stats"][k]["grad_norm"], rel=1e-5)
        assert got["stats"][k]["loss"] == pytest.approx(ref["stats"][k]["loss"], rel=1e-4, abs=1e-7)
        assert got["stats"][k]["kl"] == pytest.approx(ref["stats"][k]["kl"], rel=1e-4, abs=1e-9)
        moved = _max_diff(ref["params"][k + 1], ref["params"][k])
        assert moved > 5e-4                                            # lr 1e-3: the update is visible
        assert _max_diff(got["params"][k + 1], ref["params"][k + 1]) < 1e-5
    # a non-finite gradient: the step is skipped on every rank and the parameters stay put
    assert got["stats"][2]["skipped"] is True and ref["stats"][2]["skipped"] is True
    assert _max_diff(got["params"][3], got["params"][2]) == 0.0


def _check_run(out: Path, steps: int) -> None:
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1))
    assert all(r["grad_norm"] > 0 and not r["skipped"] for r in rows if "loss" in r)
    p0, p1 = (torch.load(out / f"params_rank{r}.pt") for r in (0, 1))
    assert _max_diff(p0, p1) == 0.0                                   # every rank holds the same parameters
    final = dict(AutoModelForCausalLM.from_pretrained(out / "final").named_parameters())
    assert _max_diff({k: v.detach() for k, v in final.items()}, p0) == 0.0  # an ordinary, consolidated HF model


# mu = 2 (old log-probs; the second update has ratios away from 1), GSPO, token_mean, mask_truncated, clip-higher
BEYOND = ["algorithm.num_iterations=2", "algorithm.importance_sampling=sequence", "algorithm.loss_agg=token_mean",
          "algorithm.mask_truncated=true", "algorithm.epsilon=0.05", "algorithm.epsilon_high=0.08"]
# dr_grpo with both of rank 1's groups filtered out (uneven zero-std filtering): rank 1 has nothing but idle
# micro-batches and still takes part in every collective
RANK1_EMPTY = ["algorithm.loss_agg=dr_grpo", "algorithm.num_iterations=2", "drop=2,3"]


@pytest.mark.slow
def test_zero2_two_processes(tmp_path, default_reference):
    """ZeRO-2, one launch of five phases: the fixed batch and the real command line with the defaults; the fixed
    batch with non-default settings (`BEYOND`, `RANK1_EMPTY`), each equal to one process with the same global
    batch and settings; a LoRA run (one step, adapter-only checkpoint and final/), then its directory copied
    without final/ and resumed at max_steps: the adapter saved from the checkpoint is the one the run ended with."""
    out, lora = tmp_path / "run", tmp_path / "lora"
    lora_run = [*SMOKE, "distributed=zero2", "model.lora.enabled=true", "model.lora.merge_on_save=false",
                "trainer.max_steps=1", "trainer.save_every=1", "data.num_eval=0"]
    p = worker("cli", tmp_path / "update", *SMOKE, "distributed=zero2", f"trainer.output_dir={out}",
               "trainer.save_every=1", f"engine.max_tokens_per_micro_batch={BUDGET}",
               THEN, "update", tmp_path / "beyond", "distributed=zero2", *BEYOND,
               THEN, "update", tmp_path / "rank1-empty", "distributed=zero2", *RANK1_EMPTY,
               THEN, "train", lora, *lora_run, f"trainer.output_dir={lora}",
               THEN, "resume", lora, *lora_run, f"trainer.output_dir={lora}-resumed", "trainer.resume=auto",
               cwd=tmp_path)
    _check_updates(tmp_path / "update", default_reference)
    _check_run(out, 2)
    ckpt = out / "checkpoints" / "step_2"
    assert (ckpt / "COMPLETE").exists() and (ckpt / "deepspeed").is_dir()
    assert (ckpt / "rank_0.json").exists() and (ckpt / "rank_1.json").exists()
    for name, extra in (("beyond", BEYOND), ("rank1-empty", RANK1_EMPTY)):
        ref = one_process(tmp_path / f"one-{name}", *extra)
        _check_updates(tmp_path / name, ref, rank1_groups=name != "rank1-empty")
        assert ref["stats"][1]["ratio_mean"] != pytest.approx(1.0, abs=1e-4)  # mu = 2: the second pass is off-policy
    # ZeRO-2 with LoRA: the checkpoint holds the adapter alone; the resumed run loaded it back from disk
    from safetensors.torch import load_file

    states = torch.load(lora / "checkpoints" / "step_1" / "deepspeed" / "mp_rank_00_model_states.pt",
                        weights_only=False)
    assert states["module"] and all("lora_" in n for n in states["module"])
    trained = load_file(str(lora / "final" / "adapter_model.safetensors"))
    assert any(t.abs().max() > 0 for n, t in trained.items() if "lora_B" in n)  # B starts at zero: it moved
    assert "saving it from the last checkpoint" in p.stderr
    resumed = load_file(str(tmp_path / "lora-resumed" / "final" / "adapter_model.safetensors"))
    assert resumed.keys() == trained.keys() and all(torch.equal(resumed[n], trained[n]) for n in trained)


@pytest.mark.slow
def test_zero3_two_processes_then_resume(tmp_path, default_reference):
    """ZeRO-3, one launch of four phases: the fixed batch; the real command line (2 steps, held-out evaluation);
    the fixed batch again with model.gradient_checkpointing=true and the shared-prefix engine (ragged prompts and
    completions, G=4): every layer is recomputed in backward, and the gradients and updates equal one process's
    without checkpointing; last, the run's directory resumed (a copy, as a run stopped after its step-2
    checkpoint leaves it) for a third step, generating layer by layer this time."""
    out, resumed = tmp_path / "run", tmp_path / "resumed"
    common = [*SMOKE, *ZERO3, "trainer.save_every=1", "data.num_eval=5", f"engine.max_tokens_per_micro_batch={BUDGET}"]
    p = worker("cli", tmp_path / "update", *common, f"trainer.output_dir={out}", "trainer.eval_every=1",
               THEN, "update", tmp_path / "checkpointed", *ZERO3, "model.gradient_checkpointing=true",
               THEN, "resume", out, *common, f"trainer.output_dir={resumed}", "trainer.max_steps=3",
               "trainer.resume=auto", "distributed.gather_for_generation=false", cwd=tmp_path)
    _check_updates(tmp_path / "update", default_reference)
    _check_run(out, 2)
    assert "held-out accuracy (step 1, 5 prompts" in p.stderr   # 5 held-out prompts on 2 ranks: 3 + 2 (padded)
    # resumed from the ZeRO-3 checkpoint (every rank loads its partition)
    assert f"resumed from {resumed}/checkpoints/step_2 (step 2)" in p.stderr
    _check_run(resumed, 3)
    # gradient checkpointing: the forward, then the recompute in backward; the reference does not checkpoint
    _check_updates(tmp_path / "checkpointed", default_reference)
    ranks = [torch.load(tmp_path / "checkpointed" / f"update_rank{r}.pt", weights_only=False) for r in (0, 1)]
    forwards = max(r["micro_batches"] for r in ranks)  # every rank runs as many (rank 1's extra ones are idle)
    assert [r["layer_calls"] for r in ranks] == [2 * forwards] * 2
    assert default_reference["layer_calls"] == default_reference["micro_batches"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
def test_accelerate_launch_runs_zero2_on_cpu(tmp_path):
    """`accelerate launch --multi_gpu` is torchrun underneath (gloo without GPUs); `--cpu` would start one
    process without RANK. No accelerate config file is read (HF_HOME is empty)."""
    out = tmp_path / "run"
    env = {**_env(), "HF_HOME": str(tmp_path / "hf")}
    p = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                        "--main_process_port", str(_free_port()), str(Path(__file__)), "train", str(tmp_path), *SMOKE,
                        "distributed=zero2", "data.num_eval=0", f"trainer.output_dir={out}"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    _check_run(out, 2)


def test_impossible_settings_fail_at_start_on_every_rank(tmp_path):
    p = torchrun("-m", "grpo.train", *SMOKE, "distributed=zero2", f"trainer.output_dir={tmp_path / 'run'}",
                 "rollout.prompts_per_step=3", cwd=tmp_path, timeout=120)
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    # each rank stops with the one line; torchrun may SIGTERM the slower rank before it prints its own
    assert 1 <= len(errors) <= 2, p.stderr[-3000:]
    assert all("rollout.prompts_per_step=3 must be divisible" in e for e in errors), p.stderr[-3000:]
    assert not re.search(r'grpo/[a-z_]+\.py"', p.stderr), p.stderr[-3000:]  # no traceback through our code
    # without a launcher there is no world to join: one line, exit 2
    p = subprocess.run([sys.executable, "-m", "grpo.train", *SMOKE, "distributed=zero3",
                        f"trainer.output_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=tmp_path,
                       env=_env(), timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: distributed.backend=deepspeed needs a launcher")


def test_config_rejects_settings_deepspeed_cannot_run(cfg_factory):
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError, match="offload_params=true needs distributed.zero_stage=3"):
        cfg_factory({"distributed": {"backend": "deepspeed", "zero_stage": 2, "offload_params": True}})
    with pytest.raises(ConfigError, match="zero_stage=3 needs distributed.backend=deepspeed"):
        cfg_factory({"distributed": {"zero_stage": 3}})
    with pytest.raises(ConfigError, match="float16 is not supported"):
        cfg_factory({"distributed": {"backend": "deepspeed", "zero_stage": 2}, "model": {"dtype": "float16"}})


def test_deepspeed_config_is_derived_from_the_recipe(cfg_factory):
    from grpo.errors import SetupError
    from grpo.runtime.base import RunShape
    from grpo.runtime.deepspeed_config import check, ds_config

    cfg = cfg_factory({"distributed": {"backend": "deepspeed", "zero_stage": 3, "bf16": True,
                                       "ds_config": {"zero_optimization": {"reduce_bucket_size": 1000}}},
                       "rollout": {"prompts_per_step": 4}, "trainer": {"max_grad_norm": 0.5}})
    shape = RunShape(cfg.rollout.prompts_per_step, cfg.algorithm.group_size, cfg.trainer.max_grad_norm, cfg.model.dtype)
    d = ds_config(cfg.distributed, shape, 2)
    assert d["train_micro_batch_size_per_gpu"] == 2 * cfg.algorithm.group_size and d["gradient_accumulation_steps"] == 1
    assert d["gradient_clipping"] == 0.5 and d["bf16"]["enabled"] and d["zero_optimization"]["stage"] == 3
    assert d["zero_optimization"]["reduce_bucket_size"] == 1000
    # the reference is partitioned
    assert ds_config(cfg.distributed, shape, 2, train=False)["zero_optimization"]["stage"] == 3
    with pytest.raises(SetupError, match="divisible"):
        check(cfg.distributed, shape, 3)
    cfg.model.lora.enabled = True
    check(cfg.distributed, shape, 2)  # ZeRO-3 with LoRA runs (tests/e2e/test_zero3_lora.py)
    cfg.model.lora.enabled = False
    cfg.distributed.ds_config = {"zero_optimization": {"stage": 2}}
    with pytest.raises(SetupError, match="zero_optimization.stage is derived"):
        check(cfg.distributed, shape, 2)
