"""The draft head through `adaspec serve` (issue 65): held-out prompts, greedy, each method
named per request; every answer must be `ar`'s, one at a time and several together.

    .venv/bin/python experiments/head_serve.py --methods "head:k=1,weights=int8" \
        --out experiments/results/head-serve-<machine>

The server runs with its defaults (`--max-batch 4`: the multi-sequence runtime) and
`--history off`, so no answer finds an earlier one. Per prompt: `ar`, then each method,
alone; then each method on `--together` prompts at once. Prompts are head_e2e's held-out ones.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = "qwen2.5-coder-1.5b-instruct"  # the built-in target, the id the server lists
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "experiments"))


def ask(port: int, prompt: str, method: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "method": method}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.loads(resp.read())
    spec = out["usage"]["speculation"]
    return {"text": out["choices"][0]["message"]["content"], "wall": time.perf_counter() - t0,
            "drafted": spec["drafted"], "accepted": spec["accepted"],
            "drafted_by": spec.get("drafted_by"), "tokens": out["usage"]["completion_tokens"]}


def wait_ready(port: int, proc: subprocess.Popen, limit: float = 600.0) -> None:
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            raise SystemExit(f"adaspec serve exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit("adaspec serve did not get ready")


def main() -> int:
    from concurrency_sweep import serve_this_checkout
    from head_e2e import held_out_prompts

    p = argparse.ArgumentParser()
    p.add_argument("--methods", default="head:k=1,weights=int8",
                   help="method strings beside ar, separated by ;")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--categories", default="translation,chat,code")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--together", type=int, default=4)
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--out", default="experiments/results/head-serve")
    args = p.parse_args()
    methods = args.methods.split(";")
    wanted = set(args.categories.split(","))
    prompts = [x for x in held_out_prompts(args.per_category) if x[0] in wanted]

    serve_this_checkout()
    log = open(Path("/tmp") / f"head-serve-{args.port}.log", "w")  # noqa: SIM115
    run = "import sys; from adaspec.cli import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", run, "serve", "--method", methods[0],
                             "--port", str(args.port), "--history", "off"],
                            stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        wait_ready(args.port, proc)
        ask(args.port, "Warm up.", "ar", 8)
        for cat, pid, text in prompts:
            row = {"category": cat, "id": pid,
                   "ar": ask(args.port, text, "ar", args.max_tokens)}
            for m in methods:
                row[m] = ask(args.port, text, m, args.max_tokens)
            rows.append(row)
            print(json.dumps({"id": pid, **{m: row[m]["text"] == row["ar"]["text"]
                                            for m in methods}}), flush=True)
        together: dict[str, list[bool]] = {}
        for m in methods:
            for start in range(0, len(prompts), args.together):
                group = list(enumerate(prompts))[start : start + args.together]
                got: dict[int, dict] = {}

                def one(i: int, text: str, method: str, got: dict[int, dict] = got) -> None:
                    got[i] = ask(args.port, text, method, args.max_tokens)

                threads = [threading.Thread(target=one, args=(i, t[2], m)) for i, t in group]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                together.setdefault(m, []).extend(
                    got[i]["text"] == rows[i]["ar"]["text"] for i, _ in group)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()

    summary = {"machine": platform.processor() or platform.machine(),
               "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
               "prompts": len(rows), "methods": {}}
    lines = [f"{summary['date']}, {summary['machine']}, `{summary['command']}` "
             "(adaspec serve with its defaults, --history off; greedy)", "",
             "| method | alone: same text as `ar` | together: same text as `ar` | acceptance "
             "| end to end vs `ar` alone (geomean) | lowest prompt |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for m in methods:
        same = sum(r[m]["text"] == r["ar"]["text"] for r in rows)
        drafted = sum(r[m]["drafted"] for r in rows)
        ratios = [r["ar"]["wall"] / r[m]["wall"] for r in rows]
        s = {"alone_equal": same, "together_equal": sum(together[m]),
             "together": len(together[m]),
             "acceptance": sum(r[m]["accepted"] for r in rows) / drafted if drafted else 0.0,
             "vs_ar_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)),
             "min_vs_ar": min(ratios)}
        summary["methods"][m] = s
        lines.append(f"| `{m}` | {same}/{len(rows)} | {s['together_equal']}/{s['together']} | "
                     f"{s['acceptance']:.2f} | {s['vs_ar_geomean']:.2f}x | "
                     f"{s['min_vs_ar']:.2f}x |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
