"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a real status.

Handlers raise `APIError` (or a streaming.schema.SchemaError); the error middleware in `server.app` turns it into a response, so
every error a client sees has the same shape and names the offending field in `param`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from aiohttp import web

from streaming.sampling_params import InvalidRequest
from streaming.schema import SchemaError, decode

T = TypeVar("T")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def request_timeout(body_timeout_s: float) -> APIError:
    return APIError(
        408,
        f"The request body did not arrive within {body_timeout_s:g} s (http_body_timeout_s).",
        code="request_timeout",
        headers={"Connection": "close"},
    )


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, param=param, code="not_found")


def unauthorized() -> APIError:
    return APIError(
        401,
        "Missing or incorrect API key: send `Authorization: Bearer <key>`.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def overloaded(retry_after_s: float, message: str = "The server is at capacity; retry later.") -> APIError:
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code="overloaded",
        headers={"Retry-After": str(max(1, round(retry_after_s)))},
    )


def engine_unavailable(retry_after_s: float = 1.0) -> APIError:
    return APIError(
        503,
        "The inference engine is unavailable.",
        type="server_error",
        code="engine_unavailable",
        headers={"Retry-After": str(max(1, round(retry_after_s)))},
    )


def internal_error(message: str = "Internal server error.") -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def schema_api_error(e: InvalidRequest) -> APIError:
    """A schema (or engine-side field) rejection -> a 400 naming the field in `param`."""
    code = e.code if isinstance(e, SchemaError) else "invalid_value"
    return invalid_request(str(e), param=e.field, code=code)


async def read_body(request: web.Request, type_: type[T], max_depth: int) -> T:
    """The request body decoded into a streaming.schema Struct (depth bounded before parsing,
    strict types, unknown keys refused), or a 400 naming the field."""
    raw = await request.read()
    try:
        return decode(raw, type_, max_depth)
    except SchemaError as e:
        raise schema_api_error(e) from None
