"""Engine start-up: one pass through every path a first real request takes, so Triton
compiles and CUDA modules load before the first client, not in its time to first audio.

A mixin of runner/engine/engine.py's Engine (it drives the engine's own add_request / step);
kept apart so the engine module holds the request and step logic only.
"""

from __future__ import annotations

from runner.engine.cuda_graphs import graph_buckets
from runner.engine.model_runner import MAX_TOKEN_ROW_QUERY
from streaming.sampling_params import SamplingParams


class WarmUp:
    def warm_up(self) -> None:
        """Run one audio request through every path a first real request takes (eager prefill,
        graphed decode, the sampler's window variant, the codec's windows of every chunk
        size), so Triton compiles now and not in the first client's time to first audio (seconds
        of it); then, on CUDA, the attention launch of every batch size an eager step can bring
        (ModelRunner.warm_attention), prompts at the row buckets no graph was captured at
        (warm_up_row_buckets), the eager prefill path (warm_up_eager_prefill), the lm_head at
        every row count and the sampler at its largest (ModelRunner.warm_sampling).
        Counters are reset afterwards; the prefix cache keeps the prompts' blocks, which is
        harmless."""
        if self.codec is not None:
            self._warm_up_audio()
        if self.device.type == "cuda":
            self.runner.warm_attention()
            self.warm_up_row_buckets()
            self.warm_up_eager_prefill()
            self.runner.warm_sampling()
        self.num_requests_total = self.num_generated_total = self.step_count = 0
        self.phase_s = [0.0] * len(self.PHASES)

    def _run_to_end(self) -> None:
        while self.has_unfinished:
            self.step()

    def _warm_sampling_params(self, max_tokens: int) -> SamplingParams:
        """A speech request's sampling as the server runs it (codes take no penalties)."""
        if self.frames:
            return SamplingParams(temperature=0.9, top_k=50, max_tokens=max_tokens, seed=0)
        return SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=max_tokens, seed=0)

    def _warm_up_audio(self) -> None:
        sp = self._warm_sampling_params(26 if self.frames else 7 * 26)
        self._add_warm("__warmup__", [i % self.cfg.model.vocab_size for i in range(1, 33)], sp, audio=True)
        self._run_to_end()

    def _add_warm(self, request_id: str, prompt: list[int], sampling: SamplingParams, **kw) -> None:
        """add_request with what the family's requests carry besides their ids (ModelFamily.warm_up_args)."""
        self.add_request(request_id, prompt, sampling, **kw, **self.family.warm_up_args(prompt))

    def warm_up_row_buckets(self) -> None:
        """One prompt alone per graph row bucket above the largest captured one, up to the
        longest prompt chunk a step runs as token rows (MAX_TOKEN_ROW_QUERY). Why: a kernel's
        launch variant (GEMM tile, split count) changes only at bucket sizes
        (runner/kernels/tuning), and the graph captures compile those up to the largest batch
        they hold; a server with few sequences (max_num_seqs 8: graphs up to 8 rows) still runs
        prompt chunks of up to 128 rows eagerly, and each new variant compiled mid-serving (a
        Triton GEMM tile: ~0.3 s, every stream waiting)."""
        sched, run = self.cfg.scheduler, self.cfg.runner
        top = min(MAX_TOKEN_ROW_QUERY, sched.max_num_batched_tokens, sched.max_model_len - 4)
        graphed = min(run.max_graph_batch_size, sched.max_num_seqs) if run.cuda_graphs else 0
        vocab = self.cfg.model.vocab_size
        text = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=1, ignore_eos=True, seed=0)
        for n in graph_buckets(top):
            if n > graphed:  # a salt of its own: no prefix shared with another warm-up prompt
                self._add_warm(f"__warmup_rows{n}__", [(n + 5 * i) % vocab for i in range(n)], text)
                self._run_to_end()

    def warm_up_eager_prefill(self) -> None:
        """Run the eager prefill path once alone (with hidden states) and once joining running
        decodes: prompts past MAX_TOKEN_ROW_QUERY, which no decode graph serves. Without it the
        first such prompt after start-up takes about twice as long as the next one (probably
        CUDA modules loaded on first launch), and every stream of the batch waits for it. The
        lengths here are not the ones the benchmark's `first_use` section times, so that
        section measures other shapes than these. Nothing to do where prompts that long cannot
        occur."""
        longest = self.cfg.scheduler.max_model_len - 4
        if longest <= MAX_TOKEN_ROW_QUERY:
            return
        vocab = self.cfg.model.vocab_size
        text = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=2, ignore_eos=True, seed=0)
        audio = self.codec is not None  # decodes as the server runs them: speech, or text
        decode = self._warm_sampling_params(28) if audio else SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

        def prompt(n: int, salt: int) -> list[int]:
            return [(salt + 7 * i) % vocab for i in range(min(n, longest))]

        self._add_warm("__warmup_prefill__", prompt(2 * MAX_TOKEN_ROW_QUERY + 100, 1), text,
                       hidden_state_layers=() if self.frames else (-1,))
        self._run_to_end()
        n_decodes = min(8, self.cfg.scheduler.max_num_seqs - 1)
        if n_decodes < 1:
            return
        for i in range(n_decodes):  # speech while the codec has streams for them (Mimi: max_streams)
            self._add_warm(f"__warmup_decode{i}__", prompt(16, 100 + i), decode, audio=audio and self.codec.can_open())
        self.step()
        self.step()  # the short prompts are decoding now ...
        self._add_warm("__warmup_join__", prompt(3 * MAX_TOKEN_ROW_QUERY + 77, 2), text)  # ... and a long one joins
        self._run_to_end()

