"""`adaspec disco bench`: DISCO and the issue's baselines on the test split, in ONE bench run
(the same process, prompts and loaded models, methods alternating prompt by prompt), then
the DISCO report (`lab.disco.disco_report`) beside the bench's own summary.

Arms: plain decoding; per tuned artifact, the best static k, the confidence rule and DISCO
(all three tuned on that artifact's validation split) and optionally DISCO's cost rule
(`stop=cost`, priced by a cost profile); the heuristic schedule; the oracle; optionally
static k = 1..8. An artifact trained on one suite and run on the other suite's
prompts is the transfer measurement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from adaspec.control.disco_artifact import DiscoArtifact
from adaspec.errors import InputError
from adaspec.lab.bench.suites import Prompt, load_suite
from adaspec.lab.disco.dataset import DiscoData, Sample
from adaspec.lab.disco.disco_report import Arm
from adaspec.lab.disco.simulate import ORACLE_CAP
from adaspec.store.atomic import write_json, write_text

HEURISTIC = "draft:ctrl=heuristic,k=4"  # the project's default schedule
ORACLE = f"draft:ctrl=oracle,k_max={ORACLE_CAP}"  # capped like every tuned length
STATIC_SWEEP = tuple(range(1, 9))


def artifact_label(art: DiscoArtifact) -> str:
    return "+".join(art.provenance.get("train_suites") or ["?"])


def cost_rule_method(path: str, profile: str | None = None) -> str:
    """DISCO with its cost rule: the artifact's classifier, the cap and guess tuned for the
    rule, steps priced by `profile` (None: this machine's)."""
    return f"draft:ctrl=disco,disco={path},stop=cost" + (f",profile={profile}" if profile else "")


def arms_for(
    artifacts: Sequence[tuple[str, DiscoArtifact]],
    static_sweep: bool = False,
    stop_cost: bool = False,
    profile: str | None = None,
) -> list[Arm]:
    arms = [Arm("plain", "ar", "ar")]
    for path, art in artifacts:
        if not art.tuning.get("best"):
            raise InputError(f"{path} is not tuned yet: run `adaspec disco tune` on it first")
        a = artifact_label(art)
        best = art.tuning["best"]
        k = int(best["static"]["sl_max"])
        conf = best["confidence"]
        arms += [
            Arm(f"static k={k} [{a}]", f"draft:k={k}", "static", a),
            Arm(
                f"confidence [{a}]",
                f"draft:ctrl=confidence,threshold={conf['threshold']},k={conf['sl_max']}",
                "confidence",
                a,
            ),
            Arm(f"DISCO [{a}]", f"draft:ctrl=disco,disco={path}", "disco", a),
        ]
        if stop_cost:
            arms.append(Arm(f"DISCO cost [{a}]", cost_rule_method(path, profile), "disco-cost", a))
    arms += [Arm("heuristic", HEURISTIC, "heuristic"), Arm("oracle", ORACLE, "oracle")]
    if static_sweep:
        arms += [Arm(f"k={k}", f"draft:k={k}", "sweep") for k in STATIC_SWEEP]
    return arms


def parse_limits(text: str | None) -> tuple[int | None, dict[str, int]]:
    """`--limit`: test prompts per category, "N", "CATEGORY:N,..." or both ("2,rag:1"):
    the default count and the per-category ones."""
    default: int | None = None
    per_cat: dict[str, int] = {}
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        cat, _, count = part.rpartition(":")
        try:
            n = int(count)
        except ValueError:
            n = -1
        if n < 1:
            raise InputError(f"--limit wants N or CATEGORY:N with N >= 1, got {part!r}")
        if cat:
            per_cat[cat] = n
        else:
            default = n
    return default, per_cat


def bench_prompts(
    samples: Sequence[Sample], questions: str | None = None, limit: str | None = None
) -> list[Prompt]:
    """The bench prompts of the test samples (with every turn), as many per category as
    `limit` allows (see parse_limits)."""
    default, per_cat_limit = parse_limits(limit)
    by_suite: dict[str, dict[str, Prompt]] = {}
    out: list[Prompt] = []
    per_cat: dict[str, int] = {}
    for s in samples:
        if s.suite not in by_suite:
            path = questions if s.suite == "spec-bench" else None
            by_suite[s.suite] = {p.id: p for p in load_suite(s.suite, None, path)}
        prompt = by_suite[s.suite].get(s.prompt_id)
        if prompt is None:
            raise InputError(f"prompt {s.prompt_id} of the data is not in suite {s.suite}")
        cap = per_cat_limit.get(s.category, default)
        if cap is not None and per_cat.get(s.category, 0) >= cap:
            continue
        per_cat[s.category] = per_cat.get(s.category, 0) + 1
        out.append(prompt)
    return out


def check_test_data(
    data: DiscoData, samples: Sequence[Sample], artifacts: Sequence[tuple[str, DiscoArtifact]]
) -> None:
    """Test data collected for another pair, or a test prompt an artifact was trained or
    tuned on (it would flatter it): refuse."""
    pair = (artifacts[0][1].target, artifacts[0][1].draft)
    made_for = (data.provenance.get("target"), data.provenance.get("draft"))
    if made_for != pair:
        raise InputError(
            f"the test data was collected with target/draft {made_for}, the artifacts were "
            f"trained for {pair}"
        )
    for path, art in artifacts:
        seen = set(art.provenance.get("train_prompts", [])) | set(
            art.provenance.get("val_prompts", [])
        )
        leaked = sorted({s.prompt_id for s in samples if s.prompt_id in seen})
        if leaked:
            raise InputError(
                f"{path} was trained or tuned on {len(leaked)} of the test prompts "
                f"({', '.join(leaked[:5])}): bench it on prompts it has not seen"
            )


def load_artifacts(paths: Sequence[str]) -> list[tuple[str, DiscoArtifact]]:
    arts = [(p, DiscoArtifact.load(p)) for p in paths]
    if not arts:
        raise InputError("--artifacts needs at least one tuned artifact")
    pairs = {(a.target, a.draft, a.weights) for _, a in arts}
    if len(pairs) > 1:
        raise InputError(f"the artifacts were trained for different model pairs: {pairs}")
    return arts


def run_disco_bench(args, log: Callable[[str], None]) -> int:
    """The `adaspec disco bench` command (args from cli.disco)."""
    from adaspec.backends.load import load_backends
    from adaspec.lab.bench.machine import describe_machine
    from adaspec.lab.bench.runner import BenchConfig, BenchRunner, check_out
    from adaspec.lab.disco.disco_report import disco_report, to_markdown  # noqa: I001

    if args.resume and args.overwrite:
        raise InputError("--resume and --overwrite exclude each other")
    if args.max_new_tokens < 2:
        raise InputError("--max-new-tokens must be >= 2")
    data = DiscoData.load(args.data)
    arts = load_artifacts([p.strip() for p in args.artifacts.split(",") if p.strip()])
    if args.profile and not args.stop_cost:
        raise InputError("--profile prices the cost rule's arms: add --stop-cost")
    arms = arms_for(arts, args.static_sweep, args.stop_cost, args.profile)
    samples = data.split("test")
    check_test_data(data, samples, arts)
    prompts = bench_prompts(samples, args.questions, args.limit)
    if not prompts:
        raise InputError(f"no test prompts in {args.data}")
    methods = list(dict.fromkeys(a.method for a in arms))
    target_name, draft_name = arts[0][1].target, arts[0][1].draft
    out = Path(args.out)
    weights, draft_weights = arts[0][1].weights
    config = BenchConfig(
        methods=methods,
        suites=data.suites,
        max_new_tokens=args.max_new_tokens,
        out=str(out / "bench"),
        resume=args.resume,
        overwrite=args.overwrite,
        target=target_name,
        draft=draft_name,
        dtype=args.dtype,
        weights=weights,
        draft_weights=draft_weights,
    )
    check_out(config)
    log(f"disco bench: {len(prompts)} test prompts x {len(methods)} methods -> {out}")
    target, tokenizer, draft, eos = load_backends(
        args.target or target_name, args.draft or draft_name, args.dtype, weights, draft_weights
    )
    assert draft is not None  # a draft model was named (by the artifact or --draft)
    arts[0][1].check_pair(target.name, draft.name)  # every artifact names the same pair
    runner = BenchRunner(
        config, target, tokenizer, draft, eos_token_ids=eos, progress=not args.no_progress
    )
    summary = runner.run(prompts, machine={"machine": describe_machine()})
    used = {p.id for p in prompts}
    report = disco_report(
        summary,
        [r for r in runner.rows if r["prompt_id"] in used],
        arms,
        arts,
        [s for s in samples if s.prompt_id in used],
        data,
    )
    report["arms"] = [asdict(a) for a in arms]
    write_json(out / "summary.json", report)
    write_text(out / "summary.md", to_markdown(report))
    print(to_markdown(report))
    if summary["exactness"]["bugs"]:
        log("disco bench: EXACTNESS FAILURE (see bench/summary.md)")
        return 1
    log(f"disco bench: results in {out}")
    return 0
