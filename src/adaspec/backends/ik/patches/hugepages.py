"""The CPU buffers of ik_llama.cpp (the repacked weights, the KV cache) ask for huge pages.

Why: with repacking the weights live in one anonymous buffer of about 1 GiB (`malloc` in
`ggml/src/ggml-backend.cpp`), and a lone token reads all of it. In 4 KiB pages that is some
260,000 pages, so the page walks of the TLB misses are a share of every token. Machines
commonly set transparent huge pages to `madvise` (the kernel uses them only where a program
asks), and the pinned ik_llama.cpp never asks. Advising the buffer before its first touch
makes the page faults take 2 MiB pages: on a 2-core Zen 5, one token of the 1.5B target took
7-8% less time (29 against 30-33 ms; 22.6 against 24.6 in the machine's faster state), a
round of 8 requests about 1% less, a prompt chunk the same (`experiments/ik_kernel_ab.py`,
`experiments/results/ik-hugepages-epyc/`). Memory placement only: the logits stay bit for bit
equal. Where transparent huge pages are off (`never`) the advice does nothing.
"""

from __future__ import annotations

from pathlib import Path

from adaspec.backends.ik.source import PatchError, patch_file

NAME = "huge-pages"
FILE = "ggml/src/ggml-backend.cpp"
MARK = "adaspec (huge-pages)"
MIN_BYTES = 4 << 20  # smaller buffers (a tiny model's) gain nothing worth a 2 MiB page

INCLUDE_AFTER = '#include "ggml-backend-impl.h"\n'
INCLUDE = "#ifdef __linux__\n#include <sys/mman.h>\n#endif\n"
ALLOC = """    void * data = malloc(size); // TODO: use GGML_ALIGNED_MALLOC (move to ggml-impl.h)
    if (data == NULL) {
        fprintf(stderr, "%s: failed to allocate buffer of size %zu\\n", __func__, size);
        return NULL;
    }
"""
ADVICE = f"""#ifdef __linux__
    // {MARK}: the buffer is not touched yet, so its page faults take 2 MiB pages
    // where transparent huge pages are `madvise` or `always` (adaspec's
    // `backends/ik/patches/hugepages.py`)
    if (size >= ((size_t){MIN_BYTES >> 20} << 20)) {{
        const uintptr_t huge = (uintptr_t)2 << 20;
        const uintptr_t first = ((uintptr_t)data + huge - 1) & ~(huge - 1);
        const uintptr_t last = ((uintptr_t)data + size) & ~(huge - 1);
        if (last > first) madvise((void *)first, last - first, MADV_HUGEPAGE);
    }}
#endif
"""


def patch_text(text: str) -> str:
    """The backend file with the advice (unchanged when already there)."""
    if MARK in text:
        return text
    for anchor in (INCLUDE_AFTER, ALLOC):
        if text.count(anchor) != 1:
            raise PatchError(f"{FILE}: expected one `{anchor.strip().splitlines()[0]}`, "
                             f"found {text.count(anchor)}")
    return text.replace(INCLUDE_AFTER, INCLUDE_AFTER + INCLUDE).replace(ALLOC, ALLOC + ADVICE)


def apply(src: Path) -> None:
    """Patch the unpacked source in place (atomically)."""
    patch_file(src, FILE, patch_text)
