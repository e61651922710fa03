"""One router artifact file: the policy weights plus everything needed to check that it
fits the engine it is loaded into (arm names and methods, target name, alpha, cost)."""

from __future__ import annotations

import os
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from torch import nn

from adaspec.errors import InputError
from adaspec.route.policy import RouterPolicy
from adaspec.store.atomic import atomic_open

FORMAT = "adaspec-router/1"
_TRAIN_HINT = "train one with `adaspec router train`"


@dataclass
class RouterArtifact:
    arms: dict[str, str]  # name -> method string, in the policy's output order
    target: str
    alpha: float
    cost: str
    policy: RouterPolicy
    info: dict = field(default_factory=dict)  # training settings, data size, history

    @property
    def arm_names(self) -> list[str]:
        return list(self.arms)

    def check(
        self,
        target: str | None = None,
        arms: list[str] | None = None,
        alpha: float | None = None,
        hidden_size: int | None = None,
        where: str = "router artifact",
    ) -> None:
        """Refuse a policy trained for another target, other arms, alpha or state size."""
        if target is not None and target != self.target:
            raise InputError(
                f"{where} was trained for target {self.target!r}, not {target!r}: "
                f"use that target or {_TRAIN_HINT} on data collected with {target!r}"
            )
        if arms is not None and list(arms) != self.arm_names:
            raise InputError(
                f"{where} chooses among arms {self.arm_names}, not {list(arms)}: "
                f"{_TRAIN_HINT} for these arms"
            )
        if alpha is not None and abs(alpha - self.alpha) > 1e-12:
            raise InputError(f"{where} was trained with alpha {self.alpha}, not {alpha}")
        if hidden_size is not None and hidden_size != self.policy.in_dim:
            raise InputError(
                f"{where} reads prompt states of size {self.policy.in_dim}, but the target's "
                f"hidden size is {hidden_size}: it belongs to another target model"
            )


def save_artifact(artifact: RouterArtifact, path: str | os.PathLike) -> Path:
    path = Path(path)
    blob = {
        "format": FORMAT,
        "arms": dict(artifact.arms),
        "target": artifact.target,
        "alpha": float(artifact.alpha),
        "cost": artifact.cost,
        "in_dim": artifact.policy.in_dim,
        "hidden": int(cast(nn.Linear, artifact.policy.net[0]).out_features),
        "state_dict": artifact.policy.state_dict(),
        "info": artifact.info,
    }
    with atomic_open(path, "wb") as f:  # a killed run leaves the old file, never half of one
        torch.save(blob, f)
    return path


_LOADED: dict[tuple, RouterArtifact] = {}


def load_artifact(path: str | os.PathLike) -> RouterArtifact:
    """Load and validate an artifact; every problem is an InputError naming the file. A file
    loaded before and unchanged since gives the same artifact (a server builds a router
    engine for every request; the policy is only read)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"router artifact not found: {path}; {_TRAIN_HINT}")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _LOADED:
        _LOADED[key] = _load(path)
    return _LOADED[key]


def _load(path: Path) -> RouterArtifact:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"router artifact {path} is unreadable or corrupt ({first})") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise InputError(f"{path} is not an adaspec router artifact ({FORMAT}); {_TRAIN_HINT}")
    try:
        arms = {str(k): str(v) for k, v in blob["arms"].items()}
        policy = RouterPolicy(int(blob["in_dim"]), len(arms), int(blob["hidden"]))
        policy.load_state_dict(blob["state_dict"])
        artifact = RouterArtifact(
            arms=arms,
            target=str(blob["target"]),
            alpha=float(blob["alpha"]),
            cost=str(blob["cost"]),
            policy=policy.eval(),
            info=dict(blob.get("info") or {}),
        )
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise InputError(f"router artifact {path} is incomplete or corrupt ({exc})") from None
    return artifact
