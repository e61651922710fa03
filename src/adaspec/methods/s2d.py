"""`s2d`: a sorted draft with early exits proposes tokens, each from the first sub-model
confident enough (docs/s2d.md). The artifact comes from `adaspec s2d train`; `adaspec s2d
tune` stores thresholds per target in it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from adaspec.errors import InputError
from adaspec.methods.base import Method, Models
from adaspec.methods.params import ChainParams, check, param

DEFAULT_THRESHOLD = 0.8  # when the artifact has none tuned for this target
DEFAULT_K = 4
DTYPES = ("bfloat16", "float32", "int8", "int4")  # int8/int4: weight-only, over bf16


@dataclass(frozen=True)
class S2DParams(ChainParams):
    k: int = param(0, "tokens to draft per step (0: the k `adaspec s2d tune` stored for "
                      f"this target, else {DEFAULT_K})")
    artifact: str = param("", "the sorted draft: a folder or a name under $ADASPEC_HOME/s2d "
                              "(s2d:NAME is short)")
    thresholds: str = param(
        "",
        "top-probability threshold of each exit but the last, e.g. 0.6/0.8 (default: the "
        f"ones `adaspec s2d tune` stored for this target, else {DEFAULT_THRESHOLD} each)",
    )
    exit: int = param(0, "draft with this one exit only (its layer count; 0: every exit, "
                         "early-exit by thresholds)")
    dtype: str = param("", "weights of the sorted draft: bfloat16 | float32 | int8 | int4 "
                           "(weight-only quantized Linear layers); default: the ones `adaspec s2d "
                           "tune` priced for this target, else bfloat16")

    def __post_init__(self) -> None:
        check(self.k >= 0, "k must be >= 1, or 0 for the tuned k")
        self.check_ctrl_and_verify()
        check(bool(self.artifact),
              "give the sorted draft, e.g. s2d:NAME; `adaspec s2d data` then `adaspec s2d train "
              "--name NAME` build one (about 12 + 14 min on a 2-vCPU EPYC; docs/s2d.md)")
        check(self.ctrl in ("static", "heuristic"),
              "s2d takes ctrl=static or ctrl=heuristic (its exits already adapt per token)")
        check(self.exit >= 0, "exit must be a layer count >= 1, or 0 for every exit")
        check(not self.dtype or self.dtype in DTYPES, f"dtype must be one of {DTYPES}")
        check(not (self.exit and self.thresholds), "exit=N uses one exit: no thresholds")
        _ = self.threshold_values  # parses: a bad list raises here

    def check_files(self) -> None:
        from adaspec.draft import s2d_artifact

        s2d_artifact.resolve(self.artifact)

    @property
    def threshold_values(self) -> tuple[float, ...] | None:
        if not self.thresholds:
            return None
        try:
            values = tuple(float(t) for t in self.thresholds.split("/"))
        except ValueError:
            raise InputError(f"thresholds must be numbers joined by '/', e.g. 0.6/0.8, got "
                             f"{self.thresholds!r}") from None
        check(all(0.0 <= t <= 1.0 for t in values), "thresholds must be in [0, 1]")
        return values


def choose_exits(exits: tuple[int, ...], exit: int, given: tuple[float, ...] | None,
                 stored: tuple[float, ...] | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The exits to draft with and their thresholds (all but the last exit's)."""
    if exit:
        if exit not in exits:
            raise InputError(f"exit={exit}: the sorted draft exits at {list(exits)} layers")
        return (exit,), ()
    thresholds = given or stored or (DEFAULT_THRESHOLD,) * (len(exits) - 1)
    if len(thresholds) != len(exits) - 1:
        raise InputError(f"the sorted draft exits at {list(exits)} layers: give "
                         f"{len(exits) - 1} thresholds (the last exit always answers), got "
                         f"{len(thresholds)}")
    return exits, thresholds


def _build(params: S2DParams, models: Models, text: str):
    from adaspec.control import CONTROLLERS
    from adaspec.draft import s2d_artifact
    from adaspec.draft.s2d import S2DDrafter
    from adaspec.engine.loop import Engine

    manifest = s2d_artifact.read_manifest(s2d_artifact.resolve(params.artifact))
    tuned = s2d_artifact.tuned_for(manifest, models.target.name)
    weights = params.dtype or str((tuned or {}).get("draft_weights", "bfloat16"))
    model, manifest = s2d_artifact.load_for_drafting(params.artifact, weights)
    model.to(models.target.device)  # drafts where the target verifies (a GPU's memory)
    if model.config.vocab_size != models.target.vocab_size:
        raise InputError(
            f"the sorted draft {params.artifact!r} has a {model.config.vocab_size}-token "
            f"vocabulary, the target {models.target.name!r} {models.target.vocab_size}: they "
            "must share the tokenizer"
        )
    stored = None if tuned is None else tuple(float(t) for t in tuned["thresholds"])
    exits, thresholds = choose_exits(model.config.exits, params.exit,
                                     params.threshold_values, stored)
    tuned = tuned or {}
    if params.exit:  # the k tuned for that exit alone
        tuned = (tuned.get("single_exit_predicted") or {}).get(f"exit {params.exit}", {})
    k = params.k or int(tuned.get("k", DEFAULT_K))
    return Engine(
        models.target,
        models.tokenizer,
        drafter=S2DDrafter(model, thresholds, exits),
        controller=CONTROLLERS[params.ctrl].build(replace(params, k=k).length_settings(), None),
        verify=params.verify,
        eos_token_ids=models.eos_token_ids,
    )


METHOD = Method(
    "s2d",
    "a sorted draft with early exits (S2D): each token from the first sub-model confident "
    "enough; thresholds and k tuned per target",
    S2DParams,
    _build,
    positional="artifact",
    doc="docs/s2d.md",
)
