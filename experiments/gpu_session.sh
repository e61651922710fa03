#!/usr/bin/env bash
# One device call on a lent GPU (issue 34; docs/gpu.md): the costs first, which need no
# weights (random-init models of the real shapes), then, where the built-in pair's weights
# were brought there (experiments/gpu_ship.py), every method end to end beside Hugging Face.
# Writes at most 8 small files under $OUT (what the device tool returns):
#   machine.txt, costs/gpu_costs.{json,md}, costs/gpu_profile.json,
#   bench/summary.{md,json}, bench/run.json, bench/results.jsonl
# Usage (device `run`, carry ['.whl'] and, for the bench, the chunks already sent); each
# part fits one call's 10 minutes:
#   bash experiments/gpu_session.sh costs      # then, one call per chunk (carry .gpuw/cNN):
#   bash experiments/gpu_session.sh keep       # and last:
#   bash experiments/gpu_session.sh bench      # BENCH_ARGS="--suite humaneval:3" to narrow;
#                                              # a call cut short: run it again (it resumes)
# or, to time the costs while the weights' chunks travel (the calls that carry chunks use
# the host's disk and network, not the GPU):
#   bash experiments/gpu_session.sh costs-detached   # returns at once; then the chunk calls
#   bash experiments/gpu_session.sh collect          # waits for the costs, returns them
# and, on any machine (CI runs it: tests/test_gpu_session.py), the costs part on tiny
# shapes on the CPU, so a typo never costs device time:
#   OUT=/tmp/out bash experiments/gpu_session.sh costs-dry
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:?set by the device tool}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
elif [ -d /tmp/site ]; then  # installed by an earlier call on this machine
    export PYTHONPATH=/tmp/site
fi
# A carried folder does not stay between calls (each call's tree replaces the last): the
# weights' chunks are kept in /tmp/gpuw, which does, while the machine is held.
KEPT=/tmp/gpuw
if [ -d .gpuw ] && [ ! -L .gpuw ]; then mkdir -p "$KEPT" && cp -r .gpuw/. "$KEPT/"; fi
[ -d "$KEPT" ] && rm -rf .gpuw && ln -s "$KEPT" .gpuw
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version \
      --format=csv 2>/dev/null || echo "no nvidia-smi: no GPU here"; python3 -c "import torch, transformers; print('torch', torch.__version__,
'cuda', torch.version.cuda, 'transformers', transformers.__version__)"; } > "$OUT/machine.txt"
cat "$OUT/machine.txt"

PART=${1:-costs}
DETACHED=/tmp/gpu-costs  # survives between calls while the machine is held
if [ "$PART" = costs ]; then
    python3 experiments/gpu_costs.py --out "$OUT/costs" || echo "gpu_costs.py failed: $?"
elif [ "$PART" = costs-dry ]; then
    python3 experiments/gpu_costs.py --tiny --device cpu --reps 2 --generate-tokens 8 \
        --compile-sizes '' --sweep 1,4 --sweep-tokens 8 --out "$OUT/costs" || exit 1
elif [ "$PART" = costs-detached ]; then
    rm -rf "$DETACHED" && mkdir -p "$DETACHED"
    setsid nohup bash -c "python3 experiments/gpu_costs.py --out $DETACHED/out \
        > $DETACHED/log 2>&1; echo \$? > $DETACHED/rc" > /dev/null 2>&1 < /dev/null &
    echo "costs started in the background (pid $!): $DETACHED/log"
elif [ "$PART" = keep ]; then
    echo "kept: $(ls "$KEPT" | wc -l) of the chunk folders, data and manifest in $KEPT"
elif [ "$PART" = collect ]; then
    for _ in $(seq 540); do [ -f "$DETACHED/rc" ] && break; sleep 1; done
    tail -n 40 "$DETACHED/log"
    mkdir -p "$OUT/costs" && cp "$DETACHED"/out/* "$DETACHED/log" "$OUT/costs/" 2>/dev/null
    echo "costs exit status: $(cat "$DETACHED/rc" 2>/dev/null || echo 'still running')"
elif [ -f .gpuw/manifest.json ]; then
    # compiled passes: 1.5-1.7x faster than graphs alone on the H200 (gpu_costs.py)
    export ADASPEC_TORCH_COMPILE=${ADASPEC_TORCH_COMPILE:-1}
    [ -f /tmp/adaspec-home/gguf/qwen2.5-coder-1.5b-instruct.gguf ] ||
        python3 experiments/gpu_ship.py assemble --home /tmp/adaspec-home || exit 1
    S2D=()  # S2D beside the others: an untrained extraction of the draft (exit 24 = the draft)
    if [ -d .gpuw/data/s2d ]; then
        [ -d /tmp/adaspec-home/s2d/s2d-extract ] ||
            ADASPEC_HOME=/tmp/adaspec-home python3 -m adaspec s2d extract --data .gpuw/data/s2d \
                --kept-tokens 0 --exits 12,18,24 --name s2d-extract || echo "s2d extract failed"
        [ -d /tmp/adaspec-home/s2d/s2d-extract ] && S2D=(--s2d s2d-extract)
    fi
    ADASPEC_HOME=/tmp/adaspec-home ADASPEC_DATA_DIR=$PWD/.gpuw/data \
        python3 experiments/gpu_bench.py --out "$OUT/bench" "${S2D[@]}" ${BENCH_ARGS:-}
else
    echo "no weights here (.gpuw/manifest.json): costs only; see docs/gpu.md"
fi
