"""Where a served request's time goes, `auto` against `ar` (issue 63, part 2): per request
through `adaspec serve` (defaults, `--history off`), the server's wall time against the
seconds its rounds spent in target calls (/metrics deltas), so the time outside the calls is
the Python side of a served step. The translation and chat prompts of `serve_path.py`, each
with both methods back to back (the order alternating). Prints a line per request:

    flock /tmp/adaspec-cpu.lock .venv/bin/python experiments/serve_overhead.py
"""
import http.client
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve_path as s  # noqa: E402


def metric(port: int, name: str) -> float:
    """The sum of a counter's samples on the server's /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(float(m.group(1)) for m in
               re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


prompts = [p for p in s.held_out(7, 2000) if p["category"] in ("chat", "translation")]
out = Path("/tmp/adaspec-serve-overhead")
out.mkdir(exist_ok=True)
peer = s.start_adaspec(out, "qwen2.5-coder-1.5b-instruct", 900)
try:
    s.ask(peer.port, [{"role": "user", "content": "warm up " * 20}], 16, "ar", "w", 900)
    for i, p in enumerate(prompts):
        for m in (("auto", "ar") if i % 2 else ("ar", "auto")):
            c0 = metric(peer.port, "adaspec_batch_round_seconds_total")
            r0 = metric(peer.port, "adaspec_batch_rounds_total")
            rec, _ = s.ask(peer.port, [{"role": "user", "content": p["text"]}], 128, m, m, 900)
            c1 = metric(peer.port, "adaspec_batch_round_seconds_total")
            r1 = metric(peer.port, "adaspec_batch_rounds_total")
            sp = rec.server["speculation"]
            rounds = r1 - r0
            outside = sp["wall_time"] - (c1 - c0)
            print(f"{p['id']:18} {m:5} tok {rec.completion_tokens:4} wall {sp['wall_time']:.2f} "
                  f"calls {c1 - c0:.2f} rounds {rounds:.0f} outside {outside:.3f} s = "
                  f"{1000 * outside / max(rounds, 1):.2f} ms/round, per call "
                  f"{1000 * (c1 - c0) / max(rounds, 1):.1f} ms drafted {sp['drafted']} "
                  f"acc {sp['accepted']}", flush=True)
finally:
    peer.close()
