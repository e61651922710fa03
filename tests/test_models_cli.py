"""`adaspec models list|prepare|verify` handlers, on fake part packages (no real models)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from adaspec.cli.models import add_models_parser
from adaspec.errors import ModelStoreError
from adaspec.store import catalog as catalog
from adaspec.store import model_store as store
from tests.test_store import make_fake_model


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("ADASPEC_HOME", str(h))
    return h


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="adaspec")
    add_models_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["models", *argv])
    return int(args.func(args))


def test_list_shows_every_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, _ = make_fake_model(tmp_path, monkeypatch)
    store.assemble(spec.name, progress=False)
    assert run("list") == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "ROLE", "SIZE", "INSTALLED", "ASSEMBLED", "CACHED"]
    fake = next(r for r in rows if r.startswith(spec.name)).split()
    assert fake[-3:] == ["yes", "yes", "-"]
    for name in catalog.CATALOG:
        assert name in out


def test_verify_ok_fail_and_exit_codes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(catalog, "CATALOG", {})
    assert run("verify") == 1  # nothing assembled: nothing verified is not a success
    assert "nothing to verify" in capsys.readouterr().out
    spec, whole = make_fake_model(tmp_path, monkeypatch)
    path = store.assemble(spec.name, progress=False)
    assert run("verify") == 0
    assert capsys.readouterr().out.startswith(f"OK    {spec.name}")
    path.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    assert run("verify", spec.name) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL  {spec.name}") and "checksum mismatch" in out
    with pytest.raises(ModelStoreError, match="unknown model"):
        run("verify", "nope")


def test_prepare_rejects_bad_dtype_before_work() -> None:
    with pytest.raises(ModelStoreError, match="unknown dtype 'int4'"):
        run("prepare", "--dtype", "int4")
