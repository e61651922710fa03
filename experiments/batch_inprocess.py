"""Requests decoded together, in process (issue 33): where a batched wave's time goes.

Loads the pair as `adaspec serve --max-batch N` does, opens N slots and, per method, runs
waves of N chat requests (prompts as `concurrency_sweep.py` picks them) through the batch
decoder priced as the server prices it; every slot's caches are emptied before each wave,
so no method inherits another's prompts. Reports aggregate tokens/s, the draft model's
share of the wave, the drafted tokens the pricing verified and cut, and `auto`'s choices.
No HTTP: what the rounds cost, not what a client sees (concurrency_sweep.py measures that).

    .venv/bin/python experiments/batch_inprocess.py --requests 8 --methods ar,auto --waves 2

`--compare-env VAR=VALUE` loads the pair a second time with VAR=VALUE and alternates the
waves between the two in one process (one machine state for both: an A/B of a runtime
setting, such as ADASPEC_IK_KV_REGIONS=off).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from concurrency_sweep import prompt_pool  # noqa: E402

from adaspec.core.sampling import SamplingParams  # noqa: E402
from adaspec.engine.batch import BatchDecoder, RoundStats  # noqa: E402
from adaspec.engine.loop import TextGenerator  # noqa: E402
from adaspec.engine.steps import GenerationResult
from adaspec.serve.config import ServeConfig  # noqa: E402
from adaspec.serve.instance import ModelInstance  # noqa: E402


def reset_slots(instance: ModelInstance) -> None:
    """Empty every slot's caches and the history, so no wave inherits another's prompts
    (as concurrency_sweep.py's fresh server a wave)."""
    if instance.history is not None:
        instance.history.index.clear()
    for view, draft in instance.slots:
        view.reset()
        if draft is not None:
            draft.reset()


def run_requests(instance: ModelInstance, decoder: BatchDecoder, method: str,
                 prompts: list[str], max_tokens: int, order: list[int] | None = None,
                 join: bool = True, each_round: Callable[[RoundStats], None] | None = None,
                 per_client: int = 1,
                 ) -> tuple[dict[int, GenerationResult], list[TextGenerator]]:
    """Greedy chat requests decoded together until all are done: their results by prompt,
    and the slots' engines. With per_client 1, prompt i on slot i, added in `order`; with
    more, len(prompts) / per_client clients (slots), client c sending prompts c, c + C,
    ... one after the other, the next as soon as the last is done (as concurrency_sweep.py's
    clients do). join False: the drafters price their drafts as requests alone (the
    pricing before `cost.batch.BatchLoad`)."""
    clients = len(prompts) // per_client
    engines = [instance.slot_engine(method, i) for i in range(clients)]
    reset_slots(instance)

    def send(i: int) -> None:
        slot = i % clients
        seat = decoder.seat() if join else None
        decoder.add(i, engines[slot].stream_steps(prompts[i], max_tokens, SamplingParams(),
                                                  chat=True, seat=seat), seat)

    for i in order if order is not None else range(clients):
        send(i)
    results: dict[int, GenerationResult] = {}
    while len(decoder):
        for key, item in decoder.round():
            if isinstance(item, Exception):
                raise item
            if isinstance(item, GenerationResult):
                results[int(str(key))] = item
                instance.request_done(engines[int(str(key)) % clients])  # the history learns
                if int(str(key)) + clients < len(prompts):
                    send(int(str(key)) + clients)
        if each_round is not None:
            each_round(decoder.last)
    return results, engines


def wave(instance: ModelInstance, decoder: BatchDecoder, method: str, prompts: list[str],
         max_tokens: int, join: bool = True, per_client: int = 1) -> dict:
    """One wave's figures (join, per_client: see `run_requests`)."""
    drafted = cut = rounds = prefill = 0
    call_s = prefill_call_s = modelled_ms = 0.0
    by_sequences: dict[int, list[int]] = {}  # sequences -> [rounds, drafted verified]
    decode_rounds: dict[int, list[float]] = {}  # sequences -> decode-only rounds' call seconds

    def count(last: RoundStats) -> None:
        nonlocal drafted, cut, rounds, prefill, call_s, prefill_call_s, modelled_ms
        modelled_ms += decoder.modelled_ms() or 0.0
        seen = by_sequences.setdefault(last.sequences, [0, 0])
        seen[0] += 1
        seen[1] += last.drafted
        drafted += last.drafted
        cut += last.cut
        prefill += last.prefill_tokens
        call_s += last.call_seconds
        if last.prefill_tokens:
            prefill_call_s += last.call_seconds
        elif last.sequences:
            decode_rounds.setdefault(last.sequences, []).append(last.call_seconds)
        rounds += 1

    t0 = time.perf_counter()
    results, engines = run_requests(instance, decoder, method, prompts, max_tokens, join=join,
                                    each_round=count, per_client=per_client)
    wall = time.perf_counter() - t0
    stats = [r.stats for r in results.values()]
    tokens = sum(s.new_tokens for s in stats)
    choices: dict[str, int] = {}
    for engine in engines:
        got = getattr(engine.drafter, "choices", None)
        if got is not None:
            for k, v in vars(got).items():
                choices[k] = choices.get(k, 0) + v
    return {
        "method": method, "requests": len(prompts), "tokens": tokens,
        "wall_s": round(wall, 2), "agg_tok_s": round(tokens / wall, 1), "rounds": rounds,
        "call_s": round(call_s, 2), "prefill_tokens": prefill,
        # the rounds' calls priced by the batch cost curve: the same for every wave of the
        # same calls, so methods compare without the machine's noise (modelled, not timed)
        "modelled_call_s": round(modelled_ms / 1000, 2),
        "rounds_drafted_by_sequences": {n: v for n, v in sorted(by_sequences.items())},
        # where the calls' time went: rounds carrying prompt tokens (with any decoding beside
        # them), then decode-only rounds by how many requests they carried
        "prefill_rounds_s": round(prefill_call_s, 2),
        "decode_rounds": {n: {"rounds": len(t), "s": round(sum(t), 2),
                              "ms_median": round(1000 * sorted(t)[len(t) // 2], 1)}
                          for n, t in sorted(decode_rounds.items())},
        "draft_s": round(sum(s.draft_time for s in stats), 2),
        "draft_calls": sum(s.draft_calls for s in stats),
        "drafted_verified": drafted, "drafted_cut": cut,
        "accepted": sum(s.accepted for s in stats), "choices": choices,
        "texts": [results[i].text[:40] for i in sorted(results)],
    }


def load(requests: int) -> tuple[ModelInstance, BatchDecoder]:
    """The pair as `adaspec serve --max-batch N` loads it, N slots open, priced."""
    from adaspec.cost.batch import batch_cost_for

    instance = ModelInstance.load(ServeConfig(method="auto", max_batch=requests, history="off"))
    instance.open_slots(requests)
    cost = batch_cost_for(instance.target, [v for v, _ in instance.slots])
    return instance, BatchDecoder(cost=cost.ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--methods", default="ar,auto",
                    help="methods; NAME/alone prices NAME's drafts as requests alone")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--per-client", type=int, default=1,
                    help="requests each of the --requests clients sends, one after the other")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--suites", default="humaneval,codeedit,wmt,sharegpt")
    ap.add_argument("--compare-env", default=None, metavar="VAR=VALUE",
                    help="also load the pair with VAR=VALUE (e.g. ADASPEC_IK_KV_REGIONS=off) "
                         "and run every wave on both, in alternating order")
    ap.add_argument("--out", default=None, help="a JSON file for the rows")
    args = ap.parse_args()
    setups = {"as is": load(args.requests)}
    if args.compare_env:
        var, _, value = args.compare_env.partition("=")
        os.environ[var] = value  # read when the runtime's context is made
        setups[args.compare_env] = load(args.requests)
    prompts = [p.text for p in prompt_pool(args.suites.split(","),
                                           args.requests * args.per_client, 2000)]
    rows = []
    for w in range(args.waves):
        order = list(setups) if w % 2 == 0 else list(reversed(setups))
        for setup in order:
            instance, decoder = setups[setup]
            for method in args.methods.split(","):
                name, _, how = method.partition("/")
                row = wave(instance, decoder, name, prompts, args.max_tokens,
                           join=how != "alone", per_client=args.per_client)
                row.update(method=method, wave=w, setup=setup, kind=instance.target.kind)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "texts"}), flush=True)
    for setup in setups:
        for method in args.methods.split(","):
            rates = sorted(r["agg_tok_s"] for r in rows
                           if r["setup"] == setup and r["method"] == method)
            modelled = sorted(r["tokens"] / r["modelled_call_s"] for r in rows
                              if r["setup"] == setup and r["method"] == method)
            print(f"{setup:>30} {method:>8}: modelled {modelled[0]:.1f} tok/s (calls priced "
                  "by the batch cost curve)")
            print(f"{setup:>30} {method:>8}: median {rates[len(rates) // 2]} tok/s over "
                  f"{len(rates)} waves ({rates[0]}-{rates[-1]})")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    for instance, _ in setups.values():
        instance.close()


if __name__ == "__main__":
    main()
