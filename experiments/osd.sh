#!/usr/bin/env bash
# OSD measurements (docs/osd.md): run alone on the machine. Needs the target's outputs from
# `adaspec s2d data --target qwen2.5-coder-1.5b-instruct` (experiments/s2d.sh collects them).
set -euo pipefail
OUT=${OUT:-experiments/results/osd-epyc}
TARGET=qwen2.5-coder-1.5b-instruct
DRAFT=qwen2.5-coder-0.5b-instruct
mkdir -p "$OUT/stream" "$OUT/ablation"
PROFILE="$OUT/profile-ik-target-int8-draft.json"
# the cost profile of the pair online distillation serves: ik_llama target, torch int8 draft
[ -f "$PROFILE" ] || adaspec profile --target $TARGET --draft $DRAFT --draft-quant int8 --out "$PROFILE"
# 1. a stream of 4 domain blocks (40 HumanEval, 40 WMT, 40 ShareGPT, 24 Spec-Bench): frozen,
#    online shared / per domain, offline distillation on 10% and 100% of the stream
adaspec osd simulate --target $TARGET --draft $DRAFT --profile "$PROFILE" --per-block 40 \
  --interval 8 --offline-steps 80 \
  --runs "frozen;online;online:domains=field;offline:0.1;offline:1" --out "$OUT/stream"
# 2. the paper's ablation (losses, sampling) on two blocks of 24 requests (the target's
#    distributions computed above are reused)
[ -f "$OUT/ablation/target_topk.pt" ] || cp "$OUT/stream/target_topk.pt" "$OUT/ablation/"
adaspec osd simulate --target $TARGET --draft $DRAFT --profile "$PROFILE" \
  --blocks wmt,sharegpt --per-block 24 --interval 8 \
  --runs "frozen;online:loss=fkl;online:loss=rkl;online:loss=jsd:0.5;online:loss=jsd:0.5,sampling=student;online:loss=jsd:0.5,sampling=mixed" \
  --out "$OUT/ablation"
# (the learning-rate choice, tuning/: --blocks wmt,sharegpt --per-block 32 with
#  --runs "frozen;online:interval=4,lr=...;online:interval=4,lr=...,record=all")
# 3. the real engine: recording overhead, exactness and the CPU the updates take from
#    serving, with the update worker at the same priority as serving, then at nice 19
adaspec osd simulate --target $TARGET --draft $DRAFT --draft-quant int8 --replay engine \
  --profile "$PROFILE" --per-block 4 --interval 4 --overhead-requests 6 --osd-nice 0 \
  --runs "frozen;online" --out "$OUT/engine"
adaspec osd simulate --target $TARGET --draft $DRAFT --draft-quant int8 --replay engine \
  --profile "$PROFILE" --per-block 4 --interval 4 --runs "frozen;online" --out "$OUT/engine-nice"
