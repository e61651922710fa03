"""`adaspec models restrict-vocab`: store the N most frequent target tokens with a draft.

    adaspec models restrict-vocab --draft qwen2.5-coder-0.5b-instruct --top 8192,16384

Counts come from the target's real outputs in bench results files (`ar` / `llamacpp` rows):
the files given with --results, else the user's own `adaspec bench` runs under ./bench-results/
(the bench's default output folder); never the repository's lab results. Then
`draft:k=4,vocab=8192` drafts with a head of 8,192 rows. Handlers return an exit code
and let AdaspecError propagate (printed by the main CLI as one line).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from adaspec.store.catalog import DRAFT_DEFAULT, TARGET_DEFAULT

# Where `adaspec bench` writes by default (bench-results/NAME/results.jsonl): the user's runs.
DEFAULT_RESULTS = "bench-results/**/results.jsonl"


def add_restrict_vocab_parser(sub: Any) -> None:
    p = sub.add_parser(
        "restrict-vocab",
        help="store the N most frequent target tokens with a draft (for draft:vocab=N)",
        description="Count token frequencies on the target's outputs recorded by `adaspec "
        "bench` (rows of plain decoding: ar, llamacpp), always keep the special tokens, fill "
        "what the counts leave open with the lowest unseen ids, and store the set next to the "
        "draft's cache with its provenance and a checksum.",
    )
    p.add_argument("--draft", default=DRAFT_DEFAULT, help="built-in name, HF dir or .gguf")
    p.add_argument(
        "--top", required=True, metavar="N[,N...]", help="set size(s), e.g. 8192 or 4096,16384"
    )
    p.add_argument(
        "--results", nargs="+", metavar="FILE",
        help="bench results.jsonl files (default: the `adaspec bench` runs in ./bench-results/, "
        f"i.e. {DEFAULT_RESULTS})",
    )
    p.add_argument(
        "--target", default=TARGET_DEFAULT,
        help="only count results files of runs with this target (default %(default)s)",
    )
    p.add_argument(
        "--exclude-prompts", default="", metavar="ID[,ID...]",
        help="prompt ids not to count (keep evaluation prompts out of the set)",
    )
    p.set_defaults(func=cmd_restrict_vocab)


def parse_sizes(text: str) -> list[int]:
    from adaspec.errors import InputError

    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--top must be integers like 8192 or 4096,16384, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise InputError(f"--top must be positive integers, got {text!r}")
    return sizes


def draft_vocabulary(draft: str) -> tuple[str, int, list[int], str | None]:
    """(model name, output-head rows, special + EOS ids, source sha256) of a draft, read
    from its prepared cache without loading the weights."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from adaspec.backends.base import eos_ids_of
    from adaspec.store.loading import MARKER, prepare

    prepared = prepare(draft)
    folder = prepared.cache_dir
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    try:
        gen = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    except OSError:
        gen = None
    specials = set(tokenizer.all_special_ids)
    specials |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    specials |= set(eos_ids_of(SimpleNamespace(generation_config=gen), tokenizer))
    source_sha = None
    marker = folder / MARKER
    if marker.is_file():
        import json

        source_sha = json.loads(marker.read_text()).get("source_sha256")
    return prepared.name, int(config.vocab_size), sorted(specials), source_sha


def cmd_restrict_vocab(args: argparse.Namespace) -> int:
    from adaspec.errors import InputError
    from adaspec.lab.bench.token_counts import count_target_outputs
    from adaspec.store.token_set import TokenSet, save_token_set, top_tokens

    sizes = parse_sizes(args.top)
    files = [Path(f) for f in args.results or []] or sorted(Path().glob(DEFAULT_RESULTS))
    if not files:
        raise InputError(
            f"no bench results to count from ({DEFAULT_RESULTS}, where `adaspec bench` writes, "
            "holds none): pass --results FILE [FILE ...], the results.jsonl of an `adaspec "
            "bench` run with the target"
        )
    excluded = [p.strip() for p in args.exclude_prompts.split(",") if p.strip()]
    counts, provenance = count_target_outputs(files, args.target, excluded)
    if not counts:
        raise InputError(
            "the results hold no target outputs (rows of method ar or llamacpp) for target "
            f"{args.target}: run `adaspec bench` first or pass other --results"
        )
    name, vocab_size, specials, source_sha = draft_vocabulary(args.draft)
    total = sum(counts.values())
    for size in sizes:
        ids = top_tokens(counts, size, vocab_size, specials)
        chosen = set(ids)
        covered = sum(c for t, c in counts.items() if t in chosen)
        seen = sum(1 for t in ids if t in counts)
        info = {
            **provenance,
            "target": args.target,
            "draft_source_sha256": source_sha,
            "vocab_size": vocab_size,
            "special_ids": specials,
            "from_counts": seen,
            "filled_by_lowest_id": size - seen - sum(1 for t in specials if t not in counts),
            "rule": "special tokens; then by count on the target outputs (ties: lower id); "
            "then the lowest unseen ids",
            "coverage_of_counted_tokens": covered / total,
        }
        path = save_token_set(TokenSet(name, tuple(ids), info))
        print(
            f"{name}: top {size} of {vocab_size} tokens ({seen} seen in {total} target tokens "
            f"of {provenance['outputs']} outputs, {len(specials)} special, the rest by lowest "
            f"id); covers {covered / total:.1%} of the counted tokens: {path}"
        )
    return 0
