"""The optional API key: `Authorization: Bearer KEY` (what OpenAI clients send) or
`X-API-Key: KEY`, compared in constant time. Without a configured key every request passes."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from adaspec.serve.errors import ServeError

# what anyone may fetch without the key: liveness, and the playground's static page (which
# asks the user for the key and sends it with its API calls)
OPEN_PATHS = ("/health", "/", "/favicon.ico")
OPEN_PREFIXES = ("/playground/",)


def key_matches(given: str | None, expected: str) -> bool:
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def presented_key(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer":
            return value.strip()
    return request.headers.get("x-api-key")


def check(request: Request, expected: str | None) -> None:
    """Raise a 401 ServeError unless the request may pass."""
    if not expected:
        return
    path = request.url.path
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return
    if not key_matches(presented_key(request), expected):
        raise ServeError(401, "missing or wrong API key: send `Authorization: Bearer KEY`",
                         type="authentication_error", code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})
