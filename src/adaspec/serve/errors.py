"""Errors as the OpenAI API returns them: `{"error": {"message", "type", "param", "code"}}`
with the matching HTTP status."""

from __future__ import annotations

from typing import Any


class ServeError(Exception):
    """An error a client gets as OpenAI error JSON with this status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> ServeError:
    return ServeError(400, message, param=param)


def queue_full(retry_after: int) -> ServeError:
    return ServeError(429, "the server is busy: its request queue is full; retry later",
                      type="rate_limit_error", code="queue_full",
                      headers={"Retry-After": str(retry_after)})


def draining() -> ServeError:
    return ServeError(503, "the server is shutting down and takes no new requests",
                      type="server_error", code="shutting_down", headers={"Retry-After": "5"})


def client_gone() -> ServeError:
    """What a cancelled job ends with (the client has gone, so nobody reads it)."""
    return ServeError(499, "the client closed the request", code="cancelled")


def timed_out(seconds: float) -> ServeError:
    return ServeError(504, f"the request took longer than the server's timeout ({seconds:g} s)",
                      type="timeout_error", code="timeout")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line (and the field) from pydantic's errors of a request body."""
    if not errors:
        return "invalid request body", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = err.get("ctx", {}).get("error", "")
        return f"malformed JSON body: {detail}".rstrip(": "), None
    msg = str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if kind == "extra_forbidden":
        msg = "unknown field (not an OpenAI field this server knows; check the spelling)"
    elif kind == "missing":
        msg = "required field missing"
    field = ".".join(loc) if loc else None
    if field and not loc[-1].isdigit() and loc[0] in ("messages", "prompt") and len(loc) > 1:
        field = loc[0]
    return (f"{field}: {msg}" if field else msg), field
