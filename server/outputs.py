"""Consuming an engine request's outputs in an HTTP handler: the first output (admission or
rejection), the rest up to the finished one, and what to tell a client when the engine side
ends a stream early."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Mapping

from aiohttp import web

from server.engine_api import EngineOverloaded, EngineUnavailable
from server.errors import APIError, internal_error
from server.sampling import rejection_error
from streaming.ipc import RequestOutput
from streaming.sampling_params import InvalidRequest


# How often a handler waiting for its first output looks at the client's connection: aiohttp
# (run_app's default) does not cancel a handler whose client left, and a request queued behind
# a busy engine may wait seconds for its first output.
CONNECTION_POLL_S = 0.25


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def cut_connection(request: web.Request) -> None:
    """End a streamed body without its terminating chunk: the client sees an incomplete
    transfer instead of a short file that looks whole."""
    if request.transport is not None:
        request.transport.close()


async def first_output(
    request: web.Request, outputs: AsyncIterator[RequestOutput], fields: Mapping[str, str], prompt_param: str
) -> RequestOutput:
    """The first output of a request, or the APIError its rejection deserves. An engine client
    may reject a request by raising InvalidRequest or by a first output with finish_reason
    "error" and `error_field`; both become a 400 naming the body's field. EngineOverloaded /
    EngineUnavailable pass through (the error middleware makes them 429 / 503). A client that
    closes its connection first ends the wait (499): the caller's `aclosing(outputs)` then
    aborts the engine request, which would otherwise run to its end for nobody."""
    nxt = asyncio.ensure_future(anext(outputs, None))
    try:
        while not nxt.done():
            await asyncio.wait((nxt,), timeout=CONNECTION_POLL_S)
            if not nxt.done() and client_gone(request):
                raise APIError(499, "the client closed the connection before the first output", code="client_closed")
        first = nxt.result()
    except InvalidRequest as e:
        raise rejection_error(str(e), e.field, fields, prompt_param) from None
    finally:
        if not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await nxt
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
