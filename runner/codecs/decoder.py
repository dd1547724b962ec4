"""The SNAC window decoder: batches of equal-length code windows -> int16 PCM, on its own stream.

Two implementations with one contract, chosen once per decoder: the torch path runs SNAC's own
layers; the fused path runs runner/kernels/snac.py (one Triton kernel per decoder layer on
channels-last rows: same results up to float rounding, ~7x less memory traffic, see
runner/codecs/cost.py). Decoder noise is positional (runner/codecs/noise.py), so a window decodes
to the same PCM alone, in any batch, or offline.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch
from snac import SNAC
from snac.layers import DecoderBlock, NoiseBlock

from runner.codecs.config import KERNEL_CHOICES, CodecError
from runner.codecs.graphs import CodecGraphs
from runner.codecs.noise import noise_salts, positional_noise
from runner.codecs.orpheus_tokens import FRAME_WIDTH, ORPHEUS_LEVELS, frames_to_levels
from runner.kernels.tuning import Tables
from runner.utils.host_staging import PinnedStaging
from streaming.audio import WindowJob, WindowPolicy, plan_offline

try:  # the fused path needs triton, which CPU torch wheels do not bring: then only torch runs
    from runner.kernels import snac as snac_kernels
except ImportError as e:
    snac_kernels = None
    _NO_TRITON: ImportError | None = e
else:
    _NO_TRITON = None

_log = logging.getLogger(__name__)


def float_to_s16(audio: torch.Tensor) -> torch.Tensor:
    """Float PCM in [-1, 1] -> int16: clip, scale by 32767, round half to even."""
    return torch.round(audio.float().clamp(-1.0, 1.0) * 32767.0).to(torch.int16)


class SnacWindowDecoder:
    """Decodes batches of equal-length frame windows with positional decoder noise.

    Two implementations with one contract, chosen once here: the torch path runs SNAC's own
    layers ((B, C, T) tensors, any device); the fused path (runner/kernels/snac.py) runs each
    decoder layer as one Triton kernel on channels-last rows, about 5x less memory traffic
    (see runner/codecs/cost.py). Both give the same PCM up to float rounding.
    """

    def __init__(
        self,
        model: SNAC,
        samples_per_frame: int,
        kernels: str = "torch",
        matmul_precision: str = "tf32x3",
        tiles=None,  # runner.kernels.snac.Tiles override (tests, tuning)
        graph_windows: tuple[int, ...] = (),  # CUDA + fused: capture graphs for these window lengths
        graph_max_rows: int = 128,
        # the device's tuning tables, load_tables(device, RunnerConfig.tuning) (CodecStage looks
        # them up); the fused path's CUDA tiles are their `snac` part. None: the device's ("auto")
        tables: Tables | None = None,
    ) -> None:
        self.model = model
        self.samples_per_frame = samples_per_frame
        self.latent_per_frame = int(model.vq_strides[0])
        # Samples per frame at each DecoderBlock's output rate (frame = 4 latent steps).
        self._block_rates: list[int] = []
        r = self.latent_per_frame
        for layer in model.decoder.model:
            if isinstance(layer, DecoderBlock):
                r *= int(layer.block[1].stride[0])  # block = [Snake, ConvTranspose, ...]
                self._block_rates.append(r)
        if not self._block_rates or self._block_rates[-1] != samples_per_frame:
            raise CodecError(f"SNAC decoder rates give {r} samples per frame, expected {samples_per_frame}")
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # CUDA: decode on a stream of its own, overlapping the model's steps (see launch_jobs)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # its own pinned ring, as MimiStreamingDecoder's: the engine's ring never waits for a
        # copy queued behind this stream's backlog
        self.staging = PinnedStaging(self.device) if self.stream is not None else None
        if kernels not in KERNEL_CHOICES:
            raise CodecError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
        self.fused = None
        if kernels == "triton" or (kernels == "auto" and self.device.type == "cuda"):
            self.fused = self._build_fused(matmul_precision, tiles, tables, required=kernels == "triton")
        if self.fused is not None and self.device.type == "cuda":
            self._warm_up(required=kernels == "triton", tiles_given=tiles is not None)
        self.kernels = "triton" if self.fused is not None else "torch"
        self._decode = self._decode_fused if self.fused is not None else self.decode_torch
        self.graphs = None  # runner.codecs.graphs.CodecGraphs: launches of these window lengths replay
        if graph_windows and self.fused is not None and self.device.type == "cuda":
            self.graphs = CodecGraphs(lambda c, s, n: float_to_s16(self._decode_fused(c, s, n)), self.device,
                                      list(graph_windows), graph_max_rows, FRAME_WIDTH, samples_per_frame)

    def _build_fused(self, precision: str, tiles, tables: Tables | None, required: bool):
        if snac_kernels is None:
            if required:
                raise CodecError(f"CodecConfig.kernels: 'triton' needs the triton package ({_NO_TRITON})") from _NO_TRITON
            _log.warning("triton is not installed; SNAC decodes with the torch path")
            return None
        salts = [noise_salts(i) for i in range(len(self._block_rates))]
        try:
            return snac_kernels.FusedSnacDecoder(self.model, self._block_rates, salts, ORPHEUS_LEVELS, precision, tiles,
                                                 tables)
        except ValueError as e:
            if required:
                raise CodecError(f"CodecConfig.kernels: the fused SNAC decoder cannot run this model: {e}") from e
            _log.warning("fused SNAC decoder unavailable (%s); using the torch path", e)
            return None

    def _warm_up(self, required: bool, tiles_given: bool) -> None:
        """Compile the ~10 kernels now (a 1-frame window: one binary serves every window length
        and batch), not in the first request's step. If the default tiles do not compile on
        this GPU (shared memory), retry with small ones; if nothing runs, "auto" keeps the
        torch path instead of failing the stage."""
        safe = snac_kernels.SAFE_TILES
        candidates = [self.fused.tiles] + ([] if tiles_given or self.fused.tiles == safe else [safe])
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        codes = torch.zeros(1, 1, 7, dtype=torch.int64, device=self.device)
        for tiles in candidates:
            self.fused.tiles = tiles
            try:
                self._decode_fused(codes, zero, zero)
                return
            except Exception as e:  # noqa: BLE001 - OutOfResources, compiler and driver errors: fall back, log
                err = e
                _log.error("fused SNAC decoder with %s failed on %s: %s: %s", tiles, self.device, type(e).__name__, e)
        if required:
            raise err
        _log.error("fused SNAC decoder unusable; using the torch path")
        self.fused = None

    def decode(self, codes: torch.Tensor, window_start: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """codes (B, W, 7) long; window_start, seeds (B,) long -> float audio (B, W * spf).

        Output sample i of row b is absolute sample window_start[b] * spf + i (all SNAC
        decoder layers are length-preserving 'same' convs or exact x-stride upsamplers).
        The decoder ends in tanh, so values lie in [-1, 1].
        """
        return self._decode(codes, window_start, seeds)

    @torch.inference_mode()
    def _decode_fused(self, codes: torch.Tensor, window_start: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        return self.fused.decode(codes, window_start, seeds)

    @torch.inference_mode()
    def decode_torch(self, codes: torch.Tensor, window_start: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """The torch path (the reference the fused kernels are tested against)."""
        z = self.model.quantizer.from_codes(frames_to_levels(codes))  # (B, latent, 4W)
        x = z.to(self.dtype)
        block = 0
        for layer in self.model.decoder.model:
            if not isinstance(layer, DecoderBlock):
                x = layer(x)
                continue
            rate = self._block_rates[block]
            for sub in layer.block:
                if isinstance(sub, NoiseBlock):
                    noise = positional_noise(seeds, block, window_start * rate, x.shape[-1]).to(x.dtype)
                    x = x + noise * sub.linear(x)  # NoiseBlock.forward with positional noise
                else:
                    x = sub(x)
            block += 1
        return x[:, 0, :]  # (B, W * spf)

    def decode_jobs(self, windows: list[np.ndarray], jobs: list[WindowJob], seeds: list[int]) -> list[np.ndarray]:
        """Decode equal-length windows in one call; return each job's emitted int16 PCM.

        windows[i]: (W, 7) codes of jobs[i]'s window. Float results of a row do not depend
        on the other rows except through kernel choice/blocking for a different batch size,
        i.e. float rounding: after int16 rounding that is at most 1 LSB, and sample counts
        are always exact.
        """
        return self.launch_jobs(windows, jobs, seeds).get()

    def launch_jobs(self, windows: list[np.ndarray], jobs: list[WindowJob], seeds: list[int]) -> PendingPCM:
        """Start decoding; on CUDA the work runs on the codec's own stream and lands in pinned
        host memory, so neither the model's stream nor the host waits for it here. The whole
        (B, W * spf) int16 block is copied and each job's emitted part is cut on the host: one
        copy instead of a device slice per window (host time grows with the batch otherwise)."""
        cuts = [j.emit_slice(self.samples_per_frame) for j in jobs]
        if self.stream is None:
            codes = torch.from_numpy(np.stack(windows)).to(self.device)
            starts = torch.tensor([j.window_start for j in jobs], dtype=torch.int64, device=self.device)
            seed_t = torch.tensor(seeds, dtype=torch.int64, device=self.device)
            pcm = float_to_s16(self.decode(codes, starts, seed_t)).cpu()  # (B, W * spf) int16
            return PendingPCM(pcm, cuts, None)
        with torch.cuda.stream(self.stream):
            # inputs come from the host only: no dependency on the model's stream
            # rows padded to an even length: meta[1] then starts 16-byte aligned for any batch
            # size, so Triton keeps one pointer specialisation (an odd batch compiled a second)
            n, w = len(jobs), windows[0].shape[0]
            pad = [0] * (n % 2)
            staging = self.staging  # no pinned block per copy
            meta = staging.to_device(np.array([[j.window_start for j in jobs] + pad, list(seeds) + pad], dtype=np.int64))
            codes = staging.to_device(np.stack(windows))
            # the PCM stays here until the stage collects it (steps later): a block of its own
            host = torch.empty((n, w * self.samples_per_frame), dtype=torch.int16, pin_memory=True)
            if self.graphs is not None and w in self.graphs.window_lengths:
                self.graphs.run(codes, meta, host)
            else:
                host.copy_(float_to_s16(self.decode(codes, meta[0, :n], meta[1, :n])), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return PendingPCM(host, cuts, event)


@dataclass
class PendingPCM:
    """PCM of one batched decode, possibly still being computed and copied to the host."""

    host: torch.Tensor  # (B, W * spf) int16 on the host
    cuts: list[tuple[int, int]]  # emitted samples [lo, hi) of each row
    event: torch.cuda.Event | None

    @property
    def ready(self) -> bool:
        """The copy has landed (get() will not wait)."""
        return self.event is None or self.event.query()

    def get(self) -> list[np.ndarray]:
        if self.event is not None:
            self.event.synchronize()
        pcm = self.host.numpy()
        return [pcm[i, lo:hi] for i, (lo, hi) in enumerate(self.cuts)]


T = TypeVar("T")


class Launches(Generic[T]):
    """A codec stage's decode launches in flight, oldest first (the SNAC and Mimi stages): each
    holds a tag (what the stage needs to route its rows), its PendingPCM and a weight counted
    against the stage's in-flight bound. Launches run in order on the codec's one stream, so the
    finished ones are a prefix."""

    def __init__(self) -> None:
        self._queue: deque[tuple[T, PendingPCM, int]] = deque()
        self.weight = 0  # summed over the launches in flight

    def add(self, tag: T, pending: PendingPCM, weight: int = 1) -> None:
        self._queue.append((tag, pending, weight))
        self.weight += weight

    def collect(self, wait: bool, bound: int) -> list[tuple[T, list[np.ndarray]]]:
        """(tag, rows' PCM) of the finished launches, oldest first: those that have landed, all
        of them when `wait`, and the oldest while more than `bound` weight is in flight (waiting
        for those, so the bound holds on return)."""
        out = []
        queue = self._queue
        while queue:
            tag, pending, weight = queue[0]
            if not (wait or self.weight > bound or pending.ready):
                break
            queue.popleft()
            self.weight -= weight
            out.append((tag, pending.get()))
        return out

    def __len__(self) -> int:
        return len(self._queue)


def offline_decode(decoder: SnacWindowDecoder, codes: np.ndarray, policy: WindowPolicy, seed: int = 0) -> np.ndarray:
    """The reference: the window rule over the complete (n, 7) code sequence, one window at a time."""
    codes = np.asarray(codes, dtype=np.int64)
    out = [np.zeros(0, dtype=np.int16)]
    for job in plan_offline(policy, codes.shape[0]):
        out += decoder.decode_jobs([codes[job.window_start : job.window_end]], [job], [seed])
    return np.concatenate(out)

