"""The glue that reads vLLM internals, all of it (vLLM VLLM_VERSION exactly, V1 model runner).

Per-request hidden states and sampled tokens streamed per step, without a fork:

- `OmniWorker` (vLLM's `worker_cls`, which Ray workers honour too) builds `OmniModelRunner`.
- `OmniModelRunner` registers the layers the engine keeps as EAGLE-3 auxiliary hidden-state
  layers (`set_aux_hidden_state_layers`), so they are outputs of the compiled graph, and in
  `sample_tokens` reads the forward state the runner kept (`execute_model_state`): each
  opted-in request's rows for the positions computed this step go to `pooler_output[i]`
  (copied on the async output stream where the step's output is copied).
- The scheduler forwards `pooler_output` as `pooling_output` beside `new_token_ids`;
  `HiddenRowsOutputProcessor` takes the rows off before the stock processor would turn the
  output into a pooling one and drop the tokens. `OmniAsyncLLM` installs it before the output
  handler captures the processor (swapping it later does not work).
- `CodeWindowLogitsProcessor`: a model family's logits constraint (Orpheus: the audio-code
  window of the token being sampled) as a vLLM logits processor.

Requests opt in through `SamplingParams.extra_args` (HIDDEN_KEY: layer list, AUDIO_KEY: True);
the engine's settings travel in `additional_config[CONFIG_KEY]`. Everything here runs in
vLLM's worker processes or its output handler, so it touches only torch and vLLM objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
from vllm.distributed.parallel_state import get_pp_group
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.platforms import current_platform
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import reserve_aux_intermediate_tensor_slots

from runner.families import family_for
from streaming.profile import ModelProfile

if current_platform.is_cpu():  # the CPU worker builds its runner in init_device (no seam there)
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner as _PlatformRunner
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as _PlatformRunner
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker

CONFIG_KEY = "omnistream"  # additional_config[CONFIG_KEY]: {"hidden_layers": [...], "profile": {...}}
HIDDEN_KEY = "omnistream_hidden"  # extra_args: HF layer indices (0..num_layers), in the request's order
AUDIO_KEY = "omnistream_audio"  # extra_args: sample under the family's logits constraint
WORKER_CLS = f"{__name__}.OmniWorker"
POS_BYTES = 8  # a packed row block starts with its first position, int64


# ---- hidden rows: worker side ----------------------------------------------------------------


def pack_rows(first: int, rows: torch.Tensor) -> torch.Tensor:
    """(first position, rows [n, L, H] on the host) -> one uint8 tensor (a pooler output)."""
    head = torch.tensor([first], dtype=torch.int64).view(torch.uint8)
    return torch.cat([head, rows.contiguous().view(-1).view(torch.uint8)])


def unpack_rows(packed: torch.Tensor, num_layers: int, hidden: int, dtype: np.dtype) -> tuple[int, np.ndarray]:
    """The other end of pack_rows: (first position, [n, num_layers, hidden] array of dtype)."""
    raw = packed.numpy()
    first = int(raw[:POS_BYTES].view(np.int64)[0])
    return first, raw[POS_BYTES:].view(dtype).reshape(-1, num_layers, hidden)


@dataclass
class _StepRows:
    """One step's rows of the opted-in requests, on the host once `event` (if any) fired."""

    rows: dict[str, tuple[int, torch.Tensor]]  # req id -> (first position, [n, L, H])
    event: object | None  # a CUDA event after the device-to-host copies

    def attach(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        if self.event is not None:
            self.event.synchronize()
        out.pooler_output = [pack_rows(*self.rows[r]) if r in self.rows else None for r in out.req_ids]
        return out


class _RowsAfter(AsyncModelRunnerOutput):
    """Async scheduling: the step's output with the rows attached once both have landed."""

    def __init__(self, inner: AsyncModelRunnerOutput, rows: _StepRows):
        self._inner, self._rows = inner, rows

    def get_output(self) -> ModelRunnerOutput:
        return self._rows.attach(self._inner.get_output())


class OmniModelRunner(_PlatformRunner):
    """The platform's V1 model runner, streaming the hidden rows requests ask for."""

    def __init__(self, vllm_config, device: torch.device):
        super().__init__(vllm_config, device)
        num_layers = self.model_config.hf_text_config.num_hidden_layers  # a multimodal model: its decoder
        kept = tuple((vllm_config.additional_config or {}).get(CONFIG_KEY, {}).get("hidden_layers", ()))
        self._omni_num_layers = num_layers
        # inner layers come out of the graph as auxiliary outputs; num_layers is the final norm's
        # output, which the runner has anyway
        self._omni_aux = tuple(sorted(l for l in kept if l < num_layers))
        self._omni_aux_index = {l: i for i, l in enumerate(self._omni_aux)}
        # Earlier pipeline stages hand their auxiliary rows on inside the intermediate tensors
        # (the model's layer setting does that); only the last stage's forward returns
        # (hidden, aux), and the runner unpacks it when this flag is on.
        if self._omni_aux and get_pp_group().is_last_rank:
            self.use_aux_hidden_state_outputs = True

    def _setup_eagle3_aux_hidden_state_outputs(self) -> None:
        if not self._omni_aux:
            return
        if not supports_eagle3(self.get_model()):
            raise RuntimeError(f"{type(self.get_model()).__name__} cannot return inner layers' hidden states in vLLM "
                               f"(no EAGLE-3 interface): start with --vllm-hidden-state-layers none (or {self._omni_num_layers})")
        self.model.set_aux_hidden_state_layers(self._omni_aux)
        pp = get_pp_group()
        if pp.world_size > 2:
            # a middle stage would have to relay the rows of the stages before it, which
            # vLLM's V1 runner does not do
            raise RuntimeError("hidden states of inner layers need --pipeline-parallel-size <= 2 on vLLM's V1 runner: "
                               f"start with --vllm-hidden-state-layers none (or {self._omni_num_layers})")
        # the last stage receives the first stage's rows inside the intermediate tensors: give
        # its receive buffers their slots (vLLM's own helper, written for its V2 runner)
        reserve_aux_intermediate_tensor_slots(self.model)

    def sample_tokens(self, grammar_output):
        state = self.execute_model_state
        rows = self._omni_take_rows(state) if state is not None else None
        out = super().sample_tokens(grammar_output)
        if rows is None:
            return out
        if isinstance(out, AsyncModelRunnerOutput):
            return _RowsAfter(out, rows)
        return rows.attach(out)

    def _omni_take_rows(self, state) -> _StepRows | None:
        """The rows of this step's positions for every request that asked, copied off the
        forward's buffers (a graph's outputs are overwritten by the next step)."""
        so = state.scheduler_output
        wanted = []
        for req_id in so.num_scheduled_tokens:
            extra = self.requests[req_id].sampling_params.extra_args
            if extra and extra.get(HIDDEN_KEY):
                wanted.append((req_id, extra[HIDDEN_KEY]))
        if not wanted:
            return None
        first = {d.req_id: d.num_computed_tokens for d in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        first.update(zip(cached.req_ids, cached.num_computed_tokens))
        qsl, index = self.query_start_loc.np, self.input_batch.req_id_to_index
        aux, final = state.aux_hidden_states, state.hidden_states
        picked = {}
        for req_id, layers in wanted:
            i = index[req_id]
            s, e = int(qsl[i]), int(qsl[i + 1])
            picked[req_id] = (first[req_id], torch.stack(
                [final[s:e] if l == self._omni_num_layers else aux[self._omni_aux_index[l]][s:e] for l in layers], dim=1))
        if self.device.type != "cuda":
            return _StepRows(picked, None)  # torch.stack made copies already
        stream = self._get_or_create_async_output_copy_stream()
        stream.wait_stream(torch.cuda.current_stream())
        host = {}
        with torch.cuda.stream(stream):
            for req_id, (pos, dev) in picked.items():
                h = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
                h.copy_(dev, non_blocking=True)
                dev.record_stream(stream)
                host[req_id] = (pos, h)
            event = torch.cuda.Event()
            event.record(stream)
        return _StepRows(host, event)


class OmniWorker(_PlatformWorker):
    """vLLM's worker for the platform, with OmniModelRunner (the V1 runner: the engine process
    sets VLLM_USE_V2_MODEL_RUNNER=0)."""

    def _make_model_runner(self):
        if self.use_v2_model_runner:
            raise RuntimeError("the omnistream vLLM backend needs vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        return OmniModelRunner(self.vllm_config, self.device)

    if current_platform.is_cpu():
        def init_device(self) -> None:
            super().init_device()
            # CPUWorker.init_device constructs its CPUModelRunner inline; replace it before the
            # model is loaded (the first one holds only input buffers)
            self.model_runner = self._make_model_runner()


# ---- the family's logits constraint -----------------------------------------------------------


class CodeWindowLogitsProcessor(LogitsProcessor):
    """Rows of requests with extra_args[AUDIO_KEY] sample only inside the family's window for
    their next output token (runner/families: Orpheus's audio-code slot k % 7, the end token at
    frame boundaries). The window's logits are kept, every other id is -inf: the distribution
    the native engine samples from (it computes only the window)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        raw = (vllm_config.additional_config or {}).get(CONFIG_KEY, {}).get("profile")
        profile = msgspec.convert(raw, ModelProfile) if raw is not None else None
        self.constraint = family_for(profile).logits_constraint("torch") if profile is not None else None
        self.device = device
        # batch index -> the request's output token list (vLLM keeps it current, placeholders
        # for tokens still on the device included, so its length is the next token's index)
        self.outputs: dict[int, list[int]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if self.constraint is not None:
            process_dict_updates(self.outputs, batch_update, self._track)

    @staticmethod
    def _track(params, _prompt, output_ids: list[int]) -> list[int] | None:
        return output_ids if params.extra_args and params.extra_args.get(AUDIO_KEY) else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.outputs:
            return logits
        rows = torch.tensor(sorted(self.outputs), dtype=torch.int64, device=logits.device)
        out_index = torch.tensor([len(self.outputs[i]) for i in sorted(self.outputs)], dtype=torch.int64,
                                 device=logits.device)
        c = self.constraint
        window = c.gather_window(logits[rows], out_index)  # [R, W]
        width = window.shape[1]
        cols = torch.arange(width, device=logits.device).repeat(len(rows))
        ids = c.window_ids(cols, out_index.repeat_interleave(width)).view(len(rows), width)
        masked = torch.full((len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device)
        logits[rows] = masked.scatter_(1, ids, window.to(logits.dtype))
        return logits


# ---- the front of vLLM: rows off the outputs -------------------------------------------------


HiddenSink = Callable[[str, torch.Tensor], None]  # (request id, packed rows)


class HiddenRowsOutputProcessor(OutputProcessor):
    """Hands each output's packed rows to `sink` and clears them, so the stock processing
    sees a token output (it would otherwise make a pooling output and drop the tokens). The
    sink runs before the step's tokens reach the request's queue."""

    def __init__(self, *args, sink: HiddenSink, **kwargs):
        super().__init__(*args, **kwargs)
        self._sink = sink
        self.scheduler_stats = None  # the latest SchedulerStats (the engine's stats read it)

    def update_scheduler_stats(self, scheduler_stats) -> None:
        super().update_scheduler_stats(scheduler_stats)
        if scheduler_stats is not None:
            self.scheduler_stats = scheduler_stats

    def process_outputs(self, engine_core_outputs, *args, **kwargs):
        for eco in engine_core_outputs:
            if eco.pooling_output is not None:
                state = self.request_states.get(eco.request_id)
                if state is not None:
                    self._sink(state.external_req_id, eco.pooling_output)
                eco.pooling_output = None
        return super().process_outputs(engine_core_outputs, *args, **kwargs)


class OmniAsyncLLM(AsyncLLM):
    """AsyncLLM whose output processor is HiddenRowsOutputProcessor. The output handler
    captures the processor when it starts (in __init__ when an event loop is running), so the
    swap happens right before that."""

    def __init__(self, *args, hidden_sink: HiddenSink, **kwargs):
        self._hidden_sink = hidden_sink
        super().__init__(*args, **kwargs)
        self._install_output_processor()

    def _run_output_handler(self):
        self._install_output_processor()
        super()._run_output_handler()

    def _install_output_processor(self) -> None:
        op = self.output_processor
        if isinstance(op, HiddenRowsOutputProcessor):
            return
        if op.request_states:
            raise RuntimeError("the output processor can only be replaced before the first request")
        self.output_processor = HiddenRowsOutputProcessor(
            op.tokenizer, log_stats=op.log_stats, stream_interval=op.stream_interval,
            tracing_enabled=op.tracing_enabled, admission_stats=op.admission_stats, sink=self._hidden_sink)
