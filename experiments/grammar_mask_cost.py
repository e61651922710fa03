"""What a grammar constraint costs per token on this CPU: llguidance against xgrammar
(issue 67, part 1: pick the library by the per-token mask cost).

    .venv/bin/pip install llguidance xgrammar   # neither is a dependency yet
    .venv/bin/python experiments/grammar_mask_cost.py \
        --out experiments/results/grammar-mask-cost-<machine>

For each JSON schema below and for plain JSON (`json_object`), with the built-in target's
tokenizer (its 151,936-token vocabulary): the time to compile the grammar, then for every
token of a valid answer (compact JSON: no whitespace allowed) the time to fill the
next-token bitmask and to advance the matcher by that token (the work a constrained decode
step adds, once per verified row), and the
share of tokens the grammar forced (exactly one allowed: what a grammar drafter proposes for
free). The libraries differ by design: llguidance allows only the canonical tokenization of
a forced string (a key: one token where xgrammar also allows its prefixes), so the table
says whether its allowed set lies within xgrammar's at every position, and how many tokens
each allows on average. Medians and the 90th/99th percentiles over 5 passes.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string"}}, "required": ["street", "city", "zip"],
            "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
PERSON_ANSWER = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                 "tags": ["mathematics", "engines", "poetry"],
                 "address": {"street": "12 St James's Square", "city": "London",
                             "zip": "SW1Y 4JH"}}
TOOL = {  # a function's arguments, as a tool call constrains them
    "type": "object",
    "properties": {"location": {"type": "string"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["location", "unit", "days"], "additionalProperties": False,
}
TOOL_ANSWER = {"location": "Lisbon, Portugal", "unit": "celsius", "days": 5}
CASES = [("person schema", PERSON, PERSON_ANSWER), ("tool arguments", TOOL, TOOL_ANSWER),
         ("json_object", None, PERSON_ANSWER)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from adaspec.store.catalog import TARGET_DEFAULT
    from adaspec.store.loading import cache_dir_for

    folder = cache_dir_for(TARGET_DEFAULT)
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    torch.set_num_threads(1)
    results: dict = {"machine": platform.processor() or platform.machine(),
                     "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                     "vocab": vocab, "cases": {}}
    libs = {"llguidance": _llguidance(tok, vocab), "xgrammar": _xgrammar(tok, vocab)}
    for name, schema, answer in CASES:
        ids = tok.encode(json.dumps(answer, separators=(",", ":")), add_special_tokens=False)
        row: dict = {"tokens": len(ids)}
        masks: dict[str, list] = {}
        for lib, make in libs.items():
            t0 = time.perf_counter()
            start = make(schema)
            compile_ms = 1000 * (time.perf_counter() - t0)
            fill, advance, forced = [], [], 0
            for _ in range(args.passes):
                matcher = start()
                allowed = []
                for t in ids:
                    t1 = time.perf_counter()
                    mask = matcher.mask()
                    t2 = time.perf_counter()
                    ok = matcher.advance(t)
                    t3 = time.perf_counter()
                    if not ok:
                        raise SystemExit(f"{lib} refused token {t} of a valid answer ({name})")
                    fill.append(1000 * (t2 - t1))
                    advance.append(1000 * (t3 - t2))
                    allowed.append(mask)
                forced = sum(int(m.sum()) == 1 for m in allowed)
            masks[lib] = allowed
            row[lib] = {"compile_ms": compile_ms, "mask_ms": _spread(fill),
                        "advance_ms": _spread(advance), "forced_share": forced / len(ids)}
        for lib, allowed in masks.items():
            row[lib]["allowed_mean"] = sum(int(m.sum()) for m in allowed) / len(allowed)
        row["llguidance_within_xgrammar"] = all(
            bool((a <= b).all()) for a, b in zip(masks["llguidance"], masks["xgrammar"],
                                                  strict=True))
        results["cases"][name] = row
        print(json.dumps({name: row}), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(results, indent=1))
        (out / "summary.md").write_text(_table(results))
    print(_table(results))
    return 0


def _spread(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"median": statistics.median(s), "p90": s[int(0.9 * (len(s) - 1))],
            "p99": s[int(0.99 * (len(s) - 1))]}


class _Matcher:
    def __init__(self, mask, advance) -> None:
        self.mask, self.advance = mask, advance


def _llguidance(tok, vocab: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)

    def make(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults={"whitespace_flexible": False})
        llguidance.LLMatcher.validate_grammar(grammar, lltok)

        def start():
            m = llguidance.LLMatcher(lltok, grammar)
            bits = lltorch.allocate_token_bitmask(1, vocab)

            def mask():
                lltorch.fill_next_token_bitmask(m, bits, 0)
                return _unpack(bits[0], vocab)

            return _Matcher(mask, lambda t: m.consume_token(t))

        return start

    return make


def _xgrammar(tok, vocab: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)

    def make(schema):
        if schema is None:
            compiled = compiler.compile_builtin_json_grammar()
        else:
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                    separators=(",", ":"))

        def start():
            m = xgr.GrammarMatcher(compiled)
            bits = xgr.allocate_token_bitmask(1, vocab)

            def mask():
                m.fill_next_token_bitmask(bits)
                return _unpack(bits[0], vocab)

            return _Matcher(mask, lambda t: m.accept_token(t))

        return start

    return make


def _unpack(words, vocab: int):
    """A bitmask row of int32 words -> bool [vocab] (bit i of word w: token 32 w + i)."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    bits = (words.to(torch.int32)[:, None] >> shifts) & 1
    return bits.flatten()[:vocab].bool()


def _table(r: dict) -> str:
    lines = [f"{r['date']}, {r['machine']}, vocabulary {r['vocab']}, `{r['command']}`", "",
             "| constraint | library | compile ms | mask ms (median / p90 / p99) | advance ms "
             "(median) | tokens allowed (mean) | forced tokens | llguidance's within "
             "xgrammar's |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, row in r["cases"].items():
        for lib in ("llguidance", "xgrammar"):
            x = row[lib]
            m = x["mask_ms"]
            lines.append(f"| {name} ({row['tokens']} tokens) | {lib} | {x['compile_ms']:.1f} | "
                         f"{m['median']:.3f} / {m['p90']:.3f} / {m['p99']:.3f} | "
                         f"{x['advance_ms']['median']:.3f} | {x['allowed_mean']:.0f} | "
                         f"{x['forced_share']:.2f} | {row['llguidance_within_xgrammar']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
