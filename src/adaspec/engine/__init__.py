"""The decode loop and what it passes around: sampling settings, token trees, request stats,
and `build`, which assembles an engine from a method string and loaded models."""
