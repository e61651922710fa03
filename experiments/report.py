"""A lab script's markdown report: dated title, the machine, the command, then its body;
printed, and written to `out` when given."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def write_report(title: str, body: list[str], out: str | None) -> str:
    from adaspec.lab.bench.machine import describe_machine

    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# {title} ({date})", "", f"Machine: {describe_machine()}", "",
             "Command: `python " + " ".join(sys.argv) + "`", "", *body]
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        Path(out).write_text(text)
    return text
