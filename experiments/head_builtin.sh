#!/usr/bin/env bash
# The draft head shipped for the built-in target (src/adaspec/draft/builtin/): the target's
# features over training prompts (DESIGN.md's), a first head on the first 340 examples, then
# the same head trained on on all of them, copied into the package with its provenance.
# About 75 minutes on a 2-vCPU Intel Xeon with AMX (answers 6 min, features 27 min, training
# 12 + 25 min).
#   bash experiments/head_builtin.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/head-builtin}
A=.venv/bin/adaspec
mkdir -p "$W"
$A head data --out "$W/data" --sharegpt 200 --wmt 120 --humaneval 0 --spec-bench 20 \
    --answer-tokens 128 --batch 20 --max-tokens 320 --scorer torch --no-progress
$A head train --data "$W/data" --out "$W/h1.pt" --mlp 1024 --heads 4 --vocab 8192 --depth 2 \
    --epochs 6 --lr 1e-3 --no-progress
$A head data --out "$W/data" --sharegpt 700 --wmt 120 --humaneval 0 --spec-bench 40 \
    --answer-tokens 128 --batch 20 --max-tokens 320 --scorer torch --no-progress
$A head train --data "$W/data" --out "$W/head.pt" --init "$W/h1.pt" --depth 2 --epochs 4 \
    --lr 7e-4 --no-progress
OUT=src/adaspec/draft/builtin/head-qwen2.5-coder-1.5b-instruct
cp "$W/head.pt" "$OUT.pt"
cp "$W/head.json" "$OUT.json"
