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
    p.add_argument("--pause", type=float, default=2.0, help="seconds between requests")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block", type=int, default=8, help="requests per reported block")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import httpx
    from serve_load import Server

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    home = out / "home"  # the learner saves its head here, not in the user's home
    common = ["--method", args.method, "--history", "off", "--model-name", "adaspec"]
    servers = {
        "frozen": Server(common, out / "frozen.log", env),
        "learning": Server([*common, "--online-distill", "--interval", str(args.interval),
                            "--osd-dir", str(home)], out / "learning.log", env),
    }
    todo = stream(args.translation, args.chat)
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
                "online_distillation")
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
        cell["speed_learning_over_frozen"] = round(
            math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
        blocks.append(cell)
    same = sum(by[(i, "frozen")]["text"] == by[(i, "learning")]["text"] for i in range(n))
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor(),
            "command": " ".join(sys.argv), "method": args.method, "interval": args.interval,
            "pause_s": args.pause, "requests": n, "same_text": same, "blocks": blocks,
            "learner": status}


def table(s: dict) -> str:
    lines = [f"# The draft head learning while it serves, {s['date']}", "",
             f"`{s['command']}`", "",
             f"Two servers, `--method {s['method']}`, one with `--online-distill --interval "
             f"{s['interval']}`; {s['requests']} held-out requests in turn, {s['pause_s']} s "
             f"between requests; answers equal on {s['same_text']} of {s['requests']}.", "",
             "| requests | domain | acceptance, frozen | acceptance, learning | end to end, "
             "learning / frozen |", "| --- | --- | ---: | ---: | ---: |"]
    for b in s["blocks"]:
        lines.append(f"| {b['requests']} | {b['domain']} | {b['frozen']['acceptance']:.3f} | "
                     f"{b['learning']['acceptance']:.3f} | "
                     f"{b['speed_learning_over_frozen']:.2f}x |")
    lines += ["", f"The learner at the end: `{json.dumps(s['learner'])}`"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
