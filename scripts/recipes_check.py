"""Prove every shipped recipe: the ones meant for one CPU machine run their first step(s) and first checkpoint;
the GPU / multi-process ones are composed and validated (dry run).

    python scripts/recipes_check.py                       # every recipe (make recipes-check)
    python scripts/recipes_check.py --recipes smoke,countdown --steps 2
    python scripts/recipes_check.py --json out.json       # also write the rows as JSON

A recipe runs here when it needs no launcher (distributed.backend none), no GPU (trainer.device not cuda) and no
download (an embedded: or tiny: model). Each runs as `python -m grpo.train recipe=NAME trainer.max_steps=N
trainer.save_every=N data.num_eval=E` in its own process; the row gives that process's peak resident memory
(ru_maxrss: model, optimizer, rollout and update together), the mean seconds per step from metrics.jsonl, and
whether a complete checkpoint and final/ were written. Exit status 1 when any recipe fails.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpo.config.compose import CONFIG_DIR, RECIPE_DIR  # noqa: E402
from grpo.config.schema import load  # noqa: E402
from grpo.trainer.checkpoint import complete_checkpoints  # noqa: E402


def compose(recipe: str, overrides: list[str]) -> dict:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        raw = hydra_compose(config_name="config", overrides=[f"recipe={recipe}", *overrides])
    return OmegaConf.to_container(raw, resolve=True)


def runs_on_this_cpu(cfg) -> str | None:
    """None when the recipe is meant for one CPU machine, else what it needs instead."""
    needs = []
    if cfg.distributed.backend != "none":
        needs.append(f"a launcher ({cfg.distributed.backend}, ZeRO-{cfg.distributed.zero_stage})")
    if cfg.trainer.device == "cuda" or cfg.model.dtype == "bfloat16":
        needs.append("a GPU")
    if not cfg.model.name_or_path.startswith(("embedded:", "tiny:")) and not Path(cfg.model.name_or_path).exists():
        needs.append(f"network ({cfg.model.name_or_path})")
    return ", ".join(needs) or None


def run_one(recipe: str, steps: int, num_eval: int, out: Path, extra: list[str]) -> dict:
    args = [sys.executable, "-m", "grpo.train", f"recipe={recipe}", f"trainer.max_steps={steps}",
            f"trainer.save_every={steps}", f"data.num_eval={num_eval}", f"trainer.output_dir={out}",
            "logging.plot=false", "logging.wandb.mode=disabled", *extra]
    log = out.parent / f"{recipe}.log"
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    row = {"recipe": recipe, "mode": "run", "exit": proc.returncode, "wall_s": round(time.time() - t0, 1),
           "peak_rss_mib": round(usage.ru_maxrss / 1024), "log": str(log)}
    metrics = out / "metrics.jsonl"
    steps_seen = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    times = [m["step_time_s"] for m in steps_seen if "step_time_s" in m]
    updates = [m["time/update_s"] for m in steps_seen if "time/update_s" in m]
    row["s_per_step"] = round(sum(times) / len(times), 3) if times else None  # a fast machine steps in < 0.05 s
    row["update_s"] = round(sum(updates) / len(updates), 3) if updates else None
    row["checkpoint"] = bool(complete_checkpoints(out)) and (out / "final").is_dir()
    budget = [line for line in log.read_text().splitlines() if "max_tokens_per_micro_batch" in line]
    row["micro_batch"] = budget[-1].split("] ", 1)[-1] if budget else None
    row["ok"] = proc.returncode == 0 and len(times) == steps and row["checkpoint"]
    if not row["ok"]:
        tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        row["error"] = tail[0][:300]
    return row


def dry_run(recipe: str, needs: str) -> dict:
    return {"recipe": recipe, "mode": "dry-run", "needs": needs, "ok": True}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="", help="comma-separated names (default: every recipes/*.yaml)")
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps per CPU recipe (checkpoint after the last)")
    ap.add_argument("--num-eval", type=int, default=4, help="held-out prompts evaluated before and after")
    ap.add_argument("--out", default="", help="where runs are written (default: a temporary directory)")
    ap.add_argument("--json", default="", help="also write the rows to this JSON file")
    ap.add_argument("overrides", nargs="*", help="key=value overrides added to every CPU run")
    a = ap.parse_args(argv)
    names = [r for r in a.recipes.split(",") if r] or sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
    out = Path(a.out or tempfile.mkdtemp(prefix="recipes-check-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        try:
            cfg = load(compose(name, [f"trainer.output_dir={out / name}", *a.overrides]))
        except Exception as e:  # a recipe that does not even compose is a failure, said in one line
            rows.append({"recipe": name, "mode": "compose", "ok": False, "error": str(e).splitlines()[0][:300]})
            continue
        needs = runs_on_this_cpu(cfg)
        rows.append(dry_run(name, needs) if needs else run_one(name, a.steps, a.num_eval, out / name, a.overrides))
        print(_line(rows[-1]), flush=True)
    print(f"\n{'recipe':<14} {'mode':<8} {'ok':<4} {'peak MiB':>9} {'s/step':>7} {'update s':>9}  checkpoint / needs")
    for r in rows:
        print(f"{r['recipe']:<14} {r['mode']:<8} {'yes' if r['ok'] else 'NO':<4} {r.get('peak_rss_mib', ''):>9} "
              f"{r.get('s_per_step') or '':>7} {r.get('update_s') or '':>9}  "
              f"{r.get('needs') or ('written' if r.get('checkpoint') else r.get('error', ''))}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


def _line(r: dict) -> str:
    if r["mode"] == "dry-run":
        return f"[recipes-check] {r['recipe']}: composed and validated; needs {r['needs']}"
    state = "ok" if r["ok"] else f"FAILED ({r.get('error', '')})"
    return (f"[recipes-check] {r['recipe']}: {state}; peak {r['peak_rss_mib']} MiB, {r['s_per_step']} s/step, "
            f"checkpoint {'written' if r['checkpoint'] else 'missing'}, {r['wall_s']} s in all")


if __name__ == "__main__":
    sys.exit(main())
