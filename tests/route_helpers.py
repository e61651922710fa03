"""Shared pieces of the router tests: a tiny collection (every arm run on a few prompts)."""

from __future__ import annotations

from adaspec.backends.torch.backend import TorchBackend
from adaspec.lab.bench.suites import Prompt
from adaspec.lab.router.collect import CollectConfig, collect
from tests.conftest import CharTokenizer, tiny_model

ARMS = {"ar": "ar", "ngram": "ngram", "draft:k=2": "draft:k=2"}
TEXTS = [
    "abcabcabc abc",
    "def add(a, b): return a + b",
    "the cat sat on the mat. the cat",
    "x = [1, 2, 3]",
    "hello world, hello",
    "for i in range(9): print(i)",
]
TRAIN = [Prompt(id=f"train/{i}", category=["code", "chat"][i % 2], text=t)
         for i, t in enumerate(TEXTS)]
TEST = [Prompt(id=f"test/{i}", category=["code", "chat"][i % 2], text=t[::-1])
        for i, t in enumerate(TEXTS[:4])]


def backends():
    target = TorchBackend(tiny_model(seed=0), name="tiny-target")
    draft = TorchBackend(tiny_model(seed=1, layers=1), name="tiny-draft")
    return target, CharTokenizer(), draft


def make_collection(folder, prompts=TRAIN, max_new_tokens: int = 10, **kw):
    target, tok, draft = backends()
    config = CollectConfig(arms=dict(ARMS), out=str(folder), max_new_tokens=max_new_tokens, **kw)
    return collect(config, prompts, target, tok, draft, eos_token_ids=[], progress=False)
