"""Each generated token's own text, for the playground's colouring.

The engine streams text by steps (and holds back what could still become a stop string);
the playground colours single tokens, so the worker also cuts the output into per-token
pieces by decoding a short window before each token. A token that ends inside a multi-byte
character gets "" and the character goes with the token that completes it.
"""

from __future__ import annotations

WINDOW = 6  # tokens of left context decoded with each new one (byte-level BPE merges)


class TokenPieces:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the decoded window
        self.read = 0  # tokens whose text has been given out

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            piece = after[len(before):] if after.startswith(before) else after
            self.read = len(self.ids)
            self.prefix = max(0, self.read - WINDOW)
            return piece
        return ""
