"""The side-by-side benchmark runner behind `adaspec bench`.

All methods run in one process on the same loaded target (and draft), after a warm-up,
alternating method by method within each prompt, so every speedup is a ratio of paired runs
measured under the same conditions. Each finished (prompt, method, repeat) is appended to
`results.jsonl` and flushed at once; `resume=True` skips the rows already there. At the end
`summary.json`, `summary.md` and PNG plots are written next to it.

Multi-turn prompts (MT-bench) run as a conversation: each method's answer to turn t is fed
back as the assistant message before turn t + 1; a row sums its stats over the turns.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from adaspec.backends.base import ModelBackend
from adaspec.backends.torch.attention import batched_attention
from adaspec.backends.weights import read_weights
from adaspec.core.metrics import RequestStats
from adaspec.core.sampling import SamplingParams
from adaspec.engine.loop import TextGenerator
from adaspec.errors import InputError
from adaspec.lab.bench.exactness import classify, first_difference, tie_tolerance
from adaspec.lab.bench.hf_reference import hf_generate, reference_settings
from adaspec.lab.bench.llamacpp_reference import Decoder, LlamaCppUnavailable, open_decoder
from adaspec.lab.bench.oracle import OracleLength
from adaspec.lab.bench.peer_build import PeerUnavailable
from adaspec.lab.bench.references import other_weights, parse_bench_method
from adaspec.lab.bench.report import row_key, summarize, to_markdown
from adaspec.lab.bench.suites import Prompt
from adaspec.lab.bench.theory import oracle_schedule, teacher_forced_hits
from adaspec.methods.build import build_generator
from adaspec.methods.spec import MethodSpec
from adaspec.store.atomic import trim_torn_tail, write_text

RESULTS = "results.jsonl"
METHOD_ORDERS = ("rotate", "fixed")  # BenchConfig.method_order
RUN_FILE = "run.json"
# Settings that change what a row means: a resumed run must match them.
RESUME_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "target",
    "draft",
    "dtype",
    "weights",
    "draft_weights",
)
# What a run.json written before a setting existed meant by it, and what it called a setting
# renamed since (issue 32: `quant` is `weights`, its value `auto` is `fastest`).
_OLD_DEFAULTS = {"weights": "none", "draft_weights": "none"}
_OLD_NAMES = {"weights": "quant", "draft_weights": "draft_quant"}
_SUM_FIELDS = (
    "prompt_tokens",
    "new_tokens",
    "target_calls",
    "draft_calls",
    "head_calls",
    "drafted",
    "accepted",
    "wall_time",
    "prefill_time",
    "draft_time",
    "draft_prefill_time",
    "verify_time",
    "target_time",
    "route_time",
)


@dataclass
class BenchConfig:
    methods: list[str]
    suites: list[str] = field(default_factory=list)
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = 0
    repeats: int = 1
    out: str = "bench-results"
    resume: bool = False
    overwrite: bool = False
    warmup_tokens: int = 8
    target: str = ""
    draft: str = ""
    dtype: str = ""
    weights: str = "none"  # backends/weights.py: a torch quantization or a llama.cpp runtime
    draft_weights: str = "none"
    device: str = "cpu"  # backends/device.py: where the models run (a resolved device)
    profile: str | None = None
    limit: int | None = None
    # "rotate": each (prompt, repeat) starts the method list one further along, so an effect
    # of the position within a prompt does not always fall on the same method; "fixed": as listed
    method_order: str = "rotate"
    # the method the report's ratios (end to end, decode, first token) are taken against,
    # besides `ar`; None: `llama-server` or `llamacpp` when one of them runs
    baseline: str | None = None

    def sampling(self, repeat: int) -> SamplingParams:
        seed = None if self.seed is None else self.seed + repeat
        return SamplingParams(self.temperature, self.top_k, self.top_p, seed)


def _earlier_setting(before: dict, key: str) -> object:
    """A setting as a run.json read back says it, under its name of the time; a renamed
    weights setting's old value `auto` is `fastest`."""
    if key in before:
        value = before[key]
    elif _OLD_NAMES.get(key, key) in before:
        value = before[_OLD_NAMES[key]]
    else:
        return _OLD_DEFAULTS.get(key)
    return read_weights(value) if key in _OLD_NAMES and isinstance(value, str) else value


def _is_hf(backend: ModelBackend | None) -> bool:
    """A backend over a transformers model (HF's `generate` runs it)."""
    return hasattr(getattr(backend, "model", None), "generate")


def with_variant_baselines(methods: list[str], run_weights: str = "none") -> list[str]:
    """Add `ar@W` right after `ar` for every target weights W a method asks for, so each
    method is checked against plain decoding of its own target (exactness is per target)."""
    variants: list[str] = []
    for m in methods:
        try:
            w = parse_bench_method(m).weights
        except InputError:
            continue  # custom engines (tests) and bad names are reported where they are built
        if w is not None and w != run_weights and w not in variants:
            variants.append(w)
    baselines = [f"ar@{w}" for w in variants if f"ar@{w}" != methods[0]]
    rest = [m for m in methods[1:] if m not in baselines]
    return [methods[0], *baselines, *rest]


def normalize_methods(methods: list[str]) -> list[str]:
    """Strip and de-duplicate; `ar` (the baseline of every ratio) always runs, first."""
    out: list[str] = []
    for m in methods:
        m = m.strip()
        if m and m not in out:
            out.append(m)
    if not out:
        raise InputError("no methods given: e.g. --methods ar,ngram,draft:k=4")
    return ["ar", *[m for m in out if m != "ar"]]


# ------------------------------------------------------------------ results file
def read_rows(path: Path) -> tuple[list[dict], int]:
    """Rows of a results file, and how many broken lines (a run killed mid-write) it had."""
    rows: list[dict] = []
    broken = 0
    if not path.exists():
        return rows, broken
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                broken += 1
                continue
            if isinstance(row, dict) and "prompt_id" in row and "method" in row:
                rows.append(row)
            else:
                broken += 1
    return rows, broken


def check_out(config: BenchConfig) -> None:
    """Refuse, before any model loads, to mix a new run into an old results file."""
    results = Path(config.out) / RESULTS
    if config.resume or config.overwrite or not results.exists():
        return
    if results.stat().st_size:
        raise InputError(
            f"{results} already holds results: pass --resume to continue that run, "
            "--overwrite to start over, or choose another --out"
        )


class BenchRunner:
    """Runs methods side by side on loaded models and writes the results folder.

    `engines` may add or override methods by name (tests use it for deliberately broken
    methods); every other method string is parsed by `adaspec.methods.spec.parse_method`.
    """

    def __init__(
        self,
        config: BenchConfig,
        target: ModelBackend,
        tokenizer,
        draft: ModelBackend | None = None,
        eos_token_ids: list[int] | None = None,
        engines: Mapping[str, TextGenerator] | None = None,
        progress: bool = True,
        log: Callable[[str], None] | None = None,
        target_gguf: str | Path | None = None,
        load_variant: Callable[[str, str], ModelBackend] | None = None,
    ) -> None:
        """target_gguf: the target's GGUF file, for the llama.cpp reference methods
        (`llamacpp`, `llamacpp-lookup`, `llamacpp-draft`; the last runs the GGUF of
        `config.draft` as its draft model).
        load_variant(role, weights): loads the "target" or "draft" with those weights, for
        methods written `NAME@WEIGHTS[/DRAFT_WEIGHTS]`."""
        self.config = config
        self.target = target
        self.tokenizer = tokenizer
        self.draft = draft
        self.progress = progress
        self._log = log
        custom = dict(engines or {})
        self.methods = with_variant_baselines(normalize_methods(config.methods), config.weights)
        self._load_variant = load_variant
        self._variants: dict[tuple[str, str | None], ModelBackend | None] = {
            ("target", None): target, ("draft", None): draft,
        }
        self.backends: dict[str, tuple[ModelBackend, ModelBackend | None]] = {}
        self.specs: dict[str, MethodSpec | None] = {}
        self.engines: dict[str, TextGenerator] = {}
        # one llama.cpp decoder (a child process, or a llama-server) per llama.cpp method
        self.reference_decoders: dict[str, Decoder] = {}
        self.skipped: dict[str, str] = {}
        # per llama.cpp method: whether llama.cpp repacked the weights, and why
        self.repack: dict[str, dict] = {}
        self.peers: dict[str, dict] = {}  # per llama-server method: binary, build, arguments
        # HF methods run on the target's plain weights beside another runtime of the run's
        self.other_runtime: set[str] = set()
        if config.baseline is not None and config.baseline not in self.methods:
            raise InputError(f"--baseline {config.baseline!r} is not among the methods "
                             f"({', '.join(self.methods)}): add it to --methods")
        try:
            self._open_methods(custom, draft, eos_token_ids, target_gguf)
        except BaseException:
            self.close()  # no server outlives a failed start
            raise
        self.methods = [m for m in self.methods if m not in self.skipped]
        self.eos_token_ids = sorted(self.engines["ar"].eos_token_ids)
        self.encoder = self.engines["ar"]
        if config.repeats < 1:
            raise InputError(f"repeats must be >= 1, got {config.repeats}")
        config.sampling(0)  # validate temperature / top-p / seed before any work
        self.out = Path(config.out)
        self.rows: list[dict] = []
        self.by_key: dict[tuple[str, str, int], dict] = {}
        # plain decoding's output by (prompt ids, budget), for ctrl=oracle
        self.references: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def _open_reference(self, m: str, spec: MethodSpec, target_gguf) -> Decoder:
        """The decoder of a method that runs the GGUF (llama-cpp-python or llama-server)."""
        if spec.name == "llama-server":
            from adaspec.lab.bench.llama_server import open_server_decoder

            slug = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in m)
            decoder = open_server_decoder(
                target_gguf, self.config.temperature, spec.settings(),
                draft=self.config.draft or None,
                log_path=Path(self.config.out) / "peers" / f"{slug}.log",
            )
            self.peers[m] = info = decoder.describe()
            self.log(f"{m}: llama-server at {info.get('url')} (log {info.get('log')})")
            return decoder
        return open_decoder(target_gguf, self.config.temperature, method=spec.name,
                            params=spec.settings(), draft=self.config.draft or None)

    def _open_methods(self, custom, draft, eos_token_ids, target_gguf) -> None:
        tokenizer = self.tokenizer
        for m in self.methods:
            if m in custom:
                self.specs[m] = None
                self.engines[m] = custom[m]
                continue
            spec = parse_bench_method(m)
            self.specs[m] = spec
            self.backends[m] = self._backends_for(spec)
            if spec.needs_draft_model() and draft is None:
                raise InputError(f"method {m!r} needs a draft model (--draft)")
            if other_weights(spec):
                try:
                    decoder = self.reference_decoders[m] = self._open_reference(
                        m, spec, target_gguf)
                except (LlamaCppUnavailable, PeerUnavailable) as exc:
                    self.skipped[m] = str(exc)
                    self.log(f"{m}: skipped: {exc}")
                    continue
                choice = getattr(decoder, "repack_choice", None)
                if choice is not None:
                    self.repack[m] = choice.as_dict()
                    self.log(f"{m}: llama.cpp weight {choice.describe()}")
            elif spec.is_reference:
                self.backends[m] = self._hf_backends(m, spec)
            else:
                tgt, drf = self.backends[m]
                self.engines[m] = build_generator(spec, tgt, tokenizer, drf, eos_token_ids)

    def _hf_backends(self, m: str, spec: MethodSpec) -> tuple[ModelBackend, ModelBackend | None]:
        """The transformers models HF's `generate` runs: the method's own, or where the run
        loaded another runtime (llama.cpp, the static runtime) the same checkpoint's plain
        weights on the run's device."""
        tgt: ModelBackend | None
        tgt, drf = self.backends[m]
        if not _is_hf(tgt):
            tgt = self._variant("target", "none")
            self.other_runtime.add(m)  # compared with plain decoding, not checked against it
        if spec.needs_draft_model() and not _is_hf(drf):
            drf = self._variant("draft", "none")
        if not _is_hf(tgt) or (spec.needs_draft_model() and not _is_hf(drf)):
            raise InputError(f"method {m!r} needs Hugging Face models (torch backend)")
        assert tgt is not None
        import transformers

        self.peers[m] = {"runtime": f"transformers {transformers.__version__}",
                         "device": getattr(tgt, "device", "cpu"), "cache": spec["cache"]}
        return tgt, drf if spec.needs_draft_model() else None

    def _hf_generate(self, m: str, spec: MethodSpec, prompt_ids: list[int],
                     max_new_tokens: int, sampling: SamplingParams
                     ) -> tuple[list[int], RequestStats]:
        """HF's generate for reference method `m`, with its cache; where HF fails with a
        static cache, the dynamic one from then on (said in the run's peers and the log)."""
        target, draft = self.backends[m]
        settings = reference_settings(spec.name, spec.settings())
        info = self.peers[m]
        settings["cache"] = info["cache"]
        with batched_attention():  # HF's own loop as it ships, even on a quantized target
            try:
                return hf_generate(
                    target.model,  # type: ignore[attr-defined]  # why: checked _is_hf
                    prompt_ids, max_new_tokens, self.eos_token_ids,
                    draft.model if draft is not None else None,  # type: ignore[attr-defined]
                    sampling=sampling, **settings)
            except (IndexError, RuntimeError, ValueError) as exc:
                if settings["cache"] != "static":
                    raise
                info.update(cache="dynamic", fallback=f"static cache failed: "
                            f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                self.log(f"{m}: Hugging Face's static cache failed ({info['fallback']}); "
                         "running it with the dynamic cache")
                self._write_run_file()
        return self._hf_generate(m, spec, prompt_ids, max_new_tokens, sampling)

    def close(self) -> None:
        """Stop what the reference methods started (llama-server processes, child
        processes); safe to call twice."""
        for decoder in self.reference_decoders.values():
            close = getattr(decoder, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    # ---------------------------------------------------------------- helpers
    def _variant(self, role: str, weights: str | None) -> ModelBackend | None:
        if weights == (self.config.weights if role == "target" else self.config.draft_weights):
            weights = None  # what the run loaded anyway
        if (role, weights) not in self._variants:
            if self._load_variant is None:
                raise InputError(f"this run cannot load a {weights} {role} (no loader given)")
            self.log(f"loading the {role} with {weights} weights")
            assert weights is not None  # (role, None) is in _variants from the start
            self._variants[(role, weights)] = self._load_variant(role, weights)
        return self._variants[(role, weights)]

    def _backends_for(self, spec: MethodSpec) -> tuple[ModelBackend, ModelBackend | None]:
        """The target and draft a method runs on: the run's, or its `@weights` variant."""
        target = self._variant("target", spec.weights)
        assert target is not None
        draft = self.draft
        if spec.needs_draft_model():
            draft = self._variant("draft", spec.draft_weights)
        return target, draft

    def baseline(self) -> str | None:
        """The method the report's peer ratios are taken against: --baseline, else
        `llama-server` or `llamacpp` when it runs."""
        if self.config.baseline is not None:
            return self.config.baseline if self.config.baseline in self.methods else None
        return next((m for m in ("llama-server", "llamacpp") if m in self.methods), None)

    def baseline_of(self, method: str) -> str:
        """The plain-decoding method whose output `method` must reproduce (same target)."""
        spec = self.specs.get(method)
        if spec is None or spec.weights in (None, self.config.weights):
            return "ar"
        return f"ar@{spec.weights}"

    def log(self, message: str) -> None:
        if self._log is not None:
            self._log(message)
        else:
            print(message, file=sys.stderr)

    @property
    def greedy(self) -> bool:
        return self.config.temperature == 0

    def draft_methods(self) -> list[str]:
        return [m for m, s in self.specs.items() if s is not None and s.needs_draft_model()]

    def turn_prompt_ids(self, prompt: Prompt, answers: list[list[int]]) -> list[int]:
        """Prompt ids of the next turn, given the token ids of the answers so far."""
        turns = prompt.all_turns
        t = len(answers)
        if t == 0:
            return self.encoder.encode_prompt(turns[0])
        messages: list[dict] = []
        for i in range(t):
            reply = self.tokenizer.decode(answers[i], skip_special_tokens=True)
            messages += [
                {"role": "user", "content": turns[i]},
                {"role": "assistant", "content": reply if reply.strip() else "(no answer)"},
            ]
        messages.append({"role": "user", "content": turns[t]})
        return self.encoder.encode_prompt(messages)

    def _generate(
        self, method: str, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams
    ) -> tuple[list[int], RequestStats, str]:
        spec = self.specs[method]
        if spec is not None and other_weights(spec):
            decoder = self.reference_decoders[method]
            ids, stats = decoder.generate(prompt_ids, max_new_tokens, self.eos_token_ids)
            finish = "eos" if ids and ids[-1] in self.eos_token_ids else "length"
            return ids, stats, finish
        if spec is not None and spec.is_reference:
            ids, stats = self._hf_generate(method, spec, prompt_ids, max_new_tokens, sampling)
            finish = "eos" if ids and ids[-1] in self.eos_token_ids else "length"
            return ids, stats, finish
        engine = self.engines[method]
        controller = getattr(engine, "controller", None)  # a router has none of its own
        if isinstance(controller, OracleLength):
            self.prime_oracle(controller, prompt_ids, max_new_tokens, sampling)
        res = engine.generate(prompt_ids, max_new_tokens, sampling)
        if method == "ar":
            self.references[(tuple(prompt_ids), max_new_tokens)] = res.token_ids
        return res.token_ids, res.stats, res.finish_reason

    def prime_oracle(
        self,
        oracle: OracleLength,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
    ) -> None:
        """ctrl=oracle drafts what will be accepted: hand it the teacher-forced hits of plain
        decoding's output for these prompt ids (from the `ar` run just before; decoded here,
        untimed, when that is missing, e.g. after a resume)."""
        if not self.greedy or self.draft is None:
            raise InputError("ctrl=oracle needs greedy decoding (temperature 0) and a draft")
        ref = self.references.get((tuple(prompt_ids), max_new_tokens))
        if ref is None:
            ref = self.engines["ar"].generate(prompt_ids, max_new_tokens, sampling).token_ids
        oracle.set_hits(teacher_forced_hits(self.draft, prompt_ids, ref))

    def run_prompt(self, method: str, prompt: Prompt, repeat: int) -> dict:
        """One (prompt, method, repeat): every turn, stats summed over turns."""
        sampling = self.config.sampling(repeat)
        answers: list[list[int]] = []
        total: dict = {k: 0 for k in _SUM_FIELDS}
        steps: list[list[int]] = []
        nodes: list[int] = []  # per step, what its call verified (a tree: all its nodes)
        finish: list[str] = []
        routes: list[str] = []  # the arm a router picked, per turn
        drafted_by: dict[str, int] = {}  # drafted tokens per part of the drafter (S2D exits)
        prompt_turn_ids: list[list[int]] = []
        peer_timings: list[dict] = []
        replayed = False
        for _ in prompt.all_turns:
            ids = self.turn_prompt_ids(prompt, answers)
            prompt_turn_ids.append(ids)
            out, stats, reason = self._generate(method, ids, self.config.max_new_tokens, sampling)
            answers.append(out)
            finish.append(reason)
            if stats.route is not None:
                routes.append(stats.route)
            for k in _SUM_FIELDS:
                total[k] += getattr(stats, k)
            steps += [[int(d), int(a)] for d, a in stats.steps]
            nodes += [int(n) for n in stats.nodes or [d for d, _ in stats.steps]]
            for part, n in stats.drafted_by.items():
                drafted_by[part] = drafted_by.get(part, 0) + n
            timings = getattr(stats, "timings", None)  # a peer's own figures, per turn
            if timings is not None:
                peer_timings.append(timings)
                replayed = replayed or bool(getattr(stats, "replayed_ids", False))
        wall, tokens = total["wall_time"], total["new_tokens"]
        turns = len(answers)
        decode_s = wall - total["prefill_time"]
        row = {
            "prompt_id": prompt.id,
            "category": prompt.category,
            "method": method,
            "repeat": repeat,
            "divergence": None,
            "token_ids": [t for a in answers for t in a],
            "turn_tokens": [len(a) for a in answers],
            "finish_reason": finish,
            **total,
            "other_time": max(
                0.0,
                wall
                - total["prefill_time"]
                - total["draft_time"]
                - total["verify_time"]
                - total["route_time"],
            ),
            "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else 0.0,
            "mean_accepted_tokens": tokens / total["target_calls"] if total["target_calls"] else 0,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "ms_per_token": 1000 * wall / tokens if tokens else 0.0,
            # time to first token (mean over turns) and tokens/s after the first token
            "ttft_s": total["prefill_time"] / turns if turns else 0.0,
            "decode_tokens_per_s": (tokens - turns) / decode_s if decode_s > 0 else None,
            "steps": steps,
            "nodes": nodes,
            "drafted_by": drafted_by,
        }
        decode_calls = total["target_calls"] - turns
        if total["target_time"] > 0 and decode_calls > 0:
            # a decode step's target pass against the loop's own time around it (issue 34)
            loop = max(0.0, decode_s - total["draft_time"] - total["target_time"])
            row["target_ms_per_step"] = 1000 * total["target_time"] / decode_calls
            row["loop_ms_per_step"] = 1000 * loop / decode_calls
        if routes:
            row["route"] = routes
        if peer_timings:
            row["peer_timings"] = peer_timings
            if replayed:
                row["replayed_ids"] = True
        if method == "ar" and self.greedy and self.draft is not None and self.draft_methods():
            row["oracle"] = self.oracle(prompt_turn_ids, answers)
        if method != "ar":
            spec = self.specs[method]
            # llama.cpp's GGUF, or a quantized target's own plain decoding: other weights
            other = spec is not None and (other_weights(spec) or self.baseline_of(method) == method
                                          or method in self.other_runtime)
            row["exactness_checked"] = self.greedy and not other
            if other:
                row["other_weights"] = True
                if method in self.other_runtime:  # the same checkpoint, transformers' kernels
                    row["other_runtime"] = True
        return row

    def oracle(self, prompt_turn_ids: list[list[int]], answers: list[list[int]]) -> dict:
        """Oracle speculation schedule over every turn of plain decoding's output."""
        assert self.draft is not None
        total = {"new_tokens": 0, "target_calls": 0, "draft_calls": 0, "steps": []}
        for ids, out in zip(prompt_turn_ids, answers, strict=True):
            sched = oracle_schedule(teacher_forced_hits(self.draft, ids, out))
            for k in ("new_tokens", "target_calls", "draft_calls"):
                total[k] += sched[k]
            total["steps"] += sched["steps"]
        return total

    def check_exactness(self, row: dict, prompt: Prompt) -> None:
        """Compare a greedy row with plain decoding's; classify the first difference."""
        if row["method"] == "ar" or not self.greedy:
            return
        base = self.baseline_of(row["method"])
        elsewhere = bool(row.get("other_weights"))
        # Other weights (llama.cpp's GGUF, a quantized target's own plain decoding) give a
        # quality figure against the run's target, not an exactness check.
        ref = self.by_key.get((prompt.id, "ar" if elsewhere else base, row["repeat"]))
        if ref is None:
            return
        if elsewhere:
            index = first_difference(ref["token_ids"], row["token_ids"])
            row["weights_difference"] = None if index is None else {"index": index}
            return
        ref_turns = _split(ref["token_ids"], ref.get("turn_tokens"))
        out_turns = _split(row["token_ids"], row.get("turn_tokens"))
        for t, (a, b) in enumerate(zip(ref_turns, out_turns, strict=False)):
            if a == b:
                continue
            ids = self.turn_prompt_ids(prompt, ref_turns[:t])
            div = classify(self.backends[base][0], ids, a, b)
            if div is not None:
                row["divergence"] = {**asdict(div), "turn": t}
                tag = "BUG" if div.kind == "bug" else "numerical tie"
                self.log(
                    f"EXACTNESS: {row['method']} differs from {base} on {prompt.id} (repeat "
                    f"{row['repeat']}, turn {t}) at token {div.index}: top-2 gap "
                    f"{div.gap:.3f} -> {tag}"
                )
            return

    # ------------------------------------------------------------------ run
    def _prepare_out(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        results = self.out / RESULTS
        run_file = self.out / RUN_FILE
        settings = {k: getattr(self.config, k) for k in RESUME_KEYS}
        # a last row cut off by a kill: dropped (or, whole but for its newline, completed)
        # so the next append starts a line of its own
        torn = trim_torn_tail(results) if self.config.resume else 0
        rows, broken = read_rows(results)
        if rows or broken or torn:
            if self.config.resume:
                if run_file.exists():
                    before = json.loads(run_file.read_text()).get("settings", {})
                    diff = {
                        k: (_earlier_setting(before, k), v)
                        for k, v in settings.items()
                        if _earlier_setting(before, k) != v
                    }
                    if diff:
                        what = ", ".join(f"{k} was {a!r}, now {b!r}" for k, (a, b) in diff.items())
                        raise InputError(
                            f"cannot resume {results}: settings differ ({what}); use the same "
                            "settings or another --out"
                        )
                if broken:  # a broken line within the file: keep only whole rows
                    write_text(results, "".join(json.dumps(r) + "\n" for r in rows))
                if broken or torn:
                    self.log(f"resume: dropped {broken + torn} incomplete line(s) from {results}")
            elif self.config.overwrite:
                results.unlink()
                rows = []
            else:
                raise InputError(
                    f"{results} already holds results: pass --resume to continue that run, "
                    "--overwrite to start over, or choose another --out"
                )
        self.rows = rows
        self.by_key = {(r["prompt_id"], r["method"], int(r.get("repeat", 0))): r for r in rows}
        self._write_run_file()

    def _refresh_peer_info(self) -> bool:
        """Re-read what the reference decoders used (a server that crashed in its warm-up
        with repacking on restarts without it); True when it changed."""
        before = (json.dumps(self.repack, sort_keys=True), json.dumps(self.peers, sort_keys=True))
        for m, decoder in self.reference_decoders.items():
            choice = getattr(decoder, "repack_choice", None)
            if choice is not None:
                self.repack[m] = choice.as_dict()
            if m in self.peers and hasattr(decoder, "describe"):
                self.peers[m] = decoder.describe()
        return before != (json.dumps(self.repack, sort_keys=True),
                          json.dumps(self.peers, sort_keys=True))

    def _write_run_file(self) -> None:
        settings = {k: getattr(self.config, k) for k in RESUME_KEYS}
        record: dict = {"settings": settings, "config": asdict(self.config)}
        if self.repack:
            record["llamacpp_repack"] = self.repack
        if self.peers:
            record["peers"] = self.peers
        write_text(self.out / RUN_FILE, json.dumps(record, indent=2) + "\n")

    def method_order(self, index: int) -> list[str]:
        """The methods in the order the `index`-th (prompt, repeat) runs them."""
        if self.config.method_order == "fixed" or not self.methods:
            return list(self.methods)
        k = index % len(self.methods)
        return self.methods[k:] + self.methods[:k]

    def _write_checked(
        self, pending: list[tuple[dict, Prompt]], f, final: bool = False
    ) -> list[tuple[dict, Prompt]]:
        """Check and append every pending row whose plain-decoding reference has run (all of
        them when final); returns the rows still waiting."""
        waiting = []
        for row, prompt in pending:
            refs = {(prompt.id, m, row["repeat"]) for m in ("ar", self.baseline_of(row["method"]))}
            if not final and row["method"] != "ar" and self.greedy and refs - self.by_key.keys():
                waiting.append((row, prompt))
                continue
            self.check_exactness(row, prompt)
            f.write(json.dumps(row) + "\n")
            f.flush()
        return waiting

    def warm_up(self, prompt: Prompt) -> None:
        ids = self.turn_prompt_ids(prompt, [])
        for m in self.methods:
            warm = getattr(self.reference_decoders.get(m), "warm_up", None)
            if warm is not None:  # a server warms up without caching the first prompt
                warm(ids, self.config.warmup_tokens, self.eos_token_ids)
                continue
            # an engine warms up on the first prompt reversed, as the servers do: it keeps
            # what its cache shares with its previous prompt, and the first measured prompt
            # must not find itself there (llama-cpp-python's decoders reset every request)
            warm_ids = ids[::-1] if m in self.engines else ids
            self._generate(m, warm_ids, self.config.warmup_tokens, self.config.sampling(0))
            if m not in self.engines and m not in self.reference_decoders and len(ids) > 1:
                # Hugging Face compiles a static cache's decode on a GPU for its length: a
                # second length makes torch recompile it for any, here and not in the first
                # measured prompt (seen on the H200: 6.8 tokens/s there, 117-212 after)
                self._generate(m, ids[1:], 2 * self.config.warmup_tokens,
                               self.config.sampling(0))

    def running_speedups(self, keys: set[tuple[str, int]]) -> dict[str, str]:
        out = {}
        ar = {row_key(r): r for r in self.rows if r["method"] == "ar" and row_key(r) in keys}
        for m in self.methods[1:]:
            pairs = [
                (ar[row_key(r)], r)
                for r in self.rows
                if r["method"] == m and row_key(r) in ar and r["new_tokens"]
            ]
            if pairs:
                base = sum(a["wall_time"] for a, _ in pairs) / sum(
                    a["new_tokens"] for a, _ in pairs
                )
                mine = sum(r["wall_time"] for _, r in pairs) / sum(
                    r["new_tokens"] for _, r in pairs
                )
                out[m] = f"{base / mine:.2f}x" if mine else "n/a"
        return out

    def run(
        self, prompts: list[Prompt], machine: dict | None = None, extra: dict | None = None
    ) -> dict:
        """Run (or finish) the benchmark over `prompts`; returns the summary. The reference
        methods' servers and child processes are stopped when it returns or fails."""
        try:
            return self._run(prompts, machine, extra)
        finally:
            self.close()

    def _run(self, prompts: list[Prompt], machine: dict | None, extra: dict | None) -> dict:
        from tqdm import tqdm

        if not prompts:
            raise InputError("no prompts to run: check --suite and --limit")
        ids = [p.id for p in prompts]
        if len(set(ids)) != len(ids):
            raise InputError("prompt ids must be unique within a run")
        self._prepare_out()
        todo = [
            (p, r, m)
            for i, (p, r) in enumerate(
                (p, r) for p in prompts for r in range(self.config.repeats)
            )
            for m in self.method_order(i)
            if (p.id, m, r) not in self.by_key
        ]
        total = len(prompts) * self.config.repeats * len(self.methods)
        keys = {(p.id, r) for p in prompts for r in range(self.config.repeats)}
        if todo:
            t0 = time.perf_counter()
            self.warm_up(prompts[0])
            self.log(f"warm-up: {time.perf_counter() - t0:.1f} s")
            if self._refresh_peer_info():
                self._write_run_file()
                for m, info in self.repack.items():
                    self.log(f"{m}: llama.cpp weight repacking {'on' if info['repack'] else 'off'}"
                             f" ({info['reason']})")
        with (
            (self.out / RESULTS).open("a", encoding="utf-8") as f,
            tqdm(
                total=total,
                initial=total - len(todo),
                desc="bench",
                disable=not self.progress,
                file=sys.stderr,
                dynamic_ncols=True,
            ) as bar,
        ):
            own_log = self._log
            self._log = own_log or bar.write  # messages print above the progress bar
            pending: list[tuple[dict, Prompt]] = []  # rows run before their reference
            for prompt, repeat, method in todo:
                row = self.run_prompt(method, prompt, repeat)
                self.rows.append(row)
                self.by_key[(prompt.id, method, repeat)] = row
                pending.append((row, prompt))
                pending = self._write_checked(pending, f)
                bar.update(1)
                bar.set_postfix(self.running_speedups(keys), refresh=False)
            self._write_checked(pending, f, final=True)
            self._log = own_log
        return self.write_summary(prompts, machine, extra)

    def write_summary(
        self, prompts: list[Prompt], machine: dict | None = None, extra: dict | None = None
    ) -> dict:
        wanted = {
            (p.id, m, r) for p in prompts for m in self.methods for r in range(self.config.repeats)
        }
        category = {p.id: p.category for p in prompts}
        rows = [
            r for r in self.rows if (r["prompt_id"], r["method"], int(r.get("repeat", 0))) in wanted
        ]
        for r in rows:  # rows written by older versions carry no category
            r.setdefault("category", category[r["prompt_id"]])
        summary = summarize(
            rows,
            self.methods,
            target_bytes=getattr(self.target, "bytes_per_forward", None),
            theory_methods=self.draft_methods() if self.greedy else (),
            tie_tolerance=tie_tolerance(self.target),
            baseline=self.baseline(),
        )
        self._refresh_peer_info()
        if self.repack:
            summary["llamacpp_repack"] = self.repack
        if self.peers:
            summary["peers"] = self.peers
        summary["config"] = {
            **asdict(self.config),
            "methods": self.methods,
            "prompts": len(prompts),
            "categories": sorted({p.category for p in prompts}),
        }
        summary["models"] = {
            "target": getattr(self.target, "name", None),
            "target_bytes_per_forward": getattr(self.target, "bytes_per_forward", None),
            "draft": getattr(self.draft, "name", None) if self.draft is not None else None,
            "draft_bytes_per_forward": getattr(self.draft, "bytes_per_forward", None),
            # the runtime setting (e.g. ik_llama-native-blocks2+child: ik_llama.cpp built for
            # this CPU, fed blocks of 2, in a child process)
            "target_kind": getattr(self.target, "kind", None),
            "draft_kind": getattr(self.draft, "kind", None) if self.draft is not None else None,
        }
        if machine:
            summary["machine"] = machine.get("machine", machine)
            if "bandwidth" in machine:
                summary["bandwidth"] = machine["bandwidth"]
        if extra:
            summary.update(extra)
        try:
            from adaspec.lab.bench.plots import write_plots

            summary["plots"] = write_plots(summary, rows, self.out)
        except ImportError as exc:
            self.log(f"plots skipped ({exc}): pip install matplotlib")
        self.save_summary(summary)
        return summary

    def save_summary(self, summary: dict) -> None:
        write_text(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        write_text(self.out / "summary.md", to_markdown(summary))


def _split(tokens: list[int], lengths: list[int] | None) -> list[list[int]]:
    if not lengths:
        return [tokens]
    out, start = [], 0
    for n in lengths:
        out.append(tokens[start : start + n])
        start += n
    return out
