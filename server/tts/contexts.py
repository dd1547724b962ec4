"""Many speech contexts on one WebSocket (ElevenLabs' multi-stream-input, Cartesia's
`context_id`s): each context has its own Speaker (ordered segments, prefetch), and they share
the session's one work slot.

The session's slot (server.ws_common.SessionActivity) is taken when the first context starts
work and given back when the last one ends, so a socket with several busy contexts still
counts as one session's work for admission, and an idle socket holds none.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.errors import APIError
from server.tts.speaker import Work

# ElevenLabs allows five concurrent contexts per multi-stream socket; the same bound keeps a
# Cartesia socket's prefetch (contexts x ws_max_inflight_utterances) small.
MAX_CONTEXTS = 5


@dataclass(frozen=True)
class ContextLimits:
    max_contexts: int = MAX_CONTEXTS
    # How often idle contexts are looked for (their timeout is the socket's inactivity_timeout).
    sweep_interval_s: float = 1.0


class SharedWork:
    """The session's slot held while any context works."""

    def __init__(self, session: Work):
        self._session = session
        self._holders = 0

    def acquire(self) -> APIError | None:
        if self._holders == 0:
            refused = self._session.start_work()
            if refused is not None:
                return refused
        self._holders += 1
        return None

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._session.end_work()


class ContextWork:
    """One context's share (the `Work` its Speaker is given): takes and gives back once."""

    def __init__(self, shared: SharedWork):
        self._shared = shared
        self.held = False

    def start_work(self) -> APIError | None:
        if self.held:
            return None
        refused = self._shared.acquire()
        self.held = refused is None
        return refused

    def end_work(self) -> None:
        if self.held:
            self.held = False
            self._shared.release()
