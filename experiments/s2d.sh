#!/usr/bin/env bash
# The S2D measurement (issue 22), every step resumable; run it alone on the machine.
#   1. the 1.5B target's greedy outputs on training prompts; the 0.5B's on validation prompts
#   2. which source to extract from (predicted, untrained)
#   3. SoFT and SFT drafts of the 0.5B's first 12 layers (exits 6, 9, 12), and the untrained one
#   4. thresholds and k per target, priced with this machine's costs
#   5. one bench per target and temperature; the table (Table 2 form) and the grids
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-experiments/results/s2d-epyc}
A=.venv/bin/adaspec
H=${ADASPEC_HOME:-$HOME/.cache/adaspec}
T15=qwen2.5-coder-1.5b-instruct
T05=qwen2.5-coder-0.5b-instruct
D15=$H/s2d/data/$T15
D05=$H/s2d/data/$T05
W=${WEIGHTS:-int4}          # the sorted draft's weights while drafting
EPOCHS=${EPOCHS:-4}
LR=${LR:-2e-4}
TOKENS=${TOKENS:-64}
mkdir -p "$OUT"

$A s2d data --target $T15 --max-new-tokens 96
$A s2d data --target $T05 --only-val --method ar --max-new-tokens 96
.venv/bin/python experiments/s2d_extraction.py --data "$D15" --weights "$W" \
  --out "$OUT/extraction.md"

$A s2d extract --data "$D15" --name s2d-untrained
$A s2d train --data "$D15" --name s2d-soft-kd --epochs 2 --lr "$LR" --distill 1.0
$A s2d train --data "$D15" --name s2d-soft --epochs "$EPOCHS" --lr "$LR" | tee "$OUT/train-soft.txt"
$A s2d train --data "$D15" --name s2d-sft --mode sft --epochs "$EPOCHS" --lr "$LR" | tee "$OUT/train-sft.txt"

for art in s2d-soft s2d-sft s2d-untrained; do
  $A s2d tune $art --target $T15 --data "$D15" --draft-weights "$W" --report "$OUT/tune-$art-1.5b.json"
  $A s2d tune $art --target $T05 --data "$D05" --draft-weights "$W" --report "$OUT/tune-$art-0.5b.json"
done
$A s2d tune s2d-soft --target $T15 --data "$D15" --draft-weights "$W" --profile flat --no-store \
  --report "$OUT/tune-s2d-soft-1.5b-flat.json"
$A s2d tune s2d-soft-kd --target $T15 --data "$D15" --draft-weights "$W" --no-store \
  --report "$OUT/tune-s2d-soft-kd.json"

S="spec-bench:1,humaneval:2"
$A bench --target $T15 --suite "spec-bench:1,humaneval:3" --max-new-tokens "$TOKENS" \
  --methods "ar,s2d:s2d-soft,s2d:s2d-soft,exit=6,s2d:s2d-soft,exit=9,s2d:s2d-soft,exit=12,s2d:s2d-sft,exit=12,s2d:s2d-untrained,draft:k=3,auto" \
  --out "$OUT/bench-1.5b-t0" --resume
$A bench --target $T15 --suite "$S" --max-new-tokens "$TOKENS" \
  --methods "ar,s2d:s2d-soft,thresholds=0.5/0.8,k=2,s2d:s2d-soft,thresholds=0.8/0.9,k=1" \
  --out "$OUT/bench-1.5b-t0-mixed" --resume
$A bench --target $T05 --suite "$S" --max-new-tokens "$TOKENS" \
  --methods "ar,s2d:s2d-soft,s2d:s2d-soft,exit=12,s2d:s2d-sft,exit=12,s2d:s2d-untrained" \
  --out "$OUT/bench-0.5b-t0" --resume
$A bench --target $T15 --suite "$S" --max-new-tokens "$TOKENS" --temperature 1 \
  --methods "ar,s2d:s2d-soft,s2d:s2d-sft,exit=12,s2d:s2d-untrained,draft:k=3" \
  --out "$OUT/bench-1.5b-t1" --resume
$A bench --target $T05 --suite "$S" --max-new-tokens "$TOKENS" --temperature 1 \
  --methods "ar,s2d:s2d-soft,s2d:s2d-sft,exit=12,s2d:s2d-untrained" \
  --out "$OUT/bench-0.5b-t1" --resume
.venv/bin/python experiments/s2d_table.py \
  --run "1.5B target, greedy=$OUT/bench-1.5b-t0" \
  --run "1.5B target, greedy, fixed thresholds (exits mixed)=$OUT/bench-1.5b-t0-mixed" \
  --run "1.5B target, T=1=$OUT/bench-1.5b-t1" --run "0.5B target, greedy=$OUT/bench-0.5b-t0" \
  --run "0.5B target, T=1=$OUT/bench-0.5b-t1" \
  --grid "1.5B target=$OUT/tune-s2d-soft-1.5b.json" --grid "0.5B target=$OUT/tune-s2d-soft-0.5b.json" \
  --out "$OUT"
