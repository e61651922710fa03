"""ik_llama.cpp (the llama.cpp fork with run-time weight repacking and multi-row CPU kernels)
behind the model backend interface.

Why: on a CPU without spare compute, verification is what speculation pays for. With its
weights repacked at load, ik_llama.cpp scores 5 tokens of the 1.5B target for about 1.5
single-token passes where mainline llama.cpp needs 3.3, and a single token is faster too.

The PyPI package `ik-llama-cpp-python` is a thin ctypes binding of the C library it ships.
adaspec uses only its library loader and its structure layouts (the version is pinned, the
layouts are that version's), and declares here every C function it calls, with the exact
signature from that version's `llama.h`: the binding wraps neither the KV-cache removal nor
the all-rows logits that verification needs.

Flash attention stays off: in this version it asserts (aborting the process) on CPUs without
AVX-VNNI. Run the backend in a child process (`process_backend`) and such an abort becomes a
one-line error instead of a lost process.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adaspec.backends.base import ChainBackend, batch_noise_setting
from adaspec.backends.sequences import ALL, LAST, NONE, Feed, SequenceView, views
from adaspec.errors import AdaspecError, InputError

IK_VERSION = "0.1.5"
INSTALL_HINT = f"pip install 'ik-llama-cpp-python=={IK_VERSION}' (a prebuilt AVX2 wheel)"
DEFAULT_CONTEXT = 8192  # tokens
DEFAULT_BATCH = 512  # tokens per llama_decode call of a prompt prefill

# A target is fed blocks of at least this many rows (IkLlamaBackend's `min_rows`). Unset:
# 1 where the library scores a lone token as it scores it in a block (checked at load), else
# 2. ADASPEC_MIN_ROWS=1 on a library that does not lets lone tokens take the one-row kernels
# (faster plain steps, and greedy speculation then parts from plain decoding at near-ties).
MIN_ROWS_ENV = "ADASPEC_MIN_ROWS"
LIB_PATH_ENV = "IK_LLAMA_CPP_LIB_PATH"  # the binding's override of its library's path
FLASH_ENV = "ADASPEC_IK_FLASH_ATTN"  # "off": no flash attention for several sequences either
REGIONS_ENV = "ADASPEC_IK_KV_REGIONS"  # "off": several sequences share the cache's cells freely
WIDE_ENV = "ADASPEC_IK_WIDE"  # "on" / "off": the 512-bit k-quant walk (`ik/patches/wide.py`)
WIDE_ROWS = 8  # the most activation rows a call walks wide, where it does
REGION_ALIGN = 256  # a region starts on a block boundary of the flash-attention kernel
# the most cells a sequence's region holds: attention spans the cache up to the last cell
# used, so long regions cost every call; what does not fit goes past the regions
REGION_TOKENS = 1024
BLOCK_ROWS = 2  # a block: this runtime scores the rows of any block of 2 or more alike
# the load probe's prefix per sequence (`sequences_alike`): past the flash-attention
# kernel's blocks of 128 cells, far enough for the running maximum to move where the
# blocks are cut otherwise (136 did not show it on SmolLM2, 300 did)
PROBE_PREFIX = 300


def context_for(sequences: int) -> int:
    """KV cache tokens for a context of `sequences` sequences (shared by them; a request is
    admitted while its prompt and budget fit)."""
    return max(DEFAULT_CONTEXT, 2048 * max(1, sequences))


def target_min_rows() -> int | None:
    """ADASPEC_MIN_ROWS, or None: decided at load by `IkLlamaBackend.rows_alike()`."""
    text = os.environ.get(MIN_ROWS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise AdaspecError(f"{MIN_ROWS_ENV} must be an integer >= 1, got {text!r}")
    return int(text)


class IkLlamaUnavailable(AdaspecError):
    """ik_llama.cpp cannot run here (package missing or of another version, or no GGUF)."""


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


@_LOG_CALLBACK
def _quiet_log(level: int, text: bytes, user_data: Any) -> None:
    """Drop the library's log lines (its errors reach the caller as return codes)."""


def _choose_build() -> str:
    """Which ik_llama.cpp library the binding loads: "native" (built for this CPU by
    `adaspec runtime build`, `backends/ik/build.py`), "wheel" (the prebuilt AVX2 one) or
    "custom" (the binding's own IK_LLAMA_CPP_LIB_PATH, set by the user)."""
    from adaspec.backends.ik import build as ik_build

    wheel = ik_build.wants_wheel()
    native = None if wheel else ik_build.native_library(IK_VERSION)
    chosen = os.environ.get(LIB_PATH_ENV)
    if chosen:  # the user's own library, or the native one a parent process chose
        return "native" if native is not None and chosen == str(native) else "custom"
    if native is None:
        return "wheel"
    os.environ[LIB_PATH_ENV] = str(native)  # child processes load the same library
    os.environ[ik_build.BUILD_ENV] = "native"
    return "native"


def multi_sequence_flash(api: Any) -> bool:
    """Whether a cache of several sequences runs with flash attention: the library was built
    with `ik_flash_patch` (the pinned version's kernel is wrong for several sequences
    without it) and ADASPEC_IK_FLASH_ATTN is not "off"."""
    from adaspec.backends.ik.patches import flash as ik_flash_patch

    value = os.environ.get(FLASH_ENV, "").strip().lower()
    if value not in ("", "auto", "off"):
        raise AdaspecError(f"{FLASH_ENV} must be 'auto' or 'off', got {value!r}")
    return value != "off" and ik_flash_patch.NAME in getattr(api, "adaspec_patches", ())


def kv_regions(api: Any) -> bool:
    """Whether a cache of several sequences with flash attention gives each sequence a
    region of its own (`ik_regions_patch`): the library was built with it and
    ADASPEC_IK_KV_REGIONS is not "off"."""
    from adaspec.backends.ik.patches import regions as ik_regions_patch

    value = os.environ.get(REGIONS_ENV, "").strip().lower()
    if value not in ("", "auto", "off"):
        raise AdaspecError(f"{REGIONS_ENV} must be 'auto' or 'off', got {value!r}")
    return value != "off" and ik_regions_patch.NAME in getattr(api, "adaspec_patches", ())


def wide_walk(api: Any) -> bool | None:
    """Whether the repacked Q4_K / Q6_K kernels walk 8 weight rows wide in 512-bit registers
    (`ik/patches/wide.py`); None where the library has no such switch. ADASPEC_IK_WIDE
    decides, else the CPU: on where it was measured to pay (Intel's AVX-512: a lone row
    0.53-0.63 of the kernel's time), off elsewhere (an AMD EPYC with AVX-512 ran a lone row's
    plain step in 45-49 ms with it against 22-39 ms without); the logits are the same."""
    from adaspec.backends.ik.patches import wide as ik_wide_patch
    from adaspec.store.native_build import cpu_vendor

    if ik_wide_patch.NAME not in getattr(api, "adaspec_patches", ()):
        return None
    value = os.environ.get(WIDE_ENV, "").strip().lower()
    if value not in ("", "auto", "on", "off"):
        raise AdaspecError(f"{WIDE_ENV} must be 'auto', 'on' or 'off', got {value!r}")
    if value in ("on", "off"):
        return value == "on"
    return cpu_vendor() == "GenuineIntel"


def target_features(api: Any) -> bool:
    """Whether the library returns the output rows' final-normed states beside their logits
    from the same pass (`ik/patches/features.py`, a draft head's input)."""
    from adaspec.backends.ik.patches import features as ik_features_patch

    return ik_features_patch.NAME in getattr(api, "adaspec_patches", ())


def token_trees(api: Any) -> bool:
    """Whether the library scores a token tree in one call, each node's row the chain's bit
    for bit, and keeps its accepted path in the chain's cells (`ik/patches/tree.py`)."""
    from adaspec.backends.ik.patches import tree as ik_tree_patch

    return ik_tree_patch.NAME in getattr(api, "adaspec_patches", ())


@cache
def library() -> Any:
    """The ik_llama.cpp binding module (structures and the loaded library), with adaspec's
    own declarations of the functions it calls; IkLlamaUnavailable names the fix."""
    try:
        from importlib.metadata import version

        installed = version("ik-llama-cpp-python")
    except Exception:
        installed = None
    if installed != IK_VERSION:
        found = f"version {installed}" if installed else "not installed"
        raise IkLlamaUnavailable(f"ik-llama-cpp-python {IK_VERSION} is needed ({found}): "
                                 f"{INSTALL_HINT}")
    build = _choose_build()
    try:
        from ik_llama_cpp import _ctypes_api as api
    except (ImportError, OSError) as exc:
        if build != "native":
            raise IkLlamaUnavailable(f"ik_llama.cpp could not load its library ({exc})") from None
        # A native build that does not load (a broken or partial build): the wheel's library,
        # said once; `adaspec runtime build --force` builds it again.
        print(f"adaspec: ik_llama.cpp built for this CPU does not load ({exc}); using the "
              "prebuilt wheel's library (`adaspec runtime build --force` rebuilds it)",
              file=sys.stderr)
        from adaspec.backends.ik import build as ik_build

        os.environ.pop(LIB_PATH_ENV, None)
        os.environ[ik_build.BUILD_ENV] = "wheel"
        return library.__wrapped__()
    api.adaspec_build = build
    api.adaspec_library = str(getattr(api._lib, "_name", "?"))  # the file loaded
    from adaspec.backends.ik import build as ik_build

    info = ik_build.build_info(IK_VERSION) if build == "native" else None
    api.adaspec_patches = tuple((info or {}).get("patches") or ())
    api.adaspec_built_at = (info or {}).get("built_at")
    lib = api._lib
    c = ctypes
    signatures: dict[str, tuple[list[Any], Any]] = {
        "llama_backend_init": ([], None),
        "llama_model_default_params": ([], api.llama_model_params),
        "llama_context_default_params": ([], api.llama_context_params),
        "llama_model_load_from_file": ([c.c_char_p, api.llama_model_params], c.c_void_p),
        "llama_free_model": ([c.c_void_p], None),
        "llama_init_from_model": ([c.c_void_p, api.llama_context_params], c.c_void_p),
        "llama_free": ([c.c_void_p], None),
        "llama_n_ctx": ([c.c_void_p], c.c_uint32),
        "llama_n_batch": ([c.c_void_p], c.c_uint32),
        "llama_n_vocab": ([c.c_void_p], c.c_int32),
        "llama_n_ctx_train": ([c.c_void_p], c.c_int32),
        "llama_n_layer": ([c.c_void_p], c.c_int32),
        "llama_model_n_embd": ([c.c_void_p], c.c_int32),
        "llama_model_size": ([c.c_void_p], c.c_uint64),
        "llama_model_n_params": ([c.c_void_p], c.c_uint64),
        "llama_batch_init": ([c.c_int32, c.c_int32, c.c_int32], api.llama_batch),
        "llama_batch_free": ([api.llama_batch], None),
        "llama_decode": ([c.c_void_p, api.llama_batch], c.c_int32),
        "llama_kv_cache_seq_rm": ([c.c_void_p, c.c_int32, c.c_int32, c.c_int32], c.c_bool),
        "llama_kv_cache_seq_cp": ([c.c_void_p, c.c_int32, c.c_int32, c.c_int32, c.c_int32],
                                  None),
        "llama_kv_cache_clear": ([c.c_void_p], None),
        "llama_get_logits": ([c.c_void_p], c.POINTER(c.c_float)),
        "llama_get_logits_ith": ([c.c_void_p, c.c_int32], c.POINTER(c.c_float)),
        "llama_set_embeddings": ([c.c_void_p, c.c_bool], None),
        "llama_get_embeddings_ith": ([c.c_void_p, c.c_int32], c.POINTER(c.c_float)),
    }
    if target_features(api):  # a native build's own function
        signatures["adaspec_features"] = ([c.c_void_p, c.c_bool], None)
        signatures["llama_get_embeddings"] = ([c.c_void_p], c.POINTER(c.c_float))
    if token_trees(api):  # a native build's own functions
        signatures["adaspec_tree"] = ([c.c_void_p, c.POINTER(c.c_int32), c.c_int32], c.c_int)
        signatures["adaspec_kv_tree_keep"] = ([c.c_void_p, c.c_int32, c.c_int32, c.c_int32,
                                               c.POINTER(c.c_int32), c.c_int32], c.c_int)
    if kv_regions(api):  # a native build's own function
        signatures["adaspec_kv_regions"] = ([c.c_void_p, c.c_uint32], c.c_int)
        signatures["adaspec_kv_seq_copy"] = ([c.c_void_p, c.c_int32, c.c_int32, c.c_int32],
                                             c.c_int)
    wide = wide_walk(api)
    if wide is not None:  # a native build's own switch (in libggml, which libllama loads)
        signatures["adaspec_set_wide_rows"] = ([c.c_int], None)
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    if wide is not None:
        lib.adaspec_set_wide_rows(WIDE_ROWS if wide else 0)
    api.adaspec_wide = wide
    lib.llama_log_set.argtypes = [_LOG_CALLBACK, c.c_void_p]
    lib.llama_log_set.restype = None
    lib.llama_log_set(_quiet_log, None)  # the library logs every load to stderr otherwise
    lib.llama_backend_init()
    api.adaspec_lib = lib
    return api


def load_model(lib: Any, gguf: str | Path, repack: bool = True) -> Any:
    """A GGUF model loaded on the CPU, memory-mapped, its weights repacked for the multi-row
    kernels (where `repack`); a null handle where the library refuses it."""
    params = lib.llama_model_default_params()
    params.n_gpu_layers = 0
    params.use_mmap = True
    params.repack_tensors = repack
    params.flash_attn = False
    return lib.llama_model_load_from_file(str(gguf).encode(), params)


def available() -> bool:
    try:
        library()
    except IkLlamaUnavailable:
        return False
    return True


class IkLlamaBackend(ChainBackend):
    """A GGUF model run by ik_llama.cpp with repacked weights: logits for every fed token
    (verification) or for the last one (prompt prefill); token trees on a native build with
    the tree patch (`feed_tree`)."""

    kind = "ik_llama"
    runtime = "ik_llama.cpp"
    pooled_cache = True  # its sequences share the context's cells (`SequenceView`)
    has_hidden_states = True  # the final layer's, for the router (`_final_state`)
    # experiments/batch_noise.py (EPYC Zen 5): a row's top-2 gap moved by up to 0.74 between
    # its single-token pass and a block of 2-8 (1,176 rows); greedy rows within it are rechecked.
    batch_noise = 0.75

    def __init__(
        self,
        gguf: str | Path,
        n_threads: int,
        name: str = "ik_llama",
        n_ctx: int = DEFAULT_CONTEXT,
        repack: bool = True,
        min_rows: int | None = 1,
        sequences: int = 1,
    ) -> None:
        """min_rows: feed every call at least this many rows (padding a shorter one with
        copies of its last token, whose rows and cache entries are dropped). This runtime
        scores a row of any block of 2 or more tokens bit for bit alike
        (experiments/batch_noise.py: blocks of 2, 3, 4, 8); a lone token too with the
        library `adaspec runtime build` makes (`ik_build.PATCHES`), but through other kernels,
        up to 0.5 logits apart, with the prebuilt wheel. None (a target): 1 if
        `rows_alike()`, else 2, so plain decoding and verification score the same numbers
        and greedy speculation emits plain decoding's tokens exactly.
        sequences: how many sequences the KV cache holds (`sequences()` hands out views of
        1 .. sequences - 1; 0 is this backend's own). With more than one, n_ctx tokens are
        shared by all of them."""
        api = library()
        lib = api.adaspec_lib
        self._lib = lib
        self.has_features = target_features(api)
        self._features = False
        # the final-normed states of the last `feed_many`'s output rows, per feed, while
        # `record_features(True)`; else None
        self.last_features: list[torch.Tensor] | None = None
        self._model = load_model(lib, gguf, repack)
        if not self._model:
            raise IkLlamaUnavailable(f"ik_llama.cpp could not load {gguf}")
        self._ctx = None
        self._batch: Any = None  # a llama_batch (ctypes) once the context exists
        trained = int(lib.llama_n_ctx_train(self._model))
        n_ctx = min(n_ctx, trained) if trained > 0 else n_ctx
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = min(DEFAULT_BATCH, n_ctx)
        cparams.n_ubatch = min(DEFAULT_BATCH, n_ctx)
        cparams.n_seq_max = max(1, int(sequences))
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        # flash attention, with the patch that makes it right for several sequences and
        # skips what the mask hides (`ik/patches/flash.py`), for one sequence as for several:
        # with regions every row then takes one path (`ik/patches/regions.py`), so a row
        # scores the same in `generate` as in a server's batch; else the plain kernels
        self.flash_attention = multi_sequence_flash(api) and (
            sequences > 1 or kv_regions(api))
        # and a region of the cache per sequence (`ik/patches/regions.py`), which compaction
        # would undo; without regions, requests come and go: compact the holes now and then
        self.region = 0
        if self.flash_attention and kv_regions(api):
            per = n_ctx // max(1, int(sequences))
            self.region = min(per, REGION_TOKENS) // REGION_ALIGN * REGION_ALIGN
        if sequences > 1:
            cparams.defrag_thold = -1.0 if self.region else 0.1
        cparams.flash_attn = self.flash_attention
        cparams.logits_all = False
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise IkLlamaUnavailable(f"ik_llama.cpp could not create a context for {gguf}")
        if self.region and lib.adaspec_kv_regions(self._ctx, self.region) != 0:
            raise IkLlamaUnavailable("ik_llama.cpp refused a region per sequence")
        self._n_batch = int(lib.llama_n_batch(self._ctx))
        self._batch = lib.llama_batch_init(self._n_batch, 0, 1)
        for i in range(self._n_batch):
            self._batch.n_seq_id[i] = 1
        self.max_sequences = max(1, int(sequences))
        self.name = name
        self.vocab_size = int(lib.llama_n_vocab(self._model))
        self.max_context = int(lib.llama_n_ctx(self._ctx))
        self._len = 0
        self.min_rows = 1
        if min_rows is None:
            self.rows_match = self.rows_alike()
            min_rows = 1 if self.rows_match else BLOCK_ROWS
        self.min_rows = max(1, int(min_rows))
        # Another library (built for this CPU) or n = 1 costing a block: another cost curve,
        # another profile.
        self.build = getattr(api, "adaspec_build", "wheel")
        if self.build != "wheel":
            self.kind = f"{self.kind}-{self.build}"
        if self.min_rows > 1:
            self.kind = f"{self.kind}-blocks{self.min_rows}"
        if self.flash_attention:  # other kernels, another cost curve
            self.kind = f"{self.kind}-fa"
        if self.region:  # another placement, another cost curve
            self.kind = f"{self.kind}-regions"
        if getattr(api, "adaspec_wide", None) is False:  # the kernels' own walk: another curve
            self.kind = f"{self.kind}-narrow"
        # the source changes a native build carries: other kernels, another cost curve
        self.patches = tuple(getattr(api, "adaspec_patches", ()))
        # and when it was built: a patch whose text changed under the same name rebuilds
        # (`adaspec runtime build --force`) with other kernels, measured again too
        self.built_at: str | None = getattr(api, "adaspec_built_at", None)
        # padded to blocks, or lone rows scored as in blocks: verification scores what plain
        # decoding scores, nothing to recheck
        alike = self.min_rows > 1 or getattr(self, "rows_match", False)
        # and with several sequences, a row the same whichever sequence and companions it
        # has (the one attention path of `ik_regions_patch`): else greedy verification
        # rechecks near-ties (`Engine._settle_near_tie`)
        self.sequences_match = self.max_sequences == 1 or self.sequences_alike()
        alike = alike and self.sequences_match
        self.batch_noise = batch_noise_setting(0.0 if alike else type(self).batch_noise)
        # token trees on its own sequence (`ik/patches/tree.py`): in the root's block of the
        # attention kernel's cells, inside its region
        self.supports_trees = bool(self.region) and token_trees(api)
        if self.supports_trees:
            from adaspec.backends.ik.patches import tree as ik_tree_patch

            self.tree_block, self.tree_span = ik_tree_patch.BLOCK, self.region
        self.hidden_size = int(lib.llama_model_n_embd(self._model))
        self.num_layers = int(lib.llama_n_layer(self._model))
        self.bytes_per_forward = int(lib.llama_model_size(self._model))
        self.n_params = int(lib.llama_model_n_params(self._model))  # the router's cost input
        self.n_threads = n_threads

    def _fed_features(self) -> torch.Tensor | None:
        return self.last_features[0] if self.last_features else None

    def feed_tree(self, seq: int, ids: list[int], positions: list[int], parents: list[int]
                  ) -> torch.Tensor:
        """Score a token tree of sequence `seq` in one call (`ik/patches/tree.py`): ids[0]
        its root right after the sequence's cache, parents[i] < i, positions the root's plus
        each node's depth; its nodes in the cells after the root's until `keep_tree`. The
        logits of every node [n, V], each bit for bit its chain's."""
        arms = (ctypes.c_int32 * len(ids))(*parents)
        if self._lib.adaspec_tree(self._ctx, arms, len(ids)) != 0:
            raise AdaspecError("ik_llama.cpp refused a token tree")
        try:
            return self.feed_many([Feed(seq, positions[0], ids, ALL, positions=positions)],
                                  pad=False)[0]
        finally:
            self._lib.adaspec_tree(self._ctx, None, 0)

    def keep_tree(self, seq: int, root: int, n: int, path: list[int]) -> None:
        """After `feed_tree`: keep nodes `path` (one a depth) where a chain puts them, free
        the tree's other cells."""
        keep = (ctypes.c_int32 * max(1, len(path)))(*path)
        code = self._lib.adaspec_kv_tree_keep(self._ctx, seq, root, n, keep, len(path))
        if code != 0:
            self.remove_seq(seq, root + 1)
            raise AdaspecError(f"ik_llama.cpp could not keep a tree's path (code {code})")

    def _feed_tree(self, ids: list[int], positions: list[int], parents: list[int]
                   ) -> torch.Tensor:
        return self.feed_tree(0, ids, positions, parents)

    def _keep_tree(self, root: int, n: int, path: list[int]) -> None:
        self.keep_tree(0, root, n, path)

    def record_features(self, on: bool) -> None:
        """Return the output rows' final-normed hidden states beside their logits (read from
        `last_features` after each call): what a draft head reads, from the same pass."""
        if on and not self.has_features:
            raise InputError("this ik_llama.cpp library returns no target features: build it "
                             "again with `adaspec runtime build --force`")
        if self.has_features:
            self._lib.adaspec_features(self._ctx, bool(on))
        self._features = bool(on)
        self.last_features = None

    def rows_alike(self) -> bool:
        """Whether a token fed alone gets bit for bit the logits it gets as the first row of
        a block of 2, at two positions after a short prefix (the kernels decide it, not the
        tokens: one check at load). Leaves the cache empty."""
        ids = [(7 + 131 * i) % self.vocab_size for i in range(10)]
        try:
            self._feed_rows(ids[:6], every_row=False)
            alike = True
            for tok in ids[6:8]:
                start = self._len
                lone = self._feed_rows([tok], every_row=True)
                self._remove_from(start)
                self._len = start
                block = self._feed_rows([tok, ids[9]], every_row=True)[:1]
                self._remove_from(start + 1)
                self._len = start + 1
                alike = alike and torch.equal(lone, block)
        finally:
            self._remove_from(0)
            self._len = 0
        return alike

    def sequences_alike(self, prefix: int = PROBE_PREFIX) -> bool:
        """Whether sequence 1 scores a token bit for bit as sequence 0 scores it (another
        region of the cache), alone, as the second row of a call beside sequence 0's, and
        as the first of a block of 2; the same tokens in both, after `prefix` tokens (more
        than a block of the flash-attention kernel, so cells placed off the blocks show).
        Leaves both sequences empty."""
        prefix = max(1, min(prefix, (self.region or self.max_context // 2) - 3))
        ids = [(11 + 197 * i) % self.vocab_size for i in range(prefix + 3)]
        try:
            self.feed_many([Feed(0, 0, ids[:prefix], NONE), Feed(1, 0, ids[:prefix], NONE)],
                           pad=False)
            tok, at = ids[prefix], prefix
            rows = [self.feed_many([Feed(0, at, [tok], ALL)], pad=False)[0]]
            self.remove_seq(0, at)
            rows.append(self.feed_many([Feed(1, at, [tok], ALL)], pad=False)[0])
            self.remove_seq(1, at)
            both = self.feed_many([Feed(0, at, [ids[at + 1]], ALL), Feed(1, at, [tok], ALL)],
                                  pad=False)
            rows.append(both[1])
            self.remove_seq(0, at)
            self.remove_seq(1, at)
            rows.append(self.feed_many([Feed(1, at, [tok, ids[at + 2]], ALL)],
                                       pad=False)[0][:1])
        finally:
            self.remove_seq(0, 0)
            self.remove_seq(1, 0)
        return all(torch.equal(rows[0], r) for r in rows[1:])

    def _feed(self, ids: list[int], every_row: bool) -> torch.Tensor:
        return self._feed_rows(ids, every_row, pad=True)

    def _feed_rows(self, ids: list[int], every_row: bool, pad: bool = False) -> torch.Tensor:
        """Feed this backend's own sequence; pad: to `min_rows` (rows_alike compares a
        lone token's rows unpadded)."""
        out = self.feed_many([Feed(0, self._len, ids, ALL if every_row else LAST)], pad)[0]
        self._len += len(ids)
        return out

    def _fill(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch = self._batch
        batch.token[i] = token
        batch.pos[i] = pos
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits

    def feed_many(self, feeds: list[Feed], pad: bool = True) -> list[torch.Tensor]:
        """Score every feed after its sequence's cache in one llama_decode (several where
        they hold more than a batch of tokens); per feed its rows (`sequences.Feed`). A call
        of fewer than `min_rows` tokens is padded with copies of its last token, whose rows
        and cache entries are dropped. A failed call leaves no entry of its feeds behind."""
        feeds = list(feeds)
        total = sum(len(f.ids) for f in feeds)
        padded = None
        if pad and feeds and 0 < total < self.min_rows:
            last = feeds[-1]
            extra = min(self.min_rows - total, self.max_context - last.start - len(last.ids))
            if extra > 0:
                padded = last
                feeds[-1] = Feed(last.seq, last.start, last.ids + last.ids[-1:] * extra, ALL)
        flat = [(k, f.seq, f.start + j if f.positions is None else f.positions[j], tok,
                 f.rows == ALL or (f.rows == LAST and j == len(f.ids) - 1))
                for k, f in enumerate(feeds) for j, tok in enumerate(f.ids)]
        got: list[list[np.ndarray]] = [[] for _ in feeds]
        states: list[list[np.ndarray]] = [[] for _ in feeds]
        lib, vocab = self._lib, self.vocab_size
        try:
            for start in range(0, len(flat), self._n_batch):
                chunk = flat[start : start + self._n_batch]
                for i, (_, seq, pos, tok, want) in enumerate(chunk):
                    self._fill(i, tok, pos, seq, want)
                self._batch.n_tokens = len(chunk)
                code = lib.llama_decode(self._ctx, self._batch)
                if code == 1:
                    raise AdaspecError(f"ik_llama.cpp: the KV cache ({self.max_context} "
                                       f"tokens) has no room for {len(chunk)} more")
                if code != 0:
                    raise AdaspecError(f"ik_llama.cpp decode failed (code {code}) for "
                                       f"{len(chunk)} tokens")
                wanted = [k for k, *_, want in chunk if want]  # feed of each output row
                if wanted:
                    rows = np.ctypeslib.as_array(lib.llama_get_logits(self._ctx),
                                                 shape=(len(wanted), vocab))
                    feats = (np.ctypeslib.as_array(lib.llama_get_embeddings(self._ctx),
                                                   shape=(len(wanted), self.hidden_size))
                             if self._features else None)
                    a = 0
                    while a < len(wanted):  # a feed's rows are one run: one copy each
                        b = a
                        while b < len(wanted) and wanted[b] == wanted[a]:
                            b += 1
                        got[wanted[a]].append(rows[a:b].copy())
                        if feats is not None:
                            states[wanted[a]].append(feats[a:b].copy())
                        a = b
        except BaseException:
            for f in feeds:
                self.remove_seq(f.seq, f.start)
            raise
        out = [_joined(rows, vocab) for rows in got]
        feats_out = [_joined(rows, self.hidden_size) for rows in states] \
            if self._features else None
        if padded is not None:
            self.remove_seq(padded.seq, padded.start + len(padded.ids))
            out[-1] = _unpadded(out[-1], padded)
            if feats_out is not None:
                feats_out[-1] = _unpadded(feats_out[-1], padded)
        self.last_features = feats_out
        return out

    def remove_seq(self, seq: int, start: int) -> None:
        self._lib.llama_kv_cache_seq_rm(self._ctx, seq, start, -1)

    def copy_seq(self, src: int, dst: int, length: int) -> None:
        """Sequence `dst` holds `src`'s first `length` positions and nothing else, not
        computed again: with regions copied into `dst`'s own region (its rows then read them
        in the blocks they would have been computed in, so its logits are bit for bit a
        fresh prefill's), else shared (the entries tagged with both ids)."""
        self._lib.llama_kv_cache_seq_rm(self._ctx, dst, 0, -1)
        if self.region and length <= self.region and \
                self._lib.adaspec_kv_seq_copy(self._ctx, src, dst, length) == 0:
            return
        self._lib.llama_kv_cache_seq_cp(self._ctx, src, dst, 0, length)

    def sequences(self, n: int) -> list[SequenceView]:
        """Views of sequences 1 .. n, each a backend of its own sharing this KV cache."""
        if n >= self.max_sequences:
            raise InputError(f"this ik_llama.cpp context holds {self.max_sequences - 1} "
                             f"sequences besides its own, not {n}")
        return views(self, n)

    def _final_state(self) -> torch.Tensor:
        """The last cached token's final-layer state (this context's own sequence)."""
        ids = self._token_ids()
        if not ids or self._len != len(ids):
            raise InputError("no prompt in the cache to read a hidden state from")
        return self.final_state(0, self._len - 1, ids[-1])

    def final_state(self, seq: int, start: int, token: int) -> torch.Tensor:
        """The final-layer state [1, hidden] of `token`, sequence `seq`'s last cached token
        at position `start`: fed again with the context's embeddings output on (which gives
        no logits in this runtime, hence the second pass: one token, padded to `min_rows`
        as every call is, so its cache entry is what it was)."""
        lib, batch = self._lib, self._batch
        self.remove_seq(seq, start)
        rows = max(1, min(self.min_rows, self.max_context - start))
        for i in range(rows):
            self._fill(i, token, start + i, seq, i == 0)
        batch.n_tokens = rows
        lib.llama_set_embeddings(self._ctx, True)
        try:
            code = lib.llama_decode(self._ctx, batch)
            if code != 0:
                raise AdaspecError(f"ik_llama.cpp decode failed (code {code}) for a hidden state")
            state = lib.llama_get_embeddings_ith(self._ctx, 0)
            if not state:
                raise AdaspecError("ik_llama.cpp gave no hidden state")
            hidden = np.ctypeslib.as_array(state, shape=(1, self.hidden_size)).copy()
        finally:
            lib.llama_set_embeddings(self._ctx, False)
            self.remove_seq(seq, start + 1)  # the padding rows
        return torch.from_numpy(hidden)

    def _remove_from(self, length: int) -> None:
        self.remove_seq(0, length)

    def close(self) -> None:
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            self._lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self._lib.llama_free_model(self._model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()



def _joined(rows: list[np.ndarray], width: int) -> torch.Tensor:
    """A feed's output rows [n, width] from its runs (one per llama_decode)."""
    if not rows:
        return torch.empty(0, width)
    return torch.from_numpy(rows[0] if len(rows) == 1 else np.concatenate(rows))


def _unpadded(rows: torch.Tensor, padded: Feed) -> torch.Tensor:
    """A padded feed's rows without its padding's."""
    keep = rows[: len(padded.ids)]
    return keep if padded.rows == ALL else keep[-1:] if padded.rows == LAST else keep[:0]
