"""Structured output on the built-in pair (issue 67): JSON-schema extraction prompts, every
answer validated, `auto` against constrained `ar`, and what the grammar costs a token.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/structured_speed.py \
        --out experiments/results/structured-<machine>

Prompts held out from every training set (DESIGN.md): HumanEval 60 on (describe a function),
Spec-Bench translation questions with even ids (translate, with metadata), ShareGPT
conversations from file index 12,000 on (classify and summarise a question). Each task has
its own schema (4-8 fields, nested objects, arrays, enums). In process on the fastest runtime,
methods alternating prompt by prompt; greedy (every method's answer must equal `ar`'s) and,
with `--temperature`, sampled (seeded per prompt). The mask's cost is timed around
`Constraint.mask` in this process. With `--serve`, the same requests go through `adaspec
serve` with its defaults (`--history off`: the cross-request history starts empty) as
OpenAI chat requests with `response_format` json_schema, the method named per request, and
the texts are compared instead of the token ids (the mask is not timed). A method named
`llama-server:spec=TYPE` (with `--serve`, greedy) is llama.cpp's own server, stock settings,
built by `adaspec bench build-peers`, sent the same chat request with the same
`response_format` (its grammar path: the schema turned into a GBNF grammar), in turn with
adaspec's methods prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

LANGS = ["English", "German", "French", "Chinese", "Japanese", "Spanish", "Russian", "other"]
SCHEMAS = {
    "code": {
        "type": "object",
        "properties": {
            "function": {"type": "string"},
            "arguments": {"type": "array", "maxItems": 4, "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "type": {"type": "string"}},
                "required": ["name", "type"], "additionalProperties": False}},
            "returns": {"type": "string"},
            "complexity": {"enum": ["O(1)", "O(log n)", "O(n)", "O(n log n)", "O(n^2)",
                                    "other"]},
            "summary": {"type": "string", "maxLength": 160},
            "has_examples": {"type": "boolean"},
        },
        "required": ["function", "arguments", "returns", "complexity", "summary",
                     "has_examples"],
        "additionalProperties": False,
    },
    "translation": {
        "type": "object",
        "properties": {
            "source_language": {"enum": LANGS},
            "target_language": {"enum": LANGS},
            "translation": {"type": "string", "maxLength": 400},
            "formality": {"enum": ["formal", "neutral", "informal"]},
        },
        "required": ["source_language", "target_language", "translation", "formality"],
        "additionalProperties": False,
    },
    "chat": {
        "type": "object",
        "properties": {
            "topic": {"type": "string", "maxLength": 60},
            "intent": {"enum": ["question", "request", "opinion", "chat", "other"]},
            "needs_code": {"type": "boolean"},
            "key_points": {"type": "array", "maxItems": 4,
                           "items": {"type": "string", "maxLength": 80}},
            "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
            "answer": {"type": "object",
                       "properties": {"short": {"type": "string", "maxLength": 200},
                                      "confidence": {"enum": ["low", "medium", "high"]}},
                       "required": ["short", "confidence"], "additionalProperties": False},
        },
        "required": ["topic", "intent", "needs_code", "key_points", "difficulty", "answer"],
        "additionalProperties": False,
    },
}
ASK = {
    "code": "Describe this function as JSON (its name, arguments with types, return type, "
            "time complexity, a one-sentence summary, whether the docstring has examples).",
    "translation": "Do the translation below and answer as JSON with the languages, the "
                   "translation and its formality.",
    "chat": "Classify the user's message below and answer it briefly, as JSON.",
}


def tasks(per_category: int) -> list[tuple[str, str, str]]:
    """(category, id, prompt) on held-out prompts."""
    from adaspec.lab.bench import suites
    from adaspec.lab.head.data import TRAIN_HUMANEVAL, TRAIN_SHAREGPT, sharegpt_pairs

    out = []
    code = suites.humaneval(None)[TRAIN_HUMANEVAL:]
    for p in code[:: max(1, len(code) // per_category)][:per_category]:
        out.append(("code", p.id, f"{ASK['code']}\n\n{p.text}"))
    even = [p for p in suites.spec_bench(None)
            if p.category == "translation" and int(p.id.rsplit("/", 1)[1]) % 2 == 0]
    for p in even[:per_category]:
        out.append(("translation", p.id, f"{ASK['translation']}\n\n{p.text}"))
    chat = []
    for ex in sharegpt_pairs(TRAIN_SHAREGPT, 10**9):
        if len(ex.prompt) <= 1500:
            chat.append(ex)
        if len(chat) >= 80 + per_category:
            break
    for ex in chat[80:]:
        out.append(("chat", ex.id, f"{ASK['chat']}\n\n{ex.prompt}"))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", default="ar;auto", help="method strings, separated by ;")
    p.add_argument("--per-category", type=int, default=14)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve", action="store_true",
                   help="through `adaspec serve` with its defaults, not in process")
    p.add_argument("--out", required=True)
    p.add_argument("--from-rows", action="store_true",
                   help="run nothing: summarise --out's rows.jsonl again")
    args = p.parse_args()
    if args.from_rows:
        return resummarise(Path(args.out), args)

    import jsonschema

    from adaspec.backends.load import load_backends
    from adaspec.core import grammar as grammar_mod
    from adaspec.core.grammar import Grammar
    from adaspec.core.sampling import SamplingParams
    from adaspec.methods.build import build_generator
    from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT

    mask_time = [0.0, 0]
    real_mask = grammar_mod.Constraint.mask

    def timed_mask(self):
        t0 = time.perf_counter()
        out = real_mask(self)
        mask_time[0] += time.perf_counter() - t0
        mask_time[1] += 1
        return out

    grammar_mod.Constraint.mask = timed_mask  # type: ignore[method-assign]
    methods = [m for m in args.methods.split(";") if m]
    todo = tasks(args.per_category)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.serve:
        return through_server(args, methods, todo, out)
    target, tok, draft, eos = load_backends(TARGET_DEFAULT, DRAFT_DEFAULT, "bfloat16",
                                            "fastest", "fastest")
    engines = {m: build_generator(m, target, tok, draft, eos_token_ids=eos) for m in methods}
    rows = []
    for i, (category, pid, prompt) in enumerate(todo):
        schema = SCHEMAS[category]
        grammar = Grammar.json_schema(schema)
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for m in order:
            sampling = SamplingParams(args.temperature, seed=args.seed + i if args.temperature
                                      else None, grammar=grammar)
            before = list(mask_time)
            t0 = time.perf_counter()
            res = engines[m].generate(prompt, max_new_tokens=args.max_tokens,
                                      sampling=sampling)
            wall = time.perf_counter() - t0
            try:
                jsonschema.validate(json.loads(res.text), schema)
                valid = True
            except Exception:  # noqa: BLE001 - any failure to parse or validate
                valid = False
            s = res.stats
            rows.append({
                "category": category, "id": pid, "method": m, "tokens": len(res.token_ids),
                "finish": res.finish_reason, "valid": valid, "wall_s": round(wall, 4),
                "target_calls": s.target_calls, "drafted": s.drafted, "accepted": s.accepted,
                "drafted_by": dict(s.drafted_by), "ids": res.token_ids,
                "mask_s": round(mask_time[0] - before[0], 5),
                "masks": mask_time[1] - before[1],
            })
            print(f"{category:11s} {pid:22s} {m:10s} {len(res.token_ids):4d} tok "
                  f"{wall:6.2f} s valid={valid} finish={res.finish_reason} "
                  f"calls={s.target_calls} grammar={s.drafted_by.get('grammar', 0)}",
                  flush=True)
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarise(rows, methods, args)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(table(summary, methods))
    print(table(summary, methods))
    return 0


def through_server(args, methods: list[str], todo, out: Path) -> int:
    """The same requests through `adaspec serve` (its defaults, --history off)."""
    import httpx
    import jsonschema

    sys.path.insert(0, str(REPO / "experiments"))
    from serve_load import Server

    server = Server(["--history", "off", "--model-name", "adaspec"], out / "server.log",
                    dict(__import__("os").environ))
    peers = {m: open_peer(m, out) for m in methods if m.startswith("llama-server")}
    rows = []
    try:
        with httpx.Client(timeout=600) as client:
            warm = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            for m in methods:  # a cost-aware method measures its profile once, first
                if m in peers:
                    peer_chat(peers[m], {**warm, "max_tokens": 16})
                    continue
                client.post(server.url + "/v1/chat/completions", json={**warm, "method": m})
            for i, (category, pid, prompt) in enumerate(todo):
                schema = SCHEMAS[category]
                order = methods[i % len(methods):] + methods[: i % len(methods)]
                for m in order:
                    body = {"messages": [{"role": "user", "content": prompt}],
                            "max_tokens": args.max_tokens, "temperature": args.temperature,
                            "method": m, "response_format": {"type": "json_schema",
                                                             "json_schema": {
                                                                 "name": category,
                                                                 "schema": schema}}}
                    if args.temperature:
                        body["seed"] = args.seed + i
                    t0 = time.perf_counter()
                    if m in peers:
                        del body["method"]
                        answer = peer_chat(peers[m], body)
                    else:
                        r = client.post(server.url + "/v1/chat/completions", json=body)
                        r.raise_for_status()
                        answer = r.json()
                    wall = time.perf_counter() - t0
                    text = answer["choices"][0]["message"]["content"]
                    spec = answer["usage"].get("speculation") or peer_speculation(answer)
                    try:
                        jsonschema.validate(json.loads(text), schema)
                        valid = True
                    except Exception:  # noqa: BLE001 - any failure to parse or validate
                        valid = False
                    rows.append({
                        "category": category, "id": pid, "method": m,
                        "tokens": answer["usage"]["completion_tokens"],
                        "finish": answer["choices"][0]["finish_reason"], "valid": valid,
                        "wall_s": round(wall, 4), "target_calls": spec["target_calls"],
                        "drafted": spec["drafted"], "accepted": spec["accepted"],
                        "drafted_by": spec.get("drafted_by") or {}, "ids": text,
                        "mask_s": 0.0, "masks": 0})
                    print(f"{category:11s} {pid:22s} {m:10s} {rows[-1]['tokens']:4d} tok "
                          f"{wall:6.2f} s valid={valid} calls={spec['target_calls']}",
                          flush=True)
    finally:
        server.stop()
        for peer in peers.values():
            peer.close()
    (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarise(rows, methods, args)
    summary["through"] = "adaspec serve (defaults, --history off)"
    summary["peers"] = {m: peer.describe() for m, peer in peers.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(table(summary, methods))
    print(table(summary, methods))
    return 0


def open_peer(method: str, out: Path):
    """llama.cpp's llama-server for `llama-server:spec=TYPE`, as the bench starts it."""
    from adaspec.backends.gguf import gguf_file
    from adaspec.lab.bench.llama_server import open_server_decoder
    from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT

    params = dict(kv.split("=", 1) for kv in method.partition(":")[2].split(",") if kv)
    (out / "peers").mkdir(exist_ok=True)
    return open_server_decoder(gguf_file(TARGET_DEFAULT), 0.0, params, DRAFT_DEFAULT,
                               out / "peers" / f"{params.get('spec', 'none')}.log")


def peer_chat(peer, body: dict) -> dict:
    """One chat request to llama-server's OpenAI endpoint; a crash with repacking on (its
    AMX path) falls back as the bench does, and is retried once."""
    from adaspec.lab.bench.peer_build import PeerUnavailable

    for attempt in range(2):
        try:
            status, answer = peer.server.request("POST", "/v1/chat/completions", body)
            if status == 200:
                return answer
            raise PeerUnavailable(f"llama-server answered {status}: {str(answer)[:300]}")
        except (PeerUnavailable, OSError):
            peer.server.exit_code(5.0)  # a crashing server may take a moment to die
            if attempt or not peer.fall_back("at a request"):
                raise
    raise AssertionError("unreachable")


def peer_speculation(answer: dict) -> dict:
    """adaspec's usage.speculation fields from llama-server's timings."""
    timings = answer.get("timings") or {}
    tokens = answer["usage"]["completion_tokens"]
    accepted = int(timings.get("draft_n_accepted", 0))
    return {"target_calls": 1 + max(0, tokens - 1 - accepted) if tokens else 0,
            "drafted": int(timings.get("draft_n", 0)), "accepted": accepted}


def resummarise(out: Path, args) -> int:
    """summary.json / summary.md again from out/rows.jsonl (the run's own settings)."""
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    old = json.loads((out / "summary.json").read_text())
    methods = list(old["methods"])
    args.temperature, args.max_tokens = old["temperature"], old["max_tokens"]
    summary = summarise(rows, methods, args)
    for key in ("machine", "cpu", "date", "through", "peers"):
        if key in old:
            summary[key] = old[key]
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(table(summary, methods))
    print(table(summary, methods))
    return 0


def against_peers(rows: list[dict], methods: list[str]) -> dict:
    """Each adaspec method against each llama-server method: geomean ratios by category of
    the time to the whole answer and of tokens/s."""
    by = {(r["id"], r["method"]): r for r in rows}
    cats = sorted({r["category"] for r in rows})
    ids = sorted({(r["category"], r["id"]) for r in rows})

    def gm(xs: list[float]) -> float:
        return math.exp(sum(map(math.log, xs)) / len(xs))

    out: dict = {}
    for peer in [m for m in methods if m.startswith("llama-server")]:
        for ours in [m for m in methods if not m.startswith("llama-server")]:
            cell: dict = {}
            for cat in [*cats, "all"]:
                pairs = [(by[(i, ours)], by[(i, peer)]) for c, i in ids
                         if cat in (c, "all") and (i, ours) in by and (i, peer) in by]
                if not pairs:
                    continue
                cell[cat] = {
                    "time": round(gm([p["wall_s"] / o["wall_s"] for o, p in pairs]), 3),
                    "tokens_per_s": round(gm([(o["tokens"] / o["wall_s"])
                                              / (p["tokens"] / p["wall_s"])
                                              for o, p in pairs]), 3)}
                if cat == "all":
                    cell["lowest_time"] = round(min(p["wall_s"] / o["wall_s"]
                                                    for o, p in pairs), 3)
            out[f"{ours} vs {peer}"] = cell
    return out


def summarise(rows: list[dict], methods: list[str], args) -> dict:
    base = methods[0]
    by = {(r["id"], r["method"]): r for r in rows}
    out: dict = {"machine": platform.processor() or platform.machine(),
                 "cpu": _cpu(), "date": time.strftime("%Y-%m-%d %H:%M"),
                 "temperature": args.temperature, "max_tokens": args.max_tokens,
                 "prompts": len({r["id"] for r in rows}), "methods": {},
                 "categories": sorted({r["category"] for r in rows}),
                 "against_peers": against_peers(rows, methods)}
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        cats: dict = {}
        for category in sorted({r["category"] for r in mine}):
            rs = [r for r in mine if r["category"] == category]
            ratios = [by[(r["id"], base)]["wall_s"] / r["wall_s"] * r["tokens"]
                      / max(1, by[(r["id"], base)]["tokens"]) for r in rs]
            cats[category] = {
                "valid": sum(r["valid"] for r in rs), "n": len(rs),
                "same_as_base": sum(r["ids"] == by[(r["id"], base)]["ids"] for r in rs),
                "speed_vs_base": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3),
                "tokens_per_call": round(sum(r["tokens"] for r in rs)
                                         / max(1, sum(r["target_calls"] for r in rs)), 3),
                "grammar_drafted_share": round(
                    sum(r["drafted_by"].get("grammar", 0) for r in rs)
                    / max(1, sum(r["tokens"] for r in rs)), 3),
            }
        tokens = sum(r["tokens"] for r in mine)
        out["methods"][m] = {
            "categories": cats,
            "valid": sum(r["valid"] for r in mine), "n": len(mine),
            "mask_ms_per_mask": round(1000 * sum(r["mask_s"] for r in mine)
                                      / max(1, sum(r["masks"] for r in mine)), 4),
            "mask_ms_per_token": round(1000 * sum(r["mask_s"] for r in mine)
                                       / max(1, tokens), 4),
            "mask_share_of_wall": round(sum(r["mask_s"] for r in mine)
                                        / max(1e-9, sum(r["wall_s"] for r in mine)), 4),
        }
    return out


def table(summary: dict, methods: list[str]) -> str:
    lines = [f"{summary['date']}, {summary['cpu']}, T = {summary['temperature']}, "
             f"{summary['prompts']} prompts, up to {summary['max_tokens']} tokens "
             f"(`experiments/structured_speed.py`)", "",
             "| method | category | valid | same text as `" + methods[0] + "` | end to end vs `"
             + methods[0] + "` (geomean) | tokens / target call | grammar-drafted share |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for m in methods:
        for category, c in summary["methods"][m]["categories"].items():
            same = (f"{c['same_as_base']}/{c['n']}" if not summary["temperature"]
                    else "(sampled)")
            lines.append(f"| `{m}` | {category} | {c['valid']}/{c['n']} | "
                         f"{same} | {c['speed_vs_base']:.2f}x | "
                         f"{c['tokens_per_call']:.2f} | {c['grammar_drafted_share']:.2f} |")
    peers = summary.get("against_peers") or {}
    if peers:
        lines += ["", "Against llama-server with the same `response_format` (its grammar path), "
                  "geomean over prompts: time to the whole answer (the peer's over adaspec's) "
                  "and, in brackets, tokens/s (the peer indents its JSON, so it writes more "
                  "tokens for the same answer):", "",
                  "| adaspec | peer | " + " | ".join(summary["categories"]) + " | all | "
                  "lowest prompt (time) |",
                  "| --- | --- |" + " ---: |" * (len(summary["categories"]) + 2)]
        for key, cell in peers.items():
            ours, peer = key.split(" vs ")
            lines.append(f"| `{ours}` | `{peer}` | " + " | ".join(
                f"{cell[c]['time']:.2f}x ({cell[c]['tokens_per_s']:.2f}x)"
                for c in summary["categories"]) + f" | {cell['all']['time']:.2f}x | "
                f"{cell['lowest_time']:.2f}x |")
    if summary.get("through"):  # the mask is timed in process only
        return "\n".join(lines) + f"\n\nThrough {summary['through']}.\n"
    lines += ["", "| method | mask ms (each) | mask ms a token | mask share of the wall time |",
              "| --- | ---: | ---: | ---: |"]
    for m in methods:
        s = summary["methods"][m]
        lines.append(f"| `{m}` | {s['mask_ms_per_mask']:.3f} | {s['mask_ms_per_token']:.3f} | "
                     f"{100 * s['mask_share_of_wall']:.2f}% |")
    return "\n".join(lines) + "\n"


def _cpu() -> str:
    from adaspec.cost.cache import cpu_model

    return cpu_model()


if __name__ == "__main__":
    raise SystemExit(main())
