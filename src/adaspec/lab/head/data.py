"""`adaspec head data`'s study form: the target's features and distributions over training text.

For each training example (a prompt and an answer, chat-templated) one forward pass of the
target records, at every position: the token, the target's final-normed hidden state (the
feature its output head reads, what an EAGLE head reads), the outputs of three layers (low,
middle, high: what an EAGLE-3 head fuses), and the target's top-k next-token probabilities.
Shards are written atomically (`shard-NNNNN.pt`) and listed with their sha256 in
`manifest.json`, so an interrupted run resumes where it stopped and a changed file is found.

Only prompts DESIGN.md lets train: ShareGPT conversations with a file index below 12,000
(their first human turn and the answer to it).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaspec.lab.bench.suites import TRAIN_HUMANEVAL, TRAIN_SHAREGPT


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str
    answer: str = ""  # the dataset's answer text (teacher-forced as it is)
    answer_ids: tuple[int, ...] = ()  # or the target's own answer, token ids (wins)


def training_examples(sharegpt: int = 0, wmt: int = 0, humaneval: int = 0,
                      spec_bench: int = 0, sharegpt_own: int = 0,
                      sharegpt_own_from: int = 0) -> list[Example]:
    """Prompts DESIGN.md lets train, and nothing else: the first `sharegpt` ShareGPT
    conversations of file index below 12,000 (with their answers), the first `sharegpt_own`
    of them from file index `sharegpt_own_from` on without their answers (ids
    `sharegpt-own/INDEX`), the first `wmt` WMT prompts, HumanEval problems
    0 .. min(humaneval, 60) - 1 and the first `spec_bench` Spec-Bench questions with an odd
    question_id (all but the first without answers: the target writes its own,
    `own_answers`, the text a head drafts at inference)."""
    from adaspec.lab.bench import suites

    out: list[Example] = []
    if sharegpt:
        for ex in sharegpt_pairs(0, TRAIN_SHAREGPT):
            if len(out) >= sharegpt:
                break
            out.append(ex)
    if sharegpt_own:
        for n, ex in enumerate(sharegpt_pairs(sharegpt_own_from, TRAIN_SHAREGPT)):
            if n >= sharegpt_own:
                break
            out.append(Example(ex.id.replace("sharegpt/", "sharegpt-own/"), ex.prompt))
    if wmt:
        out += [Example(p.id, p.text) for p in suites.wmt(wmt)]
    if humaneval:
        out += [Example(p.id, p.text) for p in suites.humaneval(min(humaneval, TRAIN_HUMANEVAL))]
    if spec_bench:
        odd = [p for p in suites.spec_bench(None) if int(p.id.rsplit("/", 1)[1]) % 2 == 1]
        out += [Example(p.id, p.text) for p in odd[:spec_bench]]
    return out


def read_prompts(path: Path) -> list[Example]:
    """A user's own prompts (`head data --prompts`): a JSON list of strings, or JSON lines
    each a string or an object with "prompt" (and optionally "id"); ids `prompts/NAME/I`
    where none is given. The target answers them itself."""
    from adaspec.errors import InputError

    if not path.is_file():
        raise InputError(f"--prompts {path}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        items = json.loads(text) if text.lstrip().startswith("[") else \
            [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise InputError(f"--prompts {path}: not JSON or JSON lines (line {exc.lineno}: "
                         f"{exc.msg})") from None
    out: list[Example] = []
    for i, item in enumerate(items):
        rid = f"prompts/{path.stem}/{i}"
        if isinstance(item, dict):
            rid = str(item.get("id") or rid)
            item = item.get("prompt")
        if not isinstance(item, str) or not item.strip():
            raise InputError(f"--prompts {path}: item {i} has no prompt text (a string, or "
                             f'an object with "prompt")')
        out.append(Example(rid, item))
    if len({e.id for e in out}) < len(out):
        raise InputError(f"--prompts {path}: two prompts share an id")
    return out


def _answers_done(out: Path) -> dict[str, list[int]]:
    """The answers an earlier run kept in `out` (a torn last line dropped)."""
    from adaspec.store.atomic import trim_torn_tail

    done: dict[str, list[int]] = {}
    if out.is_file():
        trim_torn_tail(out)
        for line in out.read_text().splitlines():
            row = json.loads(line)
            done[row["id"]] = row["answer_ids"]
    return done


def _with_answers(examples: list[Example], done: dict[str, list[int]]) -> list[Example]:
    return [Example(ex.id, ex.prompt, ex.answer, tuple(done.get(ex.id, ex.answer_ids)))
            for ex in examples]


def _to_answer(examples: list[Example], done: dict[str, list[int]]) -> list[Example]:
    return [ex for ex in examples if not ex.answer and not ex.answer_ids and ex.id not in done]


def with_saved_answers(examples: list[Example], out: Path) -> tuple[list[Example], int]:
    """The examples with the answers an earlier run kept in `out`, and how many still have
    none (0: nothing to answer, no model to load)."""
    done = _answers_done(out)
    return _with_answers(examples, done), len(_to_answer(examples, done))


def own_answers(model, tokenizer, examples: list[Example], out: Path, max_new: int,
                eos: list[int], batch: int = 16, progress: bool = True) -> list[Example]:
    """The target's own greedy answers (EAGLE-3 trains on them) to the examples that have no
    answer, in batches (left-padded, torch); kept in `out` (one JSON row per example,
    appended, so an interrupted run resumes). Returns every example with its answer."""
    from tqdm import tqdm

    done = _answers_done(out)
    todo = _to_answer(examples, done)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="target answers", unit="prompt", disable=not progress)
    for i in range(0, len(todo), batch):
        group = todo[i : i + batch]
        prompts = [_prompt_ids(tokenizer, ex.prompt) for ex in group]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad)
        with out.open("a", encoding="utf-8") as f:
            for ex, row in zip(group, gen[:, width:].tolist(), strict=True):
                answer: list[int] = []
                for t in row:
                    answer.append(int(t))
                    if t in eos:
                        break
                done[ex.id] = answer
                f.write(json.dumps({"id": ex.id, "answer_ids": answer}) + "\n")
        bar.update(len(group))
    bar.close()
    return _with_answers(examples, done)


def engine_answers(generator, examples: list[Example], out: Path, max_new: int,
                   eos: int, progress: bool = True) -> list[Example]:
    """`own_answers` through adaspec's engine (`generator`, a `TextGenerator`): greedy, so
    the text plain decoding gives whatever the method, one prompt at a time on the fastest
    runtime (on a 2-vCPU EPYC 3.9 s a prompt, where torch's batched `generate` took over
    4 minutes for its first 20). An answer that ended on the end token keeps it, as
    `own_answers` does."""
    from tqdm import tqdm

    from adaspec.core.sampling import SamplingParams

    done = _answers_done(out)
    todo = _to_answer(examples, done)
    out.parent.mkdir(parents=True, exist_ok=True)
    for ex in tqdm(todo, desc="target answers", unit="prompt", disable=not progress):
        got = generator.generate(_prompt_ids(generator.tokenizer, ex.prompt), max_new,
                                 SamplingParams(temperature=0.0), chat=False)
        answer = [int(t) for t in got.token_ids]
        if got.finish_reason == "eos" and (not answer or answer[-1] != eos):
            answer.append(eos)
        done[ex.id] = answer
        with out.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"id": ex.id, "answer_ids": answer}) + "\n")
    return _with_answers(examples, done)


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def sharegpt_pairs(start: int, stop: int) -> Iterator[Example]:
    """(first human turn, the answer to it) of the conversations with file index in
    [start, stop) that start with a human turn followed by an answer."""
    from adaspec.lab.bench.suites import _sharegpt_file, iter_json_array

    with _sharegpt_file(None).open("r", encoding="utf-8") as f:
        for index, item in enumerate(iter_json_array(f)):
            if index >= stop:
                return
            if index < start or not isinstance(item, dict):
                continue
            conv = item.get("conversations") or []
            if (len(conv) < 2 or not isinstance(conv[0], dict) or not isinstance(conv[1], dict)
                    or conv[0].get("from") != "human" or conv[1].get("from") != "gpt"):
                continue
            prompt, answer = conv[0].get("value"), conv[1].get("value")
            if isinstance(prompt, str) and isinstance(answer, str) and prompt.strip() \
                    and answer.strip():
                yield Example(f"sharegpt/{index}", prompt, answer)


def encode(tokenizer, example: Example, max_tokens: int, eos: int) -> tuple[list[int], int]:
    """Chat-templated prompt + answer + end of turn, cut to max_tokens; (ids, prompt length)."""
    prompt = _prompt_ids(tokenizer, example.prompt)
    if example.answer_ids:  # the target's own, its end of turn included where it ended
        return (prompt + list(example.answer_ids))[:max_tokens], len(prompt)
    answer = [int(t) for t in tokenizer.encode(example.answer, add_special_tokens=False)]
    return (prompt + answer + [eos])[:max_tokens], len(prompt)


def layer_picks(layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers (0-based decoder layer outputs)."""
    return (2, layers // 2, layers - 3)


class FeatureTap:
    """Captures the chosen decoder layers' outputs and the final norm's in one forward."""

    def __init__(self, model, picks: tuple[int, ...]) -> None:
        decoder = model.get_decoder()
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = []
        for i in picks:
            self.handles.append(decoder.layers[i].register_forward_hook(self._hook(f"layer{i}")))
        self.handles.append(decoder.norm.register_forward_hook(self._hook("final")))

    def _hook(self, name: str):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            self.outputs[name] = out.detach()
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class TorchScorer:
    """Scores an example with a transformers model: logits, the final-normed states and,
    where asked, the low/middle/high layers' outputs (EAGLE-3's input)."""

    def __init__(self, model, layers: bool) -> None:
        self.picks = layer_picks(model.config.num_hidden_layers) if layers else ()
        self.model = model
        self.tap = FeatureTap(model, self.picks)

    def score(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        with torch.inference_mode():
            logits = self.model(torch.tensor([ids])).logits[0].float()
        layers = None
        if self.picks:
            layers = torch.stack([self.tap.outputs[f"layer{i}"][0] for i in self.picks], 1)
        return logits, self.tap.outputs["final"][0], layers

    def close(self) -> None:
        self.tap.close()


class BackendScorer:
    """Scores an example with a runtime that returns the target's features beside its
    logits (ik_llama.cpp with its features patch: the states the head reads at inference),
    in chunks of at most `chunk` rows."""

    picks: tuple[int, ...] = ()

    def __init__(self, backend, chunk: int = 256) -> None:
        backend.record_features(True)
        self.backend = backend
        self.chunk = chunk

    def score(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, None]:
        self.backend.reset()
        logits, feats = [], []
        for i in range(0, len(ids), self.chunk):
            out = self.backend.forward(torch.tensor(ids[i : i + self.chunk]))
            if out.features is None:
                raise RuntimeError(f"the {self.backend.kind} runtime returned no features")
            logits.append(out.logits.float())
            feats.append(out.features.float())
        return torch.cat(logits), torch.cat(feats), None

    def close(self) -> None:
        self.backend.record_features(False)
        self.backend.reset()


def collect(scorer, tokenizer, examples: list[Example], out: Path, max_tokens: int = 384,
            top_k: int = 8, shard_tokens: int = 16384, eos: int = 151645,
            progress: bool = True) -> dict:
    """Record the examples not yet in `out`'s manifest with `scorer` (`TorchScorer`,
    `BackendScorer`); returns the manifest."""
    from tqdm import tqdm

    from adaspec.store.atomic import atomic_open, write_text

    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest: dict[str, Any] = (json.loads(manifest_path.read_text()) if manifest_path.exists()
                                else {"shards": [], "top_k": top_k, "max_tokens": max_tokens})
    done = {i for s in manifest["shards"] for i in s["examples"]}
    picks = scorer.picks
    manifest["layers"] = list(picks)
    todo = [e for e in examples if e.id not in done]
    rows: list[dict] = []
    n_tokens = 0

    def flush() -> None:
        nonlocal rows, n_tokens
        if not rows:
            return
        index = len(manifest["shards"])
        path = out / f"shard-{index:05d}.pt"
        with atomic_open(path, "wb") as f:
            torch.save(rows, f)
        manifest["shards"].append({"file": path.name, "sha256": _sha256(path),
                                   "examples": [r["id"] for r in rows], "tokens": n_tokens})
        manifest["tokens"] = sum(s["tokens"] for s in manifest["shards"])
        write_text(manifest_path, json.dumps(manifest, indent=1))
        rows, n_tokens = [], 0

    t0 = time.perf_counter()
    try:
        for ex in tqdm(todo, desc="target features", unit="example", disable=not progress):
            ids, prompt_len = encode(tokenizer, ex, max_tokens, eos)
            logits, final, layers = scorer.score(ids)
            top_p, top_i = torch.softmax(logits, -1).topk(top_k, -1)
            row = {
                "id": ex.id, "tokens": torch.tensor(ids, dtype=torch.int32),
                "prompt_len": prompt_len, "final": final.to(torch.float16),
                "top_ids": top_i.to(torch.int32), "top_probs": top_p.to(torch.float16),
            }
            if layers is not None:
                row["layers"] = layers.to(torch.float16)  # [T, 3, H]
            rows.append(row)
            n_tokens += len(ids)
            if n_tokens >= shard_tokens:
                flush()
        flush()
    finally:
        scorer.close()
    manifest["seconds"] = manifest.get("seconds", 0.0) + time.perf_counter() - t0
    write_text(manifest_path, json.dumps(manifest, indent=1))
    return manifest


def load_rows(root: Path, keep: Callable[[dict], bool] | None = None) -> list[dict]:
    """Every recorded example (those `keep` keeps, one shard in memory at a time), each
    shard checked against the manifest's sha256."""
    from adaspec.errors import InputError

    manifest = json.loads((root / "manifest.json").read_text())
    rows: list[dict] = []
    for shard in manifest["shards"]:
        path = root / shard["file"]
        if _sha256(path) != shard["sha256"]:
            raise InputError(f"{path}: checksum differs from the manifest's")
        rows += [r for r in torch.load(path, weights_only=True) if keep is None or keep(r)]
    return rows


def is_held(row: dict, fraction: float) -> bool:
    """Whether `split_held` holds the example out (by its id's hash)."""
    import zlib

    return zlib.crc32(str(row["id"]).encode()) / 2**32 < fraction


def split_held(rows: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """(held out, training): an example is held out by its id's hash, so a folder that grows
    (a resumed or longer recording) keeps its held-out examples held out, and a head
    warm-started on the smaller folder is validated on examples it never trained on; at
    least one held out."""
    out = [r for r in rows if is_held(r, fraction)] or rows[:1]
    chosen = {id(r) for r in out}
    return out, [r for r in rows if id(r) not in chosen]
