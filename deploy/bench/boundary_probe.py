"""What one dependency between two phases of a decode step costs on the GPU: a kernel boundary
(a chain of launches in a CUDA graph, with and without programmatic dependent launch) against
a grid barrier inside one persistent kernel. Run by `python -m deploy.bench.kernels --sections boundary`.

Why: the per-op costs (`skip=OP` variants of deploy.bench.engine) put the decode step's distance from the
bandwidth bound at every kernel boundary (~8 per layer, ~224 per step), not in any one op. A
persistent decode kernel would replace those boundaries by grid barriers; this probe measures
what each costs, with no other work in the way, so the possible gain is a number and not a
guess.

Each phase, program p reads the value program (p + 1) % G wrote in the phase before and writes
that value + 1, so a phase depends on another program's previous phase, as a GEMM depends on
the whole previous output. After K phases from zeros every value is K: a barrier that lets a
program through early reads a stale value and the check fails.

GPU only: the interpreter runs programs one after another, so a grid barrier never opens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runner.kernels.pdl import pdl_enter

# Spin limit of the grid barrier: a barrier that never opens (programs not co-resident) ends
# the kernel with a wrong result instead of hanging the device.
_MAX_SPINS = 1 << 22


@triton.jit
def _phase_kernel(buf_ptr, k, G, USE_GDC: tl.constexpr):
    # buf [2, G] int32: phase k reads row k % 2 and writes the other row
    pdl_enter(USE_GDC)
    p = tl.program_id(0)
    src = (k % 2) * G
    v = tl.load(buf_ptr + src + (p + 1) % G)
    tl.store(buf_ptr + (G - src) + p, v + 1)


@triton.jit
def _persistent_kernel(buf_ptr, bar_ptr, G, K, MAX_SPINS: tl.constexpr):
    p = tl.program_id(0)
    for k in range(K):
        src = (k % 2) * G
        v = tl.load(buf_ptr + src + (p + 1) % G, volatile=True)
        tl.store(buf_ptr + (G - src) + p, v + 1)
        # grid barrier: arrive (release: this program's store is visible first), then wait
        # until all G programs have arrived at phase k (acquire: theirs are visible to us)
        tl.debug_barrier()
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        target = G * (k + 1)
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        spins = 0
        while (seen < target) & (spins < MAX_SPINS):
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        tl.debug_barrier()


def _time_ms(fn, repeats: int) -> float:
    """Median ms of `repeats` calls of fn, CUDA events around each."""
    times = []
    for _ in range(repeats):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1))
    times.sort()
    return times[len(times) // 2]


def measure(phases: int = 224, repeats: int = 20, programs: int | None = None) -> dict:
    """us per dependency over `phases` phases of `programs` programs (default: one per SM):
    kernel chain in a CUDA graph without PDL, with PDL, and grid barriers in one kernel. Raises
    if a variant's result is wrong (a barrier that did not hold)."""
    dev = torch.device("cuda")
    G = programs or torch.cuda.get_device_properties(dev).multi_processor_count
    buf = torch.zeros(2, G, dtype=torch.int32, device=dev)
    bar = torch.zeros(1, dtype=torch.int32, device=dev)
    final = buf[phases % 2]
    out: dict[str, float] = {}

    def chain(pdl: bool) -> None:
        for k in range(phases):
            _phase_kernel[(G,)](buf, k, G, USE_GDC=pdl, launch_pdl=pdl, num_warps=4)

    def check(label: str) -> None:
        torch.cuda.synchronize()
        if not bool((final == phases).all()):
            raise RuntimeError(f"{label}: values {final.unique().tolist()}, want {phases} "
                               f"(barrier count {bar.item()})")

    reset_ms = _time_ms(lambda: (buf.zero_(), bar.zero_()), repeats)
    for label, pdl in (("kernel chain in a graph", False), ("kernel chain in a graph, PDL", True)):
        chain(pdl)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(pdl)

        def replay() -> None:
            buf.zero_()
            bar.zero_()
            graph.replay()

        out[label] = 1e3 * (_time_ms(replay, repeats) - reset_ms) / phases
        replay()
        check(label)

    def persistent() -> None:
        buf.zero_()
        bar.zero_()
        _persistent_kernel[(G,)](buf, bar, G, phases, MAX_SPINS=_MAX_SPINS, num_warps=4)

    persistent()
    check("grid barrier")
    out["grid barrier in one kernel"] = 1e3 * (_time_ms(persistent, repeats) - reset_ms) / phases
    return {"programs": G, "phases": phases, "us_per_dependency": out}
