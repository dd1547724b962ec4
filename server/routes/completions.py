"""POST /v1/completions: OpenAI text completions, streamed or whole, one prompt per request.

`prompt` is a string, a list of token ids, or a one-element list of either. Sampling fields
as OpenAI's plus `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`,
`ignore_eos`. Not supported (400 naming the field): `n` > 1, `best_of` > 1, `echo`,
`logprobs`, `suffix`, `stop` strings (use `stop_token_ids`).

The body is a streaming.schema.CompletionRequest (strict types, unknown fields refused).

Extensions: `return_hidden_states: true` (+ `hidden_state_layers`, default the final layer;
-(L+1)..L, negatives counted from the end, duplicates refused: streaming.schema.hidden_layers)
adds per choice / per SSE chunk `"hidden_states": {"dtype", "shape": [n, layers, hidden],
"positions": [first, last+1], "data": base64 of the raw little-endian rows}` ("bfloat16"
rows are raw bf16 bit patterns), and every choice carries its `token_ids`.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from server.context import ServerContext, get_ctx
from server.engine_api import EngineOverloaded, EngineUnavailable
from server.errors import read_body
from server.outputs import client_gone, first_output, mid_stream_error, until_finished
from server.sampling import COMPLETION_FIELDS, rejection_error, request_limits
from streaming.encoders import array_bytes, array_header, b64
from streaming.ipc import AddRequest, RequestOutput
from streaming.sampling_params import SamplingParams
from streaming.schema import (
    INVALID_TYPE,
    MISSING,
    UNSUPPORTED,
    CompletionRequest,
    RequestLimits,
    SchemaError,
    check_prompt_length,
    check_text,
    hidden_layers,
    sampling_params,
    token_ids,
)

ENDPOINT = "/v1/completions"
DEFAULT_SAMPLING = SamplingParams(max_tokens=16)  # OpenAI's defaults


@dataclass(frozen=True)
class CompletionJob:
    add: AddRequest
    stream: bool
    include_usage: bool
    skip_special_tokens: bool


async def parse_prompt(ctx: ServerContext, value: object, limits: RequestLimits) -> list[int]:
    """A string, a list of token ids, or a one-element list of either (OpenAI's batch form); a
    long string is tokenized off the event loop."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        text = check_text(value, "prompt", limits.max_input_chars)
        return await ctx.tokenizer.encode_async(text, add_bos=ctx.tokenizer.bos_token_id is not None)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return token_ids(value, "prompt", limits.vocab_size)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise SchemaError("prompt", "only one prompt per request is supported", UNSUPPORTED)
    raise SchemaError("prompt", "must be a non-empty string or list of token ids", INVALID_TYPE)


def _unsupported(name: str, ok: bool, why: str) -> None:
    if not ok:
        raise SchemaError(name, why, UNSUPPORTED)


async def parse_completion_body(ctx: ServerContext, req: CompletionRequest) -> CompletionJob:
    limits = request_limits(ctx)
    if req.prompt is None:
        raise SchemaError("prompt", "this field is required", MISSING)
    prompt = await parse_prompt(ctx, req.prompt, limits)
    _unsupported("n", req.n in (None, 1), "only n=1 is supported")
    _unsupported("best_of", req.best_of in (None, 1), "only best_of=1 is supported")
    _unsupported("echo", not req.echo, "echo is not supported")
    _unsupported("logprobs", req.logprobs is None, "logprobs are not supported")
    _unsupported("suffix", not req.suffix, "suffix is not supported")
    _unsupported("stop", not req.stop, "stop strings are not supported; use stop_token_ids")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sampling = sampling_params(req.given_sampling(), DEFAULT_SAMPLING, limits, COMPLETION_FIELDS)
    check_prompt_length(len(prompt), limits, "prompt", req.max_tokens)
    layers = hidden_layers(req.hidden_state_layers, limits.num_layers)
    if req.return_hidden_states and not layers:
        layers = [limits.num_layers]  # the final normed output
    add = AddRequest(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        prompt_token_ids=prompt,
        sampling=sampling,
        hidden_state_layers=layers,
    )
    skip_special = True if req.skip_special_tokens is None else req.skip_special_tokens
    return CompletionJob(add, bool(req.stream), include_usage, skip_special)


def _hidden_payload(ctx: ServerContext, rows: np.ndarray, positions: tuple[int, int]) -> dict:
    return {**array_header(rows, ctx.engine.info.dtype), "positions": list(positions), "data": b64(array_bytes(rows))}


def _usage(job: CompletionJob, last: RequestOutput, n_out: int) -> dict:
    prompt = last.num_prompt_tokens or len(job.add.prompt_token_ids)
    out = last.num_output_tokens or n_out
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}


async def create_completion(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    ctx = get_ctx(request)
    job = await parse_completion_body(ctx, await read_body(request, CompletionRequest, ctx.settings.max_json_depth))
    async with aclosing(ctx.engine.generate(job.add)) as outputs:
        first = await first_output(request, outputs, COMPLETION_FIELDS, "prompt")
        head = {"id": job.add.request_id, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name}
        if job.stream:
            ctx.metrics.active_streams.labels(ENDPOINT).inc()
            try:
                return await _stream(request, ctx, job, head, first, outputs, arrived)
            finally:
                ctx.metrics.active_streams.labels(ENDPOINT).dec()
        return await _whole(request, ctx, job, head, first, outputs)


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _stream(request, ctx: ServerContext, job: CompletionJob, head: dict, first, outputs, arrived: float):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    decoder = ctx.tokenizer.incremental_decoder(job.skip_special_tokens)
    n_out = 0
    sent_token = False
    last: RequestOutput | None = None
    try:
        try:
            async with aclosing(until_finished(first, outputs)) as steps:
                async for out in steps:
                    if client_gone(request):
                        return resp  # leaving aclosing aborts the engine request
                    text = decoder.push(out.new_token_ids)
                    if out.finished:
                        text += decoder.flush()
                    n_out += len(out.new_token_ids)
                    choice: dict = {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": out.finish_reason if out.finished and out.finish_reason != "error" else None,
                        "token_ids": list(out.new_token_ids),
                    }
                    if out.hidden is not None:
                        choice["hidden_states"] = _hidden_payload(ctx, out.hidden, out.hidden_positions)
                    last = out
                    if out.finished and out.finish_reason == "error":
                        break
                    if text or out.new_token_ids or out.hidden is not None or out.finished:
                        if out.new_token_ids and not sent_token:
                            ctx.metrics.ttft.labels(ENDPOINT).observe(time.monotonic() - arrived)
                            sent_token = True
                        await resp.write(_sse({**head, "choices": [choice]}))
        except (EngineOverloaded, EngineUnavailable) as e:
            await resp.write(_sse(mid_stream_error(e).body()))
            await resp.write(_sse("[DONE]"))
            await resp.write_eof()
            return resp
        if last is not None and last.finish_reason == "error":
            await resp.write(_sse(rejection_error(last.error, None, COMPLETION_FIELDS, "prompt").body()))
        elif job.include_usage and last is not None:
            await resp.write(_sse({**head, "choices": [], "usage": _usage(job, last, n_out)}))
        await resp.write(_sse("[DONE]"))
        await resp.write_eof()
    except ConnectionError:  # reset, or aiohttp's "Connection lost"
        pass
    return resp


async def _whole(request, ctx: ServerContext, job: CompletionJob, head: dict, first, outputs) -> web.Response:
    token_ids: list[int] = []
    hidden: list[np.ndarray] = []
    positions: list[tuple[int, int]] = []
    last: RequestOutput | None = None
    async with aclosing(until_finished(first, outputs)) as steps:
        async for out in steps:
            if client_gone(request):
                return web.Response(status=499)  # nobody reads it; for the access log
            token_ids.extend(out.new_token_ids)
            if out.hidden is not None:
                hidden.append(out.hidden)
                positions.append(out.hidden_positions)
            last = out
    assert last is not None
    if last.finish_reason == "error":
        raise rejection_error(last.error, None, COMPLETION_FIELDS, "prompt")
    choice: dict = {
        "index": 0,
        "text": ctx.tokenizer.decode(token_ids, job.skip_special_tokens),
        "logprobs": None,
        "finish_reason": last.finish_reason,
        "token_ids": token_ids,
    }
    if hidden:
        rows = np.concatenate(hidden, axis=0)
        choice["hidden_states"] = _hidden_payload(ctx, rows, (positions[0][0], positions[-1][1]))
    return web.json_response({**head, "choices": [choice], "usage": _usage(job, last, len(token_ids))})
