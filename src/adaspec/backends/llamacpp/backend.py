"""llama.cpp (through llama-cpp-python) behind the model backend interface.

A GGUF model run by llama.cpp as a `ModelBackend`, so it can serve as the draft (or the
target) in adaspec's loop: a Q4_K_M draft step costs a fraction of a bf16 torch step on this
CPU. It scores chains only (no tree masks, no hidden states): forward feeds tokens after the
cache and returns logits for every fed token; truncate drops cache entries from a position on
(`llama_memory_seq_rm`).

`llama-cpp-python` is an optional extra (`pip install 'adaspec[llamacpp]'`; it builds
llama.cpp from source, about 8 minutes on 2 cores), imported lazily: a missing install is a
LlamaCppUnavailable naming the command, never a traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from adaspec.backends.base import ChainBackend, batch_noise_setting
from adaspec.backends.gguf import LlamaCppUnavailable

INSTALL_HINT = (
    "pip install 'adaspec[llamacpp]' (builds llama-cpp-python from source, about 8 minutes)"
)
DEFAULT_CONTEXT = 8192  # tokens
# llama.cpp's "extra buffer types" repack weights at load for faster CPU kernels (AVX2 /
# AVX-512 / AMX); `Llama()` does it by default, and so does adaspec. On one Intel Xeon VM the
# AMX matmul (batches of more than one token) crashed the process in ggml_backend_amx_mul_mat:
# a probe in a child process (`repack_choice`) loads the model with repacking on and decodes a
# few tokens, and only when that crashes is repacking turned off. This variable overrides the
# probe: 1 = on, 0 = off.
EXTRA_BUFFERS_ENV = "ADASPEC_LLAMACPP_EXTRA_BUFFERS"
PROBE_TIMEOUT = 600  # seconds: a load with repacking of a large model on a slow disk


def load_gguf_backend(model: str, n_threads: int, n_ctx: int = DEFAULT_CONTEXT) -> LlamaCppBackend:
    """A built-in model or .gguf path run by llama.cpp as a backend in this process."""
    from adaspec.backends.gguf import gguf_backend_args

    return LlamaCppBackend(*gguf_backend_args(model, n_threads, n_ctx, import_llama))


def import_llama() -> type:
    """The `llama_cpp.Llama` class, or LlamaCppUnavailable naming the install command."""
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise LlamaCppUnavailable(
            f"llama-cpp-python is not installed ({exc}): {INSTALL_HINT}"
        ) from None
    return Llama


@contextmanager
def model_params_with_extra_buffers(extra_buffers: bool) -> Iterator[None]:
    """`Llama()` takes no `use_extra_bufts` argument: set it in the default model parameters
    it starts from, for the duration of one load."""
    from llama_cpp import llama_cpp as lib

    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = extra_buffers
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


@dataclass(frozen=True)
class RepackChoice:
    """Whether llama.cpp repacks the weights (its extra buffer types), and why."""

    on: bool
    reason: str

    def describe(self) -> str:
        return f"repacking {'on' if self.on else 'off'} ({self.reason})"

    def as_dict(self) -> dict:
        return {"repack": self.on, "reason": self.reason}


def _probe_command(gguf: str | Path, n_threads: int) -> list[str]:
    return [sys.executable, "-c",
            "import sys; from adaspec.backends.llamacpp.backend import repack_probe_main; "
            "sys.exit(repack_probe_main(sys.argv[1], int(sys.argv[2])))",
            str(gguf), str(n_threads)]


def repack_probe_main(gguf: str, n_threads: int) -> int:
    """The probe's child: load with repacking on, decode a block of tokens (the batched
    kernels) and two single tokens; a crash ends the process before it returns 0."""
    llm = load_llama(gguf, 512, n_threads, extra_buffers=True)
    n_vocab = int(llm.n_vocab())
    block = [(100 + 37 * i) % n_vocab for i in range(16)]
    llm.eval(block)
    llm.eval([block[0]])
    llm.eval([block[1]])
    return 0


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def probe_repacking(
    gguf: str | Path, n_threads: int, command: list[str] | None = None,
    timeout: float = PROBE_TIMEOUT,
) -> tuple[bool, str, bool]:
    """Run the probe in a child process: (repacking works, what happened, whether the answer
    is about repacking and may be cached: a pass or a crash, not a load error)."""
    cmd = command or _probe_command(gguf, n_threads)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              errors="replace")
    except subprocess.TimeoutExpired:
        return False, f"the probe with repacking on did not finish in {timeout:.0f} s", False
    except OSError as exc:
        return False, f"the probe could not start ({exc})", False
    if done.returncode == 0:
        return True, "probe passed", True
    if done.returncode < 0:
        return False, (f"a child process that loaded the model with repacking on was killed "
                       f"by {_signal_name(done.returncode)}"), True
    last = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
    return False, f"the probe with repacking on failed (exit code {done.returncode}: {last})", \
        False


def _probe_cache_path(gguf: Path) -> Path:
    import hashlib
    import json
    import platform

    from adaspec.store.assembly import adaspec_home

    try:
        from importlib.metadata import version

        lib = version("llama-cpp-python")
    except Exception:
        lib = "unknown"
    flags = ""
    with contextlib.suppress(OSError):
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith(("flags", "Features"))), "")
    stat = gguf.stat()
    key = {"llama_cpp_python": lib, "machine": platform.machine(), "cpu_flags": flags,
           "gguf": gguf.name, "size": stat.st_size}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return adaspec_home() / "probes" / f"llamacpp-repack-{gguf.stem}-{digest}.json"


def repack_choice(
    gguf: str | Path, n_threads: int, command: list[str] | None = None
) -> RepackChoice:
    """Repacking on, as `Llama()` loads by default, unless the probe (this CPU, this
    llama-cpp-python, this GGUF; its answer cached under `$ADASPEC_HOME/probes`) crashed with
    it; `ADASPEC_LLAMACPP_EXTRA_BUFFERS=1|0` decides without a probe."""
    import json

    env = os.environ.get(EXTRA_BUFFERS_ENV, "").strip()
    if env in ("0", "1"):
        return RepackChoice(env == "1", f"{EXTRA_BUFFERS_ENV}={env}")
    gguf = Path(gguf)
    cache: Path | None = None
    with contextlib.suppress(OSError):
        cache = _probe_cache_path(gguf)
    try:
        if cache is not None:
            cached = json.loads(cache.read_text())
            return RepackChoice(bool(cached["on"]), f"{cached['reason']}; cached")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ok, reason, keep = probe_repacking(gguf, n_threads, command)
    if keep and cache is not None:
        from adaspec.store.atomic import write_json

        with contextlib.suppress(OSError):
            write_json(cache, {"on": ok, "reason": reason})
    return RepackChoice(ok, reason if ok else f"{reason}: off")


def load_llama(gguf: str | Path, n_ctx: int, n_threads: int, extra_buffers: bool = True):
    """A `llama_cpp.Llama` for a GGUF file (quiet, last-token logits by default, the context
    capped at the model's training length); `extra_buffers`: llama.cpp's weight repacking
    (`Llama()`'s default; see `repack_choice`)."""
    llama = import_llama()
    import llama_cpp

    try:
        with model_params_with_extra_buffers(extra_buffers):
            llm = llama(
                model_path=str(gguf),
                n_ctx=n_ctx,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                logits_all=False,
                verbose=False,
            )
    except (ValueError, RuntimeError) as exc:
        raise LlamaCppUnavailable(f"llama.cpp could not load {gguf}: {exc}") from None
    trained = int(llama_cpp.llama_model_n_ctx_train(llm.model))
    if trained and n_ctx > trained:
        return load_llama(gguf, trained, n_threads, extra_buffers)
    return llm


class LlamaCppBackend(ChainBackend):
    """A GGUF model run by llama.cpp: chains only, logits for every fed token."""

    kind = "llamacpp"
    runtime = "llama.cpp"
    # experiments/batch_noise.py (EPYC Zen 5): up to 0.64 (1,176 rows, repacking on).
    batch_noise = 0.65

    def __init__(
        self,
        gguf: str | Path,
        n_threads: int,
        name: str = "llamacpp",
        n_ctx: int = DEFAULT_CONTEXT,
        repack: bool | None = None,
    ) -> None:
        """repack: llama.cpp's weight repacking; None decides by `repack_choice` (a probe)."""
        if repack is None:
            choice = repack_choice(gguf, n_threads)
            if not choice.on:
                print(f"adaspec: llama.cpp {choice.describe()}", file=sys.stderr, flush=True)
            repack = choice.on
        self.repack = repack
        self.llm = load_llama(gguf, n_ctx, n_threads, extra_buffers=repack)
        import llama_cpp

        self.name = name
        self.batch_noise = batch_noise_setting(type(self).batch_noise)
        self.vocab_size = int(self.llm.n_vocab())
        self.max_context = int(self.llm.n_ctx())
        self.hidden_size = int(llama_cpp.llama_model_n_embd(self.llm.model))
        self.num_layers = int(llama_cpp.llama_model_n_layer(self.llm.model))
        self.bytes_per_forward = int(llama_cpp.llama_model_size(self.llm.model))
        self._len = 0

    def _feed(self, ids: list[int], every_row: bool) -> torch.Tensor:
        """In batches of n_batch, each row copied out at once (the next decode overwrites
        llama.cpp's buffer)."""
        import numpy as np

        ctx, batch, step = self.llm._ctx, self.llm._batch, self.llm.n_batch
        rows = []
        for start in range(0, len(ids), step):
            chunk = ids[start : start + step]
            batch.set_batch(batch=chunk, n_past=self._len, logits_all=every_row)
            ctx.decode(batch)
            self._len += len(chunk)
            if every_row:
                shape = (len(chunk), self.vocab_size)
                rows.append(torch.from_numpy(np.ctypeslib.as_array(ctx.get_logits(), shape).copy()))
        if not every_row and ids:
            last = np.ctypeslib.as_array(ctx.get_logits_ith(-1), shape=(1, self.vocab_size))
            rows.append(torch.from_numpy(last.copy()))
        return torch.cat(rows) if rows else torch.empty(0, self.vocab_size)

    def _remove_from(self, length: int) -> None:
        self.llm._ctx.kv_cache_seq_rm(-1, length, -1)
