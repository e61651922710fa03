"""A fake tool chain for the native-build tests (`store/native_build.py` and its users)."""

from __future__ import annotations

from pathlib import Path

from adaspec.store import native_build


def install_fake_tools(tmp_path: Path, monkeypatch, cmake: str, build_tool: str) -> Path:
    """cmake (the given shell script), cc, c++ and `build_tool` (make or ninja) in a folder
    that is all of PATH but the system's, found beside Python too; ADASPEC_HOME under
    tmp_path. Returns the folder."""
    bin_dir = tmp_path / "tools"
    bin_dir.mkdir()
    for name, text in {"cmake": cmake, "cc": "#!/bin/sh\n", "c++": "#!/bin/sh\n",
                       build_tool: "#!/bin/sh\n"}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(native_build, "_venv_tool", lambda name: str(bin_dir / name)
                        if (bin_dir / name).exists() else None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))
    return bin_dir
