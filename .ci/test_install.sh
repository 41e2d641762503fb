#!/usr/bin/env bash
# `make test-install`: what a user does, from the wheel, outside the repository.
#
#   1. build the wheel of this tree;
#   2. a fresh virtual environment under $TMPDIR (never the repository), with the user's torch
#      installed first, the way the README says (here the CPU build the machine's package
#      index offers: TORCH_SPEC, default torch==2.13.0);
#   3. pip install '<wheel>[langchain]' (the package index pip is configured with);
#   4. agentspec models install (the quickstart's model and the memory's embedder);
#   5. the README's quickstart (examples/quickstart.py, the file the README quotes), run from
#      outside the repository with a fresh AGENTSPEC_HOME (so the first-use conversion runs),
#      and the LangChain adapter's import.
#
# Leaves nothing behind unless KEEP=1 (then it prints where the venv is).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/agentspec-install.XXXXXX")"
case "$WORK" in "$REPO"/*) echo "refusing: $WORK is inside the repository" >&2; exit 2;; esac
if [ "${KEEP:-0}" != 1 ]; then trap 'rm -rf "$WORK"' EXIT; fi
started=$(date +%s)
step() { echo "== [$(( $(date +%s) - started )) s] $*"; }

step "building the wheel of $REPO"
"$PYTHON" -m pip wheel -q --no-deps -w "$WORK/dist" "$REPO"
WHEEL="$(ls "$WORK"/dist/agentspec_llm-*.whl)"
rm -rf "$REPO/build"  # setuptools' scratch folder in the tree

step "fresh venv $WORK/venv; $TORCH_SPEC first"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q "$TORCH_SPEC"

step "pip install $(basename "$WHEEL")[langchain]"
"$VPY" -m pip install -q "$WHEEL[langchain]"

step "agentspec models install"
"$WORK/venv/bin/agentspec" models install

step "the quickstart (examples/quickstart.py), from $WORK"
cp "$REPO/examples/quickstart.py" "$WORK/quickstart.py"
cd "$WORK"
export AGENTSPEC_HOME="$WORK/home"
unset AGENTSPEC_DB
"$VPY" -c "import agentspec, sys; assert not agentspec.__file__.startswith('$REPO'), agentspec.__file__"
"$VPY" quickstart.py | tee "$WORK/quickstart.out"
grep -q "tokens/step" "$WORK/quickstart.out"
grep -q "\[session task-1: 2 calls" "$WORK/quickstart.out"
"$VPY" -c "from agentspec.adapters.langchain import ChatAgentSpec; print('langchain adapter:', ChatAgentSpec.__name__)"

step "done: the wheel installs and the quickstart runs${KEEP:+ (kept: $WORK)}"
