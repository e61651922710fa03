"""A stream of one kind the shipped draft head never trained on, for OSD on the head (issue
66): English to French translation requests built from the WMT English sentences (the head
trained on English to German ones; DESIGN.md lets the WMT prompts train), as a JSON list of
{"id", "prompt"} that `adaspec head data --prompts` records and
`experiments/head_online_serve.py --prompts` serves.

    python experiments/osd_stream.py --out /tmp/wmt-en-fr.json   # WMT sentences 300-499
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

GERMAN = "Translate the input English sentence into German.\n"


def main() -> int:
    from adaspec.lab.bench import suites

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--first", type=int, default=300, help="the first WMT sentence")
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--language", default="French")
    args = p.parse_args()
    prompts = suites.wmt(args.first + args.count)[args.first:]
    out = []
    for prompt in prompts:
        if not prompt.text.startswith(GERMAN):
            raise SystemExit(f"{prompt.id}: not a WMT English-to-German prompt")
        index = prompt.id.rsplit("/", 1)[1]
        out.append({"id": f"wmt-en-{args.language[:2].lower()}/{index}",
                    "prompt": f"Translate the input English sentence into {args.language}.\n"
                              + prompt.text[len(GERMAN):]})
    Path(args.out).write_text(json.dumps(out, ensure_ascii=False, indent=0) + "\n")
    print(f"{len(out)} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
