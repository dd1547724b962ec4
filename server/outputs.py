"""Consuming an engine request's outputs in an HTTP handler: the first output (admission or
rejection), the rest up to the finished one, and what to tell a client when the engine side
ends a stream early."""

from __future__ import annotations

from typing import AsyncIterator, Mapping

from server.engine_api import EngineOverloaded, EngineUnavailable
from server.errors import APIError, internal_error
from server.sampling import rejection_error
from streaming.ipc import RequestOutput
from streaming.sampling_params import InvalidRequest


async def first_output(
    outputs: AsyncIterator[RequestOutput], fields: Mapping[str, str], prompt_param: str
) -> RequestOutput:
    """The first output of a request, or the APIError its rejection deserves. An engine client
    may reject a request by raising InvalidRequest or by a first output with finish_reason
    "error" and `error_field`; both become a 400 naming the body's field. EngineOverloaded /
    EngineUnavailable pass through (the error middleware makes them 429 / 503)."""
    try:
        first = await anext(outputs, None)
    except InvalidRequest as e:
        raise rejection_error(str(e), e.field, fields, prompt_param) from None
    if first is None:
        raise internal_error("The engine ended the request without output.")
    if first.finished and first.finish_reason == "error":
        raise rejection_error(first.error, first.error_field, fields, prompt_param)
    return first


async def until_finished(first: RequestOutput, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """`first`, then the remaining outputs; ends after the finished one. An iterator that
    stops without a finished output is an engine fault."""
    out: RequestOutput | None = first
    while out is not None:
        yield out
        if out.finished:
            return
        out = await anext(outputs, None)
    raise EngineUnavailable("the engine stopped the output stream without finishing the request")


def mid_stream_error(e: EngineOverloaded | EngineUnavailable) -> APIError:
    """What an event stream says when the engine side ends it early (overloaded mid-stream
    means the engine client dropped us as too slow a reader)."""
    if isinstance(e, EngineOverloaded):
        return APIError(429, f"The stream was dropped: {e}", type="rate_limit_error", code="overloaded")
    return APIError(503, f"The inference engine failed: {e}", type="server_error", code="engine_unavailable")
