"""First use after warm-up (the engine section `first_use`): requests whose steps meet a shape
for the first time against the same again, and the prefill SDPA call at new prompt lengths. A
first-use cost (a CUDA module loaded on first launch, a Triton compile, a per-shape SDPA plan)
stalls every stream of the batch in serving."""

from __future__ import annotations

import contextlib
import time

import torch

from deploy.bench.common import in_process_engine, log


def run_first_use(max_num_seqs: int = 64) -> dict:
    """After Engine.warm_up: host time of requests whose steps meet a shape for the first time,
    next to the same kind of request again (new tokens, so no prefix-cache hit). A first-use
    cost (a CUDA module loaded on first launch, a Triton compile) shows as first >> again, and
    in serving every stream waits for it. Cases: eager prefills (prompts past the 128-token
    token-row limit) alone and joining 8 running decodes, and a hidden-state request."""
    from runner.engine.compile_log import recording
    from streaming.sampling_params import SamplingParams

    eng = in_process_engine(max_num_seqs)
    t_warm = time.perf_counter()
    eng.warm_up()
    log(f"  first use: Engine.warm_up took {time.perf_counter() - t_warm:.1f} s")
    with recording() as compiled:  # every Triton compile after warm-up
        g = torch.Generator().manual_seed(7)
        hi = min(100000, eng.cfg.model.vocab_size)
        text = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=2, ignore_eos=True)
        audio = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=300, seed=1)
        n = 0

        def timed(length: int, hidden: bool = False) -> tuple[float, float]:
            """(ms from add_request to its end, longest step ms while it ran)."""
            nonlocal n
            n += 1
            rid = f"first-use-{n}"
            eng.add_request(rid, torch.randint(10, hi, (length,), generator=g).tolist(), text,
                            hidden_state_layers=(-1,) if hidden else ())
            t0, longest, done = time.perf_counter(), 0.0, False
            while not done:
                ts = time.perf_counter()
                done = any(o.request_id == rid and o.finished for o in eng.step())
                longest = max(longest, time.perf_counter() - ts)
            return 1e3 * (time.perf_counter() - t0), 1e3 * longest

        res: dict = {}
        for label, length, hidden in (("prompt 300 alone", 300, False), ("prompt 517 alone", 517, False),
                                      ("hidden states, prompt 50", 50, True)):
            res[label] = {"first": timed(length, hidden), "again": timed(length, hidden), "third": timed(length + 3, hidden)}
        for i in range(8):
            eng.add_request(f"dec-{i}", torch.randint(10, hi, (24,), generator=g).tolist(), audio, audio=True)
        for _ in range(10):
            eng.step()
        res["prompt 400 joining 8 decodes"] = {"first": timed(400), "again": timed(400), "third": timed(403)}
        for r in list(eng.requests):
            eng.abort_request(r)
        while eng.has_unfinished:
            eng.step()
    res["compiled_after_warm_up"] = compiled
    for label, r in res.items():
        if label != "compiled_after_warm_up":
            log(f"  first use: {label}: " + ", ".join(f"{k} {v[0]:.1f} ms (longest step {v[1]:.1f})" for k, v in r.items()))
    log(f"  Triton compiles after warm-up: {compiled or 'none'}")
    del eng
    torch.cuda.empty_cache()
    res["sdpa"] = sdpa_first_use()
    return res


def sdpa_first_use(lengths=(611, 614, 777)) -> dict:
    """The prefill path's SDPA call alone (runner/layers/attention.py's shapes: one sequence of L
    tokens, 8 KV heads x 3 query heads folded into the query axis, boolean causal mask, bf16)
    at prompt lengths not seen before: ms of the first call and of the second, with SDPA's own
    backend choice and with runner.layers.attention.NO_PLAN_BACKENDS."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from runner.layers.attention import NO_PLAN_BACKENDS

    out = {}
    for name, backends in (("default", None), ("no_plan", NO_PLAN_BACKENDS)):
        for L in lengths:
            L += 0 if name == "default" else 1  # a length this process has not met either
            q = torch.randn(1, 8, 3 * L, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16)
            pos = torch.arange(L, device="cuda")
            mask = (pos[None, :] <= pos[:, None]).repeat(3, 1)[None, None]  # [1, 1, 3L, L]
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                    F.scaled_dot_product_attention(q, k, k, attn_mask=mask, scale=0.088)
                torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
            out[f"{name} L={L}"] = times
            log(f"  SDPA {name} L={L}: first {times[0]:.1f} ms, again {times[1]:.2f} ms")
    return out
