cd "$(dirname "$0")/../../../.."  # the repository root
D=experiments/results/disco
A=.venv/bin/adaspec
echo "start $(date)"
.venv/bin/python -m pytest -q tests/test_disco_features.py tests/test_disco_classifier.py tests/test_disco_data.py tests/test_disco_artifact.py tests/test_disco_simulate.py tests/test_disco_cli.py tests/test_disco_controllers.py > /tmp/disco/tests.log 2>&1
echo "tests done $(date)"; tail -1 /tmp/disco/tests.log
$A disco collect --suite humaneval:12,spec-bench:5 --max-new-tokens 64 --quant int8-dyn --draft-quant int4 --out $D/data.pt --no-progress > /tmp/disco/collect.log 2>&1 || exit 1
echo "collect done $(date)"
for s in humaneval spec-bench; do $A disco train --data $D/data.pt --suite $s --out $D/$s.pt > /tmp/disco/train-$s.log 2>&1; $A disco train --data $D/data.pt --suite $s --generation-position --out /tmp/disco/$s-gen.pt > /tmp/disco/train-$s-gen.log 2>&1; done
$A disco tune --artifact $D/humaneval.pt --data $D/data.pt --repeats 5 > /tmp/disco/tune-he.log 2>&1 || exit 1
$A disco tune --artifact $D/spec-bench.pt --data $D/data.pt --costs-from $D/humaneval.pt --confirm 2 > /tmp/disco/tune-sb.log 2>&1 || exit 1
echo "tune done $(date)"
$A disco bench --data $D/data.pt --artifacts $D/humaneval.pt,$D/spec-bench.pt --out $D --limit 2 --max-new-tokens 48 --no-progress > /tmp/disco/bench.log 2>&1
echo "bench done $(date) rc=$?"
