"""POST /v1/completions: OpenAI text completions, streamed or whole, one prompt per request.

`prompt` is a string, a list of token ids, or a one-element list of either. Sampling fields
as OpenAI's plus `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`,
`ignore_eos`. Not supported (400 naming the field): `n` > 1, `best_of` > 1, `echo`,
`logprobs`, `suffix`, `stop` strings (use `stop_token_ids`).

Extensions: `return_hidden_states: true` (+ `hidden_state_layers`, default the final layer)
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
from server.errors import bool_field, invalid_request, json_object_body, str_field
from server.outputs import first_output, mid_stream_error, until_finished
from server.sampling import COMPLETION_FIELDS, rejection_error, sampling_from_body
from streaming.encoders import array_bytes, array_header, b64
from streaming.ipc import AddRequest, RequestOutput
from streaming.sampling_params import SamplingParams

ENDPOINT = "/v1/completions"
DEFAULT_SAMPLING = SamplingParams(max_tokens=16)  # OpenAI's defaults


@dataclass(frozen=True)
class CompletionJob:
    add: AddRequest
    stream: bool
    include_usage: bool
    skip_special_tokens: bool


def parse_prompt(ctx: ServerContext, value: object) -> list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # OpenAI's batch form with a single prompt
    if isinstance(value, str):
        if not value:
            raise invalid_request("prompt: must not be empty", param="prompt")
        if len(value) > ctx.settings.max_input_chars:
            raise invalid_request(
                f"prompt: {len(value)} characters is over the limit of {ctx.settings.max_input_chars}", param="prompt"
            )
        return ctx.tokenizer.encode(value, add_bos=ctx.tokenizer.bos_token_id is not None)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        vocab = ctx.engine.info.vocab_size
        bad = next((t for t in value if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid_request(f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        return list(value)
    if isinstance(value, list) and len(value) > 1:
        raise invalid_request("prompt: only one prompt per request is supported", param="prompt")
    raise invalid_request("prompt: must be a non-empty string or list of token ids", param="prompt")


def parse_hidden_layers(ctx: ServerContext, body: dict) -> list[int]:
    wanted = bool_field(body, "return_hidden_states", False)
    layers = body.get("hidden_state_layers")
    if layers is None:
        return [ctx.engine.info.num_layers] if wanted else []
    n = ctx.engine.info.num_layers
    if (
        not isinstance(layers, list)
        or not layers
        or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= n for x in layers)
    ):
        raise invalid_request(
            f"hidden_state_layers: must be a non-empty list of layer indices in [0, {n}] "
            "(0 = embeddings, i = input of layer i, {n} = final normed output)".replace("{n}", str(n)),
            param="hidden_state_layers",
        )
    if len(set(layers)) != len(layers):
        raise invalid_request("hidden_state_layers: indices must be unique", param="hidden_state_layers")
    return list(layers)


def _unsupported(body: dict, name: str, ok: bool, why: str) -> None:
    if not ok:
        raise invalid_request(f"{name}: {why}", param=name, code="unsupported_value")


def parse_completion_body(ctx: ServerContext, body: dict) -> CompletionJob:
    str_field(body, "model")
    if "prompt" not in body or body["prompt"] is None:
        raise invalid_request("prompt: this field is required", param="prompt", code="missing_required_parameter")
    prompt = parse_prompt(ctx, body["prompt"])
    _unsupported(body, "n", body.get("n") in (None, 1), "only n=1 is supported")
    _unsupported(body, "best_of", body.get("best_of") in (None, 1), "only best_of=1 is supported")
    _unsupported(body, "echo", body.get("echo") in (None, False), "echo is not supported")
    _unsupported(body, "logprobs", body.get("logprobs") is None, "logprobs are not supported")
    _unsupported(body, "suffix", body.get("suffix") in (None, ""), "suffix is not supported")
    _unsupported(body, "stop", body.get("stop") in (None, [], ""), "stop strings are not supported; use stop_token_ids")
    stream = bool_field(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid_request("stream_options: must be an object", param="stream_options")
    include_usage = bool_field(options, "include_usage", False)
    sampling = sampling_from_body(body, DEFAULT_SAMPLING, COMPLETION_FIELDS, ctx.engine.info.vocab_size)
    limit = ctx.engine.info.max_model_len
    if len(prompt) >= limit:
        raise invalid_request(f"prompt: {len(prompt)} tokens; the model takes fewer than {limit}", param="prompt")
    add = AddRequest(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        prompt_token_ids=prompt,
        sampling=sampling,
        hidden_state_layers=parse_hidden_layers(ctx, body),
    )
    return CompletionJob(add, stream, include_usage, bool_field(body, "skip_special_tokens", True))


def _hidden_payload(ctx: ServerContext, rows: np.ndarray, positions: tuple[int, int]) -> dict:
    return {**array_header(rows, ctx.engine.info.dtype), "positions": list(positions), "data": b64(array_bytes(rows))}


def _usage(job: CompletionJob, last: RequestOutput, n_out: int) -> dict:
    prompt = last.num_prompt_tokens or len(job.add.prompt_token_ids)
    out = last.num_output_tokens or n_out
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}


async def create_completion(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    ctx = get_ctx(request)
    job = parse_completion_body(ctx, await json_object_body(request))
    async with aclosing(ctx.engine.generate(job.add)) as outputs:
        first = await first_output(outputs, COMPLETION_FIELDS, "prompt")
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
                    transport = request.transport
                    if transport is None or transport.is_closing():
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
    except ConnectionResetError:
        pass
    return resp


async def _whole(request, ctx: ServerContext, job: CompletionJob, head: dict, first, outputs) -> web.Response:
    token_ids: list[int] = []
    hidden: list[np.ndarray] = []
    positions: list[tuple[int, int]] = []
    last: RequestOutput | None = None
    async with aclosing(until_finished(first, outputs)) as steps:
        async for out in steps:
            transport = request.transport
            if transport is None or transport.is_closing():
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
