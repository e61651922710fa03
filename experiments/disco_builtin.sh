#!/usr/bin/env bash
# The DISCO classifier shipped for the built-in pair (src/adaspec/control/builtin/): collect,
# train on every suite, tune tau and SL_max under this machine's cost profile, then copy the
# artifact into the package with its provenance. About 10 minutes on a 2-vCPU EPYC.
#   bash experiments/disco_builtin.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/disco-builtin}
A=.venv/bin/adaspec
SUITES=humaneval:10,spec-bench:4,wmt:4,sharegpt:4
mkdir -p "$W"
COLLECT="adaspec disco collect --suite $SUITES --max-new-tokens 64 --weights ik --draft-weights ik --out data.pt"
TRAIN="adaspec disco train --data data.pt --out disco.pt"
TUNE="adaspec disco tune --artifact disco.pt --data data.pt --profile machine"
$A disco collect --suite $SUITES --max-new-tokens 64 --weights ik --draft-weights ik --out "$W/data.pt" --no-progress
$A disco train --data "$W/data.pt" --out "$W/disco.pt"
$A disco tune --artifact "$W/disco.pt" --data "$W/data.pt" --profile machine
OUT=src/adaspec/control/builtin/disco-qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct
cp "$W/disco.pt" "$OUT.pt"
.venv/bin/python - "$W/data.pt" "$OUT.json" "$COLLECT" "$TRAIN" "$TUNE" <<'PY'
import hashlib, json, platform, sys, time
from adaspec.lab.bench.machine import describe_machine
data, out, *commands = sys.argv[1:]
digest = hashlib.sha256(open(data, "rb").read()).hexdigest()
json.dump({"what": "DISCO classifier for the built-in pair (draft:ctrl=disco without disco=)",
           "commands": commands, "data_sha256": digest,
           "date": time.strftime("%Y-%m-%d"), "machine": describe_machine(),
           "python": platform.python_version(),
           "regenerate": "bash experiments/disco_builtin.sh"},
          open(out, "w"), indent=2)
print(f"wrote {out}")
PY
