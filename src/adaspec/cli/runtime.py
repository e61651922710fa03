"""`adaspec runtime build|show`: ik_llama.cpp compiled for this CPU (`backends/ik/build.py`)."""

from __future__ import annotations

import argparse
import sys


def add_runtime_parser(sub) -> None:
    runtime = sub.add_parser(
        "runtime", help="build ik_llama.cpp for this CPU, or show which library is used",
        description="The default CPU runtime, ik_llama.cpp, ships as a prebuilt AVX2 wheel; "
                    "`build` compiles the same pinned source for this CPU (AVX-512 and the "
                    "like; about 10 minutes on 2 cores, once per CPU kind) and adaspec uses it "
                    "from then on (ADASPEC_IK_BUILD=wheel keeps the wheel's).")
    rsub = runtime.add_subparsers(dest="runtime_command", required=True)
    build = rsub.add_parser("build", help="compile ik_llama.cpp for this CPU")
    build.add_argument("--force", action="store_true", help="build again even if built")
    build.add_argument("--jobs", "-j", type=int, default=None,
                       help="parallel compile jobs (default: the cores this process may use)")
    build.add_argument("--if-possible", action="store_true",
                       help="when the build cannot run or fails, say why and exit 0 (the "
                            "prebuilt wheel stays in use); `make setup` uses this")
    build.set_defaults(func=cmd_build)
    show = rsub.add_parser("show", help="which ik_llama.cpp library adaspec loads here")
    show.set_defaults(func=cmd_show)


def cmd_build(args: argparse.Namespace) -> int:
    from adaspec.backends.ik.backend import IK_VERSION
    from adaspec.backends.ik.build import IkBuildError, build_info, build_native
    from adaspec.backends.weights import llama_threads

    try:
        lib = build_native(IK_VERSION, force=args.force, jobs=args.jobs or llama_threads())
    except IkBuildError as exc:
        if not args.if_possible:
            raise
        print(f"adaspec: {exc}; the prebuilt ik_llama.cpp wheel stays in use",
              file=sys.stderr)
        return 0
    info = build_info(IK_VERSION) or {}
    print(f"ik_llama.cpp for this CPU: {lib.parent} (from ik-llama-cpp-python {IK_VERSION}, "
          f"commit {str(info.get('commit'))[:12]}; built in "
          f"{info.get('build_seconds', 0) / 60:.1f} min)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from adaspec.backends.ik import backend as ikllama
    from adaspec.backends.ik.build import build_info, current, native_library, runtime_dir

    native = native_library(ikllama.IK_VERSION)
    info = build_info(ikllama.IK_VERSION)
    if native is not None:
        patches = ", ".join((info or {}).get("patches") or []) or "none"
        print(f"native build for this CPU: {native.parent} (built "
              f"{info.get('built_at') if info else '?'}; source patches: {patches})")
        if not current(info):
            print("  made without this adaspec's source patches: `adaspec runtime build` "
                  "builds it again (lone tokens then score like blocks, see docs/exactness.md)")
    elif info is not None:
        print(f"native build at {runtime_dir(ikllama.IK_VERSION)} is for another CPU "
              f"({info.get('cpu_signature', {}).get('cpu')}); `adaspec runtime build` "
              "builds one for this CPU")
    else:
        print("no native build (`adaspec runtime build` makes one)")
    api = ikllama.library()
    print(f"loaded: {getattr(api, 'adaspec_build', 'wheel')} ({api.adaspec_library})")
    wide = getattr(api, "adaspec_wide", None)
    if wide is not None:
        print(f"512-bit k-quant walk: {'on' if wide else 'off'} (ADASPEC_IK_WIDE=on/off "
              "overrides; on where it was measured to pay, Intel's AVX-512)")
    return 0
