"""The verification slack continuous batching would share (issue 33), measured on
ik_llama.cpp: what one target call costs when it carries one token for each of B requests
(B sequences in one batch, each with its own KV entries), against one request's chain of B
tokens and against B separate single-token calls.

Eight different prompts are prefilled into eight sequences of one context (`n_seq_max` 8,
one KV cache shared by the slots), then, in interleaved rounds, each shape is timed as one
`llama_decode` and rolled back (`llama_kv_cache_seq_rm`). Medians of the rounds. Writes
batch_slack.json / batch_slack.md.

    .venv/bin/python experiments/batch_slack.py --out experiments/results/batch-slack-epyc
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from adaspec.backends.ikllama import library
from adaspec.backends.weights import llama_threads
from adaspec.lab.bench.machine import describe_machine
from adaspec.lab.bench.suites import load_suite
from adaspec.store.catalog import TARGET_DEFAULT
from adaspec.store.model_store import load_tokenizer

SLOTS = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=TARGET_DEFAULT)
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="experiments/results/batch-slack")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    assert max(sizes) <= SLOTS

    from adaspec.backends.llamacpp import gguf_backend_args

    gguf = gguf_backend_args(args.target, llama_threads(), runtime="ik")[0]
    tokenizer = load_tokenizer(args.target, "bfloat16")
    api = library()
    lib = api.adaspec_lib
    params = lib.llama_model_default_params()
    params.n_gpu_layers = 0
    params.repack_tensors = True
    model = lib.llama_model_load_from_file(str(gguf).encode(), params)
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = 8192
    cparams.n_batch = cparams.n_ubatch = 512
    cparams.n_seq_max = SLOTS
    cparams.n_threads = cparams.n_threads_batch = llama_threads()
    cparams.flash_attn = False
    ctx = lib.llama_init_from_model(model, cparams)
    batch = lib.llama_batch_init(512, 0, SLOTS)

    def decode(rows: list[tuple[int, int, int]]) -> float:
        """rows: (sequence, position, token), logits for every row; seconds."""
        for i, (seq, pos, tok) in enumerate(rows):
            batch.token[i], batch.pos[i] = tok, pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = True
        batch.n_tokens = len(rows)
        t0 = time.perf_counter()
        code = lib.llama_decode(ctx, batch)
        elapsed = time.perf_counter() - t0
        assert code == 0, code
        return elapsed

    prompts = []
    for suite in ("humaneval", "wmt", "sharegpt", "codeedit"):
        prompts += load_suite(suite, 2)
    lengths = []
    for seq, prompt in enumerate(prompts[:SLOTS]):
        ids = tokenizer(prompt.text)["input_ids"][:200]
        for start in range(0, len(ids), 256):
            chunk = ids[start : start + 256]
            decode([(seq, start + i, t) for i, t in enumerate(chunk)])
        lengths.append(len(ids))

    def roll_back() -> None:
        for seq in range(SLOTS):
            lib.llama_kv_cache_seq_rm(ctx, seq, lengths[seq], -1)

    shapes = {}
    for b in sizes:
        shapes[f"{b} requests x 1 token"] = [(s, lengths[s], 13) for s in range(b)]
        shapes[f"1 request x {b} tokens"] = [(0, lengths[0] + i, 13 + i) for i in range(b)]
    times: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, rows in shapes.items():
            times[name].append(decode(rows))
            roll_back()
    ms = {name: 1000 * statistics.median(t[1:]) for name, t in times.items()}
    one = ms["1 requests x 1 token"]
    table = [{"shape": name, "ms": round(v, 2), "single_token_passes": round(v / one, 2)}
             for name, v in ms.items()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"target": args.target, "runtime": f"ik_llama.cpp ({api.adaspec_build})",
              "machine": describe_machine(), "rounds": args.rounds, "rows": table,
              "prompt_tokens": lengths}
    (out / "batch_slack.json").write_text(json.dumps(record, indent=2))
    lines = [f"# One target call, several requests or one chain ({args.target}, "
             f"{record['runtime']}, {llama_threads()} threads)", "",
             "| shape | ms | single-token passes |", "| --- | ---: | ---: |"]
    lines += [f"| {r['shape']} | {r['ms']:.1f} | {r['single_token_passes']:.2f} |"
              for r in table]
    (out / "batch_slack.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_free_model(model)


if __name__ == "__main__":
    main()
