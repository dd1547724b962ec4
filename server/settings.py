"""The front end's one frozen configuration, built once at start-up and validated there."""

from __future__ import annotations

from dataclasses import dataclass

from streaming.knobs import knob
from streaming.sampling_params import InvalidRequest, SamplingParams

# `serve --engine` -> the module the engine process runs (`python -m MODULE ARGS_JSON`). Both take
# the same EngineProcArgs JSON and speak the same ZeroMQ IPC (streaming/ipc.py).
ENGINE_MODULES = {"native": "runner.engine.process", "vllm": "runner.vllm_engine.process"}


@dataclass(frozen=True)
class ModelSource:
    """Which model `serve` loads."""

    model: str | None = knob(None, "local Hugging Face folder (config.json + safetensors + tokenizer); "
                                   "default: the embedded tiny model")
    codec: str | None = knob(None, "local SNAC folder (config.json + pytorch_model.bin); overrides omnistream.json's codec.path")
    cache_dir: str | None = knob(None, "where the embedded default is built (default: OMNISTREAM_CACHE_DIR or ~/.cache/omnistream)")


@dataclass(frozen=True)
class ServerSettings:
    host: str = knob("127.0.0.1", "HTTP/WebSocket bind address")
    port: int = knob(8000, "HTTP/WebSocket port (0: any free port)")
    # When set, HTTP needs `Authorization: Bearer <key>` (or `xi-api-key: <key>`); WebSockets
    # may pass it as `?api_key=` / `?xi-api-key=` too because browsers cannot set headers.
    api_key: str | None = knob(None, "require this key on HTTP and WebSocket requests")
    zmq_endpoint: str = knob("tcp://127.0.0.1:5555", "ZeroMQ ROUTER endpoint for programmatic clients ('none' "
                             "disables; a non-loopback address needs --zmq-allow-remote)")
    zmq_allow_remote: bool = knob(False, "allow the ZeroMQ endpoint on a non-loopback address")
    # Over it a ZeroMQ frame is answered with a `too_large` error; over 4x it libzmq drops the
    # connection unread (memory bound), as it cannot be answered without reading it.
    zmq_max_message_bytes: int = knob(1 << 20, "largest ZeroMQ request frame served, in bytes")
    # The gateway heartbeats every connection (ZMTP PING, answered by the client's libzmq
    # itself); a connection silent this long is dropped, and a dropped connection's requests
    # are aborted in the engine.
    zmq_client_timeout_s: float = knob(15.0, "abort the requests of a ZeroMQ client whose connection "
                                              "is closed or silent this long (no heartbeat reply)")
    # Name shown in /v1/models and responses; None -> the engine's model name.
    served_model_name: str | None = knob(None, "model name shown in /v1/models and responses (default: the folder's name)")
    # Which engine process serves the model (see ENGINE_MODULES); picked once at start-up.
    engine: str = knob("native", "engine backend: native (this project's engine) or vllm (needs omnistream[vllm])")
    # Data parallel: N engine processes behind this one front end, each request routed to the
    # one with the fewest requests in flight (server/engine_pool.py). On CUDA engine i gets
    # GPU i unless --devices lists them.
    data_parallel_size: int = knob(1, "engine processes behind this front end (on CUDA: one per GPU, 0..N-1)")
    devices: str | None = knob(None, "comma-separated devices, one engine each (e.g. cuda:0,cuda:1; overrides "
                                     "--device and sets the data-parallel size)")
    max_input_chars: int = knob(4096, "longest text of one speech request")
    max_ws_message_bytes: int = 64 * 1024
    # Checked on the raw bytes before any parser recurses (streaming.schema.check_depth).
    max_json_depth: int = knob(32, "deepest JSON nesting a request body or WebSocket message may have")
    # Generation requests (HTTP) and TTS/generate WebSocket sessions admitted at once; the
    # next one gets 429 + Retry-After at the door instead of waiting.
    # Admission counts work, not sockets: an HTTP generation request holds a slot while it
    # runs; a WebSocket session holds one only while it has an utterance or a generation in
    # flight or queued (an idle session holds none). Over it: 429 + Retry-After at the door,
    # or an `overloaded` error event inside a session.
    max_concurrent_requests: int = knob(256, "generation requests (HTTP, and WebSocket sessions with work in "
                                             "flight) admitted at once (then 429)")
    # Open WebSocket sessions, busy or idle; the next upgrade gets 429 before it happens.
    max_open_sessions: int = knob(1024, "open WebSocket sessions (idle ones included) at once (then 429)")
    # One client (its peer address) may hold at most this many work slots, so it cannot take
    # every slot; 0 turns it off (behind a proxy every client has the proxy's address).
    max_requests_per_client: int = knob(0, "work slots one client address may hold at once (0: no per-client cap)")
    retry_after_s: int = 1
    # Uploaded reference voices (models that take reference audio, e.g. CSM): kept in this
    # folder across restarts; without it POST /v1/audio/voices is refused.
    voices_dir: str | None = knob(None, "folder of uploaded reference voices, kept across restarts (none: uploads off)")
    max_voices: int = knob(64, "uploaded reference voices kept at once")
    max_voice_upload_bytes: int = knob(16 << 20, "largest reference clip upload, in bytes")
    max_voice_seconds: float = knob(30.0, "longest reference clip, in seconds")
    # A connection must deliver a complete request head within this time of connecting or of
    # its previous response (a slow-header client is cut off; idle keep-alive connections
    # close after the same time).
    http_header_timeout_s: float = knob(10.0, "seconds a connection has to send a complete request head "
                                              "(after connecting, or after its previous response)")
    # A request body must arrive completely within this time of its head (then 408).
    http_body_timeout_s: float = knob(30.0, "seconds a request body has to arrive completely (then 408)")
    # A WebSocket session with no client message and no work in flight for this long gets an
    # `inactivity_timeout` error event and close 1008; `?inactivity_timeout=N` on the URL
    # picks another value in [1, ws_max_inactivity_timeout_s] (ElevenLabs' parameter).
    ws_inactivity_timeout_s: float = knob(20.0, "close a WebSocket session with no message and no work in flight "
                                                "for this long")
    ws_max_inactivity_timeout_s: float = knob(180.0, "largest inactivity_timeout a WebSocket client may ask for")
    # Bound of each request's output queue in the engine client (steps buffered for a slow
    # reader before the engine client gives up on it).
    output_queue_size: int = 256
    # WebSocket TTS: engine requests in flight per session (the one being sent + prefetched
    # ones), pending text segments before the reader stops reading the socket. 1: the next
    # sentence starts once the current one is generated and sent, which, generation being
    # faster than real time, is seconds before its audio has played, so the listener hears no
    # gap. Prefetch (2 or more) helps only a server that generates slower than real time, and
    # multiplies the rows the engine and the codec carry: CSM at 512 sessions with 2 ran ~1000
    # requests and fell behind (every stream failed); with 1, 512 sessions ran in real time
    # (docs/performance.md).
    ws_max_inflight_utterances: int = knob(1, "WebSocket TTS: engine requests in flight per session (the one "
                                              "being sent plus prefetched ones)")
    ws_max_pending_segments: int = 64
    ws_heartbeat_s: float | None = 20.0
    # Text segmentation for streamed text (see server.tts.text_segmenter).
    segment_min_clause_chars: int = 40
    segment_max_chars: int = 300
    # Operator override of the speech profile's default sampling (None: use the profile's).
    speech_sampling: SamplingParams | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, what: str) -> None:
            if not ok:
                raise ValueError(f"ServerSettings.{field}: {what}, got {getattr(self, field)!r}")

        need(bool(self.host), "host", "must be non-empty")
        need(0 <= self.port <= 65535, "port", "must be in [0, 65535]")
        need(self.api_key is None or len(self.api_key) > 0, "api_key", "must be None or non-empty")
        need(self.max_input_chars > 0, "max_input_chars", "must be > 0")
        need(self.engine in ENGINE_MODULES, "engine", f"must be one of {', '.join(ENGINE_MODULES)}")
        need(self.data_parallel_size >= 1, "data_parallel_size", "must be >= 1")
        need(self.devices is None or all(self.device_list), "devices", "must be a comma-separated list of devices")
        need(self.devices is None or self.data_parallel_size in (1, len(self.device_list)), "data_parallel_size",
             f"must be 1 or the number of --devices ({self.devices})")
        need(self.zmq_max_message_bytes >= 1024, "zmq_max_message_bytes", "must be >= 1024")
        need(self.zmq_client_timeout_s >= 0.1, "zmq_client_timeout_s", "must be >= 0.1")
        need(self.max_ws_message_bytes >= 1024, "max_ws_message_bytes", "must be >= 1024")
        need(self.max_json_depth >= 4, "max_json_depth", "must be >= 4")
        need(self.max_concurrent_requests > 0, "max_concurrent_requests", "must be > 0")
        need(self.max_open_sessions > 0, "max_open_sessions", "must be > 0")
        need(self.max_requests_per_client >= 0, "max_requests_per_client", "must be >= 0 (0: off)")
        need(self.retry_after_s >= 0, "retry_after_s", "must be >= 0")
        need(self.max_voices >= 1, "max_voices", "must be >= 1")
        need(self.max_voice_upload_bytes >= 1024, "max_voice_upload_bytes", "must be >= 1024")
        need(self.max_voice_seconds > 0, "max_voice_seconds", "must be > 0")
        need(self.http_header_timeout_s > 0, "http_header_timeout_s", "must be > 0")
        need(self.http_body_timeout_s > 0, "http_body_timeout_s", "must be > 0")
        need(self.ws_inactivity_timeout_s > 0, "ws_inactivity_timeout_s", "must be > 0")
        need(
            self.ws_max_inactivity_timeout_s >= max(1.0, self.ws_inactivity_timeout_s),
            "ws_max_inactivity_timeout_s",
            f"must be >= 1 and >= ws_inactivity_timeout_s ({self.ws_inactivity_timeout_s})",
        )
        need(self.output_queue_size > 0, "output_queue_size", "must be > 0")
        need(self.ws_max_inflight_utterances >= 1, "ws_max_inflight_utterances", "must be >= 1")
        need(self.ws_max_pending_segments >= 1, "ws_max_pending_segments", "must be >= 1")
        need(self.ws_heartbeat_s is None or self.ws_heartbeat_s > 0, "ws_heartbeat_s", "must be None or > 0")
        need(self.segment_min_clause_chars >= 1, "segment_min_clause_chars", "must be >= 1")
        need(
            self.segment_max_chars > self.segment_min_clause_chars,
            "segment_max_chars",
            f"must be > segment_min_clause_chars ({self.segment_min_clause_chars})",
        )
        if self.speech_sampling is not None:
            try:
                # Token-id ranges are checked per request against the real vocabulary.
                self.speech_sampling.validate(vocab_size=2**31)
            except InvalidRequest as e:
                raise ValueError(f"ServerSettings.speech_sampling: {e}") from None

    @property
    def device_list(self) -> list[str]:
        """--devices split (empty when not given)."""
        return [d.strip() for d in self.devices.split(",")] if self.devices is not None else []

    @property
    def ws_hard_message_bytes(self) -> int:
        """aiohttp's own frame limit: above it the socket closes with 1009 before we can say
        why, so it sits well above `max_ws_message_bytes`, which we check ourselves."""
        return 4 * self.max_ws_message_bytes
