"""The router policy shipped for the built-in pair (`router` without a path): collected and
trained on the default runtime, with a `.json` beside it naming the commands, the data's
sha256, the date and the machine (`experiments/router_builtin.sh` makes it again)."""

from __future__ import annotations

from pathlib import Path

ROUTER_BUILTIN = Path(__file__).parent / "router-qwen2.5-coder-1.5b-instruct.pt"
