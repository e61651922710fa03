"""Drafts from what the engine has served before: a cross-request n-gram index.

Prompt lookup (`draft/ngram.py`) only reads the current request, so a request that does not
repeat itself (translation, chat) gets no drafts from it. This index holds earlier requests
(the tail of each prompt and the whole output, one *document* each) and proposes what most
often followed the current context's last n tokens there, in the spirit of SuffixDecoding's
global suffix tree and llama.cpp's n-gram caches (counts of which token followed each
n-gram), with a token budget instead of unbounded growth.

**Index.** One dict maps every n-gram of a document (n in `orders`, default 3, 4 and 8; never
across document boundaries) to the tokens that followed it: a packed int (count, token) while
one token ever did, else a small record with per-token counts and the cached best. Keys are
exact (the n token ids packed into one int), so there are no hash collisions. Adding a
document costs one dict update per token and order; so does evicting one. The 8-gram is what
lets a request that repeats an earlier answer follow that answer (a 4-gram alone often
continues as some other document did): for an answer indexed before, 8.3 tokens per step
with 8-token drafts, against 6.7 with n = 2, 3, 4 (`experiments/results/history-cost/`).

**Lookup.** The longest n-gram ending the context that the index holds
gives the first token: its most frequent continuation, ties to the most recently added. The
continuation then extends greedily, token by token, each looked up with the longest n-gram
ending the drafted path, while the product of the continuations' frequency shares
(count / total) stays at or above `min_prob` and up to `k` tokens. Each token reports the
n-gram length that matched and a confidence, count / (total + 1): its frequency share shrunk
by one pseudo-observation, so a continuation seen once (1/2) is not priced like one seen
fifty times out of fifty (50/51). `draft/auto.py` prices tokens by these.

**Budget.** At most `budget` tokens are held (default 1,000,000); adding a document beyond
it evicts the oldest documents (their counts are taken back out). Measured on a 2-vCPU AMD
EPYC (Zen 5, Python 3.11; `experiments/history_cost.py`) for 1M tokens of ShareGPT answers
and prompts (Qwen2.5 tokenizer; n = 3, 4, 8): 260 MB of Python objects (273 bytes a token:
2.0M dict entries), 2.3 us a token to add (3.5 us when each add also evicts), a lookup 2.9
us when nothing matches and 9-11 us when it drafts 8 tokens (5.7 us on average over the
steps of answers it had not seen); the file is 3.8 MB, saved in 15 ms, loaded (the index
rebuilt) in 2.0 s.

**Persistence.** `save` writes one file atomically (`store.atomic`): a magic line
`adaspec-history 1`, a JSON header line (the tokenizer's key, the vocabulary size, the
number of documents and tokens, the payload's sha256), then the payload: each document's
length, then all tokens, as little-endian uint32. The index itself is rebuilt from the
documents on load. `load` refuses, with a one-line `HistoryFileError`, a file that is not
one, is truncated or corrupt (length or checksum), comes from a newer format, or was
written for another tokenizer; `load_or_new` reports that line and starts empty.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaspec.errors import InputError

DEFAULT_BUDGET = 1_000_000  # tokens held; the oldest documents go first
ORDERS = (3, 4, 8)  # the n-gram lengths indexed (experiments/history_cost.py chose them)
PROMPT_TAIL = 256  # a request adds the last PROMPT_TAIL tokens of its prompt, then its output
MAGIC = b"adaspec-history"
FORMAT = 1
_U32 = "I"  # array type code of a 4-byte unsigned int (checked below)


class HistoryFileError(InputError):
    """A history file that cannot be loaded (one line: which file, and why)."""


@dataclass
class HistoryMatch:
    """A proposed continuation. `match`: the n-gram length that matched the context (0: no
    match); per token, the n-gram length its lookup matched and its confidence."""

    tokens: list[int] = field(default_factory=list)
    match: int = 0
    orders: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)


class _Many:
    """The continuations of an n-gram that was followed by more than one token: counts in
    the order they were last added to (so the most recent comes last), the cached best."""

    __slots__ = ("best", "best_count", "counts", "total")

    def __init__(self, counts: dict[int, int]) -> None:
        self.counts = counts
        self.total = sum(counts.values())
        self._pick_best()

    def _pick_best(self) -> None:
        best, best_count = -1, 0
        for token, count in self.counts.items():  # later entries win ties: most recent
            if count >= best_count:
                best, best_count = token, count
        self.best, self.best_count = best, best_count

    def add(self, token: int) -> None:
        count = self.counts.pop(token, 0) + 1
        self.counts[token] = count  # now the most recent
        self.total += 1
        if count >= self.best_count:
            self.best, self.best_count = token, count

    def remove(self, token: int) -> None:
        count = self.counts[token] - 1
        if count:
            self.counts[token] = count
        else:
            del self.counts[token]
        self.total -= 1
        if token == self.best:
            self._pick_best()


def tokenizer_key(tokenizer, vocab_size: int) -> str:
    """What a history file is keyed by: a digest of the tokenizer's vocabulary (token
    strings and ids), or only the vocabulary size for an engine without a tokenizer."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    if not vocab:
        return f"ids:{int(vocab_size)}"
    digest = hashlib.sha256()
    for text, idx in sorted(vocab.items(), key=lambda item: item[1]):
        digest.update(f"{idx}\t{text}\n".encode("utf-8", "surrogatepass"))
    return f"vocab:{len(vocab)}:{digest.hexdigest()[:24]}"


class HistoryIndex:
    """Token sequences seen in earlier requests, and the continuations they suggest."""

    def __init__(
        self,
        vocab_size: int,
        budget: int = DEFAULT_BUDGET,
        orders: Sequence[int] = ORDERS,
        min_prob: float = 0.1,
        prompt_tail: int = PROMPT_TAIL,
        tokenizer: str = "",
    ) -> None:
        orders = tuple(sorted(set(orders)))
        if not orders or not all(isinstance(n, int) and n >= 1 for n in orders):
            raise InputError(f"history n-gram lengths must be integers >= 1, got {orders!r}")
        if not isinstance(budget, int) or budget < 1:
            raise InputError(f"the history's token budget must be >= 1, got {budget!r}")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise InputError(f"vocab_size must be >= 1, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.budget = budget
        self.orders = orders
        self.n_max, self.n_min = orders[-1], orders[0]
        self.min_prob = min_prob
        self.prompt_tail = prompt_tail
        self.tokenizer = tokenizer  # the key a saved file must carry (tokenizer_key)
        self.bits = vocab_size.bit_length()  # token + 1 fits: ids are < vocab_size
        self._token_mask = (1 << self.bits) - 1
        self._masks = [(1 << (self.bits * n)) - 1 for n in range(self.n_max + 1)]
        self._down = orders[::-1]  # the longest first
        self._table: dict[int, int | _Many] = {}
        self._docs: deque[array] = deque()
        self.tokens = 0  # tokens held, over all documents
        self.requests = 0  # requests added since this index was built or loaded
        self.version = 0  # changes since then (a saver skips an unchanged index)
        self._lock = threading.Lock()  # add / evict / save (lookups read without it)

    # ------------------------------------------------------------------ adding
    @property
    def documents(self) -> int:
        return len(self._docs)

    def __len__(self) -> int:
        return self.tokens

    def add_request(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Learn from a finished request: the tail of its prompt, then its output, as one
        document (the n-grams across the boundary are what starts an answer)."""
        tail = list(prompt[-self.prompt_tail:]) if self.prompt_tail > 0 else []
        self.add([*tail, *output])
        self.requests += 1

    def add(self, tokens: Iterable[int]) -> None:
        """Add one document (its last `budget` tokens); evict the oldest over the budget."""
        doc = array(_U32, tokens)
        if len(doc) > self.budget:
            doc = doc[len(doc) - self.budget:]
        if doc and max(doc) >= self.vocab_size:
            raise InputError(f"token id {max(doc)} is outside the history's vocabulary "
                             f"[0, {self.vocab_size})")
        if len(doc) <= self.n_min:
            return  # no n-gram with a continuation
        with self._lock:
            self._count(doc, add=True)
            self.version += 1
            self._docs.append(doc)
            self.tokens += len(doc)
            while self.tokens > self.budget:
                old = self._docs.popleft()
                self._count(old, add=False)
                self.tokens -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._table.clear()
            self._docs.clear()
            self.tokens = 0
            self.version += 1

    def _count(self, doc: array, add: bool) -> None:
        """Add (or take back) one count per (n-gram, next token) of a document."""
        table, masks = self._table, self._masks
        bits, mask, one = self.bits, self._token_mask, 1 << self.bits
        orders, top = self.orders, self._masks[self.n_max]
        key = 0  # the last n_max tokens before position i, the newest in the low bits
        for i, token in enumerate(doc):
            for n in orders:
                if n > i:
                    break
                k = key & masks[n]
                # int | _Many | None; told apart by `__class__ is int` (cheaper than isinstance
                # here), which the type checker does not narrow on
                value: Any = table.get(k)
                if add:
                    if value is None:
                        table[k] = one | token
                    elif value.__class__ is int:
                        if value & mask == token:
                            table[k] = value + one
                        else:
                            many = _Many({value & mask: value >> bits})
                            many.add(token)
                            table[k] = many
                    else:
                        value.add(token)
                elif value.__class__ is int:
                    if value >> bits == 1:
                        del table[k]
                    else:
                        table[k] = value - one
                else:
                    value.remove(token)
                    if len(value.counts) == 1:
                        table[k] = (value.best_count << bits) | value.best
            key = ((key << bits) | (token + 1)) & top

    # ------------------------------------------------------------------ lookup
    def lookup(self, context: Sequence[int], k: int) -> HistoryMatch:
        """Up to `k` tokens to follow `context` (see the module's docstring)."""
        table = self._table
        if k <= 0 or not table:
            return HistoryMatch()
        bits, mask, masks = self.bits, self._token_mask, self._masks
        down, top = self._down, masks[self.n_max]
        key = 0
        tail = context[-self.n_max:]
        for token in tail:
            key = (key << bits) | (token + 1)
        def longest(key: int, have: int):
            """The entry of the longest indexed n-gram (n <= have) ending the key, and n."""
            for n in down:
                if n <= have:
                    value = table.get(key & masks[n])
                    if value is not None:
                        return value, n
            return None, 0

        have = len(tail)
        value, n = longest(key, have)
        if value is None:
            return HistoryMatch()
        found = HistoryMatch(match=n)
        path = 1.0
        while True:
            if value.__class__ is int:
                token, count = value & mask, value >> bits
                total = count
            else:
                token, count, total = value.best, value.best_count, value.total
            path *= count / total
            if path < self.min_prob:
                break
            found.tokens.append(token)
            found.orders.append(n)
            found.confidence.append(count / (total + 1))
            if len(found.tokens) >= k:
                break
            key = ((key << bits) | (token + 1)) & top
            have += 1
            value, n = longest(key, have)
            if value is None:
                break
        return found

    # ------------------------------------------------------------- persistence
    def save(self, path: str | Path) -> Path:
        """Write every document to `path` atomically (the old file stays whole until the
        new one is complete)."""
        from adaspec.store.atomic import atomic_open

        if not self.tokenizer:
            raise InputError("this history has no tokenizer key; give HistoryIndex(..., "
                             "tokenizer=tokenizer_key(...)) to save it")
        with self._lock:
            docs = list(self._docs)
            lengths = array(_U32, (len(d) for d in docs))
            digest = hashlib.sha256()
            for part in (lengths, *docs):
                digest.update(_le_bytes(part))
            header = {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size,
                      "documents": len(docs), "tokens": sum(lengths),
                      "sha256": digest.hexdigest()}
            with atomic_open(path, "wb") as f:
                f.write(MAGIC + b" %d\n" % FORMAT)
                f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
                for part in (lengths, *docs):
                    f.write(_le_bytes(part))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path, tokenizer: str, vocab_size: int,
             **settings) -> HistoryIndex:
        """The index saved at `path`; HistoryFileError (one line) if it cannot be used."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise HistoryFileError(f"history file {path} cannot be read "
                                   f"({exc.strerror or exc})") from None
        docs = _parse(data, path, tokenizer, vocab_size)
        index = cls(vocab_size, tokenizer=tokenizer, **settings)
        for doc in docs:
            index.add(doc)
        index.version = 0  # as saved
        return index

    @classmethod
    def load_or_new(cls, path: str | Path, tokenizer: str, vocab_size: int,
                    report: Callable[[str], None] | None = None, **settings) -> HistoryIndex:
        """`load`, or a new empty index when there is no file yet or it cannot be used (then
        one line says why, through `report`, by default on stderr)."""
        if Path(path).exists():
            try:
                return cls.load(path, tokenizer, vocab_size, **settings)
            except HistoryFileError as exc:
                (report or _stderr)(f"{exc}; starting with an empty history")
        return cls(vocab_size, tokenizer=tokenizer, **settings)


def _stderr(line: str) -> None:
    print(f"adaspec: {line}", file=sys.stderr, flush=True)


def _le_bytes(part: array) -> bytes:
    if sys.byteorder == "big":
        part = array(_U32, part)
        part.byteswap()
    return part.tobytes()


def _parse(data: bytes, path: Path, tokenizer: str, vocab_size: int) -> list[array]:
    """The documents of a history file's bytes, every check done; HistoryFileError else."""

    def bad(why: str) -> HistoryFileError:
        return HistoryFileError(f"history file {path} {why}")

    first, _, rest = data.partition(b"\n")
    name, _, version = first.partition(b" ")
    if name != MAGIC or not version.isdigit():
        raise bad("is not an adaspec history file")
    if int(version) != FORMAT:
        raise bad(f"has format {int(version)}; this adaspec reads format {FORMAT}")
    line, newline, payload = rest.partition(b"\n")
    try:
        header = json.loads(line) if newline else None
    except ValueError:
        header = None
    keys = ("tokenizer", "vocab_size", "documents", "tokens", "sha256")
    if not isinstance(header, dict) or any(k not in header for k in keys):
        raise bad("has a damaged header (truncated or corrupt)")
    if header["tokenizer"] != tokenizer or header["vocab_size"] != vocab_size:
        raise bad(f"was written for another tokenizer ({header['tokenizer']}, vocabulary "
                  f"{header['vocab_size']}; this model's is {tokenizer}, {vocab_size})")
    docs, tokens = header["documents"], header["tokens"]
    if not isinstance(docs, int) or not isinstance(tokens, int) or docs < 0 or tokens < 0:
        raise bad("has a damaged header (truncated or corrupt)")
    size = array(_U32).itemsize
    if len(payload) != size * (docs + tokens):
        raise bad(f"is truncated or corrupt ({len(payload)} payload bytes, the header "
                  f"says {size * (docs + tokens)})")
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise bad("is corrupt (its checksum does not match)")
    numbers = array(_U32)
    numbers.frombytes(payload)
    if sys.byteorder == "big":
        numbers.byteswap()
    lengths, flat = numbers[:docs], numbers[docs:]
    if sum(lengths) != tokens or (flat and max(flat) >= vocab_size):
        raise bad("is corrupt (its lengths or token ids do not add up)")
    out, start = [], 0
    for length in lengths:
        out.append(flat[start:start + length])
        start += length
    return out


assert array(_U32).itemsize == 4, "history files store 4-byte token ids"
