"""Bounded replay buffers of recorded requests, one per domain (first in, first out)."""

from __future__ import annotations

from collections import deque

from adaspec.online.record import RequestRecord


class ReplayBuffer:
    """Keeps the newest records holding at most `capacity` positions in all."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1 position, got {capacity}")
        self.capacity = capacity
        self._records: deque[RequestRecord] = deque()
        self.positions = 0
        self.added_since_update = 0  # requests added since the last update started
        self.positions_since_update = 0  # ... and their recorded positions

    def add(self, record: RequestRecord) -> None:
        self.positions_since_update += len(record)
        if not len(record):
            self.added_since_update += 1
            return
        self._records.append(record)
        self.positions += len(record)
        self.added_since_update += 1
        while self.positions > self.capacity and len(self._records) > 1:
            self.positions -= len(self._records.popleft())
        if self.positions > self.capacity:  # one record alone is too big: keep its newest
            only = self._records[0]
            cut = len(only) - self.capacity
            only.positions = only.positions[cut:]
            only.top_ids, only.top_probs = only.top_ids[cut:], only.top_probs[cut:]
            self.positions = len(only)

    def started_update(self) -> None:
        self.added_since_update = 0
        self.positions_since_update = 0

    def records(self) -> list[RequestRecord]:
        return list(self._records)

    def __len__(self) -> int:
        return len(self._records)


class DomainBuffers:
    """One ReplayBuffer per domain, created on first use."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffers: dict[str, ReplayBuffer] = {}

    def __getitem__(self, domain: str) -> ReplayBuffer:
        if domain not in self.buffers:
            self.buffers[domain] = ReplayBuffer(self.capacity)
        return self.buffers[domain]
