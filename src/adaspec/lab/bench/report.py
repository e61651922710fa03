"""Summaries of benchmark rows: per category and overall, per method, plus theory and
exactness; rendered as JSON and Markdown.

Definitions (Spec-Bench and the papers):
- speedup: plain decoding's ms/token over the method's ms/token, pooled over the *paired*
  runs (the same prompts and repeats, in the same process), i.e. a ratio of total times per
  token; the median of per-prompt ratios is reported beside it;
- decode ms/token, decode speedup: the same without the target's prompt prefill, which is the
  same work for every method (a draft's own prefill stays in: it is that method's cost);
- steady ms/token, steady speedup: the decode steps alone, the draft's prompt prefill left
  out too: what a drafting method's decisions change, apart from its fixed start-up cost;
- MAT (mean accepted tokens): new tokens per target forward pass, prefill included (1.0 for
  plain decoding);
- acceptance rate: accepted draft tokens / drafted tokens; alpha: accepted / tested tokens
  (the per-token probability of the geometric model, see `theory.per_token_alpha`);
- time split: shares of wall time spent drafting, in target forwards + verification, in the
  prefill, and elsewhere (bookkeeping, detokenising);
- bandwidth: target weight bytes read per forward x target calls / wall time;
- against a baseline method run in the same bench (`--baseline`, by default `llama-server` or
  `llamacpp` when one runs), on the paired prompts: end-to-end tokens/s (new tokens / wall
  time, prefill included), decode tokens/s (tokens after the first / time after the first)
  and time to first token, each as a ratio to the baseline's, per category, with the
  geometric mean over categories; and how many outputs equal the baseline's token for token.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from adaspec.lab.bench.exactness import TIE_TOLERANCE
from adaspec.lab.bench.theory import leviathan_speedup, per_token_alpha

OVERALL = "overall"


def row_key(row: dict) -> tuple[str, int]:
    return (str(row["prompt_id"]), int(row.get("repeat", 0)))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def decode_seconds(row: dict) -> float:
    """A run's wall time without the target's prompt prefill."""
    return row["wall_time"] - row.get("prefill_time", 0.0)


def steady_seconds(row: dict) -> float | None:
    """A run's decode steps alone: wall time without either model's prompt prefill (None
    for a drafting run recorded before the draft's prefill was timed apart)."""
    if "draft_prefill_time" not in row and row.get("draft_calls"):
        return None
    return decode_seconds(row) - row.get("draft_prefill_time", 0.0)


# The three latency scopes of a run: end to end, decode, decode steps alone.
SCOPES = {"": lambda r: r["wall_time"], "decode_": decode_seconds, "steady_": steady_seconds}


def turns(row: dict) -> int:
    return max(1, len(row.get("turn_tokens") or [1]))


def ttft_seconds(row: dict) -> float:
    """Time to first token of a run (the mean over its turns): the prefill up to the first
    token, as the engine times it and as a streaming client sees it."""
    return row.get("prefill_time", 0.0) / turns(row)


def e2e_rate(rows: list[dict]) -> float | None:
    """End-to-end tokens/s pooled over rows: new tokens / wall time, prefill included."""
    return _ratio(sum(r["new_tokens"] for r in rows), sum(r["wall_time"] for r in rows))


def decode_rate(rows: list[dict]) -> float | None:
    """Decode tokens/s pooled over rows: tokens after each turn's first / the time after it."""
    return _ratio(sum(r["new_tokens"] - turns(r) for r in rows),
                  sum(decode_seconds(r) for r in rows))


def mean_ttft(rows: list[dict]) -> float | None:
    return _ratio(sum(ttft_seconds(r) for r in rows), len(rows))


def geomean(values: Iterable[float | None]) -> float | None:
    logs = [math.log(v) for v in values if v]
    return math.exp(sum(logs) / len(logs)) if logs else None


def baseline_entry(rows: list[dict], base_by_key: dict[tuple[str, int], dict]) -> dict | None:
    """One method against the baseline on the prompts both ran: ratios of end-to-end and
    decode tokens/s (> 1: faster than the baseline) and of time to first token (< 1:
    sooner), and how many outputs equal the baseline's token for token."""
    pairs = [(base_by_key[row_key(r)], r) for r in rows
             if row_key(r) in base_by_key and r["new_tokens"]
             and base_by_key[row_key(r)]["new_tokens"]]
    if not pairs:
        return None
    base, mine = [b for b, _ in pairs], [r for _, r in pairs]
    ttft_b, ttft_m = mean_ttft(base), mean_ttft(mine)
    return {
        "paired_prompts": len(pairs),
        "e2e": _ratio(e2e_rate(mine), e2e_rate(base)),
        "decode": _ratio(decode_rate(mine), decode_rate(base)),
        "ttft": _ratio(ttft_m, ttft_b),
        "same_tokens": sum(1 for b, r in pairs if b.get("token_ids") == r.get("token_ids")),
    }


def _seconds(rows: list[dict], scope: str) -> float | None:
    """Seconds pooled over rows in one of SCOPES; None when a row lacks that figure."""
    parts = [SCOPES[scope](r) for r in rows]
    return None if None in parts else sum(parts)


def _per_token(rows: list[dict], scope: str) -> float | None:
    """Seconds per new token pooled over rows, in one of SCOPES."""
    seconds = _seconds(rows, scope)
    return None if seconds is None else seconds / sum(r["new_tokens"] for r in rows)


def method_entry(
    rows: list[dict], ar_by_key: dict[tuple[str, int], dict], target_bytes: int | None = None
) -> dict:
    """Totals and rates of one method over `rows`, speedup against the paired `ar` rows."""
    tokens = sum(r["new_tokens"] for r in rows)
    wall = sum(r["wall_time"] for r in rows)
    entry: dict = {
        "prompts": len(rows),
        "new_tokens": tokens,
        "wall_time": wall,
        "tokens_per_s": _ratio(tokens, wall),
        "ms_per_token": _ratio(1000 * wall, tokens),
        "decode_tokens_per_s": decode_rate(rows),
        "ttft_ms": None if (t := mean_ttft(rows)) is None else 1000 * t,
    }
    pairs = [
        (ar_by_key[row_key(r)], r)
        for r in rows
        if row_key(r) in ar_by_key and r["new_tokens"] and ar_by_key[row_key(r)]["new_tokens"]
    ]
    for scope in ("decode_", "steady_"):
        seconds = _seconds(rows, scope)
        entry[f"{scope}ms_per_token"] = None if seconds is None else _ratio(1000 * seconds, tokens)
    entry["paired_prompts"] = len(pairs)
    if pairs:
        ar_rows, my_rows = [a for a, _ in pairs], [r for _, r in pairs]
        for scope in SCOPES:
            entry[f"{scope}speedup"] = _ratio(
                _per_token(ar_rows, scope), _per_token(my_rows, scope)
            )
        entry["median_prompt_speedup"] = statistics.median(
            (a["wall_time"] / a["new_tokens"]) / (r["wall_time"] / r["new_tokens"])
            for a, r in pairs
            if r["wall_time"] > 0
        )
    else:
        for scope in SCOPES:
            entry[f"{scope}speedup"] = None
        entry["median_prompt_speedup"] = None
    calls = sum(r.get("target_calls", 0) for r in rows)
    drafted = sum(r.get("drafted", 0) for r in rows)
    steps = [tuple(s) for r in rows for s in r.get("steps") or []]
    entry.update(
        target_calls=calls,
        draft_calls=sum(r.get("draft_calls", 0) for r in rows),
        drafted=drafted,
        accepted=sum(r.get("accepted", 0) for r in rows),
        mean_accepted_tokens=_ratio(tokens, calls),
        acceptance_rate=_ratio(sum(r.get("accepted", 0) for r in rows), drafted),
        alpha=per_token_alpha(steps),
        mean_draft_length=_ratio(sum(s[0] for s in steps), len(steps)),
    )
    drafted_by: dict[str, int] = {}  # drafted tokens per part of the drafter (S2D exits)
    for r in rows:
        for part, n in (r.get("drafted_by") or {}).items():
            drafted_by[part] = drafted_by.get(part, 0) + n
    if drafted_by:
        entry["drafted_by"] = drafted_by
    parts = {
        k: sum(r.get(k, 0.0) for r in rows) for k in ("prefill_time", "draft_time", "verify_time")
    }
    parts["other_time"] = max(0.0, wall - sum(parts.values()))
    entry["time_split"] = {k: (v / wall if wall else 0.0) for k, v in parts.items()}
    if target_bytes and wall:
        entry["target_gbs"] = target_bytes * calls / wall / 1e9
        forward_time = parts["prefill_time"] + parts["verify_time"]
        entry["target_gbs_in_forward"] = (
            target_bytes * calls / forward_time / 1e9 if forward_time else None
        )
    divs = [r["divergence"] for r in rows if r.get("divergence")]
    # Other weights (llama.cpp's quantized GGUF): differences are a quality figure, not bugs.
    entry["other_weights"] = any(r.get("other_weights") for r in rows)
    entry["differs_from_ar"] = len(divs) + sum(1 for r in rows if r.get("weights_difference"))
    entry["numerical_ties"] = sum(1 for d in divs if d["kind"] == "tie")
    entry["bugs"] = sum(1 for d in divs if d["kind"] == "bug")
    return entry


def theory_entry(rows: list[dict], ar_by_key: dict[tuple[str, int], dict]) -> dict | None:
    """Leviathan et al.'s predicted improvement and the oracle speculation length, from the
    costs measured in this run. None when the rows carry no draft steps."""
    steps = [tuple(s) for r in rows for s in r.get("steps") or []]
    draft_calls = sum(r.get("draft_calls", 0) for r in rows)
    pairs = [(ar_by_key[row_key(r)], r) for r in rows if row_key(r) in ar_by_key]
    ar_rows = [a for a, _ in pairs]
    ar_decode_calls = sum(max(a.get("target_calls", 0) - 1, 0) for a in ar_rows)
    if not steps or not draft_calls or not ar_decode_calls:
        return None
    t_target = sum(a.get("verify_time", 0.0) for a in ar_rows) / ar_decode_calls
    t_draft = (  # one draft step: the draft's prompt prefill is no step
        sum(r.get("draft_time", 0.0) - r.get("draft_prefill_time", 0.0) for r in rows)
        / draft_calls
    )
    my_decode_calls = sum(max(r.get("target_calls", 0) - 1, 0) for r in rows)
    t_verify = (
        sum(r.get("verify_time", 0.0) for r in rows) / my_decode_calls if my_decode_calls else None
    )
    alpha = per_token_alpha(steps)
    gamma = sum(s[0] for s in steps) / len(steps)
    c = t_draft / t_target if t_target else None
    out: dict = {
        "alpha": alpha,
        "gamma": gamma,
        "c": c,
        "draft_call_ms": 1000 * t_draft,
        "target_call_ms": 1000 * t_target,
        "verify_call_ms": None if t_verify is None else 1000 * t_verify,
        "leviathan_speedup": (
            leviathan_speedup(alpha, gamma, c) if alpha is not None and c is not None else None
        ),
    }
    oracle_pairs = [(a, r) for a, r in pairs if a.get("oracle")]
    if oracle_pairs and t_verify is not None:
        n = sum(a["oracle"]["new_tokens"] for a, _ in oracle_pairs)
        calls = sum(a["oracle"]["target_calls"] for a, _ in oracle_pairs)
        dcalls = sum(a["oracle"]["draft_calls"] for a, _ in oracle_pairs)
        secs = (
            sum(a.get("prefill_time", 0.0) for a, _ in oracle_pairs)
            + (calls - len(oracle_pairs)) * t_verify
            + dcalls * t_draft
        )
        ar_ms = 1000 * sum(a["wall_time"] for a, _ in oracle_pairs) / n if n else None
        oracle_ms = 1000 * secs / n if n else None
        out.update(
            oracle_mat=_ratio(n, calls),
            oracle_draft_calls=dcalls,
            oracle_ms_per_token=oracle_ms,
            oracle_speedup=_ratio(ar_ms or 0.0, oracle_ms or 0.0),
        )
    return out


def _ordered(values: Iterable[str]) -> list[str]:
    seen: list[str] = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def summarize(
    rows: list[dict],
    methods: list[str] | None = None,
    target_bytes: int | None = None,
    theory_methods: Iterable[str] = (),
    tie_tolerance: float = TIE_TOLERANCE,
    baseline: str | None = None,
) -> dict:
    """Per category and overall, per method. Rows without a category count as `all`.
    `tie_tolerance`: the target runtime's, which the run judged divergences with.
    `baseline`: a method to take end-to-end, decode and first-token ratios against (each
    method's `vs_baseline`; `baseline` holds the geometric means over categories and the
    per-prompt figures)."""
    methods = methods or _ordered(r["method"] for r in rows)
    categories = _ordered(r.get("category", "all") for r in rows)
    theory_methods = set(theory_methods)
    result: dict = {
        "methods": {},
        "categories": {},
        "theory": {},
        "theory_by_category": {},
        "exactness": {},
    }
    for scope in [*categories, OVERALL]:
        scoped = [r for r in rows if scope == OVERALL or r.get("category", "all") == scope]
        ar_by_key = {row_key(r): r for r in scoped if r["method"] == "ar"}
        base_by_key = {row_key(r): r for r in scoped if r["method"] == baseline}
        per_method = {}
        theory = {}
        for m in methods:
            mine = [r for r in scoped if r["method"] == m]
            if not mine:
                continue
            per_method[m] = method_entry(mine, ar_by_key, target_bytes)
            if baseline is not None:
                per_method[m]["vs_baseline"] = baseline_entry(mine, base_by_key)
            if m in theory_methods:
                t = theory_entry(mine, ar_by_key)
                if t is not None:
                    theory[m] = {"speedup": per_method[m]["speedup"], **t}
        if scope == OVERALL:
            result["methods"] = per_method
            result["theory"] = theory
        else:
            result["categories"][scope] = per_method
            result["theory_by_category"][scope] = theory
    divergences = [
        {
            "prompt_id": r["prompt_id"],
            "category": r.get("category", "all"),
            "method": r["method"],
            "repeat": r.get("repeat", 0),
            **r["divergence"],
        }
        for r in rows
        if r.get("divergence")
    ]
    checked = [r for r in rows if r["method"] != "ar" and r.get("exactness_checked", True)]
    other = {}
    for m in _ordered(r["method"] for r in rows if r.get("other_weights")):
        mine = [r for r in rows if r["method"] == m and "weights_difference" in r]
        firsts = [r["weights_difference"]["index"] for r in mine if r["weights_difference"]]
        other[m] = {
            "compared": len(mine),
            "differ": len(firsts),
            "first_difference": sorted(firsts),
            "runtime": any(r.get("other_runtime") for r in rows if r["method"] == m),
        }
    result["exactness"] = {
        "tie_tolerance": tie_tolerance,
        "checked": len(checked),
        "differs": len(divergences),
        "numerical_ties": sum(1 for d in divergences if d["kind"] == "tie"),
        "bugs": sum(1 for d in divergences if d["kind"] == "bug"),
        "divergences": divergences,
    }
    if other:
        result["exactness"]["other_weights"] = other
    if baseline is not None and any(r["method"] == baseline for r in rows):
        result["baseline"] = baseline_summary(result, rows, methods, baseline)
    return result


def baseline_summary(result: dict, rows: list[dict], methods: list[str], baseline: str) -> dict:
    """The geometric mean over categories of every method's ratios to the baseline, and the
    per-prompt figures (tokens/s end to end and in decode, time to first token, and their
    ratios to the baseline's run of the same prompt)."""
    geo = {}
    for m in methods:
        per_cat = [c.get(m, {}).get("vs_baseline") for c in result["categories"].values()]
        per_cat = [v for v in per_cat if v]
        geo[m] = {k: geomean(v[k] for v in per_cat) for k in ("e2e", "decode", "ttft")}
    base = {row_key(r): r for r in rows if r["method"] == baseline}
    prompts = []
    for r in rows:
        b = base.get(row_key(r))
        dec = decode_rate([r])
        entry = {
            "prompt_id": r["prompt_id"], "category": r.get("category", "all"),
            "method": r["method"], "repeat": r.get("repeat", 0),
            "new_tokens": r["new_tokens"], "tokens_per_s": e2e_rate([r]),
            "decode_tokens_per_s": dec, "ttft_ms": 1000 * ttft_seconds(r),
        }
        if b is not None and r["new_tokens"] and b["new_tokens"]:
            entry.update(
                e2e_ratio=_ratio(e2e_rate([r]), e2e_rate([b])),
                decode_ratio=_ratio(dec, decode_rate([b])),
                ttft_ratio=_ratio(ttft_seconds(r), ttft_seconds(b)),
                same_tokens=b.get("token_ids") == r.get("token_ids"),
            )
        prompts.append(entry)
    return {"method": baseline, "geomean_over_categories": geo, "per_prompt": prompts}


# ------------------------------------------------------------------------ markdown
def _x(v: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:{fmt}}{suffix}"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def method_table(entries: dict, bandwidth: float | None = None) -> list[str]:
    lines = [
        "| method | tokens/s | ms/token | speedup vs ar | decode ms/token (speedup) "
        "| steady ms/token (speedup) | MAT "
        "| acceptance | target calls | draft calls | draft / verify / other | target GB/s "
        "| differs (ties / bugs) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: "
        "| --- |",
    ]
    for m, e in entries.items():
        s = e["time_split"]
        split = (
            f"{s['draft_time']:.0%} / {s['verify_time'] + s['prefill_time']:.0%} / "
            f"{s['other_time']:.0%}"
        )
        gbs = _x(e.get("target_gbs"), ".1f")
        if bandwidth and e.get("target_gbs") is not None:
            gbs += f" ({e['target_gbs'] / bandwidth:.0%})"
        differs = f"{e['differs_from_ar']} ({e['numerical_ties']} / {e['bugs']})"
        if e.get("other_weights"):
            differs = f"{e['differs_from_ar']} (other weights)"
        lines.append(
            f"| `{m}` | {_x(e['tokens_per_s'])} | {_x(e['ms_per_token'], '.0f')} | "
            f"{_x(e['speedup'], '.2f', 'x')} | {_x(e.get('decode_ms_per_token'), '.0f')} "
            f"({_x(e.get('decode_speedup'), '.2f', 'x')}) | "
            f"{_x(e.get('steady_ms_per_token'), '.0f')} "
            f"({_x(e.get('steady_speedup'), '.2f', 'x')}) | {_x(e['mean_accepted_tokens'])} | "
            f"{_pct(e['acceptance_rate']) if e['drafted'] else 'n/a'} | {e['target_calls']} | "
            f"{e['draft_calls']} | {split} | {gbs} | {differs} |"
        )
    return lines


def _matrix(summary: dict, field: str, fmt) -> list[str]:
    cats = list(summary["categories"])
    methods = list(summary["methods"])
    lines = [
        "| method | " + " | ".join(cats) + " | overall |",
        "| --- |" + " ---: |" * (len(cats) + 1),
    ]
    for m in methods:
        cells = [fmt(summary["categories"][c].get(m, {}).get(field)) for c in cats]
        cells.append(fmt(summary["methods"][m].get(field)))
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return lines


def baseline_markdown(summary: dict) -> list[str]:
    """The section against the baseline method: ratios per category with their geometric
    mean, absolute speeds, and per prompt."""
    base = summary["baseline"]["method"]
    geo = summary["baseline"]["geomean_over_categories"]
    cats = list(summary["categories"])
    methods = list(summary["methods"])
    lines = [
        f"## Against `{base}`",
        "",
        f"Ratios to `{base}` on the same prompts in this run: end-to-end tokens/s (new tokens "
        "/ wall time, prefill included) / decode tokens/s (tokens after the first / time after "
        "the first); > 1 is faster. Geomean = geometric mean over categories. First token = "
        "time to first token over the baseline's (< 1 is sooner). Same tokens = greedy outputs "
        f"equal to `{base}`'s token for token.",
        "",
        "| method | " + " | ".join(cats) + " | geomean | first token | same tokens |",
        "| --- |" + " ---: |" * (len(cats) + 2) + " ---: |",
    ]

    def pair(v: dict | None) -> str:
        if not v:
            return "n/a"
        return f"{_x(v.get('e2e'), '.2f', 'x')} / {_x(v.get('decode'), '.2f', 'x')}"

    for m in methods:
        overall = summary["methods"][m].get("vs_baseline")
        cells = [pair(summary["categories"][c].get(m, {}).get("vs_baseline")) for c in cats]
        same = f"{overall['same_tokens']} / {overall['paired_prompts']}" if overall else "n/a"
        ttft = _x(geo.get(m, {}).get("ttft"), ".2f") if overall else "n/a"
        lines.append(f"| `{m}` | " + " | ".join(cells) + f" | {pair(geo.get(m))} | {ttft} | "
                     f"{same} |")
    lines += [
        "",
        "| method | tokens/s end to end | decode tokens/s | time to first token |",
        "| --- | ---: | ---: | ---: |",
    ]
    for m, e in summary["methods"].items():
        lines.append(f"| `{m}` | {_x(e['tokens_per_s'], '.1f')} | "
                     f"{_x(e.get('decode_tokens_per_s'), '.1f')} | "
                     f"{_x(e.get('ttft_ms'), '.0f', ' ms')} |")
    per_prompt = summary["baseline"]["per_prompt"]
    ids = list(dict.fromkeys((p["prompt_id"], p["repeat"]) for p in per_prompt))
    by = {(p["prompt_id"], p["repeat"], p["method"]): p for p in per_prompt}
    lines += [
        "",
        f"Per prompt: end-to-end / decode tokens/s ratio to `{base}`, time to first token in "
        "ms.",
        "",
        "| prompt | " + " | ".join(f"`{m}`" for m in methods if m != base)
        + f" | `{base}` tokens/s (first token) |",
        "| --- |" + " ---: |" * len(methods),
    ]
    for pid, rep in ids:
        cells = []
        for m in methods:
            if m == base:
                continue
            p = by.get((pid, rep, m))
            cells.append("n/a" if p is None or "e2e_ratio" not in p else
                         f"{_x(p['e2e_ratio'], '.2f')} / {_x(p['decode_ratio'], '.2f')} "
                         f"({p['ttft_ms']:.0f})")
        b = by.get((pid, rep, base))
        mine = "n/a" if b is None else f"{_x(b['tokens_per_s'], '.1f')} ({b['ttft_ms']:.0f})"
        name = pid if rep == 0 else f"{pid} (repeat {rep})"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mine} |")
    lines.append("")
    return lines


def to_markdown(summary: dict) -> str:
    cfg = summary.get("config", {})
    mach = summary.get("machine", {})
    bw = summary.get("bandwidth", {})
    lines = ["# adaspec bench", ""]
    if cfg:
        top_p = f", top-p {cfg.get('top_p')}" if cfg.get("temperature") else ""
        lines.append(
            f"Suites {', '.join(cfg.get('suites', []))}; {cfg.get('prompts', '?')} prompts; "
            f"{cfg.get('max_new_tokens')} new tokens; temperature {cfg.get('temperature')}"
            f"{top_p}; "
            f"{cfg.get('repeats', 1)} repeat(s); target `{cfg.get('target')}`, draft "
            f"`{cfg.get('draft')}`, {cfg.get('dtype')}. Methods alternate prompt by prompt in "
            "one process after a warm-up; speedup = ratio of paired ms/token over `ar`."
        )
        lines.append("")
    if mach:
        lines.append(
            (f"GPU: {mach['gpu']}; host: " if mach.get("gpu") else "Machine: ")
            + f"{mach.get('cpu')} ({mach.get('isa') or 'ISA not recorded'}), "
            f"{mach.get('cores')} cores, {mach.get('threads')} "
            f"torch threads, {mach.get('memory_gb')} GB RAM; torch {mach.get('torch')}, "
            f"transformers {mach.get('transformers')}."
        )
    models = summary.get("models", {})
    if models.get("target_kind"):
        lines.append(f"Runtime settings: target `{models['target_kind']}`, draft "
                     f"`{models.get('draft_kind')}`.")
    if bw:
        lines.append(
            ("Measured GPU memory bandwidth: " if bw.get("device") == "cuda"
             else "Measured memory bandwidth: ")
            + f"{bw['copy_gbs']:.1f} GB/s (copy), {bw['gemv_gbs']:.1f} GB/s "
            f"({bw['gemv_dtype']} GEMV) [{bw['method']}]. Target GB/s below = weight "
            "bytes per forward x target calls / wall time (share of the GEMV figure)."
        )
    lines += ["", "## Overall", ""]
    lines += method_table(summary["methods"], bw.get("gemv_gbs"))
    lines += [
        "",
        "Time split: verify includes the prefill. Decode = without the target's prompt prefill "
        "(the same work for every method; a draft's own prefill stays in).",
        "",
    ]
    if len(summary["categories"]) > 1:
        lines += ["## Speedup by category", ""]
        lines += _matrix(summary, "speedup", lambda v: _x(v, ".2f", "x"))
        lines += ["", "## Decode speedup by category", ""]
        lines += _matrix(summary, "decode_speedup", lambda v: _x(v, ".2f", "x"))
        lines += ["", "## MAT by category", ""]
        lines += _matrix(summary, "mean_accepted_tokens", _x)
        lines += ["", "## Acceptance rate by category", ""]
        lines += _matrix(summary, "acceptance_rate", _pct)
        lines.append("")
    if summary.get("theory"):
        lines += [
            "## Theory beside practice",
            "",
            "alpha = per-token acceptance (accepted / tested), gamma = mean draft length, "
            "c = draft call / plain target call (both measured in this run). Leviathan = "
            "(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)). Oracle = the draft drafts "
            "exactly until its first mismatch with the target (teacher-forced draft pass over "
            "`ar`'s output), costed with this method's measured draft and verify call times.",
            "",
            "| method | measured speedup | alpha | gamma | c | Leviathan | MAT | oracle MAT "
            "| oracle speedup |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for m, t in summary["theory"].items():
            mat = summary["methods"][m]["mean_accepted_tokens"]
            lines.append(
                f"| `{m}` | {_x(t['speedup'], '.2f', 'x')} | {_x(t['alpha'])} | "
                f"{_x(t['gamma'], '.1f')} | {_x(t['c'])} | {_x(t['leviathan_speedup'], '.2f', 'x')}"
                f" | {_x(mat)} | {_x(t.get('oracle_mat'))} | "
                f"{_x(t.get('oracle_speedup'), '.2f', 'x')} |"
            )
        lines.append("")
    if summary.get("baseline"):
        lines += baseline_markdown(summary)
    ex = summary.get("exactness", {})
    lines += ["## Exactness", ""]
    if cfg and cfg.get("temperature"):
        lines.append("Sampling run (temperature > 0): outputs are not compared token by token.")
    elif not ex.get("differs"):
        lines.append(
            f"All {ex.get('checked', 0)} greedy outputs equal plain decoding (`ar`) token for "
            "token."
        )
    else:
        lines.append(
            f"**{ex['differs']} of {ex['checked']} greedy outputs differ from plain decoding: "
            f"{ex['numerical_ties']} numerical tie(s), {ex['bugs']} BUG(S).** A tie: the top-2 "
            f"logit gap of the reference at the first differing token is at most "
            f"{ex.get('tie_tolerance', TIE_TOLERANCE)}, the target runtime's measured kernel "
            "noise (0.125: one bf16 ulp at magnitude 16-32; 0.5 for the llama.cpp runtimes)."
        )
        lines.append("")
        lines.append(
            "| prompt | method | repeat | turn | first differing token | top-2 gap | kind |"
        )
        lines.append("| --- | --- | ---: | ---: | ---: | ---: | --- |")
        for d in ex["divergences"]:
            lines.append(
                f"| {d['prompt_id']} | `{d['method']}` | {d['repeat']} | {d.get('turn', 0)} | "
                f"{d['index']} | {d['gap']:.3f} | {d['kind'].upper()} |"
            )
    for m, o in ex.get("other_weights", {}).items():
        if o.get("runtime"):
            what, why = ("another runtime (transformers' kernels on the same checkpoint's "
                         "plain weights)", "kernel rounding at near-ties, not a bug")
        else:
            weights = ("llama.cpp on the quantized GGUF" if m == "llamacpp"
                       else "a quantized target")
            what, why = f"other weights ({weights})", "a quality difference, not a bug"
        lines += [
            "",
            f"`{m}` runs {what}, so it is not part of the exactness "
            f"check: {o['differ']} of {o['compared']} greedy outputs differ from `ar` ({why})"
            + (f"; first differing token at {o['first_difference']}." if o["differ"] else "."),
        ]
    if summary.get("plots"):
        lines += ["", "## Plots", ""]
        lines += [f"![{p}]({p})" for p in summary["plots"]]
    return "\n".join(lines) + "\n"
