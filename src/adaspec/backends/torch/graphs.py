"""What both static-cache runtimes (`static.py`, one sequence; `torch/static_batch.py`, several)
share: a fixed-shape pass's integer inputs in one buffer, and a pass recorded as a CUDA
graph."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


def capture_graph(run: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
    """`run` recorded as a CUDA graph in memory pool `pool`, after a warm-up on a side
    stream (which initialises the kernels' workspaces); the graph and its output buffer."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


class PassInputs:
    """A fixed-shape pass's integer inputs, by name and shape, packed in one host buffer and
    one device buffer: filled on the host (`host`), sent in one copy (`send`); a captured
    graph reads the device views (`dev`) at each replay."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], device: torch.device) -> None:
        sizes = {name: math.prod(shape) for name, shape in shapes.items()}
        self._host = torch.zeros(sum(sizes.values()), dtype=torch.long)
        self._dev = torch.zeros(sum(sizes.values()), dtype=torch.long, device=device)
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        at = 0
        for name, shape in shapes.items():
            self.host[name] = self._host[at:at + sizes[name]].view(shape)
            self.dev[name] = self._dev[at:at + sizes[name]].view(shape)
            at += sizes[name]

    def clear(self) -> None:
        self._host.zero_()

    def send(self) -> None:
        self._dev.copy_(self._host)
