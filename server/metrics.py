"""Prometheus metrics of one front end (own registry per app, so tests can build many)."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from server.engine_pool import EngineStatus
from server.gc_tuning import GC_PAUSES
from streaming.ipc import EngineStats

_LATENCY_BUCKETS = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)

# EngineStats field -> (metric name, help, is_counter)
_ENGINE_FIELDS = {
    "num_running": ("omnistream_engine_running_requests", "Requests running in the engine", False),
    "num_waiting": ("omnistream_engine_waiting_requests", "Requests waiting in the engine", False),
    "num_free_blocks": ("omnistream_engine_kv_free_blocks", "Free KV-cache blocks", False),
    "num_total_blocks": ("omnistream_engine_kv_total_blocks", "KV-cache blocks in all", False),
    "num_requests_total": ("omnistream_engine_requests", "Requests the engine admitted", True),
    "num_aborted_total": ("omnistream_engine_aborted_requests", "Requests aborted in the engine", True),
    "num_preemptions_total": ("omnistream_engine_preemptions", "Preemptions (recompute)", True),
    "num_prefix_cache_hit_tokens": ("omnistream_engine_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", True),
    "num_generated_tokens_total": ("omnistream_engine_generated_tokens", "Tokens generated", True),
    "step_count": ("omnistream_engine_steps", "Engine steps", True),
    "num_codec_streams": ("omnistream_engine_codec_streams", "Codec streams open (audio requests holding decoder "
                          "state)", False),
    "num_refused_total": ("omnistream_engine_refused_requests", "Requests refused as overloaded for lack of room "
                          "(the codec's streams all in use)", True),
}


class _EngineCollector:
    """Exposes each engine's last status and EngineStats snapshot (taken when /metrics is
    scraped), labelled `engine` (its index in the pool)."""

    def __init__(self) -> None:
        self.engines: list[tuple[EngineStatus, EngineStats | None]] = []

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("omnistream_engine_healthy", "1 when the engine answers, else 0", labels=["engine"])
        info = GaugeMetricFamily("omnistream_engine_info", "The engine's device and process id (value 1)",
                                 labels=["engine", "device", "pid"])
        in_flight = GaugeMetricFamily("omnistream_engine_in_flight_requests", "Requests routed to the engine whose "
                                      "streams are open", labels=["engine"])
        restarts = CounterMetricFamily("omnistream_engine_restarts", "Times the engine process was restarted",
                                       labels=["engine"])
        fields = {f: (CounterMetricFamily if is_counter else GaugeMetricFamily)(name, help_text, labels=["engine"])
                  for f, (name, help_text, is_counter) in _ENGINE_FIELDS.items()}
        for status, stats in self.engines:
            label = str(status.engine)
            up.add_metric([label], 1.0 if stats is not None else 0.0)
            info.add_metric([label, status.device, str(status.pid or "")], 1.0)
            in_flight.add_metric([label], float(status.in_flight))
            restarts.add_metric([label], float(status.restarts))
            if stats is not None:
                for f, family in fields.items():
                    family.add_metric([label], float(getattr(stats, f)))
        yield from (up, info, in_flight, restarts)
        yield from (family for family in fields.values() if family.samples)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "omnistream_http_requests", "HTTP/WebSocket requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.rejected = Counter(
            "omnistream_admission_rejected", "Requests refused at the door (429)", ["endpoint"], registry=r
        )
        self.ttfa = Histogram(
            "omnistream_time_to_first_audio_seconds",
            "Request arrival (or text segment ready) to first audio byte sent",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "omnistream_time_to_first_token_seconds",
            "Request arrival to first token sent",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.active_streams = Gauge("omnistream_active_streams", "Open streams by endpoint", ["endpoint"], registry=r)
        self.audio_seconds = Counter("omnistream_audio_seconds", "Seconds of audio sent", registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)
        r.register(GC_PAUSES)  # process-wide; observed once serve installs its gc callback

    def set_engines(self, engines: list[tuple[EngineStatus, EngineStats | None]]) -> None:
        """Each engine's status and counters (None: it did not answer) for the next render."""
        self._engine.engines = engines

    def render(self) -> bytes:
        return generate_latest(self.registry)
