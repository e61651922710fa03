#!/usr/bin/env bash
# The router measurement (issue 6) on the built-in pair, bf16, 48 new tokens, greedy.
# Every step resumes where it stopped; each runs under the CPU lock, in chunks of <15 min.
#   train: ShareGPT first turns + the second half of HumanEval and WMT (the router's data)
#   test:  Spec-Bench (6 categories) + the first HumanEval / WMT prompts (held out)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/router
LOCK="flock /tmp/adaspec-cpu.lock"
ADASPEC=.venv/bin/adaspec
ARMS="ar,ngram,draft:k=4,draft:ctrl=heuristic,k=4"
TEST_SUITES=${TEST_SUITES:-spec-bench:1,humaneval:2,wmt:2}

# 1. offline data, in two chunks
$LOCK $ADASPEC router collect --arms "$ARMS" --suite sharegpt:3,humaneval:2,wmt:2 --out $OUT/train
$LOCK $ADASPEC router collect --arms "$ARMS" --suite sharegpt:5,humaneval:3,wmt:3 --out $OUT/train
# 2. the policy: the paper's settings except epochs (1 gradient step per epoch on this data)
$ADASPEC router train $OUT/train --epochs "${EPOCHS:-300}" --out $OUT/router.pt
# 3. the test prompts' states (to replay other policies on the measured runs), then one bench
#    run on the test prompts: every arm, the greedy and the dynamic router (two chunks)
R=$OUT/router.pt
M="$ARMS,router:$R,router:$R,mode=dynamic"
$LOCK bash -c "$ADASPEC router features --suite $TEST_SUITES --out $OUT/test-states && \
  $ADASPEC bench --suite spec-bench:1 --methods '$M' --max-new-tokens 48 --out $OUT/bench --resume"
$LOCK $ADASPEC bench --suite "$TEST_SUITES" --methods "$M" --max-new-tokens 48 --out $OUT/bench \
  --resume
# 4. the report: with the artifact's epochs, and with the paper's 3 epochs
$ADASPEC router report --train $OUT/train --bench $OUT/bench --features $OUT/test-states \
  --epochs "${EPOCHS:-300}" --out $OUT/report
$ADASPEC router report --train $OUT/train --bench $OUT/bench --features $OUT/test-states \
  --epochs 3 --out $OUT/report-paper-epochs
