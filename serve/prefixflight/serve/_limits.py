"""The HTTP limits every prefixflight server applies, in one place: a bounded request body
(413), API keys (401), and OpenAI-style error bodies.

``prefixflight route`` uses them today; they are written as plain functions over a
Starlette `Request` so that any FastAPI app (``prefixflight serve`` included) can call them
from a route or a dependency. Errors raise `HttpError`, which an app turns into an
OpenAI-style JSON error (`error_response`), the shape vLLM's server answers with.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any, Final

import attrs
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect, Request

from prefixflight.core import ConfigError

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "HttpError",
    "HttpLimits",
    "check_api_key",
    "error_body",
    "error_response",
    "read_body",
]

DEFAULT_MAX_BODY_BYTES: Final = 32 * 1024 * 1024
"""32 MiB: a 128k-token prompt as JSON text is about 1 MB, token ids about 0.8 MB."""


def _keys(value: Iterable[str]) -> frozenset[str]:
    keys = frozenset(value)
    for k in keys:
        if not isinstance(k, str) or not k:
            raise ConfigError(f"API keys must be non-empty strs, got {k!r}")
    return keys


@attrs.frozen(kw_only=True)
class HttpLimits:
    """``max_body_bytes``: the largest request body accepted (413 past it);
    ``api_keys``: when non-empty, requests must send ``Authorization: Bearer KEY`` with one
    of them (401 otherwise), as vLLM's ``--api-key`` does."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_keys: frozenset[str] = attrs.field(default=frozenset(), converter=_keys)

    def __attrs_post_init__(self) -> None:
        m = self.max_body_bytes
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"max_body_bytes must be an int >= 1, got {m!r}")


class HttpError(Exception):
    """Becomes an OpenAI-style JSON error response (`error_response`)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(err: HttpError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.kind, err.param),
        status_code=err.status,
        headers=err.headers,
    )


def check_api_key(request: Request, limits: HttpLimits) -> None:
    """401 unless the request carries one of the API keys (no keys: every request passes).
    Keys are compared in constant time."""
    if not limits.api_keys:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    token = given.strip().encode()
    ok = scheme.lower() == "bearer" and any(
        hmac.compare_digest(token, k.encode()) for k in limits.api_keys
    )
    if not ok:
        raise HttpError(
            401,
            "missing or invalid API key (send Authorization: Bearer KEY)",
            "authentication_error",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def read_body(request: Request, limits: HttpLimits) -> bytes:
    """The request body, or 413 as soon as it exceeds ``max_body_bytes`` (a declared
    Content-Length over the limit is refused before anything is read)."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise HttpError(499, "the client closed the request", "client_closed_request") from None
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> HttpError:
    return HttpError(
        413,
        f"the request body is {size} bytes or more, the limit is {limit} bytes",
        "request_too_large",
    )
