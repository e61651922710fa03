"""What speculation costs on one machine: the cost profile every adaptive decision reads.

A profile holds, for one configuration (CPU, threads, backend, target and draft weights):
the target's forward time for n = 1..N fed tokens at a few context lengths (a verification
of n - 1 drafted tokens costs `target_ms(n)`), the draft's forward time for n tokens, prompt
prefill throughput, and the decode loop's own per-step overhead. Between measured points it
interpolates linearly (in n and in context length); past the last n it extends the last
measured slope.

A profile is measured (`cost.measure`), read from a JSON file, or built from a formula
(`linear:...`, `flat`), for hardware one does not have: such a profile is marked simulated,
and every figure priced with it must say so.
"""

from __future__ import annotations

import json
import math
import os
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adaspec.errors import InputError
from adaspec.store.atomic import write_json

FORMAT = 1
TABLE_PAST = 16  # whole sizes past a curve's last one read from its table (a step's drafts)
# The formula of a GPU-like machine: verification almost free up to 16 tokens.
FLAT_FORMULA = (
    "linear:target_ms=20,per_token_ms=0.25,draft_ms=4,draft_per_token_ms=0.1,"
    "prefill_tokens_per_s=4000,draft_prefill_tokens_per_s=10000"
)


@dataclass
class Curve:
    """Forward ms for n tokens (n = sizes[i]) at a few context lengths."""

    sizes: list[int]
    contexts: list[int]
    ms: list[list[float]]  # ms[context index][size index]

    def __post_init__(self) -> None:
        if not self.sizes or not self.contexts:
            raise InputError("a cost curve needs at least one size and one context length")
        if sorted(self.sizes) != self.sizes or self.sizes[0] < 1:
            raise InputError(f"cost curve sizes must ascend from >= 1, got {self.sizes}")
        if sorted(self.contexts) != self.contexts:
            raise InputError(f"cost curve contexts must ascend, got {self.contexts}")
        if len(self.ms) != len(self.contexts) or any(len(r) != len(self.sizes) for r in self.ms):
            raise InputError("cost curve: one row of ms per context, one value per size")
        if any(not (math.isfinite(v) and v > 0) for row in self.ms for v in row):
            raise InputError("cost curve: every time must be a positive number of ms")
        # each row read at every whole n up to the last size and TABLE_PAST past it: the
        # pricing asks for these thousands of times a round, at a bisection each
        self._dense = [[0.0] + [self._interpolate(i, n)
                                for n in range(1, self.sizes[-1] + TABLE_PAST + 1)]
                       for i in range(len(self.contexts))]

    def _row_at(self, i: int, n: float) -> float:
        if type(n) is int and 0 < n < len(self._dense[i]):
            return self._dense[i][n]
        return self._interpolate(i, n)

    def _interpolate(self, i: int, n: float) -> float:
        sizes, row = self.sizes, self.ms[i]
        if len(sizes) == 1:
            return row[0] * n / sizes[0]
        if n <= sizes[0]:
            return row[0]
        j = bisect_left(sizes, n)
        if j >= len(sizes):  # past the last size: the last slope goes on
            j = len(sizes) - 1
        a, b = sizes[j - 1], sizes[j]
        slope = (row[j] - row[j - 1]) / (b - a)
        return max(row[j - 1] + slope * (n - a), 1e-3)

    def _rows_for(self, context: int | None) -> tuple[int, int, float]:
        """The two measured contexts `context` lies between and its weight on the second
        (clamped to the measured ones; None: the first)."""
        cs = self.contexts
        if context is None or len(cs) == 1 or context <= cs[0]:
            return 0, 0, 0.0
        if context >= cs[-1]:
            return len(cs) - 1, len(cs) - 1, 0.0
        j = bisect_left(cs, context)
        return j - 1, j, (context - cs[j - 1]) / (cs[j] - cs[j - 1])

    def row(self, upto: int, context: int | None = None) -> list[float]:
        """[self(n, context) for n in 1..upto], with the context's weights read once."""
        a, b, w = self._rows_for(context)
        if a == b:
            return [self._row_at(a, n) for n in range(1, upto + 1)]
        return [lo + w * (hi - lo) for lo, hi in
                ((self._row_at(a, n), self._row_at(b, n)) for n in range(1, upto + 1))]

    def __call__(self, n: int, context: int | None = None) -> float:
        """ms for a forward of n tokens after `context` cached tokens (None: the first
        measured context)."""
        if n < 1:
            return 0.0
        a, b, w = self._rows_for(context)
        if a == b:
            return self._row_at(a, n)
        lo, hi = self._row_at(a, n), self._row_at(b, n)
        return lo + w * (hi - lo)


@dataclass
class CostProfile:
    """Measured (or simulated) costs of one configuration; times in milliseconds."""

    target: Curve
    draft: Curve | None = None
    prefill_tokens_per_s: float = 0.0  # the target's prompt prefill throughput
    draft_prefill_tokens_per_s: float = 0.0
    overhead_ms: float = 0.0  # the loop's own time per step (beyond the forwards)
    bandwidth_gbs: float = 0.0  # memory copy bandwidth measured beside it (for the floor)
    key: dict = field(default_factory=dict)  # what it was measured on (cpu, threads, ...)
    source: str = "measured"  # "measured" | "file" | "formula:..."
    simulated: bool = False
    notes: str = ""
    others_share: float = 0.0  # of the machine's CPU, taken by other processes meanwhile

    # ---------------------------------------------------------------- prices
    def target_ms(self, n: int, context: int | None = None) -> float:
        return self.target(n, context)

    def draft_ms(self, n: int = 1, context: int | None = None) -> float:
        if self.draft is None:
            raise InputError("this cost profile has no draft model: measure it with a draft")
        return self.draft(n, context)

    def step_ms(self, drafted: int, draft_forwards: int = 0, context: int | None = None) -> float:
        """One speculation step: `draft_forwards` single-token draft forwards, then one
        verification of `drafted` tokens (n = drafted + 1 fed to the target)."""
        cost = self.target_ms(drafted + 1, context) + self.overhead_ms
        if draft_forwards:
            cost += draft_forwards * self.draft_ms(1, context)
        return cost

    def floor_ms(self, role: str = "target") -> float | None:
        """The physical floor of one single-token forward: the weight bytes it reads over
        the measured memory bandwidth (None when either is unknown)."""
        about = (self.key or {}).get(role) or {}
        size = about.get("bytes_per_forward")
        if not size or not self.bandwidth_gbs:
            return None
        return 1000 * size / (self.bandwidth_gbs * 1e9)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        d = asdict(self)
        d["format"] = FORMAT
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CostProfile:
        if not isinstance(d, dict) or "target" not in d:
            raise InputError("not a cost profile (no target curve)")
        if d.get("format", FORMAT) != FORMAT:
            raise InputError(f"cost profile format {d.get('format')} (this adaspec reads "
                             f"{FORMAT}); measure it again with `adaspec profile`")
        try:
            target = Curve(**d["target"])
            draft = Curve(**d["draft"]) if d.get("draft") else None
            return cls(
                target=target,
                draft=draft,
                prefill_tokens_per_s=float(d.get("prefill_tokens_per_s", 0.0)),
                draft_prefill_tokens_per_s=float(d.get("draft_prefill_tokens_per_s", 0.0)),
                overhead_ms=float(d.get("overhead_ms", 0.0)),
                bandwidth_gbs=float(d.get("bandwidth_gbs", 0.0)),
                key=dict(d.get("key", {})),
                source=str(d.get("source", "file")),
                simulated=bool(d.get("simulated", False)),
                notes=str(d.get("notes", "")),
                others_share=float(d.get("others_share", 0.0)),
            )
        except (TypeError, ValueError, KeyError) as exc:
            raise InputError(f"malformed cost profile: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (a temporary file renamed over the target)."""
        return write_json(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise InputError(f"cost profile {path} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"cost profile {path} is unreadable: {exc}") from None
        return cls.from_dict(data)

    # ------------------------------------------------------------ formulas
    @classmethod
    def from_formula(cls, text: str) -> CostProfile:
        """A simulated profile: `flat` (GPU-like: verifying 16 tokens costs about one
        pass) or `linear:target_ms=A,per_token_ms=B,draft_ms=C,draft_per_token_ms=D`,
        i.e. target(n) = A + B (n - 1) and draft(n) = C + D (n - 1); optionally
        prefill_tokens_per_s= and draft_prefill_tokens_per_s= (0: prefills not priced)."""
        spec = FLAT_FORMULA if text.strip() == "flat" else text.strip()
        kind, _, rest = spec.partition(":")
        if kind != "linear":
            raise InputError(f"unknown cost formula {text!r}: use 'flat' or "
                             "'linear:target_ms=A,per_token_ms=B,draft_ms=C,draft_per_token_ms=D'")
        # floats; target_ms and draft_ms None until given (target_ms is required)
        values: dict[str, Any] = {"target_ms": None, "per_token_ms": 0.0, "draft_ms": None,
                                  "draft_per_token_ms": 0.0, "prefill_tokens_per_s": 0.0,
                                  "draft_prefill_tokens_per_s": 0.0}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key.strip() not in values:
                raise InputError(f"cost formula {text!r}: expected one of "
                                 f"{', '.join(values)} as key=value, got {item!r}")
            try:
                values[key.strip()] = float(value)
            except ValueError:
                raise InputError(f"cost formula {text!r}: {key} must be a number") from None
        if values["target_ms"] is None:
            raise InputError(f"cost formula {text!r}: give target_ms=...")
        sizes = list(range(1, 17))
        target = Curve(sizes, [0], [[values["target_ms"] + values["per_token_ms"] * (n - 1)
                                     for n in sizes]])
        draft = None
        if values["draft_ms"] is not None:
            draft = Curve(sizes, [0], [[values["draft_ms"]
                                        + values["draft_per_token_ms"] * (n - 1)
                                        for n in sizes]])
        return cls(target=target, draft=draft,
                   prefill_tokens_per_s=values["prefill_tokens_per_s"],
                   draft_prefill_tokens_per_s=values["draft_prefill_tokens_per_s"],
                   source=f"formula:{spec}",
                   simulated=True, notes="simulated: built from a formula, not measured")


def load_profile(text: str) -> CostProfile:
    """A profile from a JSON file path or a formula (`flat`, `linear:...`)."""
    if text.strip() == "flat" or text.strip().startswith("linear:"):
        return CostProfile.from_formula(text)
    return CostProfile.load(text)
