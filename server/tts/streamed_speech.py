"""A speech request whose text is still arriving (Qwen3-TTS's streaming-text layout), shared by
the ZeroMQ gateway's `stream_input` and the WebSocket sessions' `stream_input` mode.

The text comes as (piece, final) items on a queue. The request starts as soon as the ids so
far fix its prompt (StreamedText: ids are final up to where the text's last word starts;
SpeechProfile.build_open_prompt); the caller runs the returned `feed` once the engine has the
request (`TextFeed`: after its first output, since an AppendText sent before the AddRequest
would find no request), and feed hands each later piece's ids to the running request
(ipc.AppendText), the last closed by the family's end of text. A text complete before its
prompt is fixed is an ordinary request of the whole text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from server.errors import invalid_request
from server.tokenizer import TextTokenizer
from server.tts.qwen3_tts_prompt import StreamedText
from streaming.ipc import AddRequest
from streaming.sampling_params import SamplingParams

Feed = Callable[[], Awaitable[None]]

log = logging.getLogger(__name__)


async def streamed_request(profile, tokenizer: TextTokenizer, engine, request_id: str, voice: str,
                           sampling: SamplingParams, pieces: asyncio.Queue, language: str | None = None,
                           instructions: str | None = None, param: str = "input", text: StreamedText | None = None
                           ) -> tuple[AddRequest, Feed | None]:
    """(the engine request, the coroutine function feeding the rest of its text; None when the
    text was complete before the request could start). Refusals name `param`. `text`: the
    StreamedText to fill (the caller reads the text so far from it), a new one by default."""
    text = text if text is not None else StreamedText(tokenizer)
    ids: list[int] = []
    final = False
    while not final:
        piece, final = await pieces.get()
        ids += await text.feed(piece, final)
        if not final:
            prompt = await profile.build_open_prompt(tokenizer, voice, ids, language, instructions)
            if prompt is not None:
                break
    else:  # the whole text before its prompt was fixed
        if not text.text.strip():
            raise invalid_request(f"{param}: the streamed text is empty", param=param)
        whole = await profile.build_prompt_async(tokenizer, voice, text.text, language, instructions)
        return whole.add_request(request_id, sampling), None

    async def feed() -> None:
        done = False
        while not done:
            piece, done = await pieces.get()
            new = await text.feed(piece, done)
            await engine.append_text(request_id, new + (profile.end_of_text() if done else []), done)

    return prompt.add_request(request_id, sampling, text_open=True), feed


class TextFeed:
    """A streamed request's `feed` beside its outputs: started by the first output (the engine
    has the request then), cancelled when the outputs end, a failure logged as `what`'s."""

    def __init__(self, feed: Feed | None, what: str):
        self._feed = feed
        self._what = what
        self._task: asyncio.Task | None = None

    def output(self) -> None:
        """An output of the request arrived."""
        if self._feed is not None and self._task is None:
            self._task = asyncio.create_task(self._feed())

    def close(self) -> None:
        t = self._task
        if t is None:
            return
        if t.done() and not t.cancelled() and t.exception() is not None:
            log.error("%s: feeding streamed text failed", self._what, exc_info=t.exception())
        t.cancel()
