"""llama.cpp's own decoding of the same GGUF target: the yardsticks a CPU user would pick.

Three bench reference methods (registered in `lab.bench.references`):

- `llamacpp`: plain greedy decoding, our loop around `Llama.eval` (`LlamaCppDecoder`).
- `llamacpp-lookup:k=N,n_max=M`: llama-cpp-python's prompt-lookup decoding,
  `llama_cpp.llama_speculative.LlamaPromptLookupDecoding(max_ngram_size=M,
  num_pred_tokens=N)` passed as `Llama(draft_model=...)` and run by llama-cpp-python's own
  `Llama.generate` loop (`SpeculativeDecoder`).
- `llamacpp-draft:k=N`: the same loop with a draft model: `GgufDraft`, a `LlamaDraftModel`
  that decodes the draft's GGUF greedily for N tokens with its own KV cache.

`llama-cpp-python` is an optional extra (`pip install 'adaspec[llamacpp]'`; it builds
llama.cpp from source, about 8 minutes on 2 cores), so everything here imports it lazily and
reports a missing install as a reason to skip, never as an error.

Every decoder is fed the very prompt token ids adaspec's `encode_prompt` produced (no text, no
BOS added), decodes greedily (argmax of the logits, first index on ties, as llama.cpp's greedy
sampler) and stops on the same EOS ids and token budget. Timing matches the engine's: the
clock starts before the prefill and stops after the last token, model loading excluded; the
prefill counts as a target call, then one call per further target evaluation. The KV cache is
reset before every request (llama-cpp-python's `generate` would otherwise reuse the previous
request's matching prefix, which the engine's methods do not get).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from adaspec.backends.gguf import LlamaCppUnavailable, gguf_file
from adaspec.backends.llamacpp.backend import (
    DEFAULT_CONTEXT,
    RepackChoice,
    import_llama,
    load_llama,
    model_params_with_extra_buffers,
    repack_choice,
)
from adaspec.core.metrics import RequestStats
from adaspec.errors import InputError

__all__ = [
    "Decoder",
    "GgufDraft",
    "LlamaCppDecoder",
    "LlamaCppUnavailable",
    "SpeculativeDecoder",
    "open_decoder",
]

# The bench's llama.cpp reference methods (registered in lab.bench.references).
PLAIN = "llamacpp"
LOOKUP = "llamacpp-lookup"
DRAFT = "llamacpp-draft"
METHODS = (PLAIN, LOOKUP, DRAFT)
# First context of the speculative decoders, grown on demand: llama-cpp-python keeps every
# position's logits there (n_ctx x n_vocab floats, 1.2 GB virtual for Qwen at 2048).
SPECULATIVE_CONTEXT = 2048


class Decoder(Protocol):
    """What the bench calls on a llama.cpp decoder, in this process or a child's."""

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]
    ) -> tuple[list[int], RequestStats]: ...


def check_greedy_gguf(gguf, temperature: float) -> None:
    """What every llama.cpp peer needs: greedy decoding and a GGUF target
    (LlamaCppUnavailable names what is missing)."""
    if temperature != 0:
        raise LlamaCppUnavailable("it decodes greedily only (temperature 0)")
    if gguf is None:
        raise LlamaCppUnavailable(
            "the target is not a GGUF file (llama.cpp runs GGUF only): use a built-in model "
            "name or a .gguf path as --target"
        )


def fit_context(decoder, need: int, what: str) -> bool:
    """Make a decoder's context hold `need` positions, reloading it larger (outside any
    clock) when it must; True when it reloaded. `what` names the request in the error when
    the model itself cannot hold them."""
    if need > decoder.max_context:
        raise InputError(f"{what} exceed the model's context of {decoder.max_context}")
    if need <= decoder.n_ctx:
        return False
    decoder._load(min(decoder.max_context, max(need, 2 * decoder.n_ctx)))
    return True


class LlamaCppDecoder:
    """Greedy decoding through llama-cpp-python with its own KV cache."""

    def __init__(
        self, gguf: str | Path, n_threads: int, n_ctx: int = DEFAULT_CONTEXT, repack: bool = True
    ) -> None:
        self.gguf = Path(gguf)
        self.n_threads = n_threads
        self.repack = repack  # llama.cpp's weight repacking (Llama()'s default: on)
        self._load(n_ctx)

    def _load(self, n_ctx: int) -> None:
        import llama_cpp

        self.llm: Any = None  # free the old context before allocating the new one
        self.llm = load_llama(self.gguf, n_ctx, self.n_threads, extra_buffers=self.repack)
        self.n_ctx = int(self.llm.n_ctx())
        self.n_vocab = int(self.llm.n_vocab())
        self.max_context = int(llama_cpp.llama_model_n_ctx_train(self.llm.model))

    def _last_argmax(self) -> int:
        import llama_cpp
        import numpy as np

        logits = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,)
        )
        return int(logits.argmax())

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]
    ) -> tuple[list[int], RequestStats]:
        """Greedy new tokens after `prompt_ids` and engine-compatible stats."""
        fit_context(self, len(prompt_ids) + max_new_tokens,
                    f"llamacpp: prompt {len(prompt_ids)} + {max_new_tokens} new tokens")
        eos = set(eos_token_ids)
        stats = RequestStats(prompt_tokens=len(prompt_ids))
        llm = self.llm
        t_start = time.perf_counter()
        llm.reset()
        llm.eval(list(prompt_ids))
        token = self._last_argmax()
        stats.target_calls = 1
        stats.prefill_time = time.perf_counter() - t_start
        out: list[int] = []
        while True:
            out.append(token)
            if token in eos or len(out) >= max_new_tokens:
                break
            t0 = time.perf_counter()
            llm.eval([token])
            token = self._last_argmax()
            stats.verify_time += time.perf_counter() - t0
            stats.target_calls += 1
        stats.wall_time = time.perf_counter() - t_start
        stats.new_tokens = len(out)
        return out, stats


class GgufDraft:
    """A draft model for llama-cpp-python's `Llama(draft_model=...)`: the draft's GGUF decoded
    greedily for k tokens per call, with its own KV cache.

    `Llama.generate` calls it with every token of the target's context (prompt, accepted
    tokens, and the token just sampled) and appends what it returns to the next target
    evaluation. Between calls the cache keeps what it has seen: the common prefix with the new
    context is kept, the rest (rejected draft tokens) dropped, and only the new tokens are
    fed (the last one again when nothing is new, for its logits). Registered as a virtual
    subclass of `llama_cpp.llama_speculative.LlamaDraftModel` when a decoder loads.
    """

    def __init__(
        self, gguf: str | Path, n_threads: int, k: int, n_ctx: int, repack: bool = True
    ) -> None:
        self.decoder = LlamaCppDecoder(gguf, n_threads, n_ctx, repack)
        self.k = k
        self.reset()

    @property
    def n_vocab(self) -> int:
        return self.decoder.n_vocab

    def reset(self) -> None:
        """Empty the cache and the counters (a new request)."""
        self.decoder.llm.reset()
        self.calls = 0  # draft forward passes (Llama.eval calls)
        self.prefill_time = 0.0  # the first call's evaluation of the prompt
        self._prefilled = False

    def fit(self, need: int) -> None:
        """Make room for `need` positions (reloads the draft, outside any clock)."""
        if fit_context(self.decoder, need, f"llamacpp-draft: {need} positions (draft)"):
            self.reset()

    def __call__(self, input_ids, /, **kwargs):
        import numpy as np

        llm = self.decoder.llm
        ids = np.asarray(input_ids, dtype=np.intc)
        cached = llm.input_ids[: llm.n_tokens]
        n = min(len(cached), len(ids) - 1)  # feed at least one token: its logits draft
        differ = np.flatnonzero(cached[:n] != ids[:n])
        keep = int(differ[0]) if len(differ) else n
        llm.n_tokens = keep  # Llama.eval drops the cache from n_tokens on
        t0 = time.perf_counter()
        llm.eval(ids[keep:].tolist())
        self.calls += 1
        if not self._prefilled:
            self.prefill_time += time.perf_counter() - t0
            self._prefilled = True
        out = []
        for i in range(self.k):
            token = self.decoder._last_argmax()
            out.append(token)
            if i + 1 < self.k:
                llm.eval([token])
                self.calls += 1
        return np.array(out, dtype=np.intc)


class _TimedDraft:
    """A draft model (`LlamaDraftModel`) whose calls are timed."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.time = 0.0

    def __call__(self, input_ids, /, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.inner(input_ids, **kwargs)
        finally:
            self.time += time.perf_counter() - t0


class SpeculativeDecoder:
    """llama-cpp-python's own speculative decoding, measured: a `Llama(draft_model=...,
    logits_all=True)` on the target's GGUF, decoded by its `Llama.generate` loop with greedy
    sampling (`temp=0`: llama.cpp's greedy sampler; `repeat_penalty=1`: none).

    method `llamacpp-lookup`: the draft model is `LlamaPromptLookupDecoding(max_ngram_size=
    n_max, num_pred_tokens=k)` (it proposes what followed the *first* match in the context of
    its last n-gram, longest n first); `llamacpp-draft`: `GgufDraft` on the draft's GGUF.

    How llama-cpp-python 0.3.36 runs it: after each sampled token it calls the draft model on
    the whole context and evaluates [token, *draft] in one target pass, with logits for every
    position (`draft_model` forces `logits_all`; the constructor must be given
    `logits_all=True` too, or its logits buffer is sized for one batch and overflows); then
    it samples position by position and stops at the first sampled token that differs from
    the draft, dropping the rest from the KV cache. Its output is llama.cpp's greedy output,
    except where a top-2 gap is a near tie: llama.cpp's logits for a token evaluated in a
    block differ slightly from its one-token pass (a few hundredths of a logit on
    SmolLM2), so speculation can flip a near tie that plain decoding resolves the other way.

    Stats, from wrapping the target's `Llama.eval` and the draft model: `target_calls` counts
    the target's `eval` calls (the prompt's one call may hold several llama_decode batches of
    n_batch tokens, as in `llamacpp`); `prefill_time` runs to the first token; `verify_time`
    sums the later target evals; `draft_time` is time inside the draft model; `drafted` /
    `accepted` / `steps` come from comparing each evaluation's draft tokens with the tokens
    sampled from it (steps without draft tokens are not steps, as in the engine);
    `draft_calls` counts the draft GGUF's evals (0 for prompt lookup: no model);
    `draft_prefill_time` is the draft GGUF's first evaluation of the prompt (0 for lookup).
    Sampling and llama-cpp-python's bookkeeping fall in `other_time`. Also measured: with
    `logits_all` every prompt position's logits are computed and copied (prefill is slower
    than plain `llamacpp`'s), as a llama.cpp user of this API pays too.
    """

    def __init__(
        self,
        gguf: str | Path,
        n_threads: int,
        method: str,
        params: dict,
        draft_gguf: str | Path | None = None,
        n_ctx: int = SPECULATIVE_CONTEXT,
        repack: bool = True,
    ) -> None:
        if method not in (LOOKUP, DRAFT):
            raise InputError(f"no speculative llama.cpp method {method!r}")
        self.gguf = Path(gguf)
        self.n_threads = n_threads
        self.method = method
        self.repack = repack
        self.k = int(params.get("k", 4))
        self.gguf_draft: GgufDraft | None = None
        inner: object  # a LlamaDraftModel (GgufDraft is registered as one at load)
        if method == LOOKUP:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            inner = LlamaPromptLookupDecoding(
                max_ngram_size=int(params.get("n_max", 2)), num_pred_tokens=self.k
            )
        else:
            if draft_gguf is None:
                raise LlamaCppUnavailable("llamacpp-draft needs the draft's GGUF file")
            inner = self.gguf_draft = GgufDraft(draft_gguf, n_threads, self.k, n_ctx, repack)
        self.draft = _TimedDraft(inner)
        self._evals: list[tuple[list[int], float]] = []
        self._load(n_ctx)
        if self.gguf_draft is not None and self.gguf_draft.n_vocab > self.n_vocab:
            raise LlamaCppUnavailable(
                f"the draft's vocabulary ({self.gguf_draft.n_vocab} tokens) is larger than "
                f"the target's ({self.n_vocab})"
            )

    def _load(self, n_ctx: int) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaDraftModel

        llama = import_llama()
        LlamaDraftModel.register(_TimedDraft)
        LlamaDraftModel.register(GgufDraft)
        self.llm: Any = None  # free the old context before allocating the new one
        try:
            with model_params_with_extra_buffers(self.repack):
                llm = llama(
                    model_path=str(self.gguf),
                    n_ctx=n_ctx,
                    n_threads=self.n_threads,
                    n_threads_batch=self.n_threads,
                    logits_all=True,
                    draft_model=self.draft,
                    verbose=False,
                )
        except (ValueError, RuntimeError) as exc:
            raise LlamaCppUnavailable(f"llama.cpp could not load {self.gguf}: {exc}") from None
        trained = int(llama_cpp.llama_model_n_ctx_train(llm.model))
        if trained and n_ctx > trained:
            del llm
            self._load(trained)
            return
        evaluate = llm.eval

        def counted_eval(tokens) -> None:  # every target pass, timed
            t0 = time.perf_counter()
            evaluate(tokens)
            seconds = time.perf_counter() - t0
            self._evals.append(([int(t) for t in tokens[1:]], seconds))

        llm.eval = counted_eval  # generate() calls self.eval
        self.llm = llm
        self.n_ctx = int(llm.n_ctx())
        self.n_vocab = int(llm.n_vocab())
        self.max_context = trained or self.n_ctx

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]
    ) -> tuple[list[int], RequestStats]:
        """Greedy new tokens after `prompt_ids` by llama-cpp-python's speculative loop, and
        engine-compatible stats."""
        need = len(prompt_ids) + max_new_tokens + self.k + 1  # the last block's draft too
        fit_context(self, need, f"{self.method}: prompt {len(prompt_ids)} + {max_new_tokens} "
                    f"new tokens + {self.k} draft tokens")
        if self.gguf_draft is not None:
            self.gguf_draft.fit(need)
            self.gguf_draft.reset()
        eos = set(eos_token_ids)
        stats = RequestStats(prompt_tokens=len(prompt_ids))
        self.draft.time = 0.0
        evals: list[tuple[list[int], float]] = []
        self._evals = evals
        out: list[int] = []
        source: list[int] = []  # per new token, the target eval whose logits gave it
        llm = self.llm
        llm.reset()  # no prefix reuse from the previous request
        t_start = time.perf_counter()
        tokens = llm.generate([int(t) for t in prompt_ids], top_k=1, temp=0.0,
                              repeat_penalty=1.0, reset=True)
        for token in tokens:
            if not out:
                stats.prefill_time = time.perf_counter() - t_start
            out.append(int(token))
            source.append(len(evals) - 1)
            if out[-1] in eos or len(out) >= max_new_tokens:
                break
        stats.wall_time = time.perf_counter() - t_start
        tokens.close()
        stats.new_tokens = len(out)
        stats.target_calls = len(evals)
        stats.verify_time = sum(seconds for _, seconds in evals[1:])
        stats.draft_time = self.draft.time
        if self.gguf_draft is not None:
            stats.draft_calls = self.gguf_draft.calls
            stats.draft_prefill_time = self.gguf_draft.prefill_time
        sampled: dict[int, list[int]] = {}
        for token, i in zip(out, source, strict=True):
            sampled.setdefault(i, []).append(token)
        for i, (drafted, _) in enumerate(evals[1:], 1):
            if not drafted:
                continue
            got = sampled.get(i, [])
            accepted = 0
            while accepted < min(len(got), len(drafted)) and got[accepted] == drafted[accepted]:
                accepted += 1
            stats.drafted += len(drafted)
            stats.accepted += accepted
            stats.steps.append((len(drafted), accepted))
        return out, stats


def open_decoder(
    gguf: str | Path | None,
    temperature: float,
    isolated: bool = True,
    method: str = PLAIN,
    params: dict | None = None,
    draft: str | None = None,
    repack: RepackChoice | None = None,
) -> Decoder:
    """The decoder for one of the bench's llama.cpp methods (`llamacpp`, `llamacpp-lookup`,
    `llamacpp-draft`), with as many threads as torch uses (the same cores for every method),
    in a child process unless `isolated` is False; LlamaCppUnavailable says why it cannot
    run. `draft`: the draft model (built-in name or .gguf path) whose GGUF `llamacpp-draft`
    runs. `repack`: llama.cpp's weight repacking; by default on, as `Llama()` loads, unless
    the probe crashed with it (`backends.llamacpp.repack_choice`). The decoder's
    `repack_choice` says which was used and why."""
    import torch

    if method not in METHODS:
        raise InputError(f"no llama.cpp reference method {method!r}; use one of {METHODS}")
    params = dict(params or {})
    if int(params.get("n_max", 1)) < 1:
        raise InputError(f"{method}: n_max must be >= 1")
    import_llama()
    check_greedy_gguf(gguf, temperature)
    assert gguf is not None  # check_greedy_gguf refuses None
    threads = torch.get_num_threads()
    draft_gguf: str | None = None
    if method == DRAFT:
        path = gguf_file(draft) if draft else None
        if path is None:
            raise LlamaCppUnavailable(
                "it runs the draft's GGUF file and the draft is not one: use a built-in "
                "model name or a .gguf path as --draft"
            )
        draft_gguf = str(path)
    if repack is None:
        repack = repack_choice(gguf, threads)
        if repack.on and draft_gguf is not None:  # the draft's kernels are probed too
            draft_repack = repack_choice(draft_gguf, threads)
            if not draft_repack.on:
                repack = RepackChoice(False, f"draft: {draft_repack.reason}")
    if method == PLAIN:
        factory: type[Decoder] = LlamaCppDecoder
        args: tuple = (str(gguf), threads, DEFAULT_CONTEXT, repack.on)
    else:
        factory, args = SpeculativeDecoder, (str(gguf), threads, method, params, draft_gguf,
                                             SPECULATIVE_CONTEXT, repack.on)
    decoder = ChildDecoder(factory, *args) if isolated else factory(*args)
    decoder.repack_choice = repack  # type: ignore[attr-defined]  # why: not in the Decoder protocol
    return decoder


class ChildDecoder:
    """A decoder's `generate` served by a child process: the torch methods of the bench
    run alone in theirs, and a crash in llama.cpp is a LlamaCppUnavailable, not a lost run.
    Timing is taken inside the child, as in-process (the round trip is outside the clock)."""

    def __init__(self, factory, *args) -> None:
        from adaspec.backends.child_process import ChildProcess

        self._child = ChildProcess(factory, *args, error=LlamaCppUnavailable)

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_token_ids: list[int]
    ) -> tuple[list[int], RequestStats]:
        return self._child.call(
            "generate", [int(t) for t in prompt_ids], max_new_tokens, list(eos_token_ids)
        )

    def close(self) -> None:
        self._child.close()
