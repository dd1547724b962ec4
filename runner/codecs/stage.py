"""Codec stage: Orpheus audio tokens -> SNAC codes -> 24 kHz PCM, streamed exactly once.

Per request the stage turns sampled token ids into SNAC frames (7 tokens per frame), asks
`streaming.audio.FrameCursor` which windows are ready, and decodes the ready windows of all
requests together, one batched SNAC call per distinct window length. The window rule
(documented in streaming/audio.py) makes the streamed PCM equal to `offline_decode` of the
complete code sequence under the same policy: the decoder noise is positional
(runner/codecs/noise.py), so a sample decodes the same in any window, batch or step.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from runner.codecs.config import CodecConfig, CodecError
from runner.codecs.decoder import Launches, SnacWindowDecoder
from runner.codecs.orpheus_tokens import audio_token_range, invalid_token_reason
from runner.codecs.snac import load_snac
from runner.kernels.tuning import load_tables
from streaming.audio import FrameCursor, WindowJob, plan_offline


@dataclass
class StageResult:
    pcm: np.ndarray  # int16 mono samples emitted this step, in order (may be empty)
    done: bool  # the stage has finished with this key and forgotten it
    error: str | None = None  # why the request's audio failed (done is then True)


@dataclass
class _Request:
    cursor: FrameCursor
    seed: int
    codes: np.ndarray  # (capacity, 7) int64; rows [0, n_frames) are complete frames
    n_frames: int = 0
    partial: list[int] = field(default_factory=list)  # codes of the incomplete frame
    audio_index: int = 0  # audio tokens accepted so far
    ended: bool = False  # end token seen or close() called: no more frames
    error: str | None = None


class CodecStage:
    """Streams PCM for many requests, decoding ready windows in batched SNAC calls."""

    def __init__(self, cfg: CodecConfig, device: torch.device, dtype: torch.dtype = torch.float32,
                 tuning: str = "auto") -> None:
        """tuning: RunnerConfig.tuning ("auto": the device's SNAC tiles, "none": the safe
        generic ones), looked up once here."""
        self.cfg = cfg
        self.sample_rate = cfg.sample_rate
        # graphs for the window lengths of an unbounded stream (a stream's last window is eager)
        lengths = tuple(sorted({j.window_frames for j in plan_offline(cfg.policy, 64 * cfg.policy.max_window_frames)[:-1]}))
        self.decoder = SnacWindowDecoder(load_snac(cfg, device, dtype), cfg.samples_per_frame, cfg.kernels,
                                         cfg.matmul_precision, graph_windows=lengths if cfg.cuda_graphs else (),
                                         graph_max_rows=cfg.max_batch_windows, tables=load_tables(device, tuning))
        self._reqs: dict[object, _Request] = {}
        # launched batches, weighing their windows: (key, job) per window and the windows'
        # _Request objects, with the PCM on its way
        self._launches: Launches[tuple[list[tuple[object, WindowJob]], list[_Request]]] = Launches()
        self._inflight: Counter = Counter()  # queued or launched, not yet collected, windows per key
        # ready windows not launched yet, by window length: (key, job, request, step queued);
        # _inflight counts them too, so a request is not done while one waits here
        self._queued: dict[int, list[tuple[object, WindowJob, _Request, int]]] = defaultdict(list)
        self._step_no = 0
        # CUDA: launches run on the decoder's stream and are collected by later step() calls;
        # CPU: a launch has finished when it returns (chosen once, here)
        self.asynchronous = self.decoder.stream is not None
        # keys whose frame count, end or error changed since the last step(): only they can
        # have new windows or be done (most requests complete a frame every 7th token)
        self._dirty: set = set()

    # -- request lifecycle -------------------------------------------------------------

    def can_open(self) -> bool:
        return True  # windows carry no per-stream state on the device: any number of requests

    def open(self, key: object, seed: int | None = None, prefix_frames: np.ndarray | None = None) -> None:
        """A request that wants audio starts; `seed` overrides cfg.noise_seed for it. SNAC's
        windows start from nothing: no prefix_frames."""
        if prefix_frames is not None:
            raise CodecError("prefix_frames: the SNAC stage decodes no reference frames")
        if key in self._reqs:
            raise KeyError(f"codec request {key!r} is already open")
        self._reqs[key] = _Request(
            cursor=FrameCursor(self.cfg.policy),
            seed=self.cfg.noise_seed if seed is None else seed,
            codes=np.zeros((64, self.cfg.tokens_per_frame), dtype=np.int64),
        )

    def push(self, key: object, token_ids: list[int]) -> None:
        """Newly sampled tokens of a request. The end token finishes its stream and later
        tokens are ignored; so are tokens for unknown keys (a late output after abort)."""
        self.push_many([(key, tok) for tok in token_ids])

    def push_many(self, items: list[tuple[object, int]]) -> None:
        """push() for many requests in one call: (key, token) pairs, in order within a key (the
        engine hands over each step's tokens of all its audio requests at once)."""
        cfg, reqs, dirty = self.cfg, self._reqs, self._dirty
        end, per_frame = cfg.end_token_id, cfg.tokens_per_frame
        for key, tok in items:
            req = reqs.get(key)
            if req is None or req.ended or req.error is not None:
                continue
            tok = int(tok)
            if tok == end:
                req.ended = True
                dirty.add(key)
                continue
            lo, hi = audio_token_range(cfg, req.audio_index)
            if not lo <= tok < hi:
                req.error = invalid_token_reason(cfg, tok, req.audio_index)
                dirty.add(key)
                continue
            partial = req.partial
            partial.append(tok - lo)
            req.audio_index += 1
            if len(partial) == per_frame:
                if req.n_frames == req.codes.shape[0]:
                    req.codes = np.concatenate([req.codes, np.zeros_like(req.codes)])  # amortised growth
                req.codes[req.n_frames] = partial
                req.n_frames += 1
                req.partial = []
                dirty.add(key)

    def close(self, key: object) -> None:
        """The request finished (stop/length): remaining frames become ready with truncated
        right context; an incomplete trailing frame is dropped. Unknown keys are ignored."""
        req = self._reqs.get(key)
        if req is not None:
            req.ended = True
            self._dirty.add(key)

    def abort(self, key: object) -> None:
        """Drop all state of the request; nothing more is emitted for it (its windows in flight
        are dropped when they land)."""
        self._reqs.pop(key, None)
        self._inflight.pop(key, None)

    def allowed_token_range(self, num_audio_tokens: int) -> tuple[int, int]:
        """[lo, hi) of valid ids for the next audio token after `num_audio_tokens` audio
        tokens; the end token (cfg.end_token_id) is also valid and lies outside it."""
        return audio_token_range(self.cfg, num_audio_tokens)

    def __contains__(self, key: object) -> bool:
        return key in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    @property
    def stream(self):
        """The CUDA stream the decodes run on (None on the CPU)."""
        return self.decoder.stream

    # -- decoding ----------------------------------------------------------------------

    def step(self, wait: bool = False) -> dict[object, StageResult]:
        """Queue the windows that became ready, launch queued windows batched by window length
        (first chunks first, for time to first audio), and collect the PCM of launched windows
        that have finished. Returns results for keys with news (PCM, completion or error); keys
        reported done are forgotten.

        On the CPU everything ready is launched and, the launch being synchronous, returned by
        the same call. On CUDA the decode runs on the codec's stream, overlapping the model's
        steps; a step launches at most cfg.max_launches_per_step lengths (see CodecConfig) and a
        window's PCM is returned by the first call after it has landed: the host never waits for
        the codec unless `wait` (the caller has nothing else to do: everything is launched and
        collected) or more than cfg.max_inflight_windows are in flight."""
        results: dict[object, StageResult] = {}
        pieces: dict[object, list[tuple[int, np.ndarray]]] = defaultdict(list)
        self._step_no += 1
        dirty, self._dirty = self._dirty, set()
        for key in dirty:
            req = self._reqs.get(key)
            if req is not None and req.error is None:
                for job in req.cursor.ready(req.n_frames, req.ended):
                    self._queued[job.window_frames].append((key, job, req, self._step_no))
                    self._inflight[key] += 1
        step_max = self.cfg.max_batch_windows
        for length in self._lengths_to_launch(wait or not self.asynchronous):
            # by identity: a request aborted (or failed) since its window was queued is skipped
            items = [it for it in self._queued.pop(length) if self._reqs.get(it[0]) is it[2] and it[2].error is None]
            for i in range(0, len(items), step_max):
                part = items[i : i + step_max]
                batch = [(key, job) for key, job, _, _ in part]
                reqs = [req for _, _, req, _ in part]
                windows = [r.codes[j.window_start : j.window_end] for r, (_, j) in zip(reqs, batch)]
                pending = self.decoder.launch_jobs(windows, [j for _, j in batch], [r.seed for r in reqs])
                self._launches.add((batch, reqs), pending, len(batch))
        # after the launches: the in-flight bound then holds when step() returns
        touched = self._collect(pieces, wait or not self.asynchronous)

        for key, parts in pieces.items():
            if len(parts) == 1:  # the common case: a copy (the PCM must not pin its launch's block)
                pcm = parts[0][1].copy()
            else:
                parts.sort(key=lambda t: t[0])  # chunk order; groups were decoded in any order
                pcm = np.concatenate([p for _, p in parts])
            results[key] = StageResult(pcm, done=False)
        for key in dirty | touched:  # only these can have become done or failed
            req = self._reqs.get(key)
            if req is None:
                continue
            if req.error is not None:
                results[key] = StageResult(np.zeros(0, dtype=np.int16), done=True, error=req.error)
            elif not (req.cursor.finished and self._inflight.get(key, 0) == 0):
                continue
            res = results.setdefault(key, StageResult(np.zeros(0, dtype=np.int16), done=True))
            res.done = True
            del self._reqs[key]
            self._inflight.pop(key, None)
        return results

    def _lengths_to_launch(self, everything: bool) -> list[int]:
        """Window lengths whose queued windows launch now, first chunks first: every length when
        `everything`; else those holding a first chunk or a window queued max_defer_steps ago,
        topped up with the fullest others to max_launches_per_step."""
        if everything:
            return sorted(self._queued, key=lambda n: min(j.chunk_index for _, j, _, _ in self._queued[n]))
        oldest = self._step_no - self.cfg.max_defer_steps
        urgent, rest = [], []
        for n, items in self._queued.items():
            first = min(j.chunk_index for _, j, _, _ in items)
            (urgent if first == 0 or items[0][3] <= oldest else rest).append((first, n))
        urgent.sort()
        rest.sort(key=lambda fn: -len(self._queued[fn[1]]))
        room = max(0, self.cfg.max_launches_per_step - len(urgent))
        return [n for _, n in urgent] + [n for _, n in rest[:room]]

    @property
    def num_inflight(self) -> int:
        """Windows launched and not yet collected."""
        return self._launches.weight

    def _collect(self, pieces: dict[object, list[tuple[int, np.ndarray]]], wait: bool) -> set:
        """PCM of finished launches into `pieces` (of all launches if `wait`, and of the oldest
        ones while too many windows are in flight); returns the keys collected."""
        keys = set()
        for (batch, reqs), rows in self._launches.collect(wait, self.cfg.max_inflight_windows):
            for (key, job), req, pcm in zip(batch, reqs, rows):
                # by identity: an aborted request's key may belong to a newer request by now
                if self._reqs.get(key) is req:
                    self._inflight[key] -= 1
                    keys.add(key)
                    if req.error is None:
                        pieces[key].append((job.chunk_index, pcm))
        return keys
