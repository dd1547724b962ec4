"""In-process engine: add_request / abort_request / step().

One step reads like its description: schedule, execute, sample, emit. With async scheduling the
emit of step N happens after step N+1 was scheduled and launched, so the device never waits
for the host to look at step N's tokens.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from runner.config import EngineConfig
from runner.engine.admission import check_layers, check_prompt, family_parts
from runner.engine.kv_cache import BlockManager, num_kv_blocks
from runner.engine.model_runner import ModelRunner
from runner.engine.output_copier import AsyncOutput, StepResult
from runner.engine.phase_timer import PhaseTimer
from runner.engine.frame_runner import FrameRunner
from runner.engine.request import FinishReason, Request, Status
from runner.engine.warm_up import WarmUp
from runner.engine.scheduler import Scheduler, SchedulerOutput
from runner.families.base import CodecStageLike, EncodedReference, ModelFamily
from runner.families.text import TextFamily
from runner.layers import make_backends
from runner.layers import pick_sampling_backend as pick_backend
from runner.layers.attention import kv_bytes_per_token
from streaming import ipc
from streaming.ipc import EngineStats, RequestOutput
from streaming.profile import ModelProfile
from streaming.sampling_params import InvalidRequest, SamplingParams

log = logging.getLogger(__name__)


class EngineBusy(RuntimeError):
    """add_request: the request is valid but the engine has no room for it now (its codec's
    per-stream state is all in use); nothing was registered. The engine process answers it as
    overloaded (streaming.ipc.FINISH_OVERLOADED)."""


@dataclass
class _Pending:
    sched: SchedulerOutput
    out: AsyncOutput


class Engine(WarmUp):
    # Host seconds per phase, summed over steps (`phase_s`; the engine process logs them):
    # schedule, execute (pack inputs + launch the forward), sample (launch), emit (wait for the
    # emitted step's ids + bookkeeping), codec (collect + launch windows).
    PHASES = ("schedule", "execute", "sample", "emit", "codec")

    def __init__(self, cfg: EngineConfig, model: torch.nn.Module | None = None, family: ModelFamily | None = None,
                 codec: CodecStageLike | None = None):
        """family: the model family (default: a plain language model); codec: its codec stage
        (family.build_codec), None for an engine that serves no audio."""
        self.cfg = cfg
        self.device = cfg.runner.torch_device
        self.family = family or TextFamily(ModelProfile(family="text", speech=None))
        if model is None:
            attn, ops = make_backends(cfg.runner)
            model = self.family.load_model(cfg, attn, ops)
        self.model = model
        self.num_blocks = num_kv_blocks(cfg, kv_bytes_per_token(cfg.model, cfg.runner.torch_dtype))
        self.blocks = BlockManager(self.num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching)
        self.scheduler = Scheduler(cfg.scheduler, self.blocks, frozenset(cfg.model.eos_token_ids))
        self.codec = codec
        # a multi-codebook family yields a frame of K codes per row per step (FrameRunner)
        self.frames = self.family.codes_per_frame > 1
        constraint = None
        self._audio_stop_ids: tuple[int, ...] = ()
        if codec is not None:
            constraint = self.family.logits_constraint(pick_backend(self.device, cfg.runner.sampler_backend))
            self._audio_stop_ids = self.family.stop_token_ids()
        if self.frames:
            self.runner = FrameRunner(cfg, self.model, self.num_blocks, self.family.frame_layout(),
                                      self.family.code_limit(codec))
        else:
            self.runner = ModelRunner(cfg, self.model, self.num_blocks, constraint, lambda r: r.audio)
        # the GPU streams a step's work runs on, named for the stall report (gpu_streams_busy)
        self._streams: dict[str, torch.cuda.Stream] = {}
        if self.device.type == "cuda":
            self._streams = {"step": torch.cuda.current_stream(self.device), "output copy": self.runner.copier.stream}
            if codec is not None and codec.stream is not None:
                self._streams["codec"] = codec.stream
        self.requests: dict[str, Request] = {}
        self._pending: _Pending | None = None
        self._finished_out: list[RequestOutput] = []  # outputs produced outside a step (aborts)
        self._audio_open: dict[int, Request] = {}  # codec streams not yet fully emitted
        self.step_count = 0
        self.phase_s = [0.0] * len(self.PHASES)
        self.last_scheduled = SchedulerOutput()  # what the latest step ran (for the slow-step log)
        # (step number, what it ran) of the last two launched steps: with async scheduling the
        # host waits on the older one while the newer is queued behind it (the stall report)
        self.launched: deque[tuple[int, SchedulerOutput]] = deque(maxlen=2)
        self.num_requests_total = 0
        self.num_aborted_total = 0
        self.num_refused_total = 0  # add_request: EngineBusy (no room), counted for /metrics
        self.num_generated_total = 0

    # ---- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams | None = None,
        hidden_state_layers: tuple[int, ...] | list[int] = (),
        audio: bool = False,
        prompt_frames: list[list[int]] | np.ndarray | None = None,
        step_text_ids: list[int] | None = None,
        group_sampling: SamplingParams | None = None,
        prompt_vectors: list[ipc.PromptVector] | None = None,
        step_text_open: bool = False,
    ) -> None:
        """Validate and queue a request. Raises InvalidRequest naming the field, or EngineBusy
        when there is no room for it; the engine and the other requests are unaffected. prompt_frames: a multi-codebook model's codes of the
        prompt's audio positions ([n, K], ModelFamily.prompt_frames). step_text_ids: the text
        ids fed with the generated frames, one a frame (ModelFamily.step_text: Qwen3-TTS's
        trailing text). group_sampling: parameters of codebooks 1..K-1 where the family samples
        them apart (FrameLayout.group_sampling; None: the family's defaults). prompt_vectors:
        vectors added over prompt positions' embeddings (ModelFamily.prompt_vectors: Qwen3-TTS
        Base's x-vector). step_text_open: more step text ids will come (append_text), the
        row waits for each one it needs."""
        sampling = sampling or SamplingParams()
        m, s = self.cfg.model, self.cfg.scheduler
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("request_id", "must be a non-empty string")
        if request_id in self.requests:
            raise InvalidRequest("request_id", f"{request_id!r} is already in use by a running request")
        check_prompt(prompt_token_ids, m.vocab_size, s.max_model_len, self.num_blocks * self.cfg.cache.block_size)
        sampling.validate(m.vocab_size, self.family.codes_per_frame, code0_penalty=self.code0_penalty)
        layers = tuple(hidden_state_layers)
        check_layers(layers, m.num_layers)
        if audio:
            if self.codec is None:
                raise InvalidRequest("audio", "this engine has no codec stage loaded")
            # (a multi-codebook model's end frame is its eos id already: ignore_eos keeps its say)
            missing = [t for t in self._audio_stop_ids if t not in sampling.stop_token_ids] if not self.frames else []
            if missing:
                sampling = msgspec.structs.replace(sampling, stop_token_ids=[*sampling.stop_token_ids, *missing])
        parts = family_parts(self.family, self.runner.layout.num_codebooks if self.frames else None,
                             prompt_token_ids, prompt_frames, step_text_ids, step_text_open, group_sampling,
                             prompt_vectors, audio)
        if audio and not self.codec.can_open():
            self.num_refused_total += 1
            raise EngineBusy("audio: the codec's streams are all in use by other requests; retry later")
        req = Request(request_id, list(prompt_token_ids), sampling, layers, audio, frames=parts.frames,
                      group_sampling=parts.group_sampling, vectors=parts.vectors, open_text=parts.open_text)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.num_requests_total += 1
        if audio:
            self.codec.open(id(req), seed=sampling.seed, prefix_frames=parts.codec_prefix)
            self._audio_open[id(req)] = req

    def append_text(self, request_id: str, step_text_ids: list[int], final: bool) -> bool:
        """More step text ids of a request added with step_text_open (its text streaming in);
        final: no more will come (its frames then take the pad id past the last). False when
        the request is gone (finished or aborted: its text no longer matters); InvalidRequest
        naming `step_text_ids` for a bad id or a request whose text was already complete."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        if req.open_text is None:
            raise InvalidRequest("step_text_ids", f"request {request_id!r} takes no more text (its text was complete)")
        ids = self.family.step_text(list(step_text_ids)).ids  # the family's check of the ids
        req.open_text.extend(ids, final)
        req.frames.refresh_text()
        if final:
            req.open_text = None
        return True

    @property
    def stalled_on_input(self) -> bool:
        """The last step scheduled nothing and none is in flight or to report: every live
        request waits for its text (append_text) or admission. The loop may then block on its
        inbound messages for a moment instead of spinning."""
        return self.last_scheduled.is_empty and self._pending is None and not self._finished_out

    def encode_audio(self, pcm: np.ndarray) -> EncodedReference:
        """A reference clip (int16 mono at the codec's rate) -> its codes [frames, K] (the
        family's reference format: a voice prompt's frames) and any speaker vector. InvalidRequest when the model
        takes no reference audio. Runs between steps; uploads are rare."""
        if self.codec is None:
            raise InvalidRequest("audio", "this engine has no codec stage loaded")
        return self.family.encode_reference(self.codec, pcm)

    def abort_request(self, request_id: str) -> bool:
        """Abort a live request: its blocks and slot are free before the next step. Returns
        False when the id is unknown or already finished."""
        return self._end(request_id, FinishReason.ABORT)

    def fail_request(self, request_id: str, error: InvalidRequest) -> bool:
        """End a live request with `error` (a message it could not take, e.g. a bad
        AppendText): its last output carries the error; the engine and the others go on."""
        return self._end(request_id, FinishReason.ERROR, str(error))

    def _end(self, request_id: str, reason: FinishReason, message: str = "") -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.num_aborted_total += reason is FinishReason.ABORT
        if not req.is_finished:
            self.scheduler.finish(req, reason, message)
        if self._audio_open.pop(id(req), None) is not None:
            self.codec.abort(id(req))
        self._finished_out.append(self._output(req, [], finished=True))
        return True

    @property
    def code0_penalty(self) -> bool:
        """Whether requests may give sampling.repetition_penalty to a multi-codebook family's
        code 0 (its FrameLayout's Code0Rule; streaming.ipc.Ready carries it to the front end)."""
        return self.frames and self.runner.layout.code0_penalty

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests) or self._pending is not None or bool(self._finished_out)

    # ---- the step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, sample, emit (then the codec's turn). With async scheduling the
        tokens emitted are those of the step launched before this one: step N's emit waits for
        its ids only after step N+1 is on the device, so the device never waits for the host."""
        with self.timer("schedule"):
            sched = self.last_scheduled = self.scheduler.schedule()
        launched = None
        if not sched.is_empty:
            with self.timer("execute"):
                self.runner.execute_model(sched)
            with self.timer("sample"):
                launched = _Pending(sched, self.runner.sample_tokens())
                self.step_count += 1
                self.launched.append((self.step_count, sched))
        with self.timer("emit"):
            ready = self._hand_over(launched)
            results = self._emit(ready) if ready is not None else []
        if self.codec is not None and self._audio_open:
            with self.timer("codec"):
                # with no model work queued the host would only spin on the codec: wait for it
                idle = sched.is_empty and self._pending is None
                results = self._merge(results, self._codec_step(wait=idle))
        return self._finish_failed() + results

    @property
    def phase_s(self) -> list[float]:
        """Host seconds per phase (PHASES order), summed since the last reset."""
        return self.timer.seconds

    @phase_s.setter
    def phase_s(self, seconds: list[float]) -> None:
        # a reset (__init__, warm_up, the engine process's periodic log): a timer on the new list
        self.timer = PhaseTimer(self.PHASES, seconds)

    def _hand_over(self, launched: _Pending | None) -> _Pending | None:
        """The step whose tokens to emit now: with async scheduling the one launched before
        (`_pending`, held one step), and `launched` waits in its place; else `launched`."""
        if not self.cfg.scheduler.async_scheduling:
            return launched
        ready, self._pending = self._pending, launched
        return ready

    def _finish_failed(self) -> list[RequestOutput]:
        """Final outputs of requests that ended outside a step's tokens: aborts, and requests
        the scheduler failed (e.g. could never fit the KV cache). They go first."""
        for req in self.scheduler.failed:
            self._forget(req)
            if self._audio_open.pop(id(req), None) is not None:
                self.codec.abort(id(req))
            self._finished_out.append(self._output(req, [], finished=True))
        self.scheduler.failed.clear()
        out, self._finished_out = self._finished_out, []
        return out

    def _emit(self, p: _Pending) -> list[RequestOutput]:
        res: StepResult = p.out.get()
        accepted = self.scheduler.update_from_output(p.sched, res.sampled, res.frames)
        self.num_generated_total += len(accepted)
        by_req: dict[int, RequestOutput] = {}
        audio: list[tuple[int, object]] = []  # (codec key, token or frame), handed over in one call
        closed: list[int] = []
        # this loop runs for every row of every step: locals, and status read directly
        frames, finished, stop = self.frames, Status.FINISHED, FinishReason.STOP
        for req, tok in accepted:
            if req.audio:
                # Tokens of an audio request travel with its next audio chunk or its finish
                # (_codec_step): a message per token would be ~40x the traffic for no reader.
                key = id(req)
                if req.status is finished:
                    closed.append(key)
                    if frames and req.finish_reason is stop:
                        continue  # the frame that ends the audio is not audio
                # a multi-codebook request's frame just accepted (the last row of its FrameLog)
                audio.append((key, req.frames.last() if frames else tok))
                continue
            o = by_req[id(req)] = self._output(req, [tok], finished=False)
            if req.is_finished:
                o.finished, o.finish_reason = True, req.finish_reason.value
                o.error = req.finish_message or None
                self._forget(req)
        if audio:
            self.codec.push_many(audio)
        for key in closed:  # after its last token (a step may end a stream and push nothing: its
            self.codec.close(key)  # stop frame is not audio, and it may be the step's only row)
        reqs = {id(e.req): e.req for e in p.sched.scheduled} if res.hidden else {}
        for rid, (first, rows) in res.hidden.items():
            req = reqs[rid]
            if req.is_finished and rid not in by_req:
                continue  # a step scheduled after the request ended (stop, abort): never emitted
            o = by_req.get(rid) or by_req.setdefault(rid, self._output(req, [], finished=False))
            o.hidden, o.hidden_positions = rows, (first, first + rows.shape[0])
        return list(by_req.values())

    def _codec_step(self, wait: bool) -> list[RequestOutput]:
        """Outputs of audio requests: PCM chunks, errors, completion; each carries the
        request's tokens accepted since its previous output."""
        outs = []
        for key, r in self.codec.step(wait).items():
            req = self._audio_open.get(key)
            if req is None:
                continue
            o = self._output(req, req.output_token_ids[req.num_output_tokens_sent :], finished=False,
                             first=req.num_output_tokens_sent)
            req.num_output_tokens_sent = req.num_output_tokens
            if r.pcm is not None and len(r.pcm):
                o.audio = r.pcm
            if r.error is not None:
                if not req.is_finished:
                    self.scheduler.finish(req, FinishReason.ERROR, r.error)
                o.finished, o.finish_reason, o.error = True, FinishReason.ERROR.value, r.error
            elif r.done:
                o.finished, o.finish_reason = True, req.finish_reason.value
                o.error = req.finish_message or None
            if o.finished:
                if r.error:
                    self.codec.abort(key)
                del self._audio_open[key]
                self._forget(req)
            if o.audio is not None or o.finished:
                outs.append(o)
        return outs

    @staticmethod
    def _merge(a: list[RequestOutput], b: list[RequestOutput]) -> list[RequestOutput]:
        """Fold codec outputs into the step's token outputs (one output per request per step)."""
        idx = {o.request_id: o for o in a}
        for o in b:
            t = idx.get(o.request_id)
            if t is None:
                a.append(o)
                continue
            t.new_token_ids = t.new_token_ids + o.new_token_ids
            if o.frames is not None:
                t.frames = o.frames if t.frames is None else np.concatenate([t.frames, o.frames])
            t.audio = o.audio
            t.finished, t.finish_reason, t.error = o.finished, o.finish_reason, o.error
        return a

    def _forget(self, req: Request) -> None:
        # by identity: the id may already belong to a newer request
        if self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]

    def _output(self, req: Request, toks: list[int], finished: bool, first: int | None = None) -> RequestOutput:
        """first: index among the request's outputs of toks[0] (default: the last len(toks))."""
        frames = None
        if req.frames is not None and toks:
            end = req.num_prompt_tokens + (req.num_output_tokens if first is None else first + len(toks))
            frames = req.frames.codes(end - len(toks), end).copy()
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=toks,
            frames=frames,
            finished=finished,
            finish_reason=req.finish_reason.value if finished and req.finish_reason else None,
            error=(req.finish_message or None) if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )

    # ---- introspection -----------------------------------------------------------------------

    def gpu_streams_busy(self) -> str:
        """Which of the engine's GPU streams still have work queued ("step busy, output copy
        busy, codec idle"; "" on the CPU). Safe from another thread: Stream.query only reads.
        A stalled loop whose step stream stays busy while the codec's is idle points at a step
        kernel that does not end; both busy, at the device."""
        return ", ".join(f"{name} {'idle' if s.query() else 'busy'}" for name, s in self._streams.items())

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.blocks.num_free_blocks,
            num_total_blocks=self.num_blocks,
            num_requests_total=self.num_requests_total,
            num_aborted_total=self.num_aborted_total,
            num_preemptions_total=self.scheduler.num_preemptions,
            num_prefix_cache_hit_tokens=self.blocks.hit_tokens_total,
            num_generated_tokens_total=self.num_generated_total,
            step_count=self.step_count,
            active_request_ids=sorted(self.requests),
            num_codec_streams=len(self.codec) if self.codec is not None else 0,
            num_refused_total=self.num_refused_total,
        )

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Convenience for tests and benchmarks: run prompts to completion, return output ids."""
        sps = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        ids = [f"gen-{self.num_requests_total + i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, sps):
            self.add_request(rid, p, sp)
        got: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished:
            for o in self.step():
                got[o.request_id].extend(o.new_token_ids)
        return [got[r] for r in ids]
