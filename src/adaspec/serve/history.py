"""The server's cross-request history (`draft/history.py`): one index shared by every engine
whose method drafts from history, loaded at start and saved every N finished requests and at
shutdown, under `$ADASPEC_HOME/history/` unless `--history PATH|off` says otherwise."""

from __future__ import annotations

import logging
from pathlib import Path

from adaspec.draft.history import DEFAULT_BUDGET, HistoryIndex, tokenizer_key
from adaspec.engine.loop import TextGenerator
from adaspec.errors import InputError

log = logging.getLogger("adaspec.serve")

OFF = "off"


def default_path(target_name: str) -> Path:
    from adaspec.online.adapters import safe_name
    from adaspec.store.assembly import adaspec_home

    return adaspec_home() / "history" / f"{safe_name(Path(target_name).name)}.history"


class ServedHistory:
    """The index, where it is kept (None: in memory only) and how often it is saved."""

    def __init__(self, index: HistoryIndex, path: Path | None, every: int = 16) -> None:
        if every < 1:
            raise InputError(f"--history-every must be >= 1, got {every}")
        self.index = index
        self.path = path
        self.every = every
        self._since_save = 0
        self._saved = index.version  # what the file holds (nothing to write before a change)

    @classmethod
    def open(cls, where: str, target, tokenizer, every: int = 16,
             budget: int = DEFAULT_BUDGET) -> ServedHistory:
        """`where`: a file, "" for the default one, or "off" (kept in memory, never read or
        written). A file that cannot be used is reported in one line and started afresh."""
        key = tokenizer_key(tokenizer, target.vocab_size)
        if where == OFF:
            return cls(HistoryIndex(target.vocab_size, budget=budget, tokenizer=key), None,
                       every)
        path = Path(where) if where else default_path(target.name)
        index = HistoryIndex.load_or_new(path, key, target.vocab_size, budget=budget,
                                         report=_report)
        if index.tokens:
            log.info("history: %d tokens of %d earlier documents from %s", index.tokens,
                     index.documents, path)
        return cls(index, path, every)

    def request_done(self, engine: TextGenerator) -> None:
        """A request finished on `engine`: its drafter teaches the index now (not at the next
        request), and every `every` requests the index is saved."""
        _learn(engine)
        self._since_save += 1
        if self._since_save >= self.every:
            self.save()

    def save(self) -> None:
        """Write the index if it changed since the last save (and a file is kept)."""
        self._since_save = 0
        version = self.index.version
        if self.path is None or version == self._saved:
            return
        try:
            self.index.save(self.path)
            self._saved = version
        except (OSError, InputError) as exc:  # a full disk never stops the server
            _report(f"history could not be saved to {self.path} ({exc})")

    def close(self, engines: list[TextGenerator]) -> None:
        for engine in engines:
            _learn(engine)
        self.save()


def _learn(engine: TextGenerator) -> None:
    engine.request_done()


def _report(line: str) -> None:
    import sys

    print(f"adaspec serve: {line}", file=sys.stderr, flush=True)
