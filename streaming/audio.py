"""Codec window math: which frames to decode, and which samples of the result to emit.

Pure Python (no torch) so the rule can be tested exhaustively and reused by any codec.

The exactly-once rule
---------------------
A request's codec frames are f_0 .. f_{n-1}; n is known only when the stream ends. PCM is
emitted in chunks. Chunk k covers frames [a_k, b_k), where the boundaries come from a
fixed schedule that depends on k alone (never on timing or batching). To produce chunk k
the codec decodes the window of frames

    [max(0, a_k - L), min(n_avail, b_k + R))

and cuts out exactly the samples of frames [a_k, b_k). The chunk is ready as soon as
frames up to b_k + R exist, or when the stream ends (then the right context is whatever
exists and b_k is clipped to n). Because a ready chunk never uses more than b_k + R
frames, the window of every chunk is the same whether it is computed while streaming or
over the complete sequence (`plan_offline`), so the concatenated stream is identical to
the offline decode under the same policy, every frame emitted exactly once.

Choice of defaults (L = 2, R = 2, schedule 1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8, 8, ...)
---------------------------------------------------------------------------------
* Context. SNAC 24 kHz decodes each frame (4 latent steps of 512 samples) through a k=7
  conv at latent rate (+-3 latent steps), four upsampling blocks whose dilated residual
  units (k=7, dilation 1/3/9) reach +-39 samples at their own rate (the first block, at
  8x latent rate, alone adds ~+-5 latent steps), plus the transposed convs: the
  receptive field is about +-10 latent steps = +-2.5 frames (measured: changing frame f
  changes the output from 2.3 frames before it to 2.3 frames after it). The output at a
  window edge is computed with zero padding instead of the real neighbours, so a chunk
  cut with too little context does not line up with its neighbour (a click). Measured on a random SNAC of the
  24 kHz topology, a chunk's worst deviation from a whole-utterance decode is 0.38 with no
  context, 0.057 with 1 frame each side (audible), 2e-4 (~7 LSB of int16, inaudible)
  with 2, and float noise with 3. Two frames is the knee: three would make windowed
  decoding equal to a whole-utterance decode but cost one more frame of latency (R) and
  more compute.
* Latency. Time to first audio is the time to generate b_0 + R frames: the first chunk
  has no left context (frame 0 is the start of the utterance; a whole-utterance decode
  pads there in exactly the same way), so a 1-frame first chunk with R = 2 needs 3 frames
  = 21 Orpheus tokens before the first 85 ms of audio can be sent.
* Growth. A player starts at the first chunk and plays without pause, so chunk k (frames
  [a_k, b_k)) must arrive before playback reaches a_k. With generation at a real-time factor
  rho (seconds of compute per second of audio; every chunk waits the same R frames and the
  same codec latency), that holds when rho * (b_k - b_0) <= a_k for every k
  (`max_real_time_factor`). A doubling schedule (1, 2, 4, 8) holds only up to rho = 0.5:
  the GPU serving 256 streams runs at rho ~0.64 and every stream then stalled three times.
  The default keeps each chunk within a quarter of the audio already
  sent plus one frame, which holds up to rho = 0.8 at the same first-chunk latency, for
  ~30% more decoded frames on a 4 s utterance than doubling (2.08 against 1.61 per emitted
  frame: more, shorter windows early on) and the same steady windows. Three of each size
  held to 0.75 for 1.92: the GPU ran 400 streams starting together at rho 0.73, too close
  to that edge, and the codec's share of the GPU is small since the bf16 fast-sine kernels.
  Sizes are powers of two, so windows come in few lengths (3, 4, 5, 6, 8, 12 frames) and
  more of them batch into one SNAC call when streams start at different times.
* Cost. On a GPU a small SNAC window costs about the same as a much larger one, so the
  useful quantity is emitted / decoded frames: the Orpheus reference rule (decode 4
  frames, emit 1) wastes 75% of codec time; steady chunks of 8 with L = R = 2 decode 12
  frames to emit 8 (67% useful), and every steady window has the same length (12), so
  windows of many requests batch into one call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True)
class WindowPolicy:
    """How a frame stream is cut into decode windows. All sizes are in codec frames.

    chunk_frames: sizes of chunks 0, 1, 2, ...; the last entry repeats forever.
    left_context / right_context: frames decoded before / after a chunk and thrown away.
    """

    left_context: int = 2
    right_context: int = 2
    chunk_frames: tuple[int, ...] = (1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8)

    def __post_init__(self) -> None:
        # Accept a list from config files but store a tuple so the policy stays hashable.
        if isinstance(self.chunk_frames, list):
            object.__setattr__(self, "chunk_frames", tuple(self.chunk_frames))
        for name in ("left_context", "right_context"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"WindowPolicy.{name}: must be an int >= 0, got {v!r}")
        if not isinstance(self.chunk_frames, tuple) or not self.chunk_frames:
            raise ValueError(f"WindowPolicy.chunk_frames: must be a non-empty tuple of ints >= 1, got {self.chunk_frames!r}")
        for v in self.chunk_frames:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"WindowPolicy.chunk_frames: every size must be an int >= 1, got {self.chunk_frames!r}")
        # Prefix sums of the explicit part of the schedule: _starts[k] = a_k for k <= len.
        object.__setattr__(self, "_starts", (0, *accumulate(self.chunk_frames)))

    @property
    def steady_chunk(self) -> int:
        return self.chunk_frames[-1]

    @property
    def max_window_frames(self) -> int:
        """Longest window this policy ever decodes (for sizing buffers / warm-up)."""
        return self.left_context + max(self.chunk_frames) + self.right_context


def max_real_time_factor(policy: WindowPolicy, n_frames: int) -> float:
    """Slowest generation (seconds of compute per second of audio) at which a player that
    starts at the first chunk of an n-frame stream never runs dry: min over chunks k >= 1 of
    a_k / (b_k - b_0) (see the module doc; inf when the stream is one chunk)."""
    worst = math.inf
    b0 = chunk_bounds(policy, 0)[1]
    k = 1
    while (a := chunk_bounds(policy, k)[0]) < n_frames:
        b = min(chunk_bounds(policy, k)[1], n_frames)
        worst = min(worst, a / (b - b0))
        k += 1
    return worst


def chunk_bounds(policy: WindowPolicy, k: int) -> tuple[int, int]:
    """Frames [a_k, b_k) of chunk k under an unbounded stream (clip b_k to n at the end)."""
    if k < 0:
        raise ValueError(f"chunk index must be >= 0, got {k}")
    starts: tuple[int, ...] = policy._starts  # type: ignore[attr-defined]
    sizes = policy.chunk_frames
    if k < len(sizes):
        return starts[k], starts[k + 1]
    a = starts[-1] + (k - len(sizes)) * sizes[-1]
    return a, a + sizes[-1]


@dataclass(frozen=True)
class WindowJob:
    """Decode frames [window_start, window_end), emit the samples of [emit_start, emit_end).

    Invariant: window_start <= emit_start < emit_end <= window_end.
    """

    chunk_index: int
    window_start: int
    window_end: int
    emit_start: int
    emit_end: int

    @property
    def window_frames(self) -> int:
        return self.window_end - self.window_start

    def emit_slice(self, samples_per_frame: int) -> tuple[int, int]:
        """Sample offsets [lo, hi) of the emitted part inside the decoded window."""
        return (
            (self.emit_start - self.window_start) * samples_per_frame,
            (self.emit_end - self.window_start) * samples_per_frame,
        )


def _job(policy: WindowPolicy, k: int, n_avail: int, ended: bool) -> WindowJob | None:
    """Chunk k's job if it is ready with n_avail frames, else None (also None past the end)."""
    a, b = chunk_bounds(policy, k)
    if ended:
        if a >= n_avail:
            return None
        return WindowJob(k, max(0, a - policy.left_context), min(n_avail, b + policy.right_context), a, min(b, n_avail))
    if b + policy.right_context > n_avail:
        return None
    return WindowJob(k, max(0, a - policy.left_context), b + policy.right_context, a, b)


def plan_offline(policy: WindowPolicy, n: int) -> list[WindowJob]:
    """All jobs for a complete stream of n frames (the reference the stream must equal)."""
    if n < 0:
        raise ValueError(f"frame count must be >= 0, got {n}")
    jobs = []
    k = 0
    while (job := _job(policy, k, n, ended=True)) is not None:
        jobs.append(job)
        k += 1
    return jobs


class FrameCursor:
    """Per-request progress through the chunk schedule.

    Feed it the number of complete frames available and whether the stream has ended; it
    returns the jobs that became ready, each exactly once, in chunk order.
    """

    def __init__(self, policy: WindowPolicy) -> None:
        self.policy = policy
        self.next_chunk = 0
        self.emitted_frames = 0  # frames [0, emitted_frames) already handed out as jobs
        self._avail = 0
        self._ended = False

    def ready(self, frames_available: int, ended: bool) -> list[WindowJob]:
        if frames_available < self._avail:
            raise ValueError(f"frames_available went backwards: {self._avail} -> {frames_available}")
        if self._ended and (not ended or frames_available != self._avail):
            raise ValueError("stream already ended; its frame count is fixed")
        self._avail, self._ended = frames_available, ended
        jobs = []
        while (job := _job(self.policy, self.next_chunk, frames_available, ended)) is not None:
            jobs.append(job)
            self.next_chunk += 1
            self.emitted_frames = job.emit_end
        return jobs

    @property
    def finished(self) -> bool:
        """The stream ended and every frame has been handed out."""
        return self._ended and self.emitted_frames == self._avail
