"""WebSocket /v1/generate/stream: token ids in, per-step tokens and hidden states out.

client: {"type": "generate" (optional), "prompt_token_ids": [...] | "prompt": "text",
         "sampling": {SamplingParams fields}, "hidden_state_layers": [...]}
        {"type": "cancel"}   (aborts the running request; it ends with finish_reason "abort")
        {"type": "ping"}     (a keepalive, answered {"type": "pong"})
server: per step {"type": "step", "token_ids": [...], ["frames": [[K codes] per token],] "hidden": {"dtype", "shape",
        "positions"} | null}, followed by one binary frame of raw little-endian rows
        [n, layers, hidden] when "hidden" is not null ("bfloat16" = raw bf16 bit patterns);
        then {"type": "done", "finish_reason", "usage": {...}}.
        {"type": "error", "code", "message", "param"} for a bad message or a failed request.

Messages are judged by streaming.schema (GenerateMessage: strict types, unknown keys refused,
hidden_state_layers by the one rule): a bad field is an `invalid_field` error and the
connection stays usable; a message that cannot be read (lone surrogate: 1007; nesting over
max_json_depth or size over max_ws_message_bytes: 1009) is an error event and then the close.

One request runs at a time per connection (a second one while busy is a `busy` error); the
connection can run any number of requests one after another. A request holds one of the
server's work slots while it runs (none is held between requests); when none is free it is
answered with an `overloaded` error event and the connection stays usable. A session with no
message and no request running for its inactivity timeout is closed (error event + 1008).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import aclosing

from aiohttp import WSCloseCode, web

from server.context import ServerContext, get_ctx
from server.engine_api import EngineOverloaded, EngineUnavailable
from server.errors import APIError
from server.sampling import NESTED_FIELDS, rejection_error, request_limits
from server.ws_common import (
    BadMessage,
    CloseRequest,
    PingMessage,
    SessionActivity,
    bad_message,
    dispatch_text,
    guard_session,
    new_websocket,
    overloaded_event,
    read_message,
    reject,
    send_error,
    send_json,
    session_activity,
)
from streaming.encoders import array_bytes, array_header
from streaming.ipc import AddRequest, RequestOutput
from streaming.sampling_params import InvalidRequest, SamplingParams
from streaming.schema import (
    CancelMessage,
    GenerateMessage,
    SchemaError,
    convert,
    generate_job,
)

log = logging.getLogger(__name__)

ENDPOINT = "/v1/generate/stream"


async def parse_generate_message(ctx: ServerContext, obj: dict) -> AddRequest:
    """A generate message, judged by streaming.schema (the same rules as ZeroMQ's generate);
    a long text prompt is tokenized off the event loop."""
    limits = request_limits(ctx)
    job = generate_job(convert(obj, GenerateMessage), SamplingParams(), limits)
    prompt = job.prompt_token_ids
    if prompt is None:
        assert job.prompt_text is not None
        prompt = await ctx.tokenizer.encode_async(job.prompt_text, add_bos=ctx.tokenizer.bos_token_id is not None)
        job.check_prompt(len(prompt), limits, "prompt")
    return AddRequest(
        request_id=f"gen-{uuid.uuid4().hex}",
        prompt_token_ids=prompt,
        sampling=job.sampling,
        hidden_state_layers=job.hidden_state_layers,
    )


class GenerateSession:
    def __init__(self, ctx: ServerContext, ws: web.WebSocketResponse, activity: SessionActivity):
        self.ctx = ctx
        self.ws = ws
        self.activity = activity
        self.task: asyncio.Task | None = None
        self.crash_reporter: asyncio.Future | None = None
        # The generation task ends the session by asking; the reader (run) closes.
        self.closer = CloseRequest()

    async def run(self) -> None:
        self.ctx.metrics.active_streams.labels(ENDPOINT).inc()
        try:
            await dispatch_text(self.ws, self.activity, self.closer, ENDPOINT, self._on_text, self._on_binary)
        finally:
            if self.task is not None:
                self.task.cancel()  # aborts the engine request (a no-op once it has ended)
                await asyncio.gather(self.task, return_exceptions=True)
            self.activity.end_work()  # also when the task was cancelled before it ran
            self.ctx.metrics.active_streams.labels(ENDPOINT).dec()

    def _report_crash(self, task: asyncio.Task) -> None:
        # _generate handles every expected failure; anything else is a bug worth a traceback.
        if not task.cancelled() and task.exception() is not None:
            log.error("generate session failed", exc_info=task.exception())
            self.crash_reporter = asyncio.ensure_future(
                send_error(self.ws, "internal_error", "The request failed on the server; see its log.")
            )

    async def _on_binary(self) -> None:
        await send_error(self.ws, "binary_not_allowed", "Binary frames are not accepted; send JSON.")

    async def _on_text(self, data: str) -> None:
        try:
            obj = read_message(data, self.ctx.settings)
            kind = obj.get("type", "generate")
            if kind == "generate":
                if self.task is not None and not self.task.done():
                    raise BadMessage("busy", "A request is running; wait for its done event or cancel it.", "type")
                add = await parse_generate_message(self.ctx, obj)
                refusal = self.activity.start_work()
                if refusal is not None:
                    self.ctx.metrics.rejected.labels(ENDPOINT).inc()
                    await overloaded_event(self.ws, refusal)
                    return
                self.task = asyncio.create_task(self._generate(add))
                self.task.add_done_callback(self._report_crash)
            elif kind == "cancel":
                convert(obj, CancelMessage)
                if self.task is not None and not self.task.done():
                    self.task.cancel()
                    await asyncio.gather(self.task, return_exceptions=True)
                    self.activity.end_work()  # a task cancelled before it started never ran its finally
                    await send_json(self.ws, {"type": "done", "finish_reason": "abort", "usage": None})
            elif kind == "ping":
                convert(obj, PingMessage)
                await send_json(self.ws, {"type": "pong"})
            else:
                raise BadMessage(
                    "unknown_type", f"Unknown message type {kind!r}; expected generate, cancel or ping.", "type"
                )
        except SchemaError as e:
            await reject(self.ws, bad_message(e))
        except APIError as e:
            await reject(self.ws, BadMessage("invalid_field", e.message, e.param))
        except BadMessage as e:
            await reject(self.ws, e)

    async def _generate(self, add: AddRequest) -> None:
        try:
            await self._run_request(add)
        finally:
            self.activity.end_work()  # the slot is free before the next message is read

    async def _run_request(self, add: AddRequest) -> None:
        info = self.ctx.engine.info
        n_out = 0
        try:
            async with aclosing(self.ctx.engine.generate(add)) as outputs:
                async for out in outputs:
                    if out.finished and out.finish_reason == "error":
                        err = rejection_error(out.error, out.error_field, NESTED_FIELDS, "prompt_token_ids")
                        code = "invalid_field" if err.status == 400 else "generation_failed"
                        await send_error(self.ws, code, err.message, err.param)
                        return
                    n_out += len(out.new_token_ids)
                    if out.new_token_ids or out.hidden is not None:
                        await self._send_step(out, info.dtype)
                    if out.finished:
                        prompt = out.num_prompt_tokens or len(add.prompt_token_ids)
                        completion = out.num_output_tokens or n_out
                        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
                        await send_json(self.ws, {"type": "done", "finish_reason": out.finish_reason, "usage": usage})
                        return
            await send_error(self.ws, "engine_unavailable", "The engine ended the request without finishing it.")
        except InvalidRequest as e:  # the engine client's way to reject a field
            err = rejection_error(str(e), e.field, NESTED_FIELDS, "prompt_token_ids")
            await send_error(self.ws, "invalid_field", err.message, err.param)
        except EngineOverloaded as e:
            await send_error(self.ws, "overloaded", f"The engine is at capacity: {e}")
        except EngineUnavailable as e:
            await send_error(self.ws, "engine_unavailable", f"The inference engine failed: {e}")
            self.closer.request(WSCloseCode.INTERNAL_ERROR, b"engine unavailable")
        except ConnectionError:  # reset, or aiohttp's "Connection lost"
            pass  # the reader sees the close and cleans up

    async def _send_step(self, out: RequestOutput, model_dtype: str) -> None:
        hidden = None
        if out.hidden is not None:
            hidden = {**array_header(out.hidden, model_dtype), "positions": list(out.hidden_positions)}
        step = {"type": "step", "token_ids": list(out.new_token_ids), "hidden": hidden}
        if out.frames is not None:  # multi-codebook models: the positions' codes, [n, K]
            step["frames"] = out.frames.tolist()
        await send_json(self.ws, step)
        if out.hidden is not None:
            await self.ws.send_bytes(array_bytes(out.hidden))


async def generate_stream(request: web.Request) -> web.WebSocketResponse:
    ctx = get_ctx(request)
    activity = session_activity(request)  # a bad ?inactivity_timeout= is a 400 before the upgrade
    ws = new_websocket(request)
    await ws.prepare(request)
    return await guard_session(ws, lambda: GenerateSession(ctx, ws, activity).run(), ENDPOINT)
