"""The draft head learning while it serves, measured where users meet it (issue 66): two
`adaspec serve` processes with the same head method, one with `--online-distill`, sent the
same stream of held-out prompts in turn (which one goes first alternates), one user pausing
between requests as a person does.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/head_online_serve.py \
        --out experiments/results/head-online-serve-<machine>

The stream: Spec-Bench translation questions with even ids, then ShareGPT conversations past
file index 12,000 (none trains anything; DESIGN.md), greedy, 128 tokens, OpenAI chat
requests, `--history off`. Per block of the stream: acceptance and end-to-end tokens/s of
each server; answers compared (they must be equal: the target decides every token); the
learner's /health at the end. Writes rows.jsonl, summary.json, summary.md.

`--prompts FILE` streams a file's prompts instead (a JSON list of {"id", "prompt"}; the
domain is the id's prefix), for example a kind the head never trained on: English to French
(`experiments/osd_stream.py` writes it from the WMT sentences). The summary then compares
the first and the last `--window` requests, and each request's time on the learning server
with the frozen one's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "experiments"))


def stream(translation: int, chat: int) -> list[tuple[str, str, str]]:
    """(domain, id, prompt): held-out translation questions, then held-out chat."""
    from adaspec.lab.bench import suites
    from adaspec.lab.head.data import TRAIN_SHAREGPT, sharegpt_pairs

    even = [p for p in suites.spec_bench(None)
            if p.category == "translation" and int(p.id.rsplit("/", 1)[1]) % 2 == 0]
    out = [("translation", p.id, p.text) for p in even[:translation]]
    for ex in sharegpt_pairs(TRAIN_SHAREGPT + 500, 10**9):  # past the structured bench's
        if len(ex.prompt) <= 1200:
            out.append(("chat", ex.id, ex.prompt))
        if len(out) >= translation + chat:
            break
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="head:k=1")
    p.add_argument("--translation", type=int, default=32)
    p.add_argument("--chat", type=int, default=16)
    p.add_argument("--interval", type=int, default=8)
    p.add_argument("--backoff", type=int, default=4,
                   help="the learning server's --osd-head-backoff (1: learn from every request)")
    p.add_argument("--pause", type=float, default=2.0, help="seconds between requests")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block", type=int, default=8, help="requests per reported block")
    p.add_argument("--prompts", default="", help="a JSON list of {id, prompt} to stream")
    p.add_argument("--window", type=int, default=50,
                   help="requests at each end of the stream compared")
    p.add_argument("--history", default="off", help="the servers' --history (off: the head "
                   "alone learns across requests)")
    p.add_argument("--control", action="store_true",
                   help="neither server learns: what the per-request ratios read with nothing "
                        "changed (this host's noise)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import httpx
    from serve_load import Server

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    home = out / "home"  # the learner saves its head here, not in the user's home
    common = ["--method", args.method, "--history", args.history, "--model-name", "adaspec"]
    servers = {
        "frozen": Server(common, out / "frozen.log", env),
        "learning": Server(common if args.control else [
            *common, "--online-distill", "--interval", str(args.interval), "--osd-dir",
            str(home), "--osd-head-backoff", str(args.backoff)], out / "learning.log", env),
    }
    todo = (stream(args.translation, args.chat) if not args.prompts else
            [(r["id"].split("/")[0], r["id"], r["prompt"])
             for r in json.loads(Path(args.prompts).read_text())])
    rows = []
    try:
        with httpx.Client(timeout=600) as client:
            for server in servers.values():  # warm-up (a cost profile on first use)
                client.post(server.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
            for i, (domain, pid, prompt) in enumerate(todo):
                order = list(servers) if i % 2 == 0 else list(reversed(servers))
                for name in order:
                    body = {"messages": [{"role": "user", "content": prompt}],
                            "max_tokens": args.max_tokens, "temperature": 0}
                    t0 = time.perf_counter()
                    r = client.post(servers[name].url + "/v1/chat/completions", json=body)
                    wall = time.perf_counter() - t0
                    r.raise_for_status()
                    answer = r.json()
                    spec = answer["usage"]["speculation"]
                    rows.append({"i": i, "domain": domain, "id": pid, "server": name,
                                 "tokens": answer["usage"]["completion_tokens"],
                                 "wall_s": round(wall, 4), "drafted": spec["drafted"],
                                 "accepted": spec["accepted"],
                                 "text": answer["choices"][0]["message"]["content"]})
                    time.sleep(args.pause)
                a, b = rows[-2], rows[-1]
                print(f"{i:3d} {domain:11s} {pid:24s} " + "  ".join(
                    f"{r['server']}: {r['accepted']}/{r['drafted']} {r['wall_s']:.2f}s"
                    for r in (a, b)), flush=True)
            status = client.get(servers["learning"].url + "/health").json().get(
                "online_distillation", "control: neither server learns")
    finally:
        for server in servers.values():
            server.stop()
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarise(rows, args, status)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = table(summary)
    (out / "summary.md").write_text(md)
    print(md)
    return 0


def summarise(rows: list[dict], args, status: dict | None) -> dict:
    by = {(r["i"], r["server"]): r for r in rows}
    n = max(r["i"] for r in rows) + 1
    blocks = []
    for start in range(0, n, args.block):
        ids = range(start, min(n, start + args.block))
        cell: dict = {"requests": f"{start + 1}-{ids[-1] + 1}",
                      "domain": "/".join(sorted({by[(i, 'frozen')]["domain"] for i in ids}))}
        for name in ("frozen", "learning"):
            rs = [by[(i, name)] for i in ids]
            cell[name] = {"acceptance": round(sum(r["accepted"] for r in rs)
                                              / max(1, sum(r["drafted"] for r in rs)), 4)}
        ratios = [(by[(i, "learning")]["tokens"] / by[(i, "learning")]["wall_s"])
                  / (by[(i, "frozen")]["tokens"] / by[(i, "frozen")]["wall_s"]) for i in ids]
        cell["speed_learning_over_frozen"] = _geomean(ratios)
        blocks.append(cell)
    same = sum(by[(i, "frozen")]["text"] == by[(i, "learning")]["text"] for i in range(n))
    ends = {}
    for end, ids in (("first", range(min(n, args.window))),
                     ("last", range(max(0, n - args.window), n))):
        ends[end] = {name: round(sum(by[(i, name)]["accepted"] for i in ids)
                                 / max(1, sum(by[(i, name)]["drafted"] for i in ids)), 4)
                     for name in ("frozen", "learning")}
        ends[end]["speed_learning_over_frozen"] = _geomean(
            [(by[(i, "frozen")]["wall_s"] / by[(i, "frozen")]["tokens"])
             / (by[(i, "learning")]["wall_s"] / by[(i, "learning")]["tokens"])
             for i in ids if by[(i, "learning")]["tokens"]])
    # each request's time per token, learning over frozen (> 1: slower while learning runs)
    slow = sorted(((by[(i, "learning")]["wall_s"] / max(1, by[(i, "learning")]["tokens"]))
                   / (by[(i, "frozen")]["wall_s"] / max(1, by[(i, "frozen")]["tokens"]))
                   for i in range(n)), reverse=True)
    return {"ends": ends, "window": args.window,
            "slowdown": {"worst": round(slow[0], 3), "p95": round(slow[len(slow) // 20], 3),
                         "over_1.10": sum(x > 1.10 for x in slow)},
            "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor(),
            "command": " ".join(sys.argv), "method": args.method, "interval": args.interval,
            "backoff": args.backoff, "pause_s": args.pause, "requests": n, "same_text": same,
            "blocks": blocks, "control": args.control,
            "learner": status}


def _geomean(xs: list[float]) -> float:
    return round(math.exp(sum(map(math.log, xs)) / len(xs)), 3) if xs else float("nan")


def table(s: dict) -> str:
    lines = [f"# The draft head learning while it serves, {s['date']}", "",
             f"`{s['command']}`", "",
             ("Control: two servers, neither learning (\"learning\" below is the second), "
              f"`--method {s['method']}`; " if s["control"] else
              f"Two servers, `--method {s['method']}`, one with `--online-distill --interval "
              f"{s['interval']}`; ")
             + f"{s['requests']} held-out requests in turn, {s['pause_s']} s between requests; "
             f"answers equal on {s['same_text']} of {s['requests']}.", "",
             "| requests | domain | acceptance, frozen | acceptance, learning | end to end, "
             "learning / frozen |", "| --- | --- | ---: | ---: | ---: |"]
    for b in s["blocks"]:
        lines.append(f"| {b['requests']} | {b['domain']} | {b['frozen']['acceptance']:.3f} | "
                     f"{b['learning']['acceptance']:.3f} | "
                     f"{b['speed_learning_over_frozen']:.2f}x |")
    e, w = s["ends"], s["window"]
    lines += ["", f"First {w} requests: acceptance frozen {e['first']['frozen']:.3f}, learning "
              f"{e['first']['learning']:.3f}, speed learning / frozen "
              f"{e['first']['speed_learning_over_frozen']:.2f}x; last {w}: "
              f"{e['last']['frozen']:.3f} / {e['last']['learning']:.3f}, "
              f"{e['last']['speed_learning_over_frozen']:.2f}x.", "",
              f"Each request's time per token, learning over frozen: worst "
              f"{s['slowdown']['worst']:.2f}, 95th percentile {s['slowdown']['p95']:.2f}, "
              f"{s['slowdown']['over_1.10']} of {s['requests']} above 1.10.",
              "", f"The learner at the end: `{json.dumps(s['learner'])}`"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
