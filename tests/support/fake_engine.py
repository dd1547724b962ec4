"""A deterministic in-process engine for front-end tests, plus helpers to serve an app on it.

FakeEngine implements server.engine_api.EngineClientProtocol:
- tokens: token k of a request is `(sum(prompt) + 7 * k) % token_vocab`;
- audio (requests with audio=True): from step `audio_from_step` on, one int16 chunk of
  `samples_per_step` samples per step whose first two samples are (request serial, step) and
  the rest `(serial + step + i) % 30000`, so a test can tell whose chunk it got and in which
  order (`chunk_marks`);
- hidden rows [n, len(layers), hidden_size] float32 with value `position + 1000 * layer`;
- failure knobs: `overloaded`, `dead` (raise before the first output), `fail_at_step`
  (finish_reason "error"), `die_at_step` (EngineUnavailable mid-stream), `overflow_at_step`
  (EngineOverloaded mid-stream: how server.engine_client drops a reader that fell behind),
  `reject_field`
  (reject the request naming a field: by raising InvalidRequest, as server.engine_client
  does, or with `reject_as_output` by a first output carrying `error_field`, as the engine's
  own message does);
- `aborted` lists request ids whose consumer stopped iterating before the finished output.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

import numpy as np
from aiohttp import web

from server.app import build_app, server_options
from server.context import CTX
from server.engine_api import EngineOverloaded, EngineUnavailable
from server.settings import ServerSettings
from server.tokenizer import TextTokenizer
from server.tts.voices import SpeechProfile
from streaming.ipc import AddRequest, EngineStats, Ready, RequestOutput
from streaming.sampling_params import InvalidRequest

BOS = "<|begin_of_text|>"


class FakeEngine:
    # what an engine pool shows per engine (server.engine_pool.PoolMember): no process here
    device = "fake"
    pid: int | None = None
    restarts = 0

    def __init__(
        self,
        *,
        steps: int = 6,
        samples_per_step: int = 240,
        audio_from_step: int = 1,
        step_delay: float | Callable[[AddRequest], float] = 0.0,
        first_delay: float = 0.0,
        token_vocab: int = 200,
        vocab_size: int = 156940,
        hidden_size: int = 8,
        num_layers: int = 4,
        max_model_len: int = 4096,
        sample_rate: int = 24000,
    ):
        self.info = Ready(
            model="fake-orpheus",
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            max_model_len=max_model_len,
            max_num_seqs=256,
            sample_rate=sample_rate,
            dtype="float32",
        )
        self.steps = steps
        self.samples_per_step = samples_per_step
        self.audio_from_step = audio_from_step
        self.step_delay = step_delay
        self.first_delay = first_delay
        self.token_vocab = token_vocab
        self.overloaded = False
        self.dead = False
        self.fail_at_step: int | None = None
        self.die_at_step: int | None = None
        self.overflow_at_step: int | None = None
        self.reject_field: str | None = None
        self.reject_as_output = False
        self.requests: list[AddRequest] = []
        self.aborted: list[str] = []
        self.abort_calls: list[str] = []
        self.finished: list[str] = []
        self.active: set[str] = set()
        self._serial = 0

    @property
    def healthy(self) -> bool:
        return not self.dead

    def token(self, prompt: list[int], step: int) -> int:
        return (sum(prompt) + 7 * step) % self.token_vocab

    def audio_chunk(self, serial: int, step: int) -> np.ndarray:
        chunk = (serial + step + np.arange(self.samples_per_step)) % 30000
        chunk[0], chunk[1] = serial, step
        return chunk.astype(np.int16)

    def hidden_rows(self, first_pos: int, n: int, layers: list[int]) -> np.ndarray:
        pos = np.arange(first_pos, first_pos + n, dtype=np.float32)[:, None, None]
        lay = np.asarray(layers, dtype=np.float32)[None, :, None]
        return np.broadcast_to(pos + 1000 * lay, (n, len(layers), self.info.hidden_size)).copy()

    def audio_samples_per_request(self, max_tokens: int | None = None) -> int:
        n = self.steps if max_tokens is None else min(self.steps, max_tokens)
        return max(0, n - self.audio_from_step) * self.samples_per_step

    async def generate(self, req: AddRequest) -> AsyncIterator[RequestOutput]:
        if self.dead:
            raise EngineUnavailable("fake engine is dead")
        if self.overloaded:
            raise EngineOverloaded("fake engine is full")
        serial = self._serial
        self._serial += 1
        rid = req.request_id
        self.requests.append(req)
        self.active.add(rid)
        done = False
        prompt_len = len(req.prompt_token_ids)
        try:
            field = self.reject_field
            if field is None:
                try:
                    req.sampling.validate(self.info.vocab_size)
                except InvalidRequest as e:
                    field = e.field
            if field is not None:
                done = True
                if not self.reject_as_output:
                    raise InvalidRequest(field, "rejected by the engine")
                yield RequestOutput(rid, finished=True, finish_reason="error", error=f"{field}: rejected", error_field=field)
                return
            n = min(self.steps, req.sampling.max_tokens)
            delay = self.step_delay(req) if callable(self.step_delay) else self.step_delay
            for step in range(n):
                await asyncio.sleep(self.first_delay if step == 0 and self.first_delay else delay)
                if self.die_at_step == step:
                    raise EngineUnavailable("fake engine died")
                if self.overflow_at_step == step:
                    raise EngineOverloaded("client too slow: output queue overflowed")
                if self.fail_at_step == step:
                    done = True
                    yield RequestOutput(rid, finished=True, finish_reason="error", error="codec failed")
                    return
                hidden, positions = None, (0, 0)
                if req.hidden_state_layers:
                    first, count = (0, prompt_len) if step == 0 else (prompt_len + step - 1, 1)
                    hidden, positions = self.hidden_rows(first, count, req.hidden_state_layers), (first, first + count)
                last = step == n - 1
                done = last  # set before yielding: the consumer may stop right after the last output
                yield RequestOutput(
                    rid,
                    new_token_ids=[self.token(req.prompt_token_ids, step)],
                    hidden=hidden,
                    hidden_positions=positions,
                    audio=self.audio_chunk(serial, step) if req.audio and step >= self.audio_from_step else None,
                    finished=last,
                    finish_reason="length" if last else None,
                    num_prompt_tokens=prompt_len,
                    num_output_tokens=step + 1,
                )
        finally:
            self.active.discard(rid)
            (self.finished if done else self.aborted).append(rid)

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)

    async def stats(self) -> EngineStats:
        if self.dead:
            raise EngineUnavailable("fake engine is dead")
        return EngineStats(
            num_running=len(self.active),
            num_waiting=0,
            num_free_blocks=100,
            num_total_blocks=128,
            num_requests_total=len(self.requests),
            num_aborted_total=len(self.aborted),
            num_preemptions_total=0,
            num_prefix_cache_hit_tokens=0,
            num_generated_tokens_total=0,
            step_count=0,
            active_request_ids=sorted(self.active),
        )

    async def wait_aborted(self, count: int = 1, timeout: float = 2.0) -> list[str]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.aborted) < count:
            if loop.time() > deadline:
                raise AssertionError(f"expected {count} aborted requests, got {self.aborted}")
            await asyncio.sleep(0.005)
        return self.aborted


def chunk_marks(pcm: bytes, samples_per_step: int) -> list[tuple[int, int]]:
    """(request serial, step) of each fake audio chunk in a PCM byte stream."""
    samples = np.frombuffer(pcm, dtype="<i2")
    assert len(samples) % samples_per_step == 0, len(samples)
    chunks = samples.reshape(-1, samples_per_step)
    for c in chunks:  # every sample, not just the marks: no corruption either
        serial, step = int(c[0]), int(c[1])
        expect = (serial + step + np.arange(samples_per_step)) % 30000
        assert np.array_equal(c[2:], expect[2:]), (serial, step)
    return [(int(c[0]), int(c[1])) for c in chunks]


# ---- a tiny real tokenizer (byte-level BPE trained on the spot) ------------------------------

_TOKENIZER_DIR: Path | None = None


def tokenizer_dir() -> Path:
    global _TOKENIZER_DIR
    if _TOKENIZER_DIR is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=300, special_tokens=[BOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        corpus = ["Hello there, this is a test of the speech server.", "The quick brown fox jumps over the lazy dog."] * 20
        tok.train_from_iterator(corpus, trainer)
        folder = Path(tempfile.mkdtemp(prefix="omnistream-tok-"))
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS}))
        _TOKENIZER_DIR = folder
    return _TOKENIZER_DIR


def make_tokenizer() -> TextTokenizer:
    return TextTokenizer.from_folder(tokenizer_dir())




@dataclass
class Served:
    base_url: str  # http://127.0.0.1:PORT
    engine: FakeEngine
    app: web.Application

    def url(self, path: str, scheme: str = "http") -> str:
        return self.base_url.replace("http", scheme, 1) + path


@asynccontextmanager
async def serve(
    engine: FakeEngine | None = None,
    profile: SpeechProfile | None = None,
    handler_cancellation: bool = True,
    **settings,
) -> AsyncIterator[Served]:
    """Serve an app on the fake engine on 127.0.0.1 (a free port). aiohttp cancels handlers
    of dropped connections only with `handler_cancellation=True` (its test server's choice;
    `web.run_app` defaults to False), so tests can cover both."""
    engine = engine or FakeEngine()
    app = build_app(engine, make_tokenizer(), profile or SpeechProfile(), ServerSettings(**settings))
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, **server_options(app[CTX].settings))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield Served(f"http://{host}:{port}", engine, app)
    finally:
        await runner.cleanup()
