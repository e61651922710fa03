"""Every artifact write is atomic: a crash between write and rename, or a kill of the writing
process, leaves the old file or the new one, never a torn one, and no temp file behind.

The crash is injected into `adaspec.store.atomic`: `os.replace` raises when it would move a
finished temp file (or temp directory) onto its final name, after checking that the temp
really holds the new bytes. A writer that wrote straight to its final path would change the
old file before that point, and fail these tests. Appended row files (results.jsonl,
states.jsonl) are kept, but a torn last row is dropped on resume; the safetensors cache's
checksum catches a flipped byte that leaves the size unchanged.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from argparse import Namespace
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import adaspec
from adaspec.errors import ModelStoreError
from adaspec.store import atomic
from tests.conftest import tiny_model

INJECTED = "injected crash between write and rename"


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under root, by relative path."""
    return {
        str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(root.rglob("*"))
    }


@dataclass
class Renames:
    done: list[Path] = field(default_factory=list)  # final names a temp was renamed onto
    crashed: list[Path] = field(default_factory=list)  # temps whose rename was the crash


@contextlib.contextmanager
def crash_on_rename(monkeypatch: pytest.MonkeyPatch, skip: int = 0) -> Iterator[Renames]:
    """os.replace fails when it would move a temp file or directory onto its final name, after
    letting `skip` such renames through (moving an old directory aside always works, so the
    restore path is exercised too)."""
    real = os.replace
    seen = Renames()

    def crash(src, dst, *a, **k):  # noqa: ANN001, ANN202
        src, dst = Path(src), Path(dst)
        if ".tmp-" not in src.name:
            return real(src, dst, *a, **k)
        # the crash falls between a complete write and the rename onto the final name
        assert src.parent == dst.parent and src.name != dst.name
        assert src.is_dir() and any(src.iterdir()) or src.is_file() and src.stat().st_size
        if len(seen.done) < skip:
            seen.done.append(dst)
            return real(src, dst, *a, **k)
        seen.crashed.append(src)
        raise OSError(INJECTED)

    with monkeypatch.context() as m:
        m.setattr(atomic.os, "replace", crash)
        yield seen


def check_crash_keeps_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          write: Callable[[str], object]) -> None:
    """write("old"), then write("new") crashed at its first rename, then at its second, ...:
    each crash leaves every file under tmp_path as it was (no torn file, no temp) except the
    files already renamed into place before it; then write("new") in full changes the files,
    each through a rename, and leaves nothing else behind."""
    for skip in range(100):
        write("old")
        before = snapshot(tmp_path)
        with crash_on_rename(monkeypatch, skip) as seen:
            try:
                write("new")
            except OSError as exc:
                assert INJECTED in str(exc)
        after = snapshot(tmp_path)
        assert after.keys() == before.keys()  # no temp file left, nothing removed
        renamed = {str(d.relative_to(tmp_path)) for d in seen.done}
        changed = {f for f in before if after[f] != before[f]}
        # (in the full write too: every file that changed was renamed into place)
        assert not {f for f in changed if not any(f == d or f.startswith(d + "/")
                                                  for d in renamed)}
        if not seen.crashed:  # every rename went through: the full write
            break
    assert skip > 0, "the writer never renamed a temp file onto its final name"
    assert changed  # the new version differs, so the checks above mean something


# ----------------------------------------------------------------------------- the helper


def test_atomic_open_crash_and_serializer_error_keep_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "out" / "a.json"

    def write(version: str) -> None:
        atomic.write_json(path, {"version": version, "pad": "x" * 1000})

    check_crash_keeps_old(tmp_path, monkeypatch, write)
    before = snapshot(tmp_path)
    with pytest.raises(RuntimeError, match="midway"), atomic.atomic_open(path, "wb") as f:
        f.write(b"half of the new file")
        raise RuntimeError("serializer failed midway")
    with pytest.raises(TypeError):  # json cannot encode it: nothing is written at all
        atomic.write_json(path, {"x": object()})
    assert snapshot(tmp_path) == before


def test_atomic_path_for_writers_that_take_a_file_name(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "w.safetensors"

    def write(version: str) -> None:
        with atomic.atomic_path(path) as tmp:
            save_file({"w": torch.full((64,), float(version == "new"))}, str(tmp))

    check_crash_keeps_old(tmp_path, monkeypatch, write)
    assert load_file(str(path))["w"].eq(1).all()


def test_replace_dir_restores_the_old_directory_when_the_rename_fails(tmp_path, monkeypatch):
    final = tmp_path / "cache"

    def write(version: str) -> None:
        with atomic.atomic_dir(final) as tmp:
            (tmp / "weights").write_bytes(version.encode() * 100)
            (tmp / "marker.json").write_text(version)

    check_crash_keeps_old(tmp_path, monkeypatch, write)


def test_a_kill_between_the_two_renames_of_replace_dir_is_undone(tmp_path):
    """The old directory moved aside by a process that died before renaming the new one
    into place is put back by the next write's cleanup, not deleted."""
    final = tmp_path / "cache"
    with atomic.atomic_dir(final) as tmp:
        (tmp / "f").write_text("old")
    dead = 999_999_999
    os.replace(final, tmp_path / f".cache.old-{dead}-abc")
    (tmp_path / f".cache.tmp-{dead}-def").mkdir()  # the half-built new one
    atomic.clean_stale(final)
    assert (final / "f").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


CHILD = textwrap.dedent("""
    import sys, time
    from adaspec.store.atomic import atomic_open

    with atomic_open(sys.argv[1], "wb") as f:
        for i in range(int(sys.argv[2])):
            f.write(bytes([65 + i % 26]) * (1 << 20))
            f.flush()
            if i == 2:
                print("writing", flush=True)
            time.sleep(0.02)
    print("done", flush=True)
""")


def _child(path: Path, chunks: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(chunks)],
                            stdout=subprocess.PIPE, text=True)


def test_sigkill_mid_write_leaves_the_old_file_and_the_next_write_cleans_up(tmp_path):
    path = tmp_path / "big.bin"
    old = b"the old, complete artifact\n" * 1000
    path.write_bytes(old)
    proc = _child(path, 200)  # 200 MiB over about 4 s: killed after 3 MiB
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == old  # not a byte of the new file under the final name
    leftovers = [p for p in tmp_path.iterdir() if p != path]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".big.bin.tmp-")
    assert leftovers[0].stat().st_size >= 3 << 20  # it was killed mid-write indeed

    proc = _child(path, 4)  # the same write, not killed: the new file, complete
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split() == ["writing", "done"]
    new = path.read_bytes()
    assert len(new) == 4 << 20 and new[-1:] == b"D"
    assert list(tmp_path.iterdir()) == [path]  # the killed writer's temp file is gone


# ----------------------------------------------------------------------------- each writer


def test_disco_payloads_data_and_artifact(tmp_path, monkeypatch):
    from adaspec.lab.disco.dataset import DiscoData
    from adaspec.store.payloads import save_payload
    from tests.disco_helpers import artifact, stop_at_position

    def n(version: str) -> int:
        return 2 if version == "old" else 4

    for write in (
        lambda v: save_payload({"format": "x", "t": torch.arange(1000 * n(v))}, tmp_path / "p.pt"),
        lambda v: DiscoData([], {"version": v}).save(tmp_path / "data.pt"),
        lambda v: artifact(stop_at_position(n(v))).save(tmp_path / "disco.pt"),
    ):
        check_crash_keeps_old(tmp_path, monkeypatch, write)


def test_router_artifact(tmp_path, monkeypatch):
    from adaspec.route.artifact import load_artifact, save_artifact
    from tests.test_route_artifact import make_artifact

    def write(version: str) -> None:
        art = make_artifact()
        art.info = {"version": version}
        save_artifact(art, tmp_path / "router.pt")

    check_crash_keeps_old(tmp_path, monkeypatch, write)
    assert load_artifact(tmp_path / "router.pt").info == {"version": "new"}


def test_cost_profile_and_its_cache(tmp_path, monkeypatch):
    from adaspec.cost.cache import profile_path
    from adaspec.cost.profile import CostProfile

    key = {"cpu": "x", "threads": 1, "target": {"kind": "torch", "name": "t",
                                                 "bytes_per_forward": 1}, "draft": None}

    def write(version: str) -> None:
        ms = 30 if version == "old" else 40
        profile = CostProfile.from_formula(f"linear:target_ms={ms},per_token_ms=2,draft_ms=5")
        profile.save(tmp_path / "p.json")
        profile.key = key
        profile.save(profile_path(key))  # what cost.cache.profile_for stores

    check_crash_keeps_old(tmp_path, monkeypatch, write)


def test_token_set(tmp_path, monkeypatch):
    from adaspec.store.token_set import TokenSet, save_token_set

    def write(version: str) -> None:
        ids = tuple(range(10)) if version == "old" else tuple(range(5, 15))
        save_token_set(TokenSet("tiny-draft", ids, {"version": version}))

    check_crash_keeps_old(tmp_path, monkeypatch, write)


def test_hash_record(tmp_path, monkeypatch):
    from adaspec.store.assembly import recalled_sha256, remember_sha256

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF...")

    # remember_sha256 swallows OSError (a read-only cache only costs a re-hash): the crash
    # is observed through the record instead
    remember_sha256(gguf, "a" * 64)
    before = snapshot(tmp_path)
    with crash_on_rename(monkeypatch) as seen:
        remember_sha256(gguf, "b" * 64)
    assert seen.crashed and snapshot(tmp_path) == before and recalled_sha256(gguf) == "a" * 64
    remember_sha256(gguf, "b" * 64)
    assert recalled_sha256(gguf) == "b" * 64 and snapshot(tmp_path).keys() == before.keys()


def test_gguf_assembly(tmp_path, monkeypatch, home):
    from adaspec.store import model_store as store
    from tests.test_store import make_fake_model

    spec, whole = make_fake_model(tmp_path, monkeypatch)
    with crash_on_rename(monkeypatch) as seen, pytest.raises(OSError, match=INJECTED):
        store.assemble(spec.name, progress=False)
    assert seen.crashed and not store.gguf_path(spec.name).exists()
    assert [p for p in (home / "gguf").rglob("*")] == []  # no temp file either
    assert store.assemble(spec.name, progress=False).read_bytes() == whole
    assert sorted(p.name for p in (home / "gguf").iterdir()) == [".hashes", f"{spec.name}.gguf"]
    assert not [p for p in home.rglob("*") if ".tmp-" in p.name]


def test_safetensors_cache_directory(tmp_path, monkeypatch):
    from adaspec.store.loading import cache_dir_for, verify_cache_dir, write_cache

    cache = cache_dir_for("tiny", "float32")

    def write(version: str) -> None:
        model = tiny_model(seed=0 if version == "old" else 1)
        write_cache(model, None, cache, dtype="float32",
                    marker={"name": "tiny", "source": "x.gguf", "source_sha256": version})

    check_crash_keeps_old(tmp_path, monkeypatch, write)
    assert verify_cache_dir(cache)["source_sha256"] == "new"


def test_quantized_cache_directory(tmp_path, monkeypatch):
    from adaspec.store import quant_cache

    cache = quant_cache.quant_cache_dir("tiny", "int8")

    def write(version: str) -> None:
        flat = {"w": torch.full((256,), 1 if version == "old" else 2, dtype=torch.int8)}
        quant_cache._write(cache, flat, {"format": quant_cache.QUANT_FORMAT, "v": version})

    check_crash_keeps_old(tmp_path, monkeypatch, write)
    assert quant_cache.verify_quant_cache(cache)["v"] == "new"


def test_bench_run_file_summaries_and_plots(tmp_path, monkeypatch, target, draft, tokenizer):
    from adaspec.lab.bench.plots import write_plots
    from tests.test_bench_runner import PROMPTS, make_runner

    runner = make_runner(tmp_path, target, draft, tokenizer, ["ngram:k=4"], max_new_tokens=4)
    summary = runner.run(PROMPTS[:2])
    rows = list(runner.rows)

    def run_file(version: str) -> None:
        runner.config.warmup_tokens = 8 if version == "old" else 9
        (tmp_path / "out" / "results.jsonl").unlink(missing_ok=True)
        runner._prepare_out()

    def plots(version: str) -> None:
        scale = 1 if version == "old" else 2
        write_plots({**summary, "methods": {m: {**s, "speedup": (s.get("speedup") or 1) * scale}
                                            for m, s in summary["methods"].items()}},
                    rows, tmp_path / "out")

    def summaries(version: str) -> None:  # summary.json and summary.md
        runner.save_summary({**summary, "config": {**summary["config"], "target": version}})

    for write in (run_file, summaries, plots):
        check_crash_keeps_old(tmp_path, monkeypatch, write)


def test_bench_replay(tmp_path, monkeypatch):
    from adaspec.cost.profile import CostProfile
    from adaspec.lab.bench import replay

    monkeypatch.setattr(replay, "replay",
                        lambda results, profile, name, head_ms=None: {"v": profile.notes})
    monkeypatch.setattr(replay, "to_markdown", lambda report: f"# {report['v']}\n")
    (tmp_path / "run").mkdir()
    profile = CostProfile.from_formula("flat")

    def write(version: str) -> None:
        profile.notes = version
        replay.write_replay(tmp_path / "run", profile, "p")

    check_crash_keeps_old(tmp_path, monkeypatch, write)


def test_router_collect_meta(tmp_path, monkeypatch):
    from tests.route_helpers import TRAIN, make_collection

    folder = tmp_path / "data"
    folder.mkdir()
    old = b'{"old": "collect.json"}\n'
    (folder / "collect.json").write_bytes(old)
    with crash_on_rename(monkeypatch) as seen, pytest.raises(OSError, match=INJECTED):
        make_collection(folder, TRAIN[:1], overwrite=True)
    assert seen.crashed and sorted(p.name for p in folder.iterdir()) == ["collect.json"]
    assert (folder / "collect.json").read_bytes() == old


def test_router_report_and_cv_table(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from adaspec.cli import router as cli_router
    from adaspec.lab.router import evaluate, router_report

    state = {"v": "old"}
    monkeypatch.setattr(router_report, "build_report", lambda *a, **k: {"v": state["v"]})
    monkeypatch.setattr(router_report, "write_plots", lambda rep, folder: [])
    monkeypatch.setattr(router_report, "to_markdown", lambda rep: f"# {rep['v']}\n")
    for name, value in (("train_config", lambda args: Namespace(epochs=1)),
                        ("_alphas", lambda text: [0.0]), ("_cost", lambda args: (None, None)),
                        ("_training_data", lambda args, profile: [1, 2]),
                        ("_print_cv", lambda *a: None)):
        monkeypatch.setattr(cli_router, name, value)
    monkeypatch.setattr(evaluate, "cross_validate", lambda *a: [{"v": state["v"]}])

    def report(version: str) -> None:
        state["v"] = version
        router_report.write_report("t", "b", "f", str(tmp_path / "rep"), None, "measured",
                                   None, [0.0], 1)

    def cv_table(version: str) -> None:
        state["v"] = version
        cli_router.run_cv(Namespace(alphas="0", cost="measured", folds=2,
                                    out=str(tmp_path / "cv.json")))

    def plot(version: str) -> None:
        fig, ax = plt.subplots()
        ax.plot([0, 1], [0, 1 if version == "old" else 2])
        router_report._save(fig, tmp_path / "rep" / "plot.png")

    for write in (report, cv_table, plot):
        check_crash_keeps_old(tmp_path, monkeypatch, write)


def test_profile_curves_png(tmp_path, monkeypatch):
    from adaspec.cli.profile import plot_profiles
    from adaspec.cost.profile import CostProfile

    def write(version: str) -> None:
        ms = 30 if version == "old" else 60
        profile = CostProfile.from_formula(f"linear:target_ms={ms},per_token_ms=2,draft_ms=5")
        plot_profiles([profile], tmp_path / "curves.png")

    check_crash_keeps_old(tmp_path, monkeypatch, write)


# ----------------------------------------------------------------------------- no direct writes

_PATH_WRITES = {"write_text", "write_bytes", "savefig"}  # methods: path.write_text(...)
_MODULE_WRITES = {"torch.save", "json.dump", "save_file", "np.save"}
_ATOMIC = {"atomic_open", "atomic_path", "atomic_dir"}


def _is_write(node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in _PATH_WRITES:
        return True
    if ast.unparse(func) in _MODULE_WRITES:
        return True
    if ast.unparse(func) == "open" or isinstance(func, ast.Attribute) and func.attr == "open":
        modes = [a.value for a in [*node.args, *(k.value for k in node.keywords)]
                 if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        return any(set(m) & set("wx") for m in modes)
    return False


def _direct_writes(path: Path) -> list[str]:
    """Calls that write a file by name, except inside a `with atomic_*(...) as NAME` block
    when they write through NAME (the file object, the temp path or a path in the temp
    folder). Appends (mode "a", the row files) are not writes by name here."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    through_helper: set[int] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.With):
            continue
        bound = {item.optional_vars.id for item in node.items
                 if isinstance(item.context_expr, ast.Call)
                 and ast.unparse(item.context_expr.func).split(".")[-1] in _ATOMIC
                 and isinstance(item.optional_vars, ast.Name)}
        for stmt in node.body:  # `weights = tmp / NAME` inside the block: through it too
            for assign in ast.walk(stmt):
                if isinstance(assign, ast.Assign) and bound & {
                        n.id for n in ast.walk(assign.value) if isinstance(n, ast.Name)}:
                    bound |= {t.id for t in assign.targets if isinstance(t, ast.Name)}
        for stmt in node.body:
            for call in ast.walk(stmt):
                if isinstance(call, ast.Call) and bound & {
                        n.id for n in ast.walk(call) if isinstance(n, ast.Name)}:
                    through_helper.add(id(call))
    return [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and _is_write(node) and id(node) not in through_helper]


def test_no_writer_writes_straight_to_its_final_path():
    """Every file write in the package goes through adaspec.store.atomic (appends to a
    row file are the one exception, and they are not caught here: mode "a")."""
    package = Path(adaspec.__file__).parent
    offenders = {}
    for path in sorted(package.rglob("*.py")):
        if path.name == "atomic.py" and path.parent.name == "store":
            continue
        found = _direct_writes(path)
        if found:
            offenders[str(path.relative_to(package))] = found
    assert offenders == {}


def test_the_direct_write_check_sees_one(tmp_path):
    """Negative control: the check does flag the writes this change removed."""
    src = tmp_path / "m.py"
    src.write_text(textwrap.dedent("""
        import json, torch
        def a(path, text, blob, fig):
            path.write_text(text)
            torch.save(blob, path)
            fig.savefig(path, dpi=1)
            save_file(blob, str(path))
            with open(path, "w") as f:
                json.dump(blob, f)
        def b(path, blob):
            with atomic_open(path, "wb") as f:
                torch.save(blob, f)
    """))
    assert len(_direct_writes(src)) == 6


# ----------------------------------------------------------------------------- appended rows


def test_bench_resume_drops_a_torn_last_row_with_a_warning(tmp_path, target, draft,
                                                           tokenizer):
    from adaspec.lab.bench.runner import read_rows
    from tests.test_bench_runner import PROMPTS, make_runner

    methods = ["ngram:k=4"]
    make_runner(tmp_path, target, draft, tokenizer, methods, max_new_tokens=4).run(PROMPTS[:2])
    results = tmp_path / "out" / "results.jsonl"
    first, _ = read_rows(results)
    whole = results.read_bytes()
    results.write_bytes(whole + whole.splitlines(keepends=True)[0][:40])  # killed mid-row
    logs: list[str] = []
    runner = make_runner(tmp_path, target, draft, tokenizer, methods, max_new_tokens=4,
                         resume=True)
    runner._log = logs.append
    runner.run(PROMPTS)
    assert any("dropped 1 incomplete line" in m for m in logs)
    rows, broken = read_rows(results)
    assert broken == 0 and rows[: len(first)] == first
    assert len(rows) == len(PROMPTS) * 2
    assert results.read_bytes().startswith(whole)


def test_bench_resume_keeps_a_whole_last_row_missing_its_newline(tmp_path, target, draft,
                                                                 tokenizer):
    """A kill between a row and its newline: the row is kept, and the next row appended
    after it starts a line of its own (not glued onto it, which would lose both)."""
    from adaspec.lab.bench.runner import read_rows
    from tests.test_bench_runner import PROMPTS, make_runner

    methods = ["ngram:k=4"]
    make_runner(tmp_path, target, draft, tokenizer, methods, max_new_tokens=4).run(PROMPTS[:2])
    results = tmp_path / "out" / "results.jsonl"
    first, _ = read_rows(results)
    results.write_bytes(results.read_bytes().rstrip(b"\n"))
    make_runner(tmp_path, target, draft, tokenizer, methods, max_new_tokens=4,
                resume=True).run(PROMPTS)
    rows, broken = read_rows(results)
    assert broken == 0 and rows[: len(first)] == first and len(rows) == len(PROMPTS) * 2
    keys = [(r["prompt_id"], r["method"]) for r in rows]
    assert len(set(keys)) == len(keys)


def test_router_states_resume_after_a_torn_row(tmp_path, capsys):
    from adaspec.lab.router.collection import STATES, read_states
    from tests.route_helpers import TRAIN, make_collection

    folder = tmp_path / "data"
    make_collection(folder, TRAIN[:1])
    states = folder / STATES
    states.write_bytes(states.read_bytes().rstrip(b"\n"))  # whole row, newline lost
    make_collection(folder, TRAIN[:2])
    with states.open("a") as f:
        f.write('{"prompt_id": "train/2", "sta')  # a row cut off by a kill
    capsys.readouterr()
    make_collection(folder, TRAIN[:3])
    assert f"dropped 1 incomplete line from {states}" in capsys.readouterr().err
    lines = states.read_text().splitlines()
    assert [json.loads(line)["prompt_id"] for line in lines] == ["train/0", "train/1", "train/2"]
    assert len(read_states(folder)) == 3


def test_trim_torn_tail(tmp_path):
    path = tmp_path / "r.jsonl"
    assert atomic.trim_torn_tail(path) == 0  # no file yet
    path.write_text('{"a": 1}\n{"b": 2}\n')
    assert atomic.trim_torn_tail(path) == 0 and path.read_text() == '{"a": 1}\n{"b": 2}\n'
    path.write_text('{"a": 1}\n{"b": 2')
    assert atomic.trim_torn_tail(path) == 1 and path.read_text() == '{"a": 1}\n'
    path.write_text('{"a": 1}\n{"b": 2}')
    assert atomic.trim_torn_tail(path) == 0 and path.read_text() == '{"a": 1}\n{"b": 2}\n'
    path.write_text('{"cut')
    assert atomic.trim_torn_tail(path) == 1 and path.read_text() == ""


# ----------------------------------------------------------------------------- cache checksum


def _flip_a_byte(path: Path) -> None:
    """Same size and mtime: only a re-hash can see it."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_flipped_byte_in_a_gguf_cache_is_caught_by_the_rehash_and_the_fix_works(tmp_path):
    from adaspec.cli import main
    from adaspec.store import model_store as store
    from adaspec.store.loading import WEIGHTS, verify_cache_dir
    from tests.test_store import bpe_tokenizer, write_gguf

    tok = bpe_tokenizer()
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, tiny_model(len(tok), seed=2), tok)
    cache = store.load_model(str(gguf), "float32").cache_dir
    assert cache is not None
    verify_cache_dir(cache)
    _flip_a_byte(cache / WEIGHTS)
    verify_cache_dir(cache, rehash=False)  # sizes alone cannot see it
    with pytest.raises(ModelStoreError, match="checksum mismatch") as err:
        verify_cache_dir(cache)
    fix = f"adaspec models prepare {gguf.resolve()} --dtype float32 --force"
    assert fix in str(err.value)
    assert main(fix.split()[1:]) == 0  # the command it names repairs the cache
    verify_cache_dir(cache)


def test_models_verify_names_the_fix_for_a_flipped_byte(tmp_path, monkeypatch, capsys):
    from adaspec.cli import main
    from adaspec.store import catalog
    from adaspec.store.catalog import ModelSpec, PartRef
    from adaspec.store.loading import WEIGHTS, cache_dir_for, write_cache

    spec = ModelSpec("tiny-verify", "draft", "tiny", (PartRef("no_such_pkg", "x", "a.bin"),),
                     10, "ab" * 32, "1.0")
    monkeypatch.setitem(catalog.CATALOG, spec.name, spec)
    cache = cache_dir_for(spec.name, "float32")
    write_cache(tiny_model(seed=3), None, cache, dtype="float32",
                marker={"name": spec.name, "source": "x.gguf", "source_sha256": spec.sha256})
    assert main(["models", "verify", spec.name]) == 0
    _flip_a_byte(cache / WEIGHTS)
    capsys.readouterr()
    assert main(["models", "verify", spec.name]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "checksum mismatch" in out
    assert f"`adaspec models prepare {spec.name} --dtype float32 --force`" in out
