"""Cost profiles for tests: this CPU's steep shape, and a stand-in for measuring the machine."""

from __future__ import annotations

from adaspec.cost.profile import CostProfile

STEEP = "linear:target_ms=34,per_token_ms=10,draft_ms=15,draft_per_token_ms=5"


def steep() -> CostProfile:
    """This CPU's shape: target 34 ms for 1 token, +10 ms per verified token; draft 15 ms."""
    return CostProfile.from_formula(STEEP)


def stub_machine_profile(monkeypatch, tmp_path, profile) -> list[tuple]:
    """No test measures this machine's profile (it would time the tiny models and write a
    cache): `profile_for` hands out `profile()`; the list records who asked."""
    calls: list[tuple] = []
    monkeypatch.setenv("ADASPEC_HOME", str(tmp_path / "home"))

    def profile_for(target, draft=None, tokenizer=None, **kw):
        calls.append((target.name, getattr(draft, "name", None)))
        return profile()

    monkeypatch.setattr("adaspec.cost.cache.profile_for", profile_for)
    return calls
