#!/usr/bin/env bash
# GPU benchmarks, prepared for one H200.
#
#   scripts/bench_gpu.sh [--dry-run]          # step: the whole-GRPO-step comparison, under 8 minutes
#   scripts/bench_gpu.sh [--dry-run] prefix   # prefix: the shared-prefix engine's kernels, under 4 minutes
#   scripts/bench_gpu.sh [--dry-run] rollout  # rollout: our decode loop vs vLLM, tokens/s and whole step, < 8 min
#   scripts/bench_gpu.sh [--dry-run] dist     # dist: the NCCL + bf16 + ZeRO-3 smoke, under 4 minutes
#   scripts/bench_gpu.sh [--dry-run] server   # server: the step with rollout.backend=server/vllm/hf, < 8 minutes
#   scripts/bench_gpu.sh [--dry-run] async    # async: rollout.max_staleness K=0/1/2 vs the inline loop, < 6 minutes
#   scripts/bench_gpu.sh [--dry-run] cluster  # cluster: grpo-serve on some GPUs, ZeRO-3 trainers on the others, K=1, nccl
#
# step: scripts/bench_trl.py on SmolLM2-135M and a Qwen2-0.5B-shaped random model (151936 vocab), bf16, this
# framework with the shared prefix on and off vs TRL's GRPOTrainer; tokens/s, peak GPU memory and the model
# FLOPs utilisation of the training forward/backward (nominal standard-layout FLOPs / update time / PEAK_TFLOPS).
# Needs `make bench-env` first (TRL lives only in .venv-bench).
# prefix: scripts/bench_prefix.py (forward+backward of token_logprobs, standard vs shared layout) in bf16 with
# the FlexAttention kernel, then the grouped kernel, on the tiny 49k-vocab Llama shapes and SmolLM2.
# rollout: see its section below.
# dist: torchrun with one process on one GPU (world size 1: NCCL), distributed=zero3 with bf16, the smoke recipe's
# tiny model, 2 steps with a checkpoint each and the consolidated final model; scripts/dist_smoke.py checks that
# the run took that path (backend, dtype, partitioned weights) and ended well, and prints one JSON line.
# Needs deepspeed, hydra-core and omegaconf importable by BENCH_PY. DEVICE=cpu runs the same on the CPU (gloo; the
# tests do). DIST_DIR: the run's output directory (default: a fresh temporary one).
# --dry-run prints the plan and runs nothing (works on CPU; the tests run it).
#
# Env: PEAK_TFLOPS (default 989, H200 dense bf16), STEPS (2), PROMPTS (8 prompts/step), OUT (bench_gpu.json),
# BENCH_PY (.venv-bench/bin/python, else python3), MODELS (smollm2,qwen05; smollm2-shape = SmolLM2's architecture
# with random weights, for a machine without the embedded weights), TOKENIZER (a tokenizer directory for the
# random-init models; default: the embedded SmolLM2's). docs/benchmarks.md says how to run it on a lent GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${BENCH_PY:-.venv-bench/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
MODE=step
if [ "${1:-}" = "prefix" ] || [ "${1:-}" = "step" ] || [ "${1:-}" = "dist" ] || [ "${1:-}" = "rollout" ] || \
   [ "${1:-}" = "server" ] || [ "${1:-}" = "async" ] || [ "${1:-}" = "cluster" ]; then
  MODE=$1; shift
fi

if [ "$MODE" = "prefix" ]; then
  for KERNEL in flex grouped; do
    CMD=("$PY" scripts/bench_prefix.py --device cuda --dtype bfloat16 --kernel "$KERNEL" --repeats 5 "$@")
    if [ "$DRY" = 1 ]; then echo "timeout 110 ${CMD[*]}"; else timeout --signal=INT 110 "${CMD[@]}"; fi
  done
  exit 0
fi

# ---- rollout (issue 16): completion tokens/s of our decode loop (hf) vs vLLM, then the whole step with each ------
# 1. scripts/bench_rollout.py: a Qwen2.5-0.5B-shaped model with random weights (151936 vocab), bf16, 8 prompts of
#    P=512 random tokens x G=16 samples x S=512 new tokens (exactly: min tokens), hf then vLLM (CUDA graphs); median
#    of 2 timed calls after a warm-up; vLLM's engine start reported apart. ~3 minutes.
# 2. scripts/bench_trl.py --systems ours,ours-vllm: the whole GRPO step (rollout, reward, reference, update) at the
#    same shape, rollout.backend=hf vs vllm (eager), 1 measured step after a warm-up step. ~3-4 minutes.
# Needs vLLM importable by BENCH_PY (else its rows say so and the hf rows still run) and, for 2, hydra-core,
# omegaconf and datasets. Writes ${OUT:-bench_rollout}.json and ${OUT:-bench_rollout}_step.json.
if [ "$MODE" = "rollout" ]; then
  R=${OUT:-bench_rollout}
  CMD1=("$PY" scripts/bench_rollout.py --device cuda --dtype bfloat16 --model qwen05-shape --prompt-len 512
        --prompts 8 --group 16 --new 512 --repeats 2 --backends hf,vllm --vllm-graphs --threads 4
        --json "$R.json")
  CMD2=("$PY" scripts/bench_trl.py --device cuda --dtype bfloat16 --models qwen05 --shapes 512x512x16
        --prompts-per-step 8 --systems ours,ours-vllm --steps 1 --repeats 1 --timeout 110 --json "${R}_step.json")
  [ -n "${TOKENIZER:-}" ] && CMD2+=(--tokenizer "$TOKENIZER")
  if [ "$DRY" = 1 ]; then
    echo "timeout 230 ${CMD1[*]} $*"
    "${CMD2[@]}" --dry-run "$@"
  else
    timeout --signal=INT 230 "${CMD1[@]}" "$@" || echo "bench_rollout.py ended with status $?"
    timeout --signal=INT 240 "${CMD2[@]}" "$@"
  fi
  exit 0
fi
# ---- end of rollout ------------------------------------------------------------------------------------------------
# ---- async (issue 33): scripts/bench_async.py on the GPU, the trainer and its generator process sharing it ---------
# 1. the quickstart shape (SmolLM2-135M, 8 prompts x G=8 x 16 new tokens): the inline loop, then the generator process
#    at K=0, 1, 2, alternated over 2 rounds of 2 warm-up + 4 measured steps; ~3 minutes.
# 2. the same with a reward sleeping 0.25 s per group (generation dominates), inline vs K=0 vs K=1; ~2 minutes.
# Writes ${OUT:-bench_async}.json and ${OUT:-bench_async}_slow.json.
if [ "$MODE" = "async" ]; then
  A=${OUT:-bench_async}
  CMD1=("$PY" scripts/bench_async.py --override trainer.device=cuda --rounds 2 --steps 4 --warmup 2 --json "$A.json")
  CMD2=("$PY" scripts/bench_async.py --override trainer.device=cuda --rounds 2 --steps 4 --warmup 2
        --slow-reward 0.25 --variants inline,K=0,K=1 --json "${A}_slow.json")
  if [ "$DRY" = 1 ]; then
    echo "timeout 200 ${CMD1[*]} $*"
    echo "timeout 150 ${CMD2[*]} $*"
  else
    PYTHONPATH=. timeout --signal=INT 200 "${CMD1[@]}" "$@" || echo "bench_async.py ended with status $?"
    PYTHONPATH=. timeout --signal=INT 150 "${CMD2[@]}" "$@"
  fi
  exit 0
fi
# ---- cluster (issue 39): docs/async.md#cluster-launch on one machine: grpo-serve (vLLM, its nccl weight transfer, an
# API key) on the first SERVER_GPUS GPUs, one server per GPU, then torchrun of distributed=zero3 trainers on the
# others with rollout.max_staleness=1 and rollout.server.weight_transfer=nccl, quickstart in bf16, 4 steps; with one
# GPU the server and a single trainer share it (the server takes 0.35 of its memory). Needs vLLM (CUDA) and
# deepspeed importable by BENCH_PY (SERVE: its grpo-serve). The servers are stopped at the end (by their pids).
if [ "$MODE" = "cluster" ]; then
  NGPU=${NGPU:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
  [ "$NGPU" -ge 1 ] || NGPU=1
  NS=${SERVER_GPUS:-$(( NGPU > 1 ? NGPU / 2 : 1 ))}
  NT=$(( NGPU > NS ? NGPU - NS : 1 ))
  SERVE=${SERVE:-$(dirname "$PY")/grpo-serve}
  KEY=${GRPO_SERVER_API_KEY:-bench-$$-$RANDOM}
  RUN_DIR=${CLUSTER_DIR:-/tmp/grpo-cluster-$$}
  UTIL=0.85
  [ "$NGPU" = 1 ] && UTIL=0.35
  URLS=""
  TRAIN_GPUS=""
  for ((i = 0; i < NS; i++)); do URLS+="${URLS:+,}http://127.0.0.1:$((8100 + i))"; done
  for ((g = NS; g < NS + NT; g++)); do TRAIN_GPUS+="${TRAIN_GPUS:+,}$(( g < NGPU ? g : 0 ))"; done
  COMMON=(recipe=quickstart model.dtype=bfloat16 trainer.device=cuda)
  TRAIN=(torchrun --nproc_per_node "$NT" -m grpo.train "${COMMON[@]}" distributed=zero3 rollout.backend=server
         "rollout.server.urls=[$URLS]" rollout.max_staleness=1 rollout.server.weight_transfer=nccl
         trainer.max_steps=4 trainer.save_every=2 "trainer.output_dir=$RUN_DIR/run")
  PIDS=()
  for ((i = 0; i < NS; i++)); do
    SRV=("$SERVE" "${COMMON[@]}" rollout.server.port=$((8100 + i)) -- --gpu-memory-utilization "$UTIL")
    if [ "$DRY" = 1 ]; then
      echo "CUDA_VISIBLE_DEVICES=$i GRPO_SERVER_API_KEY=*** ${SRV[*]} &"
    else
      mkdir -p "$RUN_DIR"
      CUDA_VISIBLE_DEVICES=$i GRPO_SERVER_API_KEY=$KEY "${SRV[@]}" >"$RUN_DIR/server_$i.log" 2>&1 &
      PIDS+=($!)
    fi
  done
  if [ "$DRY" = 1 ]; then
    echo "CUDA_VISIBLE_DEVICES=$TRAIN_GPUS GRPO_SERVER_API_KEY=*** timeout 300 ${TRAIN[*]} $*"
    exit 0
  fi
  trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
  CUDA_VISIBLE_DEVICES=$TRAIN_GPUS GRPO_SERVER_API_KEY=$KEY timeout --signal=INT 300 "${TRAIN[@]}" \
    rollout.server.connect_timeout_s=240 "$@"
  grep -h '"step"' "$RUN_DIR/run/metrics.jsonl" | tail -n 4 || true
  exit 0
fi
# ---- server (issue 32): scripts/bench_server.py on the quickstart recipe in bf16: the server backend (its first run
# of vLLM's nccl weight transfer: grpo/rollout/server/nccl.py has never run before this), the in-process engine and
# our decode loop, one round of 3 steps each; the server shares the one GPU (--server-gpu-util 0.35). Needs vLLM
# (CUDA) importable by BENCH_PY. Writes ${OUT:-bench_server}.json.
if [ "$MODE" = "server" ]; then
  CMD=("$PY" scripts/bench_server.py --device cuda --server-gpu-util 0.35 --backends server,vllm,hf --rounds 1
       --steps 3 --timeout 150 --json "${OUT:-bench_server}.json" model.dtype=bfloat16 "$@")
  if [ "$DRY" = 1 ]; then echo "timeout 470 ${CMD[*]}"; else timeout --signal=INT 470 "${CMD[@]}"; fi
  exit 0
fi
if [ "$MODE" = "dist" ]; then
  DEVICE=${DEVICE:-cuda}
  BACKEND=nccl
  [ "$DEVICE" = cpu ] && BACKEND=gloo
  RUN_DIR=${DIST_DIR:-}
  if [ -z "$RUN_DIR" ]; then
    if [ "$DRY" = 1 ]; then RUN_DIR=/tmp/grpo-dist-XXXXXX/run; else RUN_DIR=$(mktemp -d -t grpo-dist-XXXXXX)/run; fi
  fi
  CMD=("$PY" -m torch.distributed.run --standalone --nproc_per_node 1 scripts/dist_smoke.py
       --expect-backend "$BACKEND" --expect-dtype bfloat16 --json "${OUT:-bench_dist.json}"
       recipe=smoke distributed=zero3 distributed.bf16=true trainer.device="$DEVICE" trainer.max_steps=2
       +distributed.ds_config.zero_optimization.stage3_param_persistence_threshold=0
       trainer.save_every=1 data.num_eval=4 logging.sample_every=0 logging.plot=false
       trainer.output_dir="$RUN_DIR" "$@")
  if [ "$DRY" = 1 ]; then echo "timeout 230 ${CMD[*]}"; else OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} timeout --signal=INT 230 "${CMD[@]}"; fi
  exit 0
fi

EXTRA=()
[ "$DRY" = 1 ] && EXTRA=(--dry-run)
[ -n "${TOKENIZER:-}" ] && EXTRA+=(--tokenizer "$TOKENIZER")
# 2 models x 2 shapes x 3 systems = 12 worker processes of ~20-35 s each (start-up, warm-up step, STEPS steps).
exec timeout --signal=INT 470 "$PY" scripts/bench_trl.py --device cuda --dtype bfloat16 \
  --peak-tflops "${PEAK_TFLOPS:-989}" --models "${MODELS:-smollm2,qwen05}" --shapes 64x64x8,1024x32x8 \
  --prompts-per-step "${PROMPTS:-8}" --steps "${STEPS:-2}" --repeats 1 --timeout 200 \
  --json "${OUT:-bench_gpu.json}" "${EXTRA[@]}" "$@"
