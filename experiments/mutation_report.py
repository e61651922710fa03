"""Per-module mutation scores from mutmut's results (mutants/**/*.meta), for docs/mutation.md.

    python experiments/mutation_report.py                 # print the table
    python experiments/mutation_report.py --write docs/mutation.md
    python experiments/mutation_report.py --survivors     # surviving mutants, one a line
    python experiments/mutation_report.py --record --write docs/mutation.md  # add mutants/ first
    python experiments/mutation_report.py --globs integrity   # a group's mutant name patterns
    python experiments/mutation_report.py --unchecked engine verify   # not yet run, by group
    python experiments/mutation_report.py --unchecked engine --sample 0.2 --seed 1  # a sample

The decode path counts every mutant of its modules; the store modules count only the
integrity functions below (checksums, the hash record, atomic writes), the group `make
mutation` runs there. Score = (killed + timeout) / (every mutant checked, survivors, and
mutants no selected test reaches). Survivors listed in EQUIVALENT are shown with the reason
they cannot be killed, and a second score leaves them out; the first score is never
adjusted. `--write` replaces the text between the `<!-- scores -->` and `<!-- /scores -->`
markers of the page and keeps the rest.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import random
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"
# Every mutant result measured so far, per function and the hash of its code (mutmut's), so
# runs on different machines and sessions add up: `--record` adds this machine's.
LEDGER = ROOT / "experiments" / "results" / "mutation" / "ledger.json"

# The store's integrity code: whole atomic.py, the checksum functions of the others.
INTEGRITY = {
    "adaspec.store.atomic": ["*"],
    "adaspec.store.assembly": [
        "sha256_file", "_read_chunks", "_hash_record_path", "_stat_key", "remember_sha256",
        "recalled_sha256", "cached_sha256", "check_gguf_magic", "check_assembled",
        "_write_parts", "assemble",
    ],
    "adaspec.store.loading": ["verify_cache_dir", "_read_marker", "_cache_is_current"],
}

# Survivors judged equivalent (no test can tell them from the original): name -> reason.
# "CPU" ones are equivalent where tensors live on the CPU (every test, this project's default
# runtime); "precision" ones change float64 arithmetic to float32 in a draw, which moves a
# draw only when a uniform falls within ~1e-7 of a CDF step.
_E = {
    "core.sampling.x_process_logits": {
        20: "top_k == V keeps every token either way (topk of all V)",
        29: "torch.topk's default dim is -1",
        54: 'float("-INF") is float("-inf")',
        62: "torch.sort's default dim is -1",
        104: 'float("-INF") is float("-inf")',
    },
    "core.text.xǁTextAssemblerǁtokens_through_stop": {
        4: "the extra check at n = 1 decodes the empty prefix, which holds no (non-empty) stop",
    },
    "draft.model_tree.x_choose_branching": {3: "c[:None] is c"},
    "engine.loop.x__eos_ids": {16: "getattr(..., None) or [] is [] as getattr(..., []) or []"},
    "engine.loop.xǁEngineǁdecode": {
        101: "a request's draft_time is 0 until the draft starts: = and += agree",
        84: "a stop string is found in the step whose token completes it, so at least one of "
            "the step's tokens is kept",
        118: "the request's length check keeps prompt + max_new_tokens within max_context, so "
             "remaining - 1 is always the tighter bound",
        115: "the request's length check keeps prompt + max_new_tokens within max_context, so "
             "remaining - 1 is always the tighter bound",
        46: "drafter_started is only read for truthiness",
    },
    "core.proposal.xǁProposalǁtarget_inputs": {
        2: "torch.tensor of Python ints is int64 already",
        4: "torch.tensor of Python ints is int64 already (dtype left out)",
    },
    "core.text.xǁTextAssemblerǁ__init__": {
        6: "whole-text decoding gives the same text (slower)",
        10: "not None == not False", 16: "whole-text decoding gives the same text (slower)",
    },
    "core.text.xǁTextAssemblerǁ_text": {
        15: "the decoded prefix is kept more often; each kept one ends on a whole character",
        16: "the decoded prefix is kept one token later: the same text",
    },
    "core.text.xǁTextAssemblerǁpush": {
        29: "text[sent:safe] is empty when safe <= sent",
        30: "text[sent:safe] is empty when safe == sent",
    },
    "core.text.x__held_back": {
        23: "s[:n] for n >= len(s) is s, which push has already cut as a stop string",
    },
    "draft.ngram.xǁNgramDrafterǁ__init__": {
        14: "_reset() sets _tokens before any use", 15: "_reset() sets _index before any use",
    },
    "draft.ngram.xǁNgramDrafterǁ_reset": {
        5: "the extra tables (n below n_min) are filled but never read by the lookup",
        8: "the extra table (n_max + 1) is filled but never read by the lookup",
    },
    "draft.ngram.xǁNgramDrafterǁ_extend": {
        6: "re-indexing from the start writes each n-gram's latest end again: the same index",
    },
    "draft.model.x_roll_back_to_common_prefix": {
        2: "within a request the cache and the context both start with the prompt's first "
           "token, so skipping its comparison changes nothing",
        14: "at n == len(cached) the truncation and the del cut nothing",
    },
    "draft.model.xǁModelDrafterǁ__init__": {2: "start() sets _cached before any use"},
    "draft.model.xǁModelDrafterǁpropose": {
        1: "a chain drafter never reads `replacement` (it has no siblings to draw)",
        17: "the greedy branch never reads probs",
    },
    "verify.multi_candidate.x__check_step_args": {
        24: "precision: mixed float32/float64 inputs kept in their own dtypes",
        44: "q is [B, V]: shape[+1] is its last dim",
    },
    "draft.model_tree.xǁAutoTreeDrafterǁ_observe": {
        12: "the level below the tree's depth has no children: the loop breaks there anyway",
        15: "break -> return: nothing follows the loop",
        46: "hit is None implies rank == len(kids) (None is never a child)",
        49: "break -> return: nothing follows the loop",
    },
    "draft.model_tree.xǁAutoTreeDrafterǁpropose": {
        20: "ModelTreeDrafter.propose never reads the controller (a tree's shape is fixed)",
    },
    "draft.model_tree.x_draw_children": {
        3: "precision: float32 CDF", 5: "precision: float32 CDF",
        6: "cumsum(+1) on [f, V] is cumsum(-1)", 15: "precision: float32 uniforms",
        19: "precision: float32 uniforms", 36: "searchsorted's default is right=False",
        43: "precision: float32 remainder", 50: "sum(+1) on [f, V] is sum(-1)",
        60: "cumsum(+1) on [f, V] is cumsum(-1)", 66: "precision: float32 uniforms",
        70: "precision: float32 uniforms", 94: "searchsorted's default is right=False",
        28: "u / total = u * total for rows that sum to 1 (the input contract), up to rounding",
    },
    "draft.ngram.xǁNgramDrafterǁpropose": {1: "an n-gram chain never reads `replacement`"},
    "draft.model_tree.xǁModelTreeDrafterǁstart": {
        6: '_tree = "": a commit before any proposal has no fed nodes to read from it',
        8: "the first proposal's _sync resets _fed (the cache holds only the prompt then)",
    },
    "draft.model_tree.xǁModelTreeDrafterǁpropose": {
        44: "logits are [n, V]: shape[+1] is V",
        73: "parents and picks always have the same length: strict has nothing to refuse",
        106: "the backends cast the tree mask to bool (ones are True either way)",
        118: "torch.full with an int fill is int64",
        95: "the new level's nodes are the tree's last: one column past the end is no column",
    },
    "draft.model_tree.xǁModelTreeDrafterǁ_sync": {
        1: "at equal lengths nothing was fed: the cut is to the cache's own length, and "
           "propose sets _tree anew",
        5: "propose sets _tree before any commit reads it",
    },
    "engine.loop.xǁTextGeneratorǁgenerate": {
        3: "stream always ends with a GenerationResult: the sentinel is never returned",
    },
    "core.sampling.x_sample_rows": {
        5: "precision: a float32 CDF", 15: "precision: float32 uniforms",
        16: "CPU: device=None",
        39: "searchsorted's default is right=False",
    },
    "core.sampling.x_argmax": {
        1: "CPU: detach() lets the numpy path take a tensor that requires grad (same answer)",
    },
    "verify.greedy.xǁGreedyVerifierǁverify": {
        21: "torch.tensor of Python ints is int64, argmax's dtype",
    },
    "draft.model_tree.xǁModelTreeDrafterǁ__init__": {
        6: "start() sets _fed before any proposal", 7: "start() sets _fed before any proposal",
    },
    "draft.ngram.xǁNgramDrafterǁ_sync": {
        3: "a context equal to the indexed tokens is rebuilt from scratch: same index, slower",
        5: "extending by an empty tail changes nothing",
    },
    "core.text.xǁTextAssemblerǁfinal_text": {4: "text[:None] is text"},
    "draft.s2d.xǁS2DDrafterǁpropose": {
        1: "a chain drafter never reads `replacement` (it has no siblings to draw)",
    },
    "draft.s2d.xǁS2DDrafterǁ__init__": {
        18: "exits[:n] and thresholds[:n] past their ends are the whole tuples either way",
        33: "propose() sets _used before any step",
    },
    "draft.s2d_artifact.x_extract": {
        41: "bool(None) is False", 47: "transformers configs always set tie_word_embeddings",
        44: "transformers configs always set tie_word_embeddings",
        59: "every key matches (the model's own state names): strict has nothing to refuse",
        61: "load_state_dict's default is strict=True",
        62: "every key matches (the model's own state names): strict has nothing to refuse",
    },
    "draft.sorted_model.xǁSortedDraftLMǁfull_logits": {13: 'float("-INF") is float("-inf")'},
    "draft.sorted_model.xǁSortedDraftLMǁexit_hidden": {
        14: "input_ids are [b, n]: shape[+1] is shape[-1]",
    },
    "draft.sorted_model.x_rope": {
        9: "an int64 arange over an int is true division: the same float32 values",
        13: "an int64 arange over an int is true division: the same float32 values",
        23: "freqs is [n, d/2]: dim +1 is dim -1",
    },
    "draft.sorted_model.xǁAttentionǁ__init__": {
        9: "nn.Linear's default is bias=True", 18: "nn.Linear's default is bias=True",
        27: "nn.Linear's default is bias=True", 33: "bias=None is falsy: no bias, as bias=False",
    },
    "draft.sorted_model.xǁAttentionǁforward": {
        65: "the past keys and values always have the same length",
        66: "keys are [b, heads, L, d]: shape[+2] is shape[-2]",
        67: "an empty past (heads > 0 always) concatenates to k itself",
        74: "keys are [b, heads, L, d]: dim +2 is dim -2",
        82: "values are [b, heads, L, d]: dim +2 is dim -2",
        85: "keys are [b, heads, L, d]: shape[+2] is shape[-2]",
    },
    "draft.sorted_model.xǁMLPǁ__init__": {
        5: "bias=None is falsy: no bias, as bias=False",
        13: "bias=None is falsy: no bias, as bias=False",
        21: "bias=None is falsy: no bias, as bias=False",
    },
    "draft.sorted_model.xǁSortedDraftLMǁ__init__": {
        42: "register_buffer's default is persistent=True",
        49: "bias=None is falsy: no bias, as bias=False",
    },
    "draft.s2d_artifact.x_load": {
        49: "every key matches (the artifact's own names): strict has nothing to refuse",
        51: "load_state_dict's default is strict=True",
        52: "every key matches (the artifact's own names): strict has nothing to refuse",
    },
    "draft.s2d_artifact.x_read_manifest": {
        6: "the locale's encoding is UTF-8 on every machine here (C.UTF-8)",
        8: "encoding names are case-insensitive",
    },
    "draft.s2d_artifact.x_source_files": {
        6: "prepare's default dtype is bfloat16",
        30: "progress=None draws a bar only on a terminal; the tests have none",
        32: "progress=None (the default) draws a bar only on a terminal; the tests have none",
        23: "the folder is local: transformers reads it without the hub either way",
        25: "the folder is local: transformers reads it without the hub either way",
        27: "the folder is local: transformers reads it without the hub either way",
    },
    "draft.sorted_model.x__cat": {
        5: "a hidden state's width is never 0; cat with an empty a gives b anyway",
        11: "torch.cat's default dim is 0",
    },
    "draft.sorted_model.xǁExitStateǁtruncate": {
        1: "at length == total every segment keeps all it has: nothing to cut",
        2: "segment 0 runs every position, so its pending is always None and above unread",
        25: "an empty pending tensor and None are the same to _cat and every reader",
    },
    "core.token_tree.xǁTokenTreeǁpositions": {
        3: "torch.tensor of Python ints is int64", 5: "torch.tensor of Python ints is int64",
    },
    "core.token_tree.xǁTokenTreeǁflatten": {2: "torch.tensor of Python ints is int64"},
    "draft.model_tree.xǁModelTreeDrafterǁ_accept_path": {
        9: "always compacting: keeping a prefix of the cache is the same cut",
        10: "compacting (all but an empty path): keeping a prefix of the cache is the same cut",
        25: "torch.tensor of Python ints is int64 already",
    },
    "verify.multi_candidate.x_mcss_step": {
        16: "precision: float32 uniforms", 17: "CPU: device=None", 22: "CPU: default device",
        21: "precision: float32 uniforms", 26: "torch.full with an int fill is int64",
        30: "torch.full with an int fill is int64",
        128: "q_i updated after the last candidate is never read",
    },
    "verify.multi_candidate.x__follow": {
        9: "every reader tests choice < 0 / >= 0, not -1",
        26: "every reader tests choice < 0 / >= 0, not -1",
    },
    "verify.multi_candidate.xǁTreeWalkVerifierǁwalk_regular": {
        36: "torch.full with an int fill is int64",
        103: "at the last level there are no candidates, so every walk stops and go is empty; "
             "an empty go updates nothing",
        54: "after the last level every walk has stopped: the loop breaks",
    },
    "verify.multi_candidate.xǁMCSSWithoutReplacementVerifierǁstep": {
        5: "replacement=None is falsy, as False",
    },
    "verify.multi_candidate.xǁMCNSVerifierǁstep": {2: "mcns_step never reads q"},
    "store.atomic.x_temp_path": {6: "13 hex digits instead of 12: names stay unique"},
    "store.atomic.x_write_text": {
        2: '"UTF-8" names the same codec', 5: "atomic_open defaults text to utf-8",
        7: 'atomic_open\'s default mode is "w"', 8: "atomic_open defaults text to utf-8",
    },
    "store.atomic.x_trim_torn_tail": {
        18: "read() at the last byte returns that byte", 19: "read(2) at the last byte: 1 byte",
        33: "read block size 128 KiB: the same lines found", 34: "read block size 128 KiB",
        39: "reading to the end from an earlier block adds only bytes without a newline",
        57: "whole is only read for truthiness",
    },
    "draft.auto.xǁAutoDrafterǁpropose": {
        1: "auto proposes chains: `replacement` unused",
        16: "the plain option has n = 0, which takes the plain branch whatever its label",
        17: "the plain option has n = 0, which takes the plain branch whatever its label",
        18: "kind 'plain' takes the plain branch whatever its n",
        77: "a draft option under another label still falls through to the draft branch",
        78: "a draft option under another label still falls through to the draft branch",
        81: "max over (value, kind, n) tuples: ties go to 'plain' first either way",
        83: "max over (value, kind, n) tuples: ties go to 'plain' first either way",
        86: "an option with n = 0 ties with plain, which max picks first",
        112: "Choice.start is never read", 116: "Choice.start is never read",
        19: "ngram_tokens is only read after the n-gram lookup assigns it",
        20: "match is only read after the n-gram lookup assigns it",
        21: "match is only read after the n-gram lookup assigns it",
        24: "lookup_with_match returns no tokens for limit 0 (its index syncs to the context "
            "at the next lookup anyway)",
        55: "limit 0: the draft option is (1 / plain price, n = 0), a tie plain wins",
        88: "the plain option has n = 0, which takes the plain branch whatever its label",
        89: "the plain option has n = 0, which takes the plain branch whatever its label",
    },
    "draft.auto.xǁAutoDrafterǁ_draft": {
        26: "cost_keeps_drafting looks ahead at most limit - n: step_ms[limit + 1] unread",
        33: "at limit tokens the cost rule's look-ahead is empty, so the loop breaks there "
            "(propose never calls _draft with limit 0)",
        121: "Choice.start is never read", 125: "Choice.start is never read",
    },
    "draft.auto.xǁAutoDrafterǁcommit": {
        10: "NgramDrafter.commit ignores the path (it syncs to the context)",
        13: "no draft model means it never started",
        16: "ModelDrafter.commit ignores the path (it syncs to the context)",
    },
    "draft.auto.xǁAutoDrafterǁstart": {
        2: "the engine never commits before a proposal, which sets _last",
        3: "_model_started is only read for truthiness",
    },
    "draft.auto.xǁAutoDrafterǁ__init__": {
        25: "start() resets it before any use", 26: "start() resets it before any use",
        27: "start() resets it before any use",
    },
    "verify.multi_candidate.xǁMCSSVerifierǁstep": {10: "mcss_step's default is replacement=True"},
    "verify.speculative.xǁSpeculativeSamplerǁverify": {
        18: "torch.tensor of Python ints is int64 already", 21: "ditto (dtype inferred int64)",
        19: "CPU: device=None", 22: "CPU: default device",
    },
    "verify.speculative.x__pad_vocab": {
        6: "F.pad by (0, 0) returns the same values", 12: "F.pad by (0, 0) returns the same values",
    },
    "verify.speculative.x_speculative_sample": {
        58: "precision: target rows kept float32 while the draft's are float64 (mixed inputs)",
        67: "precision: draft rows kept in their own float dtype",
        69: "CPU: device=None", 71: "CPU: default device", 83: "CPU: device=None",
        70: "int32 ids index and gather as int64 ones in this torch",
        72: "int32 ids index and gather as int64 ones in this torch",
        85: "CPU: default device", 96: "CPU: device=None", 99: "CPU: default device",
        114: "precision: float32 uniforms", 115: "CPU: device=None",
        119: "precision: float32 uniforms", 120: "CPU: default device",
        168: "a residual mass exactly equal to the smallest normal float: measure zero",
    },
    "control.cursor.xǁGenerationCursorǁstart": {3: "_open is only read for truthiness"},
    "control.cursor.xǁGenerationCursorǁend_step": {5: "_open is only read for truthiness"},
    "control.disco.xǁDiscoLengthǁstart": {1: "max_tokens resets _step before any keep_drafting"},
    "control.disco.xǁDiscoLengthǁ__init__": {
        60: "stop=tau never reads step_ms; stop=cost sets it below",
        89: "max_tokens resets _step before any keep_drafting",
        91: "start() resets the running mean before every request (the engine calls it)",
        92: "start() resets the running mean before every request (the engine calls it)",
    },
    "store.atomic.x__owner_pid": {
        5: "rsplit without a limit: [-2] is the same field (the pid)",
        8: "rsplit limit 3: [-2] is the same field (the pid)",
    },
    "store.atomic.x_replace_dir": {
        10: 'old = "": shutil.rmtree("", ignore_errors=True) in `finally` does nothing',
        32: 'old = "" after the put-back: the same no-op rmtree',
    },
    "store.assembly.x__hash_record_path": {4: "a 21-character key: still one record per path"},
    "store.assembly.x__stat_key": {4: "the record file is already per path"},
    "store.assembly.x_assemble": {
        10: "rehash=None is falsy, as False",
        27: "a pip command holds one `pip install`", 32: "a pip command holds one `pip install`",
    },
}
# `draft.model_tree.PricedTreeDrafter` was `AutoTreeDrafter` (issue 32): the ledger keeps the
# results measured under the old name, a new run records them under the new one.
for _f in ("_observe", "propose"):
    _E[f"draft.model_tree.xǁPricedTreeDrafterǁ{_f}"] = (
        _E[f"draft.model_tree.xǁAutoTreeDrafterǁ{_f}"])

EQUIVALENT: dict[str, str] = {
    f"adaspec.{func}__mutmut_{n}": reason
    for func, reasons in _E.items() for n, reason in reasons.items()
}

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests",
          34: "skipped", 35: "suspicious", 36: "timeout", -24: "timeout", 24: "timeout",
          152: "timeout", 255: "timeout", -11: "segfault", -9: "segfault",
          37: "caught by type check", 2: "interrupted", None: "not checked"}


def integrity_globs() -> list[str]:
    out = []
    for module, funcs in INTEGRITY.items():
        for f in funcs:
            out.append(f"{module}.*" if f == "*" else f"{module}.x_{f}__mutmut_*")
    return out


def counted(module: str, mutant: str) -> bool:
    if not module.startswith("adaspec.store."):
        return True
    return any(fnmatch.fnmatch(mutant, g) for g in integrity_globs()
               if g.startswith(module + "."))


def _module_of(meta: Path) -> str:
    return ".".join(meta.relative_to(MUTANTS / "src").with_suffix("").with_suffix("").parts)


def _split(module: str, mutant: str) -> tuple[str, int]:
    """'adaspec.core.text.xǁTǁpush__mutmut_3' -> ('xǁTǁpush', 3)."""
    function, number = mutant.removeprefix(module + ".").rsplit("__mutmut_", 1)
    return function, int(number)


def local() -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    """module -> ({mutant: status}, {function: hash}) from this machine's mutants/ folder."""
    out = {}
    for meta in sorted(MUTANTS.glob("src/**/*.py.meta")):
        module = _module_of(meta)
        data = json.loads(meta.read_text())
        statuses = {m: STATUS.get(c, f"exit {c}") for m, c in data["exit_code_by_key"].items()
                    if counted(module, m)}
        if statuses:
            out[module] = (statuses, data["hash_by_function_name"])
    return out


def read_ledger() -> dict:
    return json.loads(LEDGER.read_text()) if LEDGER.is_file() else {}


def record(found: dict[str, tuple[dict[str, str], dict[str, str]]]) -> int:
    """Add this machine's checked mutants to the ledger; a function whose code changed
    (another hash) starts over. Returns how many mutant results were written."""
    ledger = read_ledger()
    written = 0
    for module, (statuses, hashes) in found.items():
        per_function: dict[str, dict[int, str]] = {}
        for mutant, status in statuses.items():
            function, number = _split(module, mutant)
            per_function.setdefault(function, {})[number] = status
        for function, numbers in per_function.items():
            entry = ledger.setdefault(module, {}).get(function)
            if entry is None or entry["hash"] != hashes.get(function):
                entry = {"hash": hashes.get(function), "status": {}}
            old = {n: st for st, ns in entry["status"].items() for n in ns}
            new = {n: st for n, st in numbers.items() if st != "not checked"}
            written += len(new)
            old.update(new)
            entry["mutants"] = len(numbers)
            entry["status"] = {st: sorted(n for n, s2 in old.items() if s2 == st)
                               for st in sorted(set(old.values()))}
            ledger[module][function] = entry
    LEDGER.parent.mkdir(parents=True, exist_ok=True)
    tmp = LEDGER.with_suffix(".tmp")
    tmp.write_text(_ledger_text(ledger))
    tmp.replace(LEDGER)
    return written


def _ledger_text(ledger: dict) -> str:
    """JSON with one line per function (small diffs when a run adds results)."""
    def dump(value) -> str:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)

    modules = []
    for module in sorted(ledger):
        functions = ",\n".join(f"  {dump(f)}: {dump(e)}" for f, e in sorted(ledger[module].items()))
        modules.append(f" {dump(module)}: {{\n{functions}\n }}")
    return "{\n" + ",\n".join(modules) + "\n}\n"


def load() -> dict[str, dict[str, str]]:
    """module -> {mutant name: status}: this machine's results, and where it has not checked
    a mutant, the ledger's (if the function's code is the one the ledger measured). With no
    mutants/ folder the ledger alone gives the table."""
    ledger = read_ledger()
    found = local() if MUTANTS.is_dir() else {}
    results: dict[str, dict[str, str]] = {}
    for module in sorted(set(found) | set(ledger)):
        statuses, hashes = found.get(module, ({}, {}))
        merged = dict(statuses)
        for function, entry in ledger.get(module, {}).items():
            if hashes and hashes.get(function) != entry["hash"]:
                continue  # the code changed since: its old results do not count
            known = {n: st for st, ns in entry["status"].items() for n in ns}
            for n in range(1, entry["mutants"] + 1):
                name = f"{module}.{function}__mutmut_{n}"
                if not counted(module, name):
                    continue
                if merged.get(name, "not checked") == "not checked":
                    merged[name] = known.get(n, "not checked")
        if merged:
            results[module] = dict(sorted(merged.items()))
    return results


GROUPS = {
    "engine": ["engine.loop", "core.proposal", "core.sampling", "core.token_tree",
               "core.text"],
    "draft": ["draft.model", "draft.model_tree", "draft.ngram", "draft.rates", "draft.base"],
    "auto": ["draft.auto"],
    "s2d": ["draft.s2d", "draft.s2d_artifact", "draft.sorted_model"],
    "verify": ["verify."],
    "control": ["control.", "lab.bench.oracle"],
    "integrity": ["store."],
}


def group_globs(groups: list[str]) -> list[str]:
    """Mutant name patterns for `mutmut run`: a module's every mutant, or for the store
    only its integrity functions."""
    out: list[str] = []
    for g in groups:
        out += integrity_globs() if g == "integrity" else [
            f"adaspec.{p}*" if p.endswith(".") else f"adaspec.{p}.*" for p in GROUPS[g]]
    return out


def in_groups(module: str, groups: list[str]) -> bool:
    short = module.removeprefix("adaspec.")
    return any(short == p or (p.endswith(".") and short.startswith(p))
               for g in groups for p in GROUPS[g])


def group_of(module: str) -> str:
    return "integrity" if module.startswith("adaspec.store.") else "decode"


def table(results: dict[str, dict[str, str]]) -> str:
    head = ("| module | mutants | killed | timeout | survived | no tests | not checked "
            "| score | equivalent | score without them |")
    lines = [head, "|" + " --- |" * 10]
    totals: dict[str, Counter] = {}
    for module, statuses in results.items():
        c = Counter(statuses.values())
        eq = sum(1 for m, s in statuses.items() if s == "survived" and m in EQUIVALENT)
        c["equivalent"] = eq
        c["total"] = len(statuses)
        totals.setdefault(group_of(module), Counter()).update(c)
        lines.append(row(module.removeprefix("adaspec."), c))
    for group, c in totals.items():
        lines.append(row(f"**{group} (all)**", c))
    lines.append("")
    for group in totals:
        lines.append(estimate(group, results))
    return "\n".join(lines)


def estimate(group: str, results: dict[str, dict[str, str]]) -> str:
    """The group's score over all its mutants, estimated from what was checked: each module's
    checked mutants are a random sample of it (or all of it), so the modules are strata and
    the estimate weighs each module's score by its size; 95% interval from the stratified
    variance with the finite-population correction."""
    strata = []
    for module, statuses in results.items():
        if group_of(module) != group:
            continue
        killed, n = _killed_checked(Counter(statuses.values()))
        strata.append((len(statuses), n, killed))
    size = sum(N for N, n, _ in strata if n)
    if not size:
        return f"- {group}: nothing checked yet"
    mean = sum(N / size * k / n for N, n, k in strata if n)
    var = sum((N / size) ** 2 * (k / n) * (1 - k / n) / max(n - 1, 1) * (1 - n / N)
              for N, n, k in strata if n)
    unmeasured = sum(N for N, n, _ in strata if not n)
    tail = (f" ({unmeasured} mutants in modules with none checked are left out)"
            if unmeasured else "")
    return (f"- **{group}**, estimated over all {size} mutants of the measured modules: "
            f"{100 * mean:.1f}% killed, 95% interval {100 * (mean - 1.96 * var ** 0.5):.1f}% "
            f"to {100 * min(1.0, mean + 1.96 * var ** 0.5):.1f}%{tail}")


def _killed_checked(c: Counter) -> tuple[int, int]:
    killed = c["killed"] + c["timeout"]
    return killed, killed + c["survived"] + c["no tests"] + c["suspicious"] + c["segfault"]


def row(name: str, c: Counter) -> str:
    killed, checked = _killed_checked(c)
    score = f"{100 * killed / checked:.1f}%" if checked else "-"
    rest = checked - c["equivalent"]
    score_eq = f"{100 * killed / rest:.1f}%" if rest else "-"
    return (f"| {name} | {c['total']} | {c['killed']} | {c['timeout']} | {c['survived']} "
            f"| {c['no tests']} | {c['not checked']} | {score} | {c['equivalent']} "
            f"| {score_eq} |")


def survivors(results: dict[str, dict[str, str]]) -> list[str]:
    return [m for statuses in results.values() for m, s in statuses.items()
            if s in ("survived", "no tests")]


def equivalent_list(results: dict[str, dict[str, str]]) -> str:
    lines = []
    for statuses in results.values():
        for m, s in statuses.items():
            if s == "survived" and m in EQUIVALENT:
                lines.append(f"- `{m.removeprefix('adaspec.')}`: {EQUIVALENT[m]}")
    return "\n".join(lines) or "(none)"


def open_survivors(results: dict[str, dict[str, str]]) -> str:
    """Survivors not judged equivalent, counted per function: the tests still missing."""
    per = Counter(m.removeprefix("adaspec.").rsplit("__mutmut_", 1)[0]
            for statuses in results.values() for m, s in statuses.items()
            if s in ("survived", "no tests") and m not in EQUIVALENT)
    return "\n".join(f"- `{f}`: {n}" for f, n in sorted(per.items())) or "(none)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="replace the scores block of this page")
    ap.add_argument("--survivors", action="store_true")
    ap.add_argument("--record", action="store_true",
                    help="add this machine's results (mutants/) to the ledger first")
    ap.add_argument("--globs", nargs="+", choices=sorted(GROUPS), metavar="GROUP",
                    help="print the mutant name patterns of these groups (for `mutmut run`)")
    ap.add_argument("--unchecked", nargs="+", choices=sorted(GROUPS), metavar="GROUP",
                    help="print the mutants of these groups not run yet (for `mutmut run`)")
    ap.add_argument("--sample", type=float, default=1.0, metavar="SHARE",
                    help="with --unchecked: a random share of each module's unchecked "
                         "mutants (an unbiased estimate of the score when all cannot run)")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    args = ap.parse_args()
    if args.globs:
        print(" ".join(f"'{g}'" for g in group_globs(args.globs)))
        return 0
    if args.record:
        if not MUTANTS.is_dir():
            print("no mutants/ folder: run `make mutation` first", file=sys.stderr)
            return 1
        print(f"recorded {record(local())} mutant results in {LEDGER.relative_to(ROOT)}")
    if not MUTANTS.is_dir() and not LEDGER.is_file():
        print("no results: run `make mutation` first", file=sys.stderr)
        return 1
    results = load()
    if args.unchecked:
        rng = random.Random(args.seed)
        picked: list[str] = []
        for module, statuses in results.items():
            if in_groups(module, args.unchecked):
                todo = [m for m, st in statuses.items() if st == "not checked"]
                n = len(todo) if args.sample >= 1 else round(args.sample * len(todo))
                picked += sorted(rng.sample(todo, n))
        print(" ".join(picked))
        return 0
    if args.survivors:
        print("\n".join(survivors(results)))
        return 0
    block = (table(results) + "\n\nSurvivors not killed yet (no test tells them apart; "
             "`mutmut show NAME`), per function:\n\n" + open_survivors(results)
             + "\n\nSurvivors judged equivalent:\n\n" + equivalent_list(results))
    if args.write is None:
        print(block)
        return 0
    page = args.write.read_text()
    start, end = "<!-- scores -->", "<!-- /scores -->"
    if start not in page or end not in page:
        print(f"{args.write} has no {start} ... {end} block", file=sys.stderr)
        return 1
    before, rest = page.split(start, 1)
    after = rest.split(end, 1)[1]
    args.write.write_text(f"{before}{start}\n{block}\n{end}{after}")
    print(f"wrote the scores to {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
