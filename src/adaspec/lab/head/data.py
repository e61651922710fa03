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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TRAIN_SHAREGPT = 12000  # conversations below this file index may train (DESIGN.md)


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str
    answer: str


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
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}],
                                           add_generation_prompt=True, tokenize=True)
    if hasattr(prompt, "keys"):
        prompt = prompt["input_ids"]
    prompt = [int(t) for t in prompt]
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


def collect(model, tokenizer, examples: list[Example], out: Path, max_tokens: int = 384,
            top_k: int = 8, shard_tokens: int = 16384, eos: int = 151645,
            progress: bool = True) -> dict:
    """Record the examples not yet in `out`'s manifest; returns the manifest."""
    from tqdm import tqdm

    from adaspec.store.atomic import write_text

    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest: dict[str, Any] = (json.loads(manifest_path.read_text()) if manifest_path.exists()
                                else {"shards": [], "top_k": top_k, "max_tokens": max_tokens})
    done = {i for s in manifest["shards"] for i in s["examples"]}
    picks = layer_picks(model.config.num_hidden_layers)
    manifest["layers"] = list(picks)
    tap = FeatureTap(model, picks)
    todo = [e for e in examples if e.id not in done]
    rows: list[dict] = []
    n_tokens = 0

    def flush() -> None:
        nonlocal rows, n_tokens
        if not rows:
            return
        index = len(manifest["shards"])
        path = out / f"shard-{index:05d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(rows, tmp)
        tmp.replace(path)
        manifest["shards"].append({"file": path.name, "sha256": _sha256(path),
                                   "examples": [r["id"] for r in rows], "tokens": n_tokens})
        manifest["tokens"] = sum(s["tokens"] for s in manifest["shards"])
        write_text(manifest_path, json.dumps(manifest, indent=1))
        rows, n_tokens = [], 0

    t0 = time.perf_counter()
    try:
        for ex in tqdm(todo, desc="target features", unit="example", disable=not progress):
            ids, prompt_len = encode(tokenizer, ex, max_tokens, eos)
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            probs = torch.softmax(logits, -1)
            top_p, top_i = probs.topk(top_k, -1)
            rows.append({
                "id": ex.id, "tokens": torch.tensor(ids, dtype=torch.int32),
                "prompt_len": prompt_len,
                "final": tap.outputs["final"][0].to(torch.float16),
                "layers": torch.stack([tap.outputs[f"layer{i}"][0] for i in picks], 1)
                .to(torch.float16),  # [T, 3, H]
                "top_ids": top_i.to(torch.int32), "top_probs": top_p.to(torch.float16),
            })
            n_tokens += len(ids)
            if n_tokens >= shard_tokens:
                flush()
        flush()
    finally:
        tap.close()
    manifest["seconds"] = manifest.get("seconds", 0.0) + time.perf_counter() - t0
    write_text(manifest_path, json.dumps(manifest, indent=1))
    return manifest


def load_rows(root: Path) -> list[dict]:
    """Every recorded example, each shard checked against the manifest's sha256."""
    from adaspec.errors import InputError

    manifest = json.loads((root / "manifest.json").read_text())
    rows: list[dict] = []
    for shard in manifest["shards"]:
        path = root / shard["file"]
        if _sha256(path) != shard["sha256"]:
            raise InputError(f"{path}: checksum differs from the manifest's")
        rows += torch.load(path, weights_only=True)
    return rows
