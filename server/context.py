"""Everything a handler needs, built once by `build_app` and stored on the application."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from aiohttp import web

from server.engine_pool import EnginePool
from server.metrics import Metrics
from server.settings import ServerSettings
from server.tokenizer import TextTokenizer
from server.tts.voices import SpeechProfile
from streaming.sampling_params import SamplingParams


@dataclass(frozen=True)
class ServerContext:
    engine: EnginePool  # one or more engines (data parallel), each request routed to one
    tokenizer: TextTokenizer
    profile: SpeechProfile
    settings: ServerSettings
    metrics: Metrics
    # Open WebSocket sessions (closed with 1001 at shutdown); entries vanish with their sockets.
    websockets: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or self.engine.info.model

    @property
    def speech_sampling(self) -> SamplingParams:
        return self.settings.speech_sampling or self.profile.sampling


CTX: web.AppKey[ServerContext] = web.AppKey("omnistream_context", ServerContext)


def get_ctx(request: web.Request) -> ServerContext:
    return request.app[CTX]
