#!/usr/bin/env bash
# The router measurement (issue 6): greedy, 48 new tokens, every step resumable, each under
# the CPU lock. Defaults (with ALPHA=0.1) reproduce the Xeon run (bf16 built-in pair,
# experiments/results/router);
# on another machine set OUT, WEIGHTS / DRAFT_WEIGHTS (formerly QUANT / DRAFT_QUANT, still
# read) and ARMS, e.g. the AVX2 run:
#   OUT=experiments/results/router-epyc WEIGHTS=int8 DRAFT_WEIGHTS=int4 \
#     ARMS=ar,ngram,draft:k=1,draft:k=3 TRAIN_SUITES=sharegpt:18,humaneval:10,wmt:10 \
#     TEST_SUITES=spec-bench:1,humaneval:2,wmt:2 experiments/router.sh
#   train: ShareGPT first turns + the second half of HumanEval and WMT (the router's data)
#   test:  Spec-Bench (6 categories) + the first HumanEval / WMT prompts (held out)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-experiments/results/router}
LOCK="flock /tmp/adaspec-cpu.lock"
ADASPEC=.venv/bin/adaspec
ARMS=${ARMS:-ar,ngram,draft:k=4,draft:ctrl=heuristic,k=4}
MODEL="--weights ${WEIGHTS:-${QUANT:-none}} --draft-weights ${DRAFT_WEIGHTS:-${DRAFT_QUANT:-none}}"
TEST_SUITES=${TEST_SUITES:-spec-bench:1,humaneval:2,wmt:2}
EPOCHS=${EPOCHS:-300}

# 1. offline data (two chunks when TRAIN_SUITES is unset, as the Xeon run was made)
if [ -n "${TRAIN_SUITES:-}" ]; then
  $LOCK $ADASPEC router collect $MODEL --arms "$ARMS" --suite "$TRAIN_SUITES" --out $OUT/train
else
  $LOCK $ADASPEC router collect $MODEL --arms "$ARMS" --suite sharegpt:3,humaneval:2,wmt:2 --out $OUT/train
  $LOCK $ADASPEC router collect $MODEL --arms "$ARMS" --suite sharegpt:5,humaneval:3,wmt:3 --out $OUT/train
fi
# 2. the policy: the paper's settings except epochs (1 gradient step per epoch on this data),
#    alpha chosen by 5-fold cross-validation on the training prompts (no test data), or
#    ALPHA=... (the Xeon run: ALPHA=0.1, before --alpha-cv existed)
if [ -n "${ALPHA:-}" ]; then PICK="--alpha $ALPHA"; else PICK="--alpha-cv --folds 5 --alphas 0,0.1,0.25,0.5,1"; fi
$ADASPEC router train $OUT/train --epochs "$EPOCHS" $PICK --out $OUT/router.pt | tee $OUT/train.txt
# 3. the test prompts' states (to replay other policies on the measured runs), then one bench
#    run on the test prompts: every arm, the greedy and the dynamic router
R=$OUT/router.pt
M="$ARMS,router:$R,router:$R,mode=dynamic"
$LOCK $ADASPEC router features $MODEL --suite "$TEST_SUITES" --out $OUT/test-states
$LOCK $ADASPEC bench $MODEL --suite "$TEST_SUITES" --methods "$M" --max-new-tokens 48 --out $OUT/bench \
  --resume
# 4. the report: with the artifact's epochs, and with the paper's 3 epochs
$ADASPEC router report --train $OUT/train --bench $OUT/bench --features $OUT/test-states \
  --epochs "$EPOCHS" --out $OUT/report
$ADASPEC router report --train $OUT/train --bench $OUT/bench --features $OUT/test-states \
  --epochs 3 --out $OUT/report-paper-epochs
