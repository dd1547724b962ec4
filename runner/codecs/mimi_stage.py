"""Mimi codec stage: frames of K codes -> 24 kHz int16 PCM, streamed exactly once per request.

The per-request interface of the SNAC stage (runner/codecs/stage.py, what the engine calls through
runner/families/base.py's CodecStageLike): open / push_many / close / abort / step / __len__,
except that push_many takes (key, frame) pairs where a frame is the K codes of one step (one per
codebook), not a token. Each request holds a slot of decoder state (runner/codecs/mimi.py), so a
frame is decoded once, when it arrives, and its samples are emitted once, in order: the
concatenated PCM of a request equals transformers' offline `MimiModel.decode` of its codes up to
float rounding (at most 1 int16 LSB, tests/codecs/test_mimi.py). Requests with the same number of
new frames decode together in one batched call.

On CUDA decoding is asynchronous, as in the SNAC stage: a decode call is launched on the codec's
own stream (runner/codecs/mimi.py `launch`) and its PCM returned by the first step() after it
has landed, so the engine's host thread neither waits for the decode nor, behind it, for the
model's step. On the CPU a launch has finished when it returns (chosen once, at construction).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import MimiModel

from runner.codecs.config import CodecError
from runner.codecs.decoder import Launches
from runner.codecs.mimi import MimiStreamingDecoder
from runner.codecs.mimi_loader import load_mimi
from runner.codecs.mimi_graphs import MimiGraphs
from runner.codecs.stage import StageResult
from runner.codecs.streaming_state import StreamingDecoderBase


@dataclass(frozen=True)
class MimiCodecConfig:
    path: str  # local MimiModel folder: config.json + model.safetensors (save_pretrained's layout)
    num_codebooks: int | None = None  # codes per frame; None: all the codec's quantizers (CSM: 32)
    sample_rate: int = 24000  # checked against the codec's MimiConfig.sampling_rate
    # Streams with decoder state at once (its pools grow by doubling up to this); open() past it
    # is an error, so the engine must not run more audio requests than this.
    max_streams: int = 1024
    max_batch_rows: int = 256  # streams per decode call; bounds activation memory with max_chunk_frames
    # A stream decodes when it holds its next chunk of frames: first_chunk_frames (the first
    # audio goes out after one frame), then after each launch chunk_ratio x the frames it has
    # sent (at least 1, at most max_chunk_frames). Why: a decode call costs about the same host
    # time for 1 or 16 frames (its kernels are launch-bound), so decoding every frame as it
    # comes would spend the engine loop on the codec at hundreds of streams; but playback starts
    # at the first chunk, and the next chunk of c frames lands c steps after the last while the
    # player holds the S frames sent less the time since: with steps of t ms and 80 ms frames it
    # never starves while S x 80 >= (S - 1 + c) x t, i.e. t <= 80 / (1 + chunk_ratio) ms. At
    # ratio 1 (doubling) a stream needs steps of 40 ms, twice real time, which a busy engine
    # misses (CSM at 512 streams: steps of 24 ms, 57 ms at worst); 0.5 holds to 53 ms for a few
    # more calls in an utterance's first two seconds.
    first_chunk_frames: int = 1
    chunk_ratio: float = 0.5
    # frames of one stream per decode call: a longer backlog decodes in several calls of the same step()
    max_chunk_frames: int = 16
    # Frames pushed and not decoded yet, per request: past this the request fails (a producer
    # that outruns step() must not grow memory without bound).
    max_pending_frames: int = 4096
    # CUDA: decode calls launched and not yet collected; past this, step() waits for the oldest.
    # Bounds the pinned PCM blocks held and how far the codec may fall behind the model: the
    # engine then slows to the codec's pace instead of queueing without end, and a new stream's
    # first chunk, which queues behind every launch in flight, keeps its time to first audio
    # (a step launches about one call per chunk length in use, so this is a few steps of slack).
    max_inflight_launches: int = 16
    # On CUDA, decode calls replay graphs captured per (rows up to max_batch_rows, chunk length
    # of the doubling schedule); the decoder's state is then allocated for max_streams up front.
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        for name in ("sample_rate", "max_streams", "max_batch_rows", "first_chunk_frames", "max_chunk_frames",
                     "max_pending_frames", "max_inflight_launches"):
            if getattr(self, name) < 1:
                raise CodecError(f"MimiCodecConfig.{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 < self.chunk_ratio <= 1:
            raise CodecError(f"MimiCodecConfig.chunk_ratio: must be in (0, 1], got {self.chunk_ratio}")
        if self.num_codebooks is not None and self.num_codebooks < 1:
            raise CodecError(f"MimiCodecConfig.num_codebooks: must be >= 1, got {self.num_codebooks}")


def chunk_lengths(cfg: MimiCodecConfig) -> list[int]:
    """The frames a decode call takes (ascending): 1, first_chunk_frames, the powers of two below
    max_chunk_frames and max_chunk_frames. Any chunk launches as a few of them, longest first."""
    lengths, m = {1, min(cfg.first_chunk_frames, cfg.max_chunk_frames), cfg.max_chunk_frames}, 2
    while m < cfg.max_chunk_frames:
        lengths.add(m)
        m *= 2
    return sorted(lengths)


def _as_batch(items: list[tuple[object, object]], k: int) -> np.ndarray | None:
    """The items' frames as one [N, K] int64 array, or None when they do not form one."""
    if not items:
        return None
    try:
        batch = np.asarray([frame for _, frame in items])
    except ValueError:  # ragged
        return None
    if batch.ndim != 2 or batch.shape[1] != k or batch.dtype.kind not in "iu":
        return None
    return batch.astype(np.int64, copy=False)


@dataclass
class _Request:
    slot: int
    pending: list[np.ndarray] = field(default_factory=list)  # (K,) int64 frames not decoded yet
    n_frames: int = 0  # frames accepted so far (the index of the next one)
    ended: bool = False  # close() called: no more frames
    error: str | None = None
    chunk: int = 1  # frames the next decode waits for (unless the request ended)
    inflight: int = 0  # launches holding frames of it, not yet collected (it is done only at 0)


class MimiCodecStage:
    """Streams PCM for many requests; each step decodes their new frames in batched Mimi calls."""

    def __init__(self, cfg: MimiCodecConfig, device: torch.device, dtype: torch.dtype = torch.float32,
                 tuning: str = "auto", model=None) -> None:
        """model: an already loaded transformers MimiModel (CSM's codec_model) instead of
        cfg.path; tuning: accepted for the families' build_codec signature (no tuned kernels yet)."""
        self.cfg = cfg
        self.decoder = self._load_decoder(cfg, device, dtype, model)
        # Every launch decodes one of these lengths, the chunk schedule's (and 1): a remainder
        # (an utterance's last frames, a backlog past max_chunk_frames) goes as several of them.
        # Why: on CUDA each has a graph, so no launch decodes eagerly mid-serving (an eager
        # decode is hundreds of launches of host time in the engine loop); the stream state
        # makes any split exact (the streamed PCM equals the offline decode).
        self._lengths = chunk_lengths(cfg)
        if device.type == "cuda" and cfg.cuda_graphs:
            self.decoder.reserve_all()
            rows = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b < cfg.max_batch_rows] + [cfg.max_batch_rows]
            self.decoder.graphs = MimiGraphs(self.decoder, rows, self._lengths)
            self.decoder.graphs.capture()
        if self.decoder.sample_rate != cfg.sample_rate:
            raise CodecError(f"MimiCodecConfig.sample_rate: the codec runs at {self.decoder.sample_rate} Hz, "
                             f"got {cfg.sample_rate}")
        self.sample_rate = cfg.sample_rate
        self.num_codebooks = self.decoder.num_codebooks
        self.codebook_size = self.decoder.codebook_size
        self.samples_per_frame = self.decoder.samples_per_frame
        self._reqs: dict[object, _Request] = {}
        # Keys that reached their next chunk, ended or failed since the last step(): only they can
        # launch, fail or become done there (one in max_chunk_frames steps per stream once its
        # chunks are long, so step() does not visit every stream every step). A launch takes all
        # of a request's pending frames, so a request not marked holds less than its chunk.
        self._dirty: set = set()
        # decode calls launched, each with its rows' (key, request) and frames per row, the PCM
        # on its way
        self._launches: Launches[tuple[list[tuple[object, _Request]], int]] = Launches()
        self._launched_frames = 0  # frames in those launches
        self.asynchronous = self.decoder.stream is not None  # else a launch has landed on return

    def _load_decoder(self, cfg: MimiCodecConfig, device: torch.device, dtype: torch.dtype,
                      model) -> StreamingDecoderBase:
        """The streaming decoder this stage drives (a subclass serves another codec)."""
        return MimiStreamingDecoder(load_mimi(model if model is not None else cfg.path, device, dtype),
                                    cfg.num_codebooks, max_streams=cfg.max_streams)

    def _encoder(self) -> MimiModel:
        """The MimiModel whose encode gives this codec's codes (Mimi: the decoder's own model)."""
        return self.decoder.model

    # -- request lifecycle -------------------------------------------------------------

    def can_open(self) -> bool:
        """A free decoder slot remains (cfg.max_streams streams hold state at once)."""
        return self.decoder.num_free > 0

    def open(self, key: object, seed: int | None = None, prefix_frames: np.ndarray | None = None) -> None:
        """A request that wants audio starts. `seed` is accepted for the interface: the decoder
        has no noise. prefix_frames (n, K) int: frames decoded into the stream's state first and
        never emitted (a voice-clone reference's codes: the request's audio is then the tail of
        the decode of prefix + its frames, as Qwen3-TTS's ICL decode cuts it)."""
        if key in self._reqs:
            raise KeyError(f"codec request {key!r} is already open")
        prefix = self._check_prefix(prefix_frames) if prefix_frames is not None else None
        slot = self.decoder.new_stream()
        if prefix is not None:
            # queued on the decoder's stream before the request's own frames; the PCM is dropped
            # (pieces of max_chunk_frames: the bound on a decode's activation memory)
            for i in range(0, len(prefix), self.cfg.max_chunk_frames):
                part = prefix[i : i + self.cfg.max_chunk_frames]
                self.decoder.launch([slot], np.ascontiguousarray(part.T[None]))
        self._reqs[key] = _Request(slot=slot, chunk=self.cfg.first_chunk_frames)

    def _check_prefix(self, frames: np.ndarray) -> np.ndarray:
        codes = np.asarray(frames)
        k, size = self.num_codebooks, self.codebook_size
        if codes.ndim != 2 or codes.shape[1] != k or codes.dtype.kind not in "iu":
            raise CodecError(f"prefix_frames: (frames, {k}) integer codes, got shape {codes.shape} {codes.dtype}")
        bad = np.argwhere((codes < 0) | (codes >= size))
        if bad.size:
            f, c = (int(v) for v in bad[0])
            raise CodecError(f"prefix_frames: frame {f}, codebook {c}: code {int(codes[f, c])} is outside "
                             f"the codebook range [0, {size})")
        return codes.astype(np.int64, copy=False)

    def push_many(self, items: list[tuple[object, object]]) -> None:
        """(key, frame) pairs in order within a key; a frame is K codes (a sequence or array of
        ints, one per codebook). A bad frame fails its request (the error names frame and
        codebook); frames for unknown keys (a late output after abort) or ended requests are
        ignored."""
        # One range check over the whole step's frames (a per-frame check cost ~3 us a frame, a
        # few ms a step at hundreds of streams); a frame it flags, or a batch that is not one
        # [N, K] integer array, is judged frame by frame for the error message.
        # The loop runs for every request of every step: the batch's rows and flags as Python
        # lists (an index into a numpy array costs more than the rest of an item's work).
        batch = _as_batch(items, self.num_codebooks)
        if batch is None:
            rows, ok = [None] * len(items), [False] * len(items)
        else:
            rows, ok = list(batch), (~((batch < 0) | (batch >= self.codebook_size)).any(axis=1)).tolist()
        reqs, dirty, cap = self._reqs, self._dirty, self.cfg.max_pending_frames
        for (key, frame), codes, good in zip(items, rows, ok):
            req = reqs.get(key)
            if req is None or req.ended or req.error is not None:
                continue
            pending = req.pending
            if not good or len(pending) >= cap:
                why = None
                if not good:
                    codes, why = self._check_frame(frame, req.n_frames)
                if why is None and len(pending) >= cap:
                    why = f"MimiCodecConfig.max_pending_frames: more than {cap} frames waiting to be decoded"
                if why is not None:
                    req.error = why
                    dirty.add(key)
                    continue
            pending.append(codes)
            req.n_frames += 1
            if len(pending) >= req.chunk:
                dirty.add(key)  # it holds its next chunk: the next step() launches it

    def _check_frame(self, frame: object, index: int) -> tuple[np.ndarray | None, str | None]:
        """The frame as (K,) int64 codes, or why it is invalid (naming frame and codebook)."""
        codes = np.asarray(frame)
        k, size = self.num_codebooks, self.codebook_size
        if codes.shape != (k,):
            return None, f"codes: frame {index} must hold {k} codes (one per codebook), got shape {codes.shape}"
        if codes.dtype.kind not in "iu":
            return None, f"codes: frame {index} must hold integer codes, got dtype {codes.dtype}"
        bad = np.flatnonzero((codes < 0) | (codes >= size))
        if bad.size:
            c = int(bad[0])
            return None, (f"codes: frame {index}, codebook {c}: code {int(codes[c])} is outside the codebook "
                          f"range [0, {size})")
        return codes.astype(np.int64, copy=False), None

    def close(self, key: object) -> None:
        """The request finished: its pushed frames are decoded, then it is done. Unknown keys are
        ignored."""
        req = self._reqs.get(key)
        if req is not None:
            req.ended = True
            self._dirty.add(key)

    def abort(self, key: object) -> None:
        """Drop the request and free its decoder state; nothing more is emitted for it (its
        launches in flight are dropped when they land, by request identity: the key may belong
        to a newer request by then)."""
        req = self._reqs.pop(key, None)
        if req is not None:
            # at once, launches of it in flight: the decoder resets a slot for its next stream
            # behind them on its stream (MimiStreamingDecoder.new_stream)
            self.decoder.free(req.slot)
        self._dirty.discard(key)

    def __contains__(self, key: object) -> bool:
        return key in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    @property
    def stream(self):
        """The CUDA stream the decodes run on (None on the CPU)."""
        return self.decoder.stream

    # -- encoding (reference clips) -----------------------------------------------------

    @torch.inference_mode()
    def encode(self, pcm: np.ndarray) -> np.ndarray:
        """int16 mono PCM at the codec's rate -> its codes [frames, K] int64 (transformers'
        MimiModel.encode, the first K codebooks: what CSM's prompt frames hold)."""
        model = self._encoder()
        x = torch.from_numpy(pcm.astype(np.float32) / 32768.0).to(self.decoder.device, self.decoder.dtype)
        codes = model.encode(x[None, None], num_quantizers=self.num_codebooks).audio_codes  # [1, K, F]
        return codes[0].T.to(torch.int64).cpu().numpy()

    # -- decoding ----------------------------------------------------------------------

    def step(self, wait: bool = False) -> dict[object, StageResult]:
        """Launch a decode of the pushed frames of every request holding its next chunk (or
        ended; each call takes the longest of chunk_lengths(cfg) the request holds, calls
        repeated until its backlog is launched), collect the PCM of launches that have landed, and return results
        for keys with news: PCM in order, an error, or completion (once every frame it was
        pushed is collected). Keys reported done are forgotten. A request short of its chunk
        waits for the push that completes it, which marks it.

        On CUDA the host waits for the codec only when `wait` (the caller has nothing else to
        do: everything launched is collected) or past cfg.max_inflight_launches; on the CPU
        every launch has landed when step() returns."""
        results: dict[object, StageResult] = {}
        pieces: dict[object, list[np.ndarray]] = defaultdict(list)
        dirty, self._dirty = self._dirty, set()
        live = [(key, self._reqs[key]) for key in dirty if key in self._reqs]
        todo = [(key, req) for key, req in live
                if req.error is None and req.pending and (req.ended or len(req.pending) >= req.chunk)]
        for _, req in todo:  # every pushed frame is launched below: n_frames is what it has sent
            req.chunk = min(max(1, int(self.cfg.chunk_ratio * req.n_frames)), self.cfg.max_chunk_frames)
        while todo:
            by_len: dict[int, list[tuple[object, _Request]]] = defaultdict(list)
            for key, req in todo:
                n = len(req.pending)
                by_len[max(m for m in self._lengths if m <= n)].append((key, req))
            for m, group in by_len.items():
                for i in range(0, len(group), self.cfg.max_batch_rows):
                    self._launch(group[i : i + self.cfg.max_batch_rows], m)
            todo = [(key, req) for key, req in todo if req.pending]
        # after the launches: the in-flight bound then holds when step() returns
        touched = self._collect(pieces, wait or not self.asynchronous)
        for key, parts in pieces.items():
            # a copy either way: a row must not pin its launch's block
            results[key] = StageResult(parts[0].copy() if len(parts) == 1 else np.concatenate(parts), done=False)
        for key, req in live + touched:  # only these can have failed or become done
            if self._reqs.get(key) is not req:
                continue  # reported done above (a key both dirty and collected)
            if req.error is not None:
                results[key] = StageResult(np.zeros(0, dtype=np.int16), done=True, error=req.error)
            elif not (req.ended and not req.pending and req.inflight == 0):
                continue
            results.setdefault(key, StageResult(np.zeros(0, dtype=np.int16), done=True)).done = True
            self.abort(key)
        return results

    def _launch(self, group: list[tuple[object, _Request]], m: int) -> None:
        """Launch the decode of the next m frames of each request in `group`, in one call."""
        # one stack of all B * m frames: a stack per request costs more than its copy
        frames = []
        for _, req in group:
            frames += req.pending[:m]
            del req.pending[:m]
            req.inflight += 1
        codes = np.ascontiguousarray(np.stack(frames).reshape(len(group), m, -1).transpose(0, 2, 1))  # (B, K, m)
        self._launches.add((group, m), self.decoder.launch([req.slot for _, req in group], codes))
        self._launched_frames += m * len(group)

    def _collect(self, pieces: dict[object, list[np.ndarray]], wait: bool) -> list[tuple[object, _Request]]:
        """PCM of landed launches (of all when `wait`, of the oldest while too many are in
        flight) into `pieces`, in launch order, which is each stream's frame order; returns the
        (key, request) of their rows still open."""
        touched = []
        for (group, m), rows in self._launches.collect(wait, self.cfg.max_inflight_launches):
            self._launched_frames -= m * len(group)
            for (key, req), pcm in zip(group, rows):
                req.inflight -= 1
                # by identity: an aborted request's key may belong to a newer request by now
                if self._reqs.get(key) is req and req.error is None:
                    pieces[key].append(pcm)
                    touched.append((key, req))
        return touched

    @property
    def num_inflight(self) -> int:
        """Frames pushed whose PCM has not been returned yet: waiting for their chunk, or
        launched and not collected (an aborted request's too, until they land)."""
        return sum(len(r.pending) for r in self._reqs.values()) + self._launched_frames
