#!/usr/bin/env python
"""The whole GRPO step, this framework vs TRL's GRPOTrainer, on the same job, side by side.

    make bench-env                                        # .venv-bench: pinned torch, this package, pinned TRL
    .venv-bench/bin/python scripts/bench_trl.py           # full comparison (tiny Llama + SmolLM2, two shapes)
    python scripts/bench_trl.py --quick --systems ours    # seconds; no TRL needed (what the tests run)
    python scripts/bench_trl.py --dry-run                 # print the plan, run nothing

Systems: ``ours`` (shared prefix on: engine.shared_prefix and rollout.share_prompt), ``ours-noshare`` (both
off) and ``trl`` (GRPOTrainer). Each run is a fresh worker process; runs are interleaved
(ours, ours-noshare, trl, ours, ...) for --repeats rounds. Every run does one warm-up step (excluded) and
--steps measured steps. One step = rollout (P-token prompts, G samples each, exactly S new tokens:
min_new_tokens = max_new_tokens = S in both), a seeded random reward, group advantages, reference log-probs
(beta 0.04), one forward/backward and one optimizer step. Reported: median seconds per step over all
measured steps of all repeats, completion tokens per second, peak RSS of the worker (ru_maxrss) and, with
--peak-tflops (GPU), model FLOPs utilisation of the training forward/backward.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from bench_prefix import SMOLLM2_SHAPE, TINY_LLAMA  # noqa: E402  (the same model shapes in both benchmarks)

QUICK_LLAMA = dict(TINY_LLAMA, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6,
              rms_norm_eps=1e-6)
MODELS = {"tiny": ("llama", TINY_LLAMA), "quick": ("llama", QUICK_LLAMA), "qwen05": ("qwen2", QWEN05),
          "smollm2-shape": ("llama", SMOLLM2_SHAPE), "smollm2": None}
DEFAULT_SHAPES = "64x64x8,1024x32x8"
SYSTEMS = ("ours", "ours-noshare", "trl")  # the default comparison
# ours with rollout.backend=vllm (an in-process vLLM engine samples; needs vLLM in the workers' environment)
EXTRA_SYSTEMS = ("ours-vllm",)


# ------------------------------------------------------------------------------------------------ reward
_RNG = random.Random(0)


def bench_reward(prompts, completions, **kwargs):
    """Seeded random reward (TRL's batch signature): non-zero advantages, no dependence on the text."""
    return [_RNG.random() for _ in completions]


# ------------------------------------------------------------------------------------------------ setup
def prepare_model(name: str, workdir: Path, tokenizer: str | None = None) -> str:
    """A local HF directory for ``name``: SmolLM2 (embedded) or a random-init model with ``tokenizer`` (default:
    the embedded SmolLM2's)."""
    if MODELS[name] is None or tokenizer is None:
        from grpo.models import prepare_embedded

        smol = prepare_embedded()
        if MODELS[name] is None:
            return str(smol)
        tokenizer = str(smol)
    out = workdir / name
    if (out / "config.json").exists():
        return str(out)
    import torch
    import transformers

    family, cfg = MODELS[name]
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    conf_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    config = conf_cls(**cfg, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def make_prompts(model_dir: str, P: int, n: int, seed: int = 0) -> list[dict]:
    """``n`` prompt texts that tokenize to exactly ``P`` tokens (space-prefixed whole-word tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    words = sorted(t for t in tok.get_vocab() if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower()
                   and 3 <= len(t) <= 9)
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        pick = [rng.choice(words) for _ in range(P)]
        text = "".join(w.replace("Ġ", " ") for w in pick)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) == P:
            out.append({"text": text, "ids": ids})
    return out


# ------------------------------------------------------------------------------------------------ FLOPs
def train_flops(cfg: dict, P: int, S: int, G: int, n: int) -> float:
    """Model FLOPs of the training forward+backward of one step in the standard layout (6 * params * tokens,
    lm_head at the completion positions, causal attention), the nominal work both frameworks do."""
    h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, Hkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    D = cfg.get("head_dim") or h // H
    lin = 2 * h * H * D + 2 * h * Hkv * D + 3 * h * inter
    T = P + S
    per_seq = 6 * L * lin * T + 6 * h * V * S + 3 * 2 * 2 * L * H * D * T * T / 2
    return per_seq * G * n


# ------------------------------------------------------------------------------------------------ workers
def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker_ours(spec: dict) -> dict:
    import torch

    from grpo import experience
    from grpo.config.schema import load
    from grpo.data import PromptSampler
    from grpo.trainer.build import build_run
    from grpo.update import policy_update

    P, S, G, n = spec["P"], spec["S"], spec["G"], spec["prompts_per_step"]
    shared = spec["system"] in ("ours", "ours-vllm")
    backend = "vllm" if spec["system"] == "ours-vllm" else "hf"
    cfg = load({
        "model": {"name_or_path": spec["model_dir"], "dtype": spec["dtype"]},
        "data": {"source": "builtin:arithmetic", "num_train": 4, "num_eval": 0, "chat_template": False},
        # the key "accuracy" replaces the default reward of that name (dicts merge onto the defaults)
        "reward": {"functions": {"accuracy": {"fn": "bench_trl:bench_reward", "weight": 1.0}}},
        "rollout": {"prompts_per_step": n, "max_new_tokens": S, "batch_size": n, "share_prompt": shared,
                    "temperature": 1.0, "backend": backend},
        "algorithm": {"group_size": G, "beta": 0.04, "num_iterations": 1},
        # one group per micro-batch in both layouts: `auto` would be planned from the short built-in prompts that
        # the bench's P-token prompts replace after the build
        "engine": {"shared_prefix": shared, "max_tokens_per_micro_batch": max(4096, G * (P + S))},
        "trainer": {"max_steps": spec["steps"] + 1, "lr": 1e-6, "output_dir": spec["out"], "seed": 0,
                    "device": spec["device"]},
        "logging": {"plot": False, "sample_every": 0},
    })
    run = build_run(cfg)
    assert [rf.fn.__name__ for rf in run.sampler.rewards] == ["bench_reward"], run.sampler.reward_names
    run.splits.train = [{"prompt": p["text"], "prompt_ids": p["ids"], "answer": ""} for p in spec["prompts"]]
    run.sampler.rows = run.splits.train  # the sampler draws its prompts from these rows
    run.sampler.prompts = PromptSampler(len(run.splits.train), seed=0)

    def collect(run):
        return experience.collect(run.sampler, run.runtime, run.settings.collect, run)
    import functools

    import grpo.rollout.hf
    from grpo.rollout.backends import HFBackend

    # exactly S new tokens, as in the TRL run (generation_kwargs min_new_tokens)
    if backend == "vllm":
        _vllm_exact_length(S)
    else:  # the run's hf backend, its decode loop told to sample exactly S tokens
        exact = functools.partial(grpo.rollout.hf.generate, min_new_tokens=S)
        run.sampler.backend.backend = HFBackend(lambda: run.runtime.model, run.tokenizer, batch_size=n,
                                                share_prompt=shared, context=run.runtime.generation_context,
                                                generate_fn=exact)
    settings = dataclasses.replace(run.settings.update, mask_truncated=False)
    times, cpu, upd, lens, roll = [], [], [], [], []
    for step in range(spec["steps"] + 1):
        _sync(spec["device"])
        t0, c0 = time.perf_counter(), time.process_time()
        batch = collect(run)
        _sync(spec["device"])
        t1 = time.perf_counter()
        policy_update(run.runtime, batch, settings)
        _sync(spec["device"])
        t2 = time.perf_counter()
        times.append(t2 - t0)
        cpu.append(time.process_time() - c0)
        _progress(step, times[-1], cpu[-1])
        upd.append(t2 - t1)
        lens.append(sum(len(c) for g in batch.completion_ids for c in g))
        roll.append(batch.stats["time/rollout_s"])
        if lens[-1] != n * G * S:
            raise RuntimeError(f"completions are not all exactly S={S} tokens ({lens[-1]} != {n * G * S})")
    if spec.get("profile"):
        _profile(lambda: policy_update(run.runtime, collect(run),
                                       dataclasses.replace(settings, temperature=1.0, max_len=S, max_grad_norm=1.0)),
                 spec["profile"])
    return {"step_s": times[1:], "cpu_step_s": cpu[1:], "update_s": upd[1:], "rollout_s": roll[1:],
            "completion_tokens": lens[1:], "prompt_len": P,
            "peak_rss_mib": _peak_rss_mib(), **_gpu_mem(spec["device"]), "torch_threads": torch.get_num_threads()}


def _vllm_exact_length(S: int) -> None:
    """The vLLM backend's sampling parameters with min_tokens = S (as min_new_tokens for our decode loop)."""
    from vllm import SamplingParams

    from grpo.rollout.vllm import VLLMBackend

    original = VLLMBackend.sampling_params

    def exact(self, sampling, group_size, seed):
        p = original(self, sampling, group_size, seed)
        keep = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "logprobs", "seed")
        return SamplingParams(**{k: getattr(p, k) for k in keep}, min_tokens=S, detokenize=False)

    VLLMBackend.sampling_params = exact


def _timed(fn, sink: list, device):
    """Wrap ``fn`` so each call's wall time (device synchronised before and after) lands in ``sink``."""
    def wrapper(*a, **k):
        _sync(device)
        t0 = time.perf_counter()
        out = fn(*a, **k)
        _sync(device)
        sink.append(time.perf_counter() - t0)
        return out
    return wrapper


def worker_trl(spec: dict) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    P, S, G, n = spec["P"], spec["S"], spec["G"], spec["prompts_per_step"]
    dtype = getattr(torch, spec["dtype"])
    tok = transformers.AutoTokenizer.from_pretrained(spec["model_dir"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype,
                                                              attn_implementation="sdpa")
    texts = [p["text"] for p in spec["prompts"]]
    assert all(len(tok(t, add_special_tokens=False)["input_ids"]) == P for t in texts)
    args = GRPOConfig(
        output_dir=spec["out"], per_device_train_batch_size=n * G, gradient_accumulation_steps=1,
        num_generations=G, max_completion_length=S, generation_kwargs={"min_new_tokens": S},
        temperature=1.0, beta=0.04, num_iterations=1, loss_type="grpo", learning_rate=1e-6,
        max_steps=spec["steps"] + 1, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        use_cpu=spec["device"] == "cpu", bf16=spec["dtype"] == "bfloat16", fp16=False,
        gradient_checkpointing=False,  # TRL defaults to True; ours does not checkpoint by default
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
    )
    times, cpu, gen = [], [], []
    lens = []

    class Timer(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            _sync(spec["device"])
            times.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_step_end(self, *a, **k):
            _sync(spec["device"])
            times.append(time.perf_counter())
            cpu.append(time.process_time())
            _progress(len(times) - 2, times[-1] - times[-2], cpu[-1] - cpu[-2])

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lens.append(logs["completions/mean_length"] * n * G)

    trainer = GRPOTrainer(model=model, reward_funcs=bench_reward, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": texts}), callbacks=[Timer()])
    # rollout + reward + reference log-probs (the rest of the step is the update), and the rollout alone
    trainer._generate_and_score_completions = _timed(trainer._generate_and_score_completions, gen, spec["device"])
    roll: list[float] = []
    trainer._generate = _timed(trainer._generate, roll, spec["device"])
    trainer.train()
    steps = [b - a for a, b in zip(times, times[1:])]
    upd = [s - g for s, g in zip(steps, gen)]
    return {"step_s": steps[1:], "cpu_step_s": [b - a for a, b in zip(cpu[1:], cpu[2:])],
            "update_s": upd[1:], "rollout_s": roll[1:],
            "completion_tokens": [round(x) for x in lens[1:]],
            "prompt_len": P, "peak_rss_mib": _peak_rss_mib(), **_gpu_mem(spec["device"]),
            "trl": trl.__version__, "torch_threads": torch.get_num_threads()}


def _progress(step: int, wall: float, cpu: float) -> None:
    """One line per finished step on stderr (step 0 is the warm-up), so a worker stopped by --timeout still says
    how long its steps took. CPU seconds of the process: with --threads 1 they are the step's cost even when
    other work shares the machine (wall seconds then are not)."""
    print(f"[worker] step {step}{' (warm-up)' if step == 0 else ''}: {wall:.1f} s wall, {cpu:.1f} s CPU",
          file=sys.stderr, flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _gpu_mem(device: str) -> dict:
    if not device.startswith("cuda"):
        return {}
    import torch

    return {"peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20}


def _profile(fn, path: str) -> None:
    """One whole step under torch.profiler; the operator table (CPU time) goes to ``path``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        with record_function("grpo_step"):
            fn()
    Path(path).write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))


# ------------------------------------------------------------------------------------------------ driver
def run_worker(python: str, spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        spec = dict(spec, out=str(Path(tmp) / "out"))
        spec_path, res_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        threads = {"OMP_NUM_THREADS": str(spec["threads"])} if spec.get("threads") else {}
        env = dict(os.environ, **threads, TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=f"{ROOT}:{HERE}",
                   TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
        cmd = [python, str(Path(__file__).resolve()), "--worker", str(spec_path), "--result", str(res_path)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:  # say how far it got (the worker's per-step lines)
            done = [line for line in _text(e.stderr).splitlines() if line.startswith("[worker] step")]
            raise RuntimeError(f"{spec['system']} worker stopped after the {timeout:.0f} s --timeout; steps finished: "
                               f"{'; '.join(done) or 'none'}") from None
        if p.returncode != 0 or not res_path.exists():
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-25:])
            raise RuntimeError(f"{spec['system']} worker failed (exit {p.returncode}):\n{tail}")
        return json.loads(res_path.read_text())


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def parse_shapes(s: str) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in part.split("x")) for part in s.split(",") if part]


def summarise(results: dict, key, flops: float | None, peak_tflops: float | None) -> dict:
    runs = results[key]
    steps = [t for r in runs for t in r["step_s"]]
    upd = [t for r in runs for t in r["update_s"]]
    toks = [t for r in runs for t in r["completion_tokens"]]
    s = statistics.median(steps)
    out = {"step_s": s, "tok_s": statistics.median(toks) / s, "rss_mib": max(r["peak_rss_mib"] for r in runs),
           "update_s": statistics.median(upd),
           "rollout_s": statistics.median([t for r in runs for t in r["rollout_s"]]),
           "tokens_per_step": statistics.median(toks),
           "steps": len(steps), "min_step_s": min(steps), "max_step_s": max(steps),
           "cpu_step_s": statistics.median([t for r in runs for t in r["cpu_step_s"]])}
    if any("peak_gpu_mib" in r for r in runs):
        out["gpu_mib"] = max(r.get("peak_gpu_mib", 0) for r in runs)
    if flops and peak_tflops:
        out["mfu"] = flops / (out["update_s"] * peak_tflops * 1e12)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run (plus one warm-up step)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds (one process per system per round)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="PxSxG,... prompt tokens x new tokens x group size")
    ap.add_argument("--models", default="tiny,smollm2", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory for the random-init models (default: the "
                    "embedded SmolLM2's, prepared on demand)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of ours, ours-noshare, trl, ours-vllm "
                    "(rollout.backend=vllm)")
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (0 = torch's default); 1 keeps "
                                                          "timings sane on a CPU shared with other jobs")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak (e.g. 989 for H200 bf16) for MFU")
    ap.add_argument("--python", default=None, help="interpreter for the workers (default: .venv-bench if present, "
                                                   "else this one)")
    ap.add_argument("--profile", default=None,
                    help="also write torch.profiler tables of one 'ours' step to PREFIX.<model>.<shape>.txt")
    ap.add_argument("--json", default=None, help="write all raw results here")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    ap.add_argument("--quick", action="store_true", help="a tiny model, one small shape, 1 step, 1 repeat")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        spec = json.loads(Path(a.worker).read_text())
        if spec.get("threads"):
            import torch

            torch.set_num_threads(spec["threads"])
        res = (worker_trl if spec["system"] == "trl" else worker_ours)(spec)
        Path(a.result).write_text(json.dumps(res))
        return 0

    if a.quick:
        a.models, a.shapes, a.steps, a.repeats = "quick", "16x8x4", 1, 1
    models = [m for m in a.models.split(",") if m]
    systems = [s for s in a.systems.split(",") if s]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for s in systems:
        if s not in SYSTEMS + EXTRA_SYSTEMS:
            ap.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS + EXTRA_SYSTEMS)}")
    shapes = parse_shapes(a.shapes)
    bench_py = ROOT / ".venv-bench" / "bin" / "python"
    python = a.python or (str(bench_py) if bench_py.exists() else sys.executable)
    plan = [(m, shape, r, s) for m in models for shape in shapes for r in range(a.repeats) for s in systems]
    print(f"# plan: {len(plan)} worker runs, {a.steps} measured steps each (+1 warm-up), "
          f"{a.prompts_per_step} prompts/step, device {a.device}, {a.dtype}, workers: {python}", flush=True)
    if a.dry_run:
        for m, (P, S, G), r, s in plan:
            print(f"  {m:8s} P={P:<5d} S={S:<4d} G={G:<3d} repeat {r}  {s}")
        return 0

    _warn_if_busy()
    workdir = Path(tempfile.mkdtemp(prefix="bench-models-"))
    raw: dict = {}
    table = []
    trl_version = None
    try:
        _run_all(a, models, shapes, systems, python, workdir, raw, table)
    except KeyboardInterrupt:  # e.g. bench_gpu.sh's time limit: report what finished
        print("# interrupted: the table holds the shapes that finished", flush=True)
    trl_version = next((r.get("trl") for v in raw.values() for rs in v["runs"].values() for r in rs if r.get("trl")),
                       None)
    print_table(table, trl_version, a)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "trl": trl_version, "results": raw}, indent=1))
    return 0


def _warn_if_busy() -> None:
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"# warning: load average {load:.1f} before starting; other work on this machine skews the timings",
              flush=True)


def _run_all(a, models, shapes, systems, python, workdir, raw, table) -> None:
    for m in models:
        model_dir = prepare_model(m, workdir, a.tokenizer)
        cfg = MODELS[m][1] if MODELS[m] else json.loads((Path(model_dir) / "config.json").read_text())
        for P, S, G in shapes:
            prompts = make_prompts(model_dir, P, a.prompts_per_step * (a.steps + 1) * 2)
            base = dict(model_dir=model_dir, P=P, S=S, G=G, prompts_per_step=a.prompts_per_step, steps=a.steps,
                        prompts=prompts, device=a.device, dtype=a.dtype, threads=a.threads)
            results = {s: [] for s in systems}
            for r in range(a.repeats):
                for s in systems:
                    prof = f"{a.profile}.{m}.{P}x{S}x{G}.txt" if (a.profile and s == "ours" and r == 0) else None
                    t0 = time.time()
                    try:
                        res = run_worker(python, dict(base, system=s, profile=prof), a.timeout)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:  # report it, go on with the others
                        print(f"  {m} P={P} S={S} G={G} {s}: FAILED: {e}", flush=True)
                        continue
                    results[s].append(res)
                    print(f"  {m} P={P} S={S} G={G} {s:13s} round {r}: steps {[round(x, 2) for x in res['step_s']]} s"
                          f" (CPU {[round(x, 2) for x in res['cpu_step_s']]} s)"
                          f"  ({time.time() - t0:.0f} s wall)", flush=True)
            flops = train_flops(cfg, P, S, G, a.prompts_per_step)
            summ = {s: summarise(results, s, flops, a.peak_tflops) for s in systems if results[s]}
            raw[f"{m}/{P}x{S}x{G}"] = {"runs": results, "summary": summ}
            table.append((m, (P, S, G), summ))


def print_table(table, trl_version, a) -> None:
    print(f"\n## Whole GRPO step ({a.device}, {a.dtype}, {a.threads or 'default'} threads, "
          f"{a.prompts_per_step} prompts/step, beta 0.04, "
          f"median of {a.steps} steps x {a.repeats} runs; TRL {trl_version or 'not run'})\n")
    mfu = a.peak_tflops is not None
    head = "| model | P | S | G | system | s/step | completion tok/s | peak RSS MiB |"
    head += " peak GPU MiB | MFU (train fwd/bwd) |" if mfu else ""
    head += " rollout s | update s | speed vs TRL | memory vs TRL |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for m, (P, S, G), summ in table:
        ref = summ.get("trl")
        for s, v in summ.items():
            row = f"| {m} | {P} | {S} | {G} | {s} | {v['step_s']:.2f} | {v['tok_s']:.0f} | {v['rss_mib']:.0f} |"
            if mfu:
                row += f" {v.get('gpu_mib', 0):.0f} | {100 * v.get('mfu', 0):.1f}% |"
            row += f" {v['rollout_s']:.2f} | {v['update_s']:.2f} |"
            if ref and s != "trl":
                row += f" {ref['step_s'] / v['step_s']:.2f}x | {v['rss_mib'] / ref['rss_mib']:.2f} |"
            else:
                row += " 1.00x | 1.00 |" if ref else " - | - |"
            print(row)
    print()


if __name__ == "__main__":
    sys.exit(main())
