"""`adaspec profile`: measure what speculation costs on this machine; `profile show` prints
profiles as tables and draws their cost curves."""

from __future__ import annotations

import argparse
from pathlib import Path

from adaspec.cli.model_options import add_model_options

SHOWN_SIZES = (1, 2, 3, 4, 5, 8, 12, 16)


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measure (or show) this machine's cost profile: forward time per n tokens",
        description="Measure the target's forward time for n = 1..16 tokens at two context "
        "lengths, the draft's step, prefill throughput and the loop's overhead; cached under "
        "$ADASPEC_HOME/profiles and reused by every cost-aware decision. `show` prints them.",
    )
    psub = p.add_subparsers(dest="profile_command")
    add_model_options(p, device=True)
    p.add_argument("--no-draft", action="store_true", help="profile the target alone")
    p.add_argument("--force", action="store_true", help="measure again even if cached")
    p.add_argument("--out", default=None, help="also write the profile to this JSON file")
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="also measure the batch cost (one call carrying the tokens of up to "
                        "N sequences, what a server decoding N requests together prices its "
                        "drafts by; measured by `adaspec serve` on first use otherwise), on a "
                        "runtime that decodes sequences together")
    p.set_defaults(func=run_profile)
    show = psub.add_parser("show", help="print profiles and draw their cost curves (PNG)")
    show.add_argument("files", nargs="*", help="profile JSON files (default: every cached one)")
    show.add_argument("--png", default=None,
                      help="where to draw the curves (default: beside each profile)")
    show.set_defaults(func=run_show)


def run_profile(args: argparse.Namespace) -> int:
    from adaspec.backends.load import load_backends
    from adaspec.cost.cache import profile_for, profile_key, profile_path
    from adaspec.engine.overhead import loop_overhead_ms

    target, tokenizer, draft, _ = load_backends(
        args.target, None if args.no_draft else args.draft, args.dtype, args.weights,
        args.draft_weights, device=args.device,
    )
    profile = profile_for(target, draft, tokenizer, remeasure=args.force, quiet=True,
                          loop_overhead=loop_overhead_ms)
    path = profile_path(profile_key(target, draft))
    print(format_profile(profile, path))
    if args.out:
        profile.save(args.out)
        print(f"written: {args.out}")
    png = path.with_suffix(".png")
    plot_profiles([profile], png)
    print(f"cost curves: {png}")
    if args.batch:
        print(format_batch_cost(target, args.batch, args.force))
    return 0


def format_batch_cost(target, sequences: int, remeasure: bool) -> str:
    """Measure (or read) the batch cost of `sequences` sequences; its table."""
    from adaspec.backends.sequences import sequences as views_of
    from adaspec.cost.batch import PER_SEQUENCE, batch_cost_for
    from adaspec.errors import InputError

    if sequences < 2:
        raise InputError(f"--batch counts the sequences decoded together: at least 2, not "
                         f"{sequences}")
    cost = batch_cost_for(target, views_of(target, sequences), remeasure=remeasure)
    seqs = [int(s) for s in cost.curve.contexts]
    lines = [f"batch cost of {target.name} ({target.kind}): ms of one call, by sequences and "
             "tokens each", "", "| sequences | " + " | ".join(f"{t} each" for t in PER_SEQUENCE)
             + " |", "| ---: |" + " ---: |" * len(PER_SEQUENCE)]
    for s in seqs:
        lines.append(f"| {s} | " + " | ".join(f"{cost.ms(s * t, s):.2f}" for t in PER_SEQUENCE)
                     + " |")
    return "\n".join(lines)


def run_show(args: argparse.Namespace) -> int:
    from adaspec.cost.cache import profiles_dir
    from adaspec.cost.profile import load_profile
    from adaspec.errors import InputError

    paths = [Path(f) for f in args.files] or sorted(profiles_dir().glob("*.json"))
    if not paths:
        raise InputError(f"no cost profiles in {profiles_dir()}: run `adaspec profile` first")
    profiles = [load_profile(str(p)) for p in paths]
    for path, profile in zip(paths, profiles, strict=True):
        print(format_profile(profile, path))
        print()
    if args.png:
        plot_profiles(profiles, Path(args.png))
        print(f"cost curves: {args.png}")
    else:
        for path, profile in zip(paths, profiles, strict=True):
            plot_profiles([profile], path.with_suffix(".png"))
            print(f"cost curves: {path.with_suffix('.png')}")
    return 0


def format_profile(profile, path: Path | None = None) -> str:
    key = profile.key or {}
    lines = []
    if path is not None:
        lines.append(f"profile {path}")
    label = "SIMULATED " if profile.simulated else ""
    lines.append(f"{label}source: {profile.source}; {profile.notes}".rstrip("; "))
    if key:
        lines.append(f"cpu: {key.get('cpu')} | threads: {key.get('threads')}")
    roles = [("target", profile.target)]
    if profile.draft is not None:
        roles.append(("draft", profile.draft))
    for role, curve in roles:
        about = key.get(role) or {}
        who = f"{about.get('name', role)} ({about.get('kind', '?')})" if about else role
        lines.append(f"{role}: {who}")
        sizes = [n for n in SHOWN_SIZES if n <= max(curve.sizes)]
        header = "| context | " + " | ".join(f"n={n}" for n in sizes) + " |"
        lines.append(header)
        lines.append("| ---: | " + " | ".join("---:" for _ in sizes) + " |")
        for c in curve.contexts:
            cells = " | ".join(f"{curve(n, c):.1f}" for n in sizes)
            lines.append(f"| {c} | {cells} |")
        floor = profile.floor_ms(role)
        if floor is not None:
            lines.append(f"physical floor for n=1 ({about.get('bytes_per_forward', 0) / 1e9:.2f}"
                         f" GB of weights / {profile.bandwidth_gbs:.1f} GB/s): {floor:.1f} ms")
    lines.append(f"prefill: target {profile.prefill_tokens_per_s:.0f} tokens/s"
                 + (f", draft {profile.draft_prefill_tokens_per_s:.0f} tokens/s"
                    if profile.draft is not None else ""))
    lines.append(f"loop overhead per step: {profile.overhead_ms:.2f} ms")
    one = profile.target_ms(1)
    lines.append("verification in single-token passes: "
                 + ", ".join(f"n={n}: {profile.target_ms(n) / one:.2f}" for n in (2, 4, 8, 16)))
    return "\n".join(lines)


def _short_label(profile) -> str:
    """`ik_llama+child` -> `ik_llama`, the runtime that tells profiles apart on one plot."""
    about = (profile.key or {}).get("target") or {}
    kind = str(about.get("kind", "")).replace("+child", "")
    return kind or profile.source


def plot_profiles(profiles: list, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for profile in profiles:
        name = _short_label(profile) if len(profiles) > 1 else ""
        sim = " (simulated)" if profile.simulated else ""
        for role, curve in (("target", profile.target), ("draft", profile.draft)):
            if curve is None:
                continue
            for c in curve.contexts:
                ns = list(range(1, max(curve.sizes) + 1))
                ax.plot(ns, [curve(n, c) for n in ns], marker="o" if role == "target" else "x",
                        label=f"{name} {role}, context {c}{sim}".strip())
        floor = profile.floor_ms("target")
        if floor is not None:
            ax.axhline(floor, linestyle=":", color="grey", label=f"{name} target floor (n=1)")
    ax.set_xlabel("tokens per forward (n)")
    ax.set_ylabel("ms per forward")
    ax.set_title("forward cost per number of tokens" + (" (SIMULATED)" if any(
        p.simulated for p in profiles) else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    from adaspec.store.atomic import atomic_open

    with atomic_open(png, "wb") as f:  # a killed run leaves the old plot or the new one
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
