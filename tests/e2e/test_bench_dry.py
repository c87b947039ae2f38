"""scripts/bench_trl.py (make bench) without TRL: the plan, and one quick run of this framework's whole step;
scripts/bench_gpu.sh's plans (dry runs)."""
import json
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "bench_trl.py"
PLAN_LINE = re.compile(r"^  (\S+)\s+P=(\d+)\s+S=(\d+)\s+G=(\d+)\s+repeat (\d+)\s+(\S+)$")


def _plan(stdout: str) -> tuple[str, list[tuple]]:
    """(header line, [(model, P, S, G, repeat, system)]) of a bench_trl.py --dry-run."""
    header = next(ln for ln in stdout.splitlines() if ln.startswith("# plan:"))
    rows = [PLAN_LINE.match(ln) for ln in stdout.splitlines() if ln.startswith("  ")]
    assert all(rows), stdout
    return header, [(m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5]), m[6]) for m in rows]


def test_bench_dry_run_plans_interleaved_runs():
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--repeats", "2"], capture_output=True, text=True,
                       check=True)
    header, rows = _plan(p.stdout)
    assert header.startswith("# plan: 24 worker runs, 3 measured steps each (+1 warm-up), 2 prompts/step, device cpu")
    assert len(rows) == 2 * 2 * 2 * 3  # models x shapes x repeats x systems
    assert [r[-1] for r in rows[:6]] == ["ours", "ours-noshare", "trl"] * 2  # interleaved A B C A B C
    assert [r[4] for r in rows[:6]] == [0, 0, 0, 1, 1, 1]
    assert {r[1:4] for r in rows} == {(64, 64, 8), (1024, 32, 8)} and {r[0] for r in rows} == {"tiny", "smollm2"}


def _gpu_dry(*args, **env):
    return subprocess.run(["bash", str(ROOT / "scripts" / "bench_gpu.sh"), "--dry-run", *args], capture_output=True,
                          text=True, check=True, env={"PATH": "/usr/bin:/bin", "BENCH_PY": sys.executable, **env})


def test_bench_gpu_script_dry_run():
    header, rows = _plan(_gpu_dry().stdout)
    assert header.startswith("# plan: 12 worker runs, 2 measured steps each (+1 warm-up), 8 prompts/step, "
                             "device cuda, bfloat16")
    assert {r[0] for r in rows} == {"smollm2", "qwen05"} and {r[1:4] for r in rows} == {(64, 64, 8), (1024, 32, 8)}
    assert [r[-1] for r in rows] == ["ours", "ours-noshare", "trl"] * 4 and {r[4] for r in rows} == {0}
    # the environment knobs reach the plan
    header, rows = _plan(_gpu_dry(STEPS="3", PROMPTS="4", MODELS="smollm2-shape").stdout)
    assert header.startswith("# plan: 6 worker runs, 3 measured steps each (+1 warm-up), 4 prompts/step")
    assert {r[0] for r in rows} == {"smollm2-shape"}


def test_bench_gpu_prefix_dry_run_runs_valid_bench_prefix_commands():
    lines = _gpu_dry("prefix", "--no-smollm2").stdout.splitlines()
    assert len(lines) == 2
    helptext = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_prefix.py"), "--help"],
                              capture_output=True, text=True, check=True).stdout
    kernels = []
    for ln in lines:
        words = ln.split()
        assert words[:3] == ["timeout", "110", sys.executable] and words[3] == "scripts/bench_prefix.py"
        assert words[-1] == "--no-smollm2"  # extra arguments pass through
        opts = dict(zip(words[4:-1:2], words[5:-1:2]))
        assert all(o in helptext for o in opts)  # options bench_prefix.py knows
        assert opts["--device"] == "cuda" and opts["--dtype"] == "bfloat16" and opts["--repeats"] == "5"
        kernels.append(opts["--kernel"])
    assert kernels == ["flex", "grouped"]


@pytest.mark.slow
def test_bench_quick_ours_whole_step(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_trl import QUICK_LLAMA, train_flops

    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--systems", "ours,ours-noshare", "--python",
                        sys.executable, "--peak-tflops", "1", "--json", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())["results"]["quick/16x8x4"]
    flops = train_flops(QUICK_LLAMA, 16, 8, 4, 2)
    for system in ("ours", "ours-noshare"):
        (run,) = res["runs"][system]
        assert run["completion_tokens"] == [2 * 4 * 8]  # 2 prompts x G=4, exactly S=8 tokens each
        assert len(run["step_s"]) == len(run["update_s"]) == 1 and 0 < run["update_s"][0] < run["step_s"][0]
        assert len(run["cpu_step_s"]) == 1 and run["cpu_step_s"][0] > 0  # one thread: about the wall time
        assert res["summary"][system]["cpu_step_s"] == run["cpu_step_s"][0]
        summary = res["summary"][system]
        assert summary["tok_s"] == pytest.approx(64 / run["step_s"][0])
        assert summary["mfu"] == pytest.approx(flops / (run["update_s"][0] * 1e12))  # --peak-tflops 1
        assert run["peak_rss_mib"] > 100  # a worker that imported torch and built a model
    assert "| quick | 16 | 8 | 4 | ours |" in p.stdout
    assert "[worker]" not in p.stdout and "(CPU [" in p.stdout  # the per-round line carries CPU seconds


def test_bench_gpu_rollout_dry_run_plans_both_parts():
    """scripts/bench_gpu.sh rollout: bench_rollout.py (hf vs vLLM tokens/s at the Qwen2.5-0.5B shape, G=16, P=512,
    S=512) and bench_trl.py's whole step with rollout.backend=hf and vllm, both under their timeouts (< 8 min)."""
    out = _gpu_dry("rollout").stdout
    first = out.splitlines()[0].split()
    assert first[:4] == ["timeout", "230", sys.executable, "scripts/bench_rollout.py"]
    words = first[4:]
    opts = {w: (words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else True)
            for i, w in enumerate(words) if w.startswith("--")}
    assert {k: opts[k] for k in ("--device", "--dtype", "--model", "--prompt-len", "--group", "--new", "--backends")} \
        == {"--device": "cuda", "--dtype": "bfloat16", "--model": "qwen05-shape", "--prompt-len": "512",
            "--group": "16", "--new": "512", "--backends": "hf,vllm"}
    helptext = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_rollout.py"), "--help"],
                              capture_output=True, text=True, check=True).stdout
    assert all(o in helptext for o in opts) and opts["--vllm-graphs"] is True
    header, rows = _plan(out)
    assert header.startswith("# plan: 2 worker runs, 1 measured steps each (+1 warm-up), 8 prompts/step, device cuda")
    assert rows == [("qwen05", 512, 512, 16, 0, "ours"), ("qwen05", 512, 512, 16, 0, "ours-vllm")]


def test_bench_rollout_measures_our_decode_loop(tmp_path):
    """bench_rollout.py on a small random Llama (``--model quick-shape``; the benchmarks use ``smollm2-shape`` and
    ``qwen05-shape``, the same code path), a few tokens: the hf record (exactly the tokens asked),
    and a vLLM record that says why it was skipped where vLLM does not import."""
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_rollout.py"), "--model", "quick-shape",
                        "--prompt-len", "8", "--prompts", "2", "--group", "2", "--new", "3", "--repeats", "1",
                        "--threads", "1", "--backends", "hf" if _vllm_imports() else "hf,vllm", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    records = json.loads(out.read_text())
    hf = records[0]
    assert hf["backend"] == "hf" and hf["tokens"] == 2 * 2 * 3 and hf["prompt_len"] == 8
    assert hf["tokens_per_s"] == pytest.approx(hf["tokens"] / hf["median_s"], rel=0.05)
    if not _vllm_imports():
        assert records[1]["backend"] == "vllm" and records[1]["skipped"].startswith("vllm does not import")


def _vllm_imports() -> bool:
    from tests.helpers import vllm_problem

    return vllm_problem() is None
def _dist_command(stdout: str) -> tuple[list[str], dict, list[str]]:
    """(launcher words, dist_smoke.py options, grpo.train overrides) of `bench_gpu.sh --dry-run dist`."""
    (line,) = stdout.splitlines()
    words = line.split()
    at = words.index("scripts/dist_smoke.py")
    rest = words[at + 1:]
    opts = dict(zip(rest[0:6:2], rest[1:6:2]))
    return words[:at], opts, rest[6:]


def test_bench_gpu_dist_dry_run_is_a_valid_one_gpu_zero3_bf16_run():
    from omegaconf import OmegaConf

    from grpo.config.schema import load
    from tests.helpers import compose_recipe

    launcher, opts, overrides = _dist_command(_gpu_dry("dist", "trainer.seed=7").stdout)
    assert launcher == ["timeout", "230", sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "1"]                      # one process: world size 1
    assert opts == {"--expect-backend": "nccl", "--expect-dtype": "bfloat16", "--json": "bench_dist.json"}
    assert overrides[-1] == "trainer.seed=7"                          # extra overrides pass through
    helptext = subprocess.run([sys.executable, str(ROOT / "scripts" / "dist_smoke.py"), "--help"],
                              capture_output=True, text=True, check=True).stdout
    assert all(o in helptext for o in opts)
    # the overrides compose into a valid config: ZeRO-3, bf16, on the GPU, 2 steps with checkpoints
    recipe = next(o.split("=", 1)[1] for o in overrides if o.startswith("recipe="))
    cfg = load(OmegaConf.to_container(compose_recipe(recipe, [o for o in overrides if not o.startswith("recipe=")]),
                                      resolve=True))
    assert (cfg.distributed.backend, cfg.distributed.zero_stage, cfg.distributed.bf16) == ("deepspeed", 3, True)
    assert (cfg.trainer.device, cfg.trainer.max_steps, cfg.trainer.save_every) == ("cuda", 2, 1)
    # DEVICE=cpu: the same run on the CPU, checked against gloo
    launcher, opts, overrides = _dist_command(_gpu_dry("dist", DEVICE="cpu").stdout)
    assert opts["--expect-backend"] == "gloo" and "trainer.device=cpu" in overrides


@pytest.mark.slow
def test_bench_gpu_dist_smoke_runs_on_cpu(tmp_path):
    """The dist smoke for real with DEVICE=cpu (gloo instead of NCCL): ZeRO-3 with bf16, 2 steps, every check of
    scripts/dist_smoke.py passes; a check that fails makes the script fail."""
    out = tmp_path / "dist.json"
    env = {"PATH": "/usr/bin:/bin", "BENCH_PY": sys.executable, "DEVICE": "cpu", "DIST_DIR": str(tmp_path / "run"),
           "OUT": str(out), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "bench_gpu.sh"), "dist"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"] and res["problems"] == []
    assert (res["backend"], res["dtype"], res["zero_stage"], res["world_size"]) == ("gloo", "bfloat16", 3, 1)
    assert res["partitioned"] and len(res["update_s"]) == 2
    # the checks are real: the same finished run, held to a dtype it does not have, fails them
    sys.path.insert(0, str(ROOT / "scripts"))
    from dist_smoke import check

    assert check(res, "gloo", "float32") == ["dtype is 'bfloat16', expected 'float32'",
                                             "final/ holds torch.bfloat16 weights, expected float32"]


def test_bench_multiturn_prefills_each_prompt_once_per_later_turn():
    """bench_multiturn.py on the tiny model (docs/benchmarks.md runs it on SmolLM2-135M): with the Echo environment
    every episode runs 3 turns; prefilling each prompt once per later turn (shared) prefills (P - 1) * (G - 1) fewer
    prompt tokens per group in each later turn than prefilling every episode's whole context (whole), and the
    trainer's path (kept: K/V kept across turns) only each episode's new tokens (here 4 sampled per turn, the last
    one kept, and the observation), far fewer again."""
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_multiturn.py"), "--model", "tiny", "--prompts",
                        "2", "--group", "3", "--new", "4", "--paths", "kept,shared,whole"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    kept, shared, whole = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert (kept["path"], shared["path"], whole["path"]) == ("kept", "shared", "whole")
    assert kept["turns_mean"] == shared["turns_mean"] == whole["turns_mean"] == 3.0
    assert kept["prefill_turn1_tokens"] == shared["prefill_turn1_tokens"]
    assert 0 < kept["prefill_later_tokens"] < shared["prefill_later_tokens"] / 4
    assert shared["prefill_turn1_tokens"] == whole["prefill_turn1_tokens"]
    P = shared["prompt_len_mean"]  # the multiplication prompts all have the same length
    assert whole["prefill_later_tokens"] - shared["prefill_later_tokens"] == 2 * 2 * (P - 1) * (3 - 1)
    assert shared["decode_later_s"] > 0 and shared["cpu_s"] > 0


def test_bench_gpu_async_dry_run_plans_both_cases_on_cuda():
    """scripts/bench_gpu.sh async: bench_async.py on the quickstart shape (inline, K=0/1/2) and with the slow reward,
    both on CUDA, under their timeouts (< 6 min in all)."""
    lines = _gpu_dry("async").stdout.splitlines()
    assert [ln.split()[:4] for ln in lines] == [["timeout", "200", sys.executable, "scripts/bench_async.py"],
                                                 ["timeout", "150", sys.executable, "scripts/bench_async.py"]]
    assert all("--override trainer.device=cuda" in ln for ln in lines)
    assert "--slow-reward 0.25 --variants inline,K=0,K=1" in lines[1]


def test_bench_async_quick_measures_every_variant(tmp_path):
    """bench_async.py --quick (the smoke recipe's tiny model; docs/benchmarks.md runs the quickstart shape): the
    inline loop and the generator process at K=1, each with its step time and idle fractions, and the slow reward
    only on the side that scores."""
    out = tmp_path / "async.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_async.py"), "--quick", "--variants",
                        "inline,K=1", "--slow-reward", "0.05", "--json", str(out)], capture_output=True, text=True,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == ["K=1", "inline"] and all(r["steps"] == 2 and r["step_s_median"] > 0 for r in rows.values())
    assert rows["inline"]["trainer_idle_frac"] == 0 and rows["inline"]["generator_idle_frac"] is None
    assert 0 <= rows["K=1"]["trainer_idle_frac"] < 1 and 0 <= rows["K=1"]["generator_idle_frac"] < 1
    assert rows["K=1"]["publish_s_mean"] > 0 and rows["inline"]["sample_s_mean"] >= 0.05 * 2  # 2 groups asleep


def test_bench_async_curve_trains_both_lags_and_plots_them(tmp_path):
    """bench_async.py --curve (docs/benchmarks.md: the learning curves K=0 vs K=1), scaled to the smoke recipe
    at 2 steps: both runs train every step, K=1 on a lag (its metrics say so), and the figure is written."""
    png = tmp_path / "curve.png"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_async.py"), "--curve", str(png), "--recipe",
                        "smoke", "--override", "trainer.max_steps=2", "--override", "data.num_eval=0"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-2000:]
    runs = {r["K"]: r for r in map(json.loads, p.stdout.splitlines())}
    assert sorted(runs) == [0, 1] and all(len(r["rewards"]) == 2 and r["total_s"] > 0 for r in runs.values())
    assert runs[1]["staleness_max"] == 1 and runs[0]["staleness_max"] == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_gpu_server_dry_run_plans_the_three_backends_on_cuda():
    """scripts/bench_gpu.sh server: bench_server.py on CUDA in bf16 (the server backend first: its nccl push), under
    8 minutes, with options its parser has; bench_server.py's own plan: one grpo-serve and a run per backend."""
    line = _gpu_dry("server").stdout.splitlines()[0].split()
    assert line[:4] == ["timeout", "470", sys.executable, "scripts/bench_server.py"]
    words = line[4:]
    opts = {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--")}
    assert {k: opts[k] for k in ("--device", "--backends", "--rounds")} == \
        {"--device": "cuda", "--backends": "server,vllm,hf", "--rounds": "1"}
    helptext = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_server.py"), "--help"],
                              capture_output=True, text=True, check=True).stdout
    assert all(o in helptext for o in opts) and words[-1] == "model.dtype=bfloat16"
    plan = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_server.py"), *words, "--dry-run"],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    assert plan[0].split()[1:3] == ["-m", "grpo.serve"] and "--gpu-memory-utilization" in plan[0]
    backends = [next(w for w in ln.split() if w.startswith("rollout.backend=")) for ln in plan[1:]]
    assert backends == ["rollout.backend=server", "rollout.backend=vllm", "rollout.backend=hf"]
    assert all("trainer.device=cuda" in ln and "model.dtype=bfloat16" in ln for ln in plan)


def test_bench_server_plans_the_server_backend_at_a_lag():
    """bench_server.py's ``server-K1``: the server backend with rollout.max_staleness=1, against the one server."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_server.py"), "--backends", "server,server-K1", "--rounds", "1",
           "--dry-run"]
    plan = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(plan) == 3 and plan[0].split()[1:3] == ["-m", "grpo.serve"]
    sync, lagged = (ln.split() for ln in plan[1:])
    assert "rollout.backend=server" in sync and not any(w.startswith("rollout.max_staleness") for w in sync)
    assert "rollout.backend=server" in lagged and "rollout.max_staleness=1" in lagged
    assert [w for w in sync if w.startswith("rollout.server.urls")] == \
        [w for w in lagged if w.startswith("rollout.server.urls")]


def test_bench_engine_ab_counts_each_trees_ops_and_parses_each_runs_row(capsys):
    """scripts/bench_engine_ab.py: an exported tree against this one (op counts per layout), and the timing mode's
    parse of a bench_prefix.py table (its own run takes minutes: the coordinator's, on an idle machine)."""
    from tests.helpers import load_script

    ab = load_script("bench_engine_ab")
    assert ab.main(["--ops", "16x4x2", "--old", "HEAD"]) == 0
    out = capsys.readouterr().out
    totals = re.search(r"old HEAD \{'standard': (\d+), 'shared': (\d+)\}, new working tree \{'standard': (\d+)", out)
    assert totals and int(totals[1]) > 100 and int(totals[2]) > int(totals[1]) and totals[1] == totals[3], out
    table = ("# device=cpu\n| model | P | S | G | standard s | shared s | speedup |\n|---|---|---|---|---|---|---|\n"
             "| tiny-llama-49k | 4096 | 256 | 16 | 116.750 | 27.360 | 4.27x |\n")
    done = subprocess.CompletedProcess([], 0, stdout=table, stderr="")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ab.subprocess, "run", lambda *a, **k: done)
        row = ab.bench_row(ROOT, "4096x256x16", threads=2, repeats=1)
    assert row == {"standard": 116.75, "shared": 27.36, "speedup": 116.75 / 27.36}


def test_bench_gpu_cluster_dry_run_puts_servers_and_zero3_trainers_on_their_own_gpus():
    """scripts/bench_gpu.sh cluster (docs/async.md#cluster-launch on one machine): with 4 GPUs, grpo-serve on GPUs 0
    and 1 (the key in the environment, never printed), torchrun of 2 ZeRO-3 trainers on GPUs 2 and 3 against both
    servers, K = 1, nccl; every command's overrides are a valid config; with one GPU they share it."""
    from grpo.config.compose import compose
    from grpo.config.schema import load

    lines = _gpu_dry("cluster", NGPU="4").stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1",
                                              "CUDA_VISIBLE_DEVICES=2,3"]
    assert all("GRPO_SERVER_API_KEY=***" in ln for ln in lines)
    train = lines[2].split()
    assert train[train.index("torchrun"):train.index("torchrun") + 5] == ["torchrun", "--nproc_per_node", "2", "-m",
                                                                         "grpo.train"]
    assert "rollout.server.urls=[http://127.0.0.1:8100,http://127.0.0.1:8101]" in train
    assert {"distributed=zero3", "rollout.max_staleness=1", "rollout.server.weight_transfer=nccl"} <= set(train)
    for ln, ports in zip(lines[:2], ("8100", "8101")):
        assert f"rollout.server.port={ports}" in ln.split() and ln.endswith("&")
    for words in [ln.split("grpo-serve ")[1].split(" --")[0].split() for ln in lines[:2]] + \
            [train[train.index("grpo.train") + 1:]]:
        raw = compose([w for w in words if not w.startswith("trainer.output_dir=")])
        raw.trainer.output_dir = "unused"
        load(raw)
    one = _gpu_dry("cluster", NGPU="1").stdout.splitlines()
    assert [ln.split()[0] for ln in one] == ["CUDA_VISIBLE_DEVICES=0"] * 2 and "--nproc_per_node 1" in one[1]
