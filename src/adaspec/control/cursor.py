"""Where in the generation a length controller's next draft starts.

The engine asks `max_tokens` once per step and calls `update` only when a draft was sent to
verification, so a step without a draft (k = 0) shows up as a `max_tokens` call with no
`update` after it; every step emits its accepted tokens plus one token of the target's.
"""

from __future__ import annotations


class GenerationCursor:
    def __init__(self) -> None:
        self.begin()

    def begin(self) -> None:
        self.next = 1  # token 0 comes from the prefill
        self._open = False

    def begin_step(self) -> int:
        """Call from `max_tokens`: the index of the first token this step will draft."""
        if self._open:  # the previous step drafted nothing: the target added one token
            self.next += 1
        self._open = True
        return self.next

    def end_step(self, accepted: int) -> None:
        """Call from `update`."""
        self.next += accepted + 1
        self._open = False
