# DISCO on the AVX2 EPYC: int8 torch target, the draft's GGUF run by llama.cpp in a child process
cd "$(dirname "$0")/../../../.."  # the repository root
D=experiments/results/disco-epyc
L=$D/logs
A=.venv/bin/adaspec
echo "start $(date)"
$A disco collect --suite humaneval:10,spec-bench:4 --max-new-tokens 64 --quant int8 --draft-quant gguf --out $D/data.pt --no-progress > $L/collect.log 2>&1 || exit 1
echo "collect done $(date)"
for s in humaneval spec-bench; do
  $A disco train --data $D/data.pt --suite $s --out $D/$s.pt > $L/train-$s.log 2>&1
  $A disco train --data $D/data.pt --suite $s --generation-position --out $L/$s-gen.pt > $L/train-$s-gen.log 2>&1
done
$A disco tune --artifact $D/humaneval.pt --data $D/data.pt --repeats 5 > $L/tune-he.log 2>&1 || exit 1
$A disco tune --artifact $D/spec-bench.pt --data $D/data.pt --costs-from $D/humaneval.pt > $L/tune-sb.log 2>&1 || exit 1
echo "tune done $(date)"
$A disco bench --data $D/data.pt --artifacts $D/humaneval.pt,$D/spec-bench.pt --out $D --max-new-tokens 48 --no-progress > $L/bench.log 2>&1
echo "bench done $(date) rc=$?"
# The bench above was stopped during its warm-up and re-run with the measured static sweep:
# $A disco bench --data $D/data.pt --artifacts $D/humaneval.pt,$D/spec-bench.pt --out $D --max-new-tokens 48 --static-sweep --no-progress > $L/bench.log 2>&1
