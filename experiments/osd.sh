#!/usr/bin/env bash
# OSD measurements (docs/osd.md): run alone on the machine.
#   OUT=experiments/results/osd-NAME experiments/osd.sh [data] [stream] [ablation] [engine]
# (no step named: all of them). `data` collects the target's greedy outputs on training
# prompts (adaspec s2d data; resumable), which every other step replays.
set -euo pipefail
OUT=${OUT:-experiments/results/osd}
TARGET=qwen2.5-coder-1.5b-instruct
DRAFT=qwen2.5-coder-0.5b-instruct
STEPS=${*:-data stream ablation engine}
mkdir -p "$OUT"
PROFILE="$OUT/profile-ik-target-int8-draft.json"
profile() {  # the cost profile of the pair online distillation serves: ik target, int8 draft
  [ -f "$PROFILE" ] || adaspec profile --target $TARGET --draft $DRAFT --draft-weights int8 \
    --out "$PROFILE"
}
for step in $STEPS; do
  case $step in
  data)
    adaspec s2d data --target $TARGET --suite sharegpt:100,humaneval:80,wmt:100,spec-bench:4 \
      --max-new-tokens 96 ;;
  stream)
    # 304 requests in 7 blocks; HumanEval, WMT and ShareGPT come back with new requests.
    # Online with one shared draft and one per domain, then (a second sitting, the same frozen
    # baseline) offline distillation on 10% and 100% of the stream
    profile
    BLOCKS=humaneval:40,wmt:50,sharegpt:50,humaneval:40,wmt:50,sharegpt:50,spec-bench:24
    adaspec osd simulate --target $TARGET --draft $DRAFT --profile "$PROFILE" --interval 8 \
      --blocks $BLOCKS --runs "frozen;online;online:domains=field" --out "$OUT/stream"
    mkdir -p "$OUT/stream-offline"
    [ -f "$OUT/stream-offline/target_topk.pt" ] || cp "$OUT/stream/target_topk.pt" "$OUT/stream-offline/"
    adaspec osd simulate --target $TARGET --draft $DRAFT --profile "$PROFILE" --blocks $BLOCKS \
      --offline-steps 80 --runs "frozen;offline:0.1;offline:1" --out "$OUT/stream-offline" ;;
  ablation)
    # the paper's ablation (losses, sampling) on two blocks of 24 requests
    profile
    mkdir -p "$OUT/ablation"
    [ -f "$OUT/ablation/target_topk.pt" ] || cp "$OUT/stream/target_topk.pt" "$OUT/ablation/"
    adaspec osd simulate --target $TARGET --draft $DRAFT --profile "$PROFILE" \
      --blocks wmt:24,sharegpt:24 --interval 8 \
      --runs "frozen;online:loss=fkl;online:loss=rkl;online:loss=jsd:0.5;online:loss=jsd:0.5,sampling=student;online:loss=jsd:0.5,sampling=mixed" \
      --out "$OUT/ablation" ;;
  engine)
    # the real engine: recording overhead, exactness (each difference classified) and the
    # CPU the updates take from serving, the update worker at nice 0, then at nice 19
    profile
    adaspec osd simulate --target $TARGET --draft $DRAFT --draft-weights int8 --replay engine \
      --profile "$PROFILE" --blocks humaneval:4,wmt:4,sharegpt:4,spec-bench:4 --interval 4 \
      --overhead-requests 6 --osd-nice 0 --runs "frozen;online" --out "$OUT/engine"
    adaspec osd simulate --target $TARGET --draft $DRAFT --draft-weights int8 --replay engine \
      --profile "$PROFILE" --blocks humaneval:4,wmt:4,sharegpt:4,spec-bench:4 --interval 4 \
      --runs "frozen;online" --out "$OUT/engine-nice" ;;
  *) echo "unknown step $step (steps: data stream ablation engine)"; exit 2 ;;
  esac
done
