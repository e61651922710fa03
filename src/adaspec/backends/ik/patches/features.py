"""The target's features beside its logits, from the same pass (the draft head's input).

Why: a draft head (`draft/head_model.py`) reads the target's final-normed hidden state at
every scored row. The pinned ik_llama.cpp returns either logits or those states: with its
embeddings switch on, an output buffer holds the states and no logits
(`has_logits = !cparams.embeddings`), so the head's input would cost a second pass. Its own
multi-token-prediction path already extracts both; this patch opens that path to any model,
switched on per context by `adaspec_features(ctx, on)`:

- the output buffer holds the states of the output rows beside their logits
  (`llama_output_reserve`);
- decoding finds the graph's `result_norm` (the final norm's output, which the output head
  reads) and copies its rows after the logits' (`llama_decode_internal`), as token
  embeddings (no pooling), read with `llama_get_embeddings_ith`.

Nothing changes while the switch is off, and the logits are the same bit for bit with it on
(the graph is the same; only one more copy out of it).
"""

from __future__ import annotations

from pathlib import Path

from adaspec.backends.ik.source import PatchError, apply_edits

NAME = "target-features"
MARK = "adaspec (target-features)"

# (file, anchor, replacement): the anchor found exactly once
_EDITS: list[tuple[str, str, str]] = [
    ("src/llama-context.h", "    struct llama_kv_cache       kv_self;\n", f"""\
    struct llama_kv_cache       kv_self;
    // {MARK}: the output rows' final-normed hidden states beside their logits
    bool adaspec_features = false;
"""),
    ("src/llama.cpp",
     "    const bool has_embd   = lctx.is_encoding || (cparams.embeddings && "
     "(cparams.pooling_type == LLAMA_POOLING_TYPE_NONE)) || has_mtp;\n",
     "    const bool has_embd   = lctx.is_encoding || (cparams.embeddings && "
     "(cparams.pooling_type == LLAMA_POOLING_TYPE_NONE)) || has_mtp\n"
     f"                            || lctx.adaspec_features; // {MARK}\n"),
    ("src/llama.cpp",
     "            if (cparams.embeddings || has_mtp) {\n",
     f"            if (cparams.embeddings || has_mtp || lctx.adaspec_features) {{ // {MARK}\n"),
    ("src/llama.cpp",
     "\n            switch (cparams.pooling_type) {\n                case LLAMA_POOLING_TYPE_NONE:",
     f"\n            // {MARK}: the states of the output rows, whatever the pooling\n"
     "            switch (lctx.adaspec_features ? LLAMA_POOLING_TYPE_NONE : "
     "cparams.pooling_type) {\n                case LLAMA_POOLING_TYPE_NONE:"),
]

_EXPORT = f"""

// {MARK}: switch the output rows' final-normed states on beside their logits
extern "C" LLAMA_API void adaspec_features(struct llama_context * ctx, bool on) {{
    ctx->adaspec_features = on;
}}
"""

FILES = sorted({path for path, *_ in _EDITS})


def patch_files(texts: dict[str, str]) -> dict[str, str]:
    """The files (path -> text) with the patch applied; files already patched come back
    unchanged. PatchError where an anchor is missing or not unique."""
    out = dict(texts)
    if any(MARK in t for t in out.values()):
        return out
    for path, anchor, replacement in _EDITS:
        body = out.get(path)
        if body is None:
            raise PatchError(f"{path}: missing")
        if body.count(anchor) != 1:
            raise PatchError(f"{path}: the anchor {anchor.strip()[:60]!r} is not there once")
        out[path] = body.replace(anchor, replacement)
    out["src/llama.cpp"] += _EXPORT
    return out


def apply(src: Path) -> int:
    """Patch the unpacked source in place (atomically, file by file); returns the edits."""
    return apply_edits(src, FILES, patch_files, len(_EDITS) + 1)
