"""Accepted tokens -> final text, streamed: stop strings and incomplete characters are held
back until they are settled."""

from __future__ import annotations


class TextAssembler:
    """Turns accepted tokens into final text, holding back what may still become a stop
    string or an incomplete UTF-8 character."""

    STABLE_EVERY = 16  # tokens between updates of the decoded prefix kept

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.sent = 0  # characters already handed out
        self.cut: int | None = None  # where a stop string begins
        # Decoding every generated token again at each step cost 1.4 ms a step at 256
        # tokens; a prefix that ends on a whole character decodes the same on its own, so
        # its text is kept and only the tokens after it are decoded. (Not when the tokenizer
        # rewrites spaces across tokens: then the whole text is decoded each time.)
        self._incremental = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._stable: list[int] = []
        self._stable_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        n = len(self._stable)
        if not self._incremental or ids[:n] != self._stable:
            self._stable, self._stable_text = [], ""
            n = 0
        text = self._stable_text + self._decode(ids[n:])
        if len(ids) - n >= self.STABLE_EVERY and not text.endswith("\ufffd"):
            self._stable, self._stable_text = list(ids), text
        return text

    def push(self, ids: list[int], final: bool) -> tuple[str, bool]:
        text = self._text(ids)
        hit = False
        for s in self.stop:
            pos = text.find(s)
            if pos != -1 and (self.cut is None or pos < self.cut):
                self.cut = pos
                hit = True
        if self.cut is not None:
            safe = self.cut
        elif final:
            safe = len(text)
        else:
            safe = len(text) - _held_back(text, self.stop)
        piece = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return piece, hit

    def tokens_through_stop(self, ids: list[int]) -> int:
        """The fewest leading tokens whose text already reaches the stop string."""
        assert self.cut is not None
        n = len(ids)
        while n > 1 and self._reaches_stop(ids[: n - 1]):
            n -= 1
        return n

    def _reaches_stop(self, ids: list[int]) -> bool:
        text = self._text(ids)
        return any(text.find(s) == self.cut for s in self.stop)

    def final_text(self, ids: list[int]) -> str:
        text = self._text(ids)
        return text[: self.cut] if self.cut is not None else text


def _held_back(text: str, stop: list[str]) -> int:
    """Characters at the end of `text` that could still start a stop string or be a partial
    multi-byte character."""
    hold = 0
    while hold < len(text) and text[len(text) - 1 - hold] == "\ufffd":
        hold += 1
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold
