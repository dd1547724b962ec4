"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a real status.

Handlers raise `APIError`; the error middleware in `server.app` turns it into a response, so
every error a client sees has the same shape and names the offending field in `param`.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


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


async def json_object_body(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying why not."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid_request(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    return body


# ---- typed field readers for request bodies (null counts as "not given", as in OpenAI) --------


def str_field(body: dict[str, Any], name: str, default: str | None = None, *, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise invalid_request(f"{name}: this field is required", param=name, code="missing_required_parameter")
        return default
    if not isinstance(value, str):
        raise invalid_request(f"{name}: must be a string, got {type(value).__name__}", param=name)
    return value


def bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_request(f"{name}: must be a boolean, got {type(value).__name__}", param=name)
    return value


def number_field(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid_request(f"{name}: must be a number, got {type(value).__name__}", param=name)
    if not lo <= value <= hi:
        raise invalid_request(f"{name}: must be in [{lo}, {hi}], got {value}", param=name)
    return float(value)


def choice_field(body: dict[str, Any], name: str, choices: tuple[str, ...], default: str) -> str:
    value = str_field(body, name, default)
    assert value is not None
    if value not in choices:
        raise invalid_request(
            f"{name}: unsupported value {value!r}; supported: {', '.join(choices)}", param=name, code="unsupported_value"
        )
    return value
