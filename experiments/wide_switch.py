"""The 512-bit k-quant walk (`ik/patches/wide.py`) on and off in one build: the target's
calls of 1-16 rows after a 512-token prompt, the server's layout, alternating rounds.

Why: the walk was measured on an Intel Xeon (a lone row 0.53-0.63 of the kernel's time)
and turned on wherever AVX-512 was; on an AMD EPYC a lone row's plain step then took 45-49 ms
against 22-39 ms without it. `ADASPEC_IK_WIDE` switches it at load, so both run on the same
library, and their logits are compared too (the walk changes no arithmetic).

    python experiments/wide_switch.py --rounds 3 --out experiments/results/ik-wide-zen-epyc/rows.md
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import statistics
import subprocess
import sys
import time

ROWS = (1, 2, 4, 8, 16)
SEQUENCES = 5  # what `adaspec serve` runs: 4 requests besides the context's own sequence


def measure(repeats: int) -> dict:
    """Median ms of a call of n rows after a 512-token prompt, per n; the prompt's seconds;
    a digest of the logits of a 40-token block (to compare the two walks bit for bit)."""
    import hashlib

    from adaspec.backends.gguf import gguf_file
    from adaspec.backends.ik.backend import IkLlamaBackend, context_for, library
    from adaspec.backends.sequences import ALL, LAST, Feed
    from adaspec.backends.weights import llama_threads
    from adaspec.store.catalog import TARGET_DEFAULT

    backend = IkLlamaBackend(gguf_file(TARGET_DEFAULT), n_threads=llama_threads(),
                             n_ctx=context_for(SEQUENCES), sequences=SEQUENCES, min_rows=None)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 30000) for _ in range(600)]
    seq = 1
    t0 = time.perf_counter()
    backend.feed_many([Feed(seq, 0, ids[:512], LAST)])
    prompt = time.perf_counter() - t0
    out: dict = {"wide": library().adaspec_wide, "prompt_s": prompt, "ms": {}}
    for n in ROWS:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            backend.feed_many([Feed(seq, 512, ids[512:512 + n], ALL)])
            times.append(1000 * (time.perf_counter() - t0))
            backend.remove_seq(seq, 512)
        out["ms"][n] = statistics.median(times)
    block = backend.feed_many([Feed(seq, 512, ids[512:552], ALL)])[0]
    out["logits_sha256"] = hashlib.sha256(block.numpy().tobytes()).hexdigest()[:16]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of on and off")
    p.add_argument("--repeats", type=int, default=15, help="calls per row count, per round")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.child:
        print(repr(measure(args.repeats)))
        return 0
    from report import write_report

    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for walk in ("on", "off") if r % 2 == 0 else ("off", "on"):
            done = subprocess.run([sys.executable, __file__, "--child", "--repeats",
                                   str(args.repeats)], capture_output=True, text=True,
                                  env={**os.environ, "ADASPEC_IK_WIDE": walk})
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                return 1
            got = ast.literal_eval(done.stdout.strip().splitlines()[-1])
            if got["wide"] is None:
                print("this library has no wide-walk switch (`adaspec runtime build --force`)",
                      file=sys.stderr)
                return 1
            runs[walk].append(got)
            print(f"round {r + 1} wide {walk}: " + " ".join(
                f"{n}:{ms:.1f}" for n, ms in got["ms"].items()), file=sys.stderr, flush=True)
    same = {g["logits_sha256"] for v in runs.values() for g in v}
    lines = [f"The built-in target on ik_llama.cpp, {SEQUENCES} sequences (the server's layout), "
             f"a 512-token prompt, then calls of n rows; per round the median of "
             f"{args.repeats} calls, {args.rounds} rounds alternating which goes first; "
             "the table gives the best round and the range.", "",
             "| rows | wide walk on: ms | off: ms | off / on |", "| ---: | ---: | ---: | ---: |"]
    for n in ROWS:
        on = [g["ms"][n] for g in runs["on"]]
        off = [g["ms"][n] for g in runs["off"]]
        lines.append(f"| {n} | {min(on):.1f} ({min(on):.1f}-{max(on):.1f}) | {min(off):.1f} "
                     f"({min(off):.1f}-{max(off):.1f}) | {min(off) / min(on):.2f} |")
    pon = min(g["prompt_s"] for g in runs["on"])
    poff = min(g["prompt_s"] for g in runs["off"])
    lines += ["", f"512-token prompt: {pon:.2f} s on, {poff:.2f} s off.",
              f"Logits of a 40-row block, every run: "
              f"{'bit for bit the same' if len(same) == 1 else 'DIFFERENT: ' + str(same)}."]
    write_report("The 512-bit k-quant walk, on and off", lines, args.out)
    return 0 if len(same) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
