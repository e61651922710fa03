"""One DISCO artifact file: classifier weights, feature spec, tau, SL_max, the draft/target
pair it was trained for, the provenance of its training data, its metrics and the tuning
that chose tau and SL_max (with the baselines tuned beside it). A classifier only means
something for the draft whose distributions it learned and the target whose tokens labelled
them, so loading it for another pair is an InputError."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from adaspec.control.disco_classifier import DiscoClassifier
from adaspec.control.disco_features import FeatureSpec
from adaspec.errors import InputError
from adaspec.store.payloads import load_payload, save_payload

ARTIFACT_FORMAT = "adaspec-disco-artifact"
ARTIFACT_VERSION = 1
WHAT = "DISCO artifact (adaspec disco train / tune)"


@dataclass
class DiscoArtifact:
    classifier: DiscoClassifier
    spec: FeatureSpec
    tau: float
    sl_max: int
    target: str
    draft: str
    provenance: dict = field(default_factory=dict)  # training data: suites, prompts, tokens
    metrics: dict = field(default_factory=dict)  # F1 of the classifier and of static k
    tuning: dict = field(default_factory=dict)  # latency tuning of tau, SL_max and baselines

    @property
    def weights(self) -> tuple[str, str]:
        """The weights of (target, draft) the training data was collected with: the
        classifier reads that draft's distributions, so it is used with the same weights.
        Data collected before issue 32 names them `quant` / `draft_quant`."""
        from adaspec.backends.weights import read_weights

        data = self.provenance.get("data", {})
        return (read_weights(str(data.get("weights", data.get("quant", "none")))),
                read_weights(str(data.get("draft_weights", data.get("draft_quant", "none")))))

    def check_pair(self, target: str, draft: str) -> None:
        if (target, draft) != (self.target, self.draft):
            raise InputError(
                f"this DISCO classifier was trained for draft {self.draft!r} with target "
                f"{self.target!r}, not draft {draft!r} with target {target!r}: collect and "
                "train one for this pair (adaspec disco collect / train / tune)"
            )

    def save(self, path: str | Path) -> None:
        payload = {
            "format": ARTIFACT_FORMAT,
            "version": ARTIFACT_VERSION,
            "state_dict": self.classifier.state_dict(),
            "hidden": self.classifier.hidden,
            "spec": self.spec.to_dict(),
            "tau": float(self.tau),
            "sl_max": int(self.sl_max),
            "target": self.target,
            "draft": self.draft,
            "provenance": self.provenance,
            "metrics": self.metrics,
            "tuning": self.tuning,
        }
        save_payload(payload, path)

    @classmethod
    def load(cls, path: str | Path) -> DiscoArtifact:
        payload = load_payload(path, ARTIFACT_FORMAT, WHAT)
        if payload.get("version") != ARTIFACT_VERSION:
            raise InputError(
                f"{path}: DISCO artifact version {payload.get('version')!r}, this adaspec "
                f"reads version {ARTIFACT_VERSION}; retrain it"
            )
        try:
            spec = FeatureSpec.from_dict(payload["spec"])
            model = DiscoClassifier(spec.size, int(payload["hidden"]))
            model.load_state_dict(payload["state_dict"])
            tau, sl_max = float(payload["tau"]), int(payload["sl_max"])
            target, draft = str(payload["target"]), str(payload["draft"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise InputError(f"{path}: DISCO artifact is malformed ({exc})") from None
        if sl_max < 1 or not 0.0 <= tau <= 1.0:
            raise InputError(f"{path}: DISCO artifact has tau={tau}, sl_max={sl_max}")
        model.eval()
        return cls(
            classifier=model,
            spec=spec,
            tau=tau,
            sl_max=sl_max,
            target=target,
            draft=draft,
            provenance=dict(payload.get("provenance", {})),
            metrics=dict(payload.get("metrics", {})),
            tuning=dict(payload.get("tuning", {})),
        )
