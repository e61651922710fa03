"""How much of a call is attention, per ik_llama.cpp build, read from profiler samples.

Why: on a 2-vCPU VM the same call's wall time varies by 10-20% from minute to minute, more
than a kernel change moves it. The share of a call's samples in the attention kernels against
the share in the weights' products (the same work in every build) does not depend on how fast
the machine runs that minute, so two builds compare in one number: attention / products.

Each workload runs in a child process on the server's layout (5 sequences, a region each):
a history of `--history` tokens is prefilled, then `perf record` samples the child while it
scores a prompt chunk of `--chunk` tokens twice, or verification calls of 1 or 4 rows after
the history. `--home NAME=DIR` names an ADASPEC_HOME whose runtime is another build (its
`build.json` must list this adaspec's patch names, or flash attention stays off); without
it, this adaspec's own build.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/attention_share.py \\
        --home before=/path/to/home-with-the-older-build --home after=$HOME/.cache/adaspec \\
        --out experiments/results/ik-rows-together-epyc-avx2/attention-share.md
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ATTENTION = re.compile(r"Flash|_fa4<|iqk_flash|compute_helper|soft_max|mul_mat_Qx_Qy_MxN<|fX_fY")
PRODUCTS = re.compile(r"mul_mat_q\d|mul_mat_iq|quantize_row|up_gate")
WORKLOADS = ("chunk", "rows1", "rows4")


def child(workload: str, history: int, chunk: int, flags: Path) -> None:
    """Prefill the history, touch flags/go, run the workload, touch flags/done."""
    import random

    from adaspec.backends.gguf import gguf_file
    from adaspec.backends.ik.backend import IkLlamaBackend, context_for
    from adaspec.backends.sequences import ALL, LAST, Feed
    from adaspec.backends.weights import llama_threads
    from adaspec.store.catalog import TARGET_DEFAULT

    backend = IkLlamaBackend(gguf_file(TARGET_DEFAULT), n_threads=llama_threads(),
                             n_ctx=context_for(5), sequences=5, min_rows=None)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 30000) for _ in range(history + chunk + 8)]
    backend.feed_many([Feed(1, 0, ids[:history], LAST)])
    (flags / "go").touch()
    t0 = time.perf_counter()
    if workload == "chunk":
        for _ in range(2):
            backend.feed_many([Feed(1, history, ids[history:history + chunk], LAST)])
            backend.remove_seq(1, history)
    else:
        rows = int(workload[4:])
        for _ in range(160 // rows):
            backend.feed_many([Feed(1, history, ids[history:history + rows], ALL)])
            backend.remove_seq(1, history)
    (flags / "seconds").write_text(f"{time.perf_counter() - t0:.2f}")
    (flags / "done").touch()


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    while not path.exists():
        if proc.poll() is not None:
            raise SystemExit(f"the workload's process ended early ({proc.returncode})")
        time.sleep(0.2)


def profile(home: str | None, workload: str, args: argparse.Namespace) -> dict:
    """Samples of one workload under one build: attention and products shares, wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        flags = Path(tmp)
        env = dict(os.environ, **({"ADASPEC_HOME": home} if home else {}))
        proc = subprocess.Popen([sys.executable, __file__, "--child", workload, "--history",
                                 str(args.history), "--chunk", str(args.chunk), "--flags",
                                 tmp], env=env, stderr=subprocess.DEVNULL)
        wait_for(flags / "go", proc)
        data = flags / "perf.data"
        perf = subprocess.Popen(["perf", "record", "-F", "299", "-p", str(proc.pid), "-o",
                                 str(data)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        wait_for(flags / "done", proc)
        perf.send_signal(signal.SIGINT)
        perf.wait()
        proc.wait()
        report = subprocess.run(["perf", "report", "-i", str(data), "--sort", "symbol",
                                 "--stdio"], capture_output=True, text=True).stdout
        seconds = float((flags / "seconds").read_text())
    shares = {"attention": 0.0, "products": 0.0, "other": 0.0}
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+\[\.\]\s+(.*)", line)
        if not m:
            continue
        kind = ("attention" if ATTENTION.search(m.group(2)) else
                "products" if PRODUCTS.search(m.group(2)) else "other")
        shares[kind] += float(m.group(1))
    return {**shares, "seconds": seconds}


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--home", action="append", default=[], help="NAME=ADASPEC_HOME (repeat)")
    p.add_argument("--history", type=int, default=3000)
    p.add_argument("--chunk", type=int, default=600)
    p.add_argument("--rounds", type=int, default=2, help="runs of each build, alternating")
    p.add_argument("--out", default=None)
    p.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)
    p.add_argument("--flags", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.history, args.chunk, Path(args.flags))
        return 0
    if shutil.which("perf") is None:
        raise SystemExit("attention_share needs `perf` (Debian: linux-perf)")
    homes = [tuple(h.split("=", 1)) for h in args.home] or [("this build", "")]
    from report import write_report

    rows = []
    for workload in WORKLOADS:
        for r in range(args.rounds):
            for name, home in homes:
                got = profile(home or None, workload, args)
                rows.append((workload, name, got))
                print(f"{workload} {name} round {r + 1}: {got}", file=sys.stderr, flush=True)
    what = {"chunk": f"a prompt chunk of {args.chunk} tokens, twice",
            "rows1": "160 calls of 1 row (decoding)", "rows4": "40 calls of 4 rows (a draft)"}
    lines = [f"After a history of {args.history} tokens, the server's layout (5 sequences, a "
             "region each). Shares are of `perf` samples (299 Hz) in the child; attention: the "
             "flash-attention kernels (or the pinned kernels' products and softmax); products: "
             "the weights' quantized products. Wall seconds vary with the machine's minute; "
             "the ratio does not.", "",
             "| workload | build | attention | products | attention / products | wall s |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for workload, name, got in rows:
        ratio = got["attention"] / got["products"] if got["products"] else float("nan")
        lines.append(f"| {what[workload]} | {name} | {got['attention']:.1f}% | "
                     f"{got['products']:.1f}% | {ratio:.3f} | {got['seconds']:.2f} |")
    write_report("Attention's share of a call per build", lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
