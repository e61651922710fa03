#!/usr/bin/env bash
# The router policy shipped for the built-in pair (src/adaspec/route/builtin/): collect the
# arms side by side on the default runtime (ik_llama.cpp: the prompt state it gives), train,
# then copy the artifact into the package with its provenance. About 15 minutes on a
# 2-vCPU Xeon.
#   bash experiments/router_builtin.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/router-builtin}
A=.venv/bin/adaspec
ARMS=ar,auto:use=ngram+history,head:k=1,draft:k=4
W_ARGS="--weights ik --draft-weights ik"
SUITES=sharegpt:16,humaneval:8,wmt:8  # DESIGN.md's training prompts (suites.training_prompts)
COLLECT="adaspec router collect --arms $ARMS --suite $SUITES $W_ARGS --out data --overwrite"
TRAIN="adaspec router train data --hidden 128 --out router.pt"
$A router collect --arms $ARMS --suite $SUITES $W_ARGS --out "$W/data" --overwrite --no-progress
$A router train "$W/data" --hidden 128 --out "$W/router.pt"
OUT=src/adaspec/route/builtin/router-qwen2.5-coder-1.5b-instruct
cp "$W/router.pt" "$OUT.pt"
.venv/bin/python - "$W/data" "$OUT.json" "$COLLECT" "$TRAIN" <<'PY'
import hashlib, json, sys, time
from pathlib import Path
from adaspec.lab.bench.machine import describe_machine
data, out, *commands = sys.argv[1:]
digest = hashlib.sha256()
for f in sorted(p for p in Path(data).rglob("*") if p.is_file()):
    digest.update(f.relative_to(data).as_posix().encode())
    digest.update(f.read_bytes())
prompts = sorted({json.loads(line)["prompt_id"]
                  for line in open(Path(data) / "runs" / "results.jsonl")})
json.dump({"what": "router policy for the built-in pair (method `router` without a path)",
           "commands": commands, "data_sha256": digest.hexdigest(),
           "trained_on": prompts,
           "date": time.strftime("%Y-%m-%d"), "machine": describe_machine(),
           "regenerate": "bash experiments/router_builtin.sh"},
          open(out, "w"), indent=2)
print(f"wrote {out}")
PY
