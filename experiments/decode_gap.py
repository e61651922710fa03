"""Where a plain decode step's time goes against llama-server's (issue 63, "never slower"):
the target's one-row call timed at each layer, the same prompt, this machine, one run:

- `raw`: ik_llama.cpp's `llama_decode` of one row in process (ctypes), as adaspec loads the
  model (repacked), one sequence (`--max-batch 1`'s layout) and a context of several
  sequences with its multi-sequence flash attention (the server's default);
- `backend`: the runtime adaspec drives (a child process), one sequence and as the default
  server loads it (`sequences` = slots + 1): `forward` of one token, logits back;
- `llama-server`: a native llama-server (stock settings) decoding the same prompt, its own
  `timings.predicted_per_token_ms`.

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/decode_gap.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "experiments"))


def prompt_ids(tokenizer, n: int) -> list[int]:
    from adaspec.lab.bench.suites import load_suite

    text = " ".join(p.text for p in load_suite("sharegpt", 8))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids][-n:]


def raw(target: str, prompt: list[int], steps: int, sequences: int) -> float:
    import ik_raw

    from adaspec.backends.ik.backend import multi_sequence_flash

    api, lib, model = ik_raw.load_model(target)
    flash = multi_sequence_flash(api) if sequences > 1 else False
    ctx = ik_raw.Context(lib, model, flash=flash, sequences=sequences, n_ctx=8192)
    try:
        ctx.feed(0, prompt)
        rng = random.Random(0)
        times = []
        for i in range(steps):
            s, _ = ctx.decode([(0, len(prompt) + i, rng.randrange(1000, 30000))], want={0})
            times.append(1000 * s)
        return statistics.median(times[4:])
    finally:
        ctx.close()
        lib.llama_free_model(model)


def backend(target: str, prompt: list[int], steps: int, sequences: int) -> float:
    import torch

    from adaspec.backends.load import load_backends

    tgt, _, _, _ = load_backends(target, None, sequences=sequences)
    try:
        tgt.prefill(torch.tensor(prompt))
        rng = random.Random(0)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = tgt.forward(torch.tensor([rng.randrange(1000, 30000)]))
            float(out.logits[-1].max())  # the logits read, as the loop reads them
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times[4:])
    finally:
        close = getattr(tgt, "close", None)
        if callable(close):
            close()


def llama_server(target: str, prompt: list[int], steps: int) -> float:
    from serve_path import start_llama

    from adaspec.backends.gguf import gguf_backend_args
    from adaspec.backends.ik.backend import library
    from adaspec.backends.weights import llama_threads

    gguf = gguf_backend_args(target, llama_threads(), 8192, library)[0]
    out = Path("/tmp/adaspec-decode-gap")
    out.mkdir(exist_ok=True)
    dec = start_llama(out, Path(gguf), "none", llama_threads())
    try:
        server = dec.server
        body = {"prompt": prompt, "n_predict": steps, "temperature": 0.0,
                "cache_prompt": False, "ignore_eos": True}
        server.request("POST", "/completion", dict(body, n_predict=4))
        status, got = server.request("POST", "/completion", body)
        assert status == 200, got
        return float(got["timings"]["predicted_per_token_ms"])
    finally:
        dec.close()


def main() -> int:
    from adaspec.store.catalog import TARGET_DEFAULT
    from adaspec.store.model_store import load_tokenizer

    p = argparse.ArgumentParser()
    p.add_argument("--target", default=TARGET_DEFAULT)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--sequences", type=int, default=17, help="the default server's: slots + 1")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    prompt = prompt_ids(load_tokenizer(args.target, "bfloat16"), args.prompt_tokens)
    parts = {
        "llama-server plain": lambda: llama_server(args.target, prompt, args.steps),
        "raw ik, one sequence": lambda: raw(args.target, prompt, args.steps, 1),
        f"raw ik, {args.sequences} sequences": lambda: raw(args.target, prompt, args.steps,
                                                            args.sequences),
        "backend, one sequence": lambda: backend(args.target, prompt, args.steps, 1),
        f"backend, {args.sequences} sequences": lambda: backend(args.target, prompt,
                                                                 args.steps, args.sequences),
    }
    got: dict[str, list[float]] = {k: [] for k in parts}
    for r in range(args.rounds):
        for name, run in parts.items():
            got[name].append(run())
            print(f"round {r}: {name}: {got[name][-1]:.2f} ms a token", flush=True)
    print(json.dumps({k: [round(x, 2) for x in v] for k, v in got.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
