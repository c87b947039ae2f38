#!/usr/bin/env bash
# The whole-GRPO-step comparison (scripts/bench_trl.py) on one GPU, prepared for an H200, under 8 minutes:
# SmolLM2-135M and a Qwen2-0.5B-shaped random model (151936 vocab), bf16, this framework with the shared
# prefix on and off vs TRL's GRPOTrainer; tokens/s, peak GPU memory and the model FLOPs utilisation of the
# training forward/backward (nominal standard-layout FLOPs / update time / PEAK_TFLOPS).
#
#   make bench-env && scripts/bench_gpu.sh            # on the GPU machine
#   scripts/bench_gpu.sh --dry-run                    # print the plan (runs on CPU; what the tests do)
#
# Env: PEAK_TFLOPS (default 989, H200 dense bf16), STEPS (2), PROMPTS (8 prompts/step), OUT (bench_gpu.json),
# BENCH_PY (.venv-bench/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${BENCH_PY:-.venv-bench/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
EXTRA=()
if [ "${1:-}" = "--dry-run" ]; then EXTRA=(--dry-run); shift; fi
# 2 models x 2 shapes x 3 systems = 12 worker processes of ~20-35 s each (start-up, warm-up step, STEPS steps).
exec timeout --signal=INT 470 "$PY" scripts/bench_trl.py --device cuda --dtype bfloat16 \
  --peak-tflops "${PEAK_TFLOPS:-989}" --models smollm2,qwen05 --shapes 64x64x8,1024x32x8 \
  --prompts-per-step "${PROMPTS:-8}" --steps "${STEPS:-2}" --repeats 1 --timeout 200 \
  --json "${OUT:-bench_gpu.json}" "${EXTRA[@]}" "$@"
