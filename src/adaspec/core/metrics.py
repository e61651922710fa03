"""Per-request statistics: what was drafted, accepted, and where the time went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_calls: int = 0  # target forward passes, prefill included
    draft_calls: int = 0  # draft model forward passes
    head_calls: int = 0  # draft head steps (priced apart: a few % of a target step)
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # draft tokens the target accepted
    wall_time: float = 0.0
    prefill_time: float = 0.0
    draft_time: float = 0.0  # every draft-model second, its prompt prefill included
    draft_prefill_time: float = 0.0  # the part of draft_time spent prefilling the prompt
    verify_time: float = 0.0  # target forward + verification (prefill excluded)
    target_time: float = 0.0  # the target's passes alone (device drained): verify_time's share
    steps: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per step
    # drafted nodes per step (a tree's; a chain's is its length): what its call verified
    nodes: list[int] = field(default_factory=list)
    route: str | None = None  # the drafter a router picked, if any
    route_time: float = 0.0
    # greedy rows of a multi-token pass re-scored alone: their top-2 gap was within the
    # runtime's batch noise (each one is also a target call)
    rechecks: int = 0
    # drafted tokens per part of the drafter that produced them (S2D: "exit 6": n), if any
    drafted_by: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0  # prompt tokens the target's cache already held (not computed)

    @property
    def other_time(self) -> float:
        return max(
            0.0,
            self.wall_time
            - self.prefill_time
            - self.draft_time
            - self.verify_time
            - self.route_time,
        )

    @property
    def loop_time(self) -> float:
        """The loop's own seconds after the prompt: everything but the target's and the
        draft's passes (verification, rollback, bookkeeping, text), in time a GPU waits."""
        return max(0.0, self.wall_time - self.prefill_time - self.route_time - self.draft_time
                   - self.target_time)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """MAT: tokens emitted per target forward pass (1.0 for plain decoding)."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.wall_time / self.new_tokens if self.new_tokens else 0.0

    def acceptance_by_position(self) -> list[float]:
        """Share of steps whose draft token at position i was accepted, given it was drafted."""
        drafted: list[int] = []
        accepted: list[int] = []
        for d, a in self.steps:
            for i in range(d):
                if i >= len(drafted):
                    drafted.append(0)
                    accepted.append(0)
                drafted[i] += 1
                accepted[i] += i < a
        return [a / d for a, d in zip(accepted, drafted, strict=True)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            other_time=self.other_time,
            loop_time=self.loop_time,
            acceptance_rate=self.acceptance_rate,
            mean_accepted_tokens=self.mean_accepted_tokens,
            tokens_per_s=self.tokens_per_s,
            ms_per_token=self.ms_per_token,
        )
        return d

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after it (the prompt's prefill left out)."""
        decode = self.wall_time - self.prefill_time - self.route_time
        return (self.new_tokens - 1) / decode if decode > 0 and self.new_tokens > 1 else 0.0

    def summary_line(self) -> str:
        line = (
            f"{self.new_tokens} new tokens | {self.tokens_per_s:.2f} tokens/s "
            f"(decode {self.decode_tokens_per_s:.2f}) | first token {self.prefill_time:.2f} s | "
            f"{self.target_calls} target calls | MAT {self.mean_accepted_tokens:.2f} | "
            f"acceptance {self.acceptance_rate:.1%} ({self.accepted}/{self.drafted})"
        )
        total = sum(self.drafted_by.values())
        if total:  # which part of the drafter drafted (S2D: its exits)
            line += " | drafted by " + ", ".join(
                f"{part} {n / total:.0%}" for part, n in self.drafted_by.items())
        return line
