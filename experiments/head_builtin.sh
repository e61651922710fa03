#!/usr/bin/env bash
# The draft head shipped for the built-in target (src/adaspec/draft/builtin/) and its DISCO
# classifier (src/adaspec/control/builtin/): the target's features over training prompts
# (DESIGN.md's: ShareGPT below file index 12,000 teacher-forced; WMT, HumanEval 0-59 and odd
# Spec-Bench questions answered by the target itself), one head trained on all of them from
# scratch, then DISCO's classifier trained on the head's own drafts over the examples it never
# trained on and tuned at this machine's prices; each copied into the package with its
# provenance. About 3.7 hours on a 2-vCPU Intel Xeon with AMX (answers about 10 min, features
# about 2 h, training 85 min, DISCO 5 min; the recording resumes where a killed run stopped).
#   bash experiments/head_builtin.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/head-builtin}
A=.venv/bin/adaspec
mkdir -p "$W"
$A head data --out "$W/data" --sharegpt 4500 --wmt 300 --humaneval 60 --spec-bench 80 \
    --answer-tokens 128 --batch 20 --max-tokens 320 --scorer torch --no-progress
$A head train --data "$W/data" --out "$W/head.pt" --mlp 1024 --heads 4 --vocab 8192 --depth 2 \
    --epochs 3 --lr 1e-3 --no-progress
$A head disco --data "$W/data" --head "$W/head.pt" --out "$W/disco.pt" --no-progress
OUT=src/adaspec/draft/builtin/head-qwen2.5-coder-1.5b-instruct
cp "$W/head.pt" "$OUT.pt"
cp "$W/head.json" "$OUT.json"
DISCO=src/adaspec/control/builtin/disco-qwen2.5-coder-1.5b-instruct+head
cp "$W/disco.pt" "$DISCO.pt"
cp "$W/disco.json" "$DISCO.json"
