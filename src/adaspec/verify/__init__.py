"""Verifiers: decide which drafted tokens the target accepts, keeping the target's distribution."""
