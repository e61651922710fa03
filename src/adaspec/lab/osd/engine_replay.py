"""Engine replay: every request of the stream decoded by the real engine (the target and
the torch draft as `adaspec serve` runs them), with online distillation beside it as the
server runs it (updates in the worker process while decoding goes on)."""

from __future__ import annotations

import time

from adaspec.lab.bench.exactness import classify
from adaspec.lab.osd.simulate import RequestResult, RunResult, RunSpec, run_config
from adaspec.lab.osd.stream import StreamRequest
from adaspec.online.record import Recorder
from adaspec.online.service import OnlineDistiller


def engine_run(engine, service: OnlineDistiller | None, stream: list[StreamRequest],
               max_new_tokens: int, spec: RunSpec, progress: bool = True) -> RunResult:
    from tqdm import tqdm

    if service is not None:
        service.reset(run_config(service.cfg, spec) if spec.kind == "online" else None)
    t0 = time.perf_counter()
    results: list[RequestResult] = []
    for r in tqdm(stream, desc=f"{spec.text} (engine)", disable=not progress, unit="req"):
        domain = "default"
        online = service if spec.kind == "online" else None
        if online is not None:
            domain = online.domain(r.suite if online.cfg.domains != "shared" else None,
                                   r.prompt_ids)
            online.before_request(domain)
        res = engine.generate(r.prompt_ids, max_new_tokens=max_new_tokens,
                              recorder=online.recorder if online is not None else None)
        if online is not None:
            online.after_request(online.recorder.take(res.token_ids, domain,
                                                      res.stats.drafted, res.stats.accepted))
        done = online.adapters.get(domain) if online else None
        # the stored output is the target's greedy one: a difference is a numerical tie of
        # the runtime (top-2 logits within its noise where the two part) or a bug
        reference = r.output[: len(res.token_ids)]
        div = classify(engine.target, r.prompt_ids, reference, res.token_ids)
        results.append(RequestResult(
            r.index, r.suite, domain, res.stats.drafted, res.stats.accepted,
            len(res.stats.steps), done.updates if done else 0, res.stats.wall_time,
            len(res.token_ids), div is None, div.kind if div else ""))
    updates = []
    if service is not None and spec.kind == "online":
        service.collect(wait=True)
        from adaspec.lab.osd.simulate import _update_row

        updates = [_update_row(u) for u in service.history]
    return RunResult(spec.text, results, updates, time.perf_counter() - t0)


def recording_overhead(engine, stream: list[StreamRequest], max_new_tokens: int,
                       top_k: int, rounds: int = 2, progress: bool = True) -> dict:
    """Decode time with and without the recorder, alternating per request (which goes first
    alternates too), so drift in the machine's speed cancels."""
    from tqdm import tqdm

    times = {"off": 0.0, "on": 0.0}
    tokens = {"off": 0, "on": 0}
    recorder = Recorder(top_k, "rejected")
    jobs = [(i, r) for i in range(rounds) for r in stream]
    for n, (i, r) in enumerate(tqdm(jobs, desc="recording overhead", disable=not progress)):
        order = ("on", "off") if (n + i) % 2 == 0 else ("off", "on")
        for mode in order:
            res = engine.generate(r.prompt_ids, max_new_tokens=max_new_tokens,
                                  recorder=recorder if mode == "on" else None)
            if mode == "on":
                recorder.take(res.token_ids)
            times[mode] += res.stats.wall_time
            tokens[mode] += len(res.token_ids)
    off = tokens["off"] / times["off"]
    on = tokens["on"] / times["on"]
    return {"requests": len(jobs), "tok_s_without": off, "tok_s_with": on,
            "slowdown": 1 - on / off}

