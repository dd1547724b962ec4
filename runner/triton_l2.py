"""L2 prefetch of a later kernel's weights from inside an earlier one (Hopper bulk prefetch).

Why: a decode layer's DRAM sits partly idle while a launch is latency-bound (the attention's
chain of dependent loads before its first K/V tile, its tail). Weights are never written by a
kernel, so any launch of the step may ask the memory system to bring the next GEMM's weights
into L2 then; the GEMM reads them back as L2 hits. One `cp.async.bulk.prefetch.L2` per program
(fire and forget: the issuing thread does not wait for the bytes), issued by thread 0 only.

Policies (`POLICY`, a constexpr): 0 none (the call compiles to nothing), 1 the default L2
eviction priority, 2 evict_last (`createpolicy`), so a stream read with evict_first that
follows (the attention's K/V) pushes other lines out first.
"""

from __future__ import annotations

import triton
import triton.language as tl

# thread 0 of the program issues the prefetch; $0 is a dummy result (inline asm must return one)
_ASM_NORMAL = tl.constexpr("""{
.reg .pred p; .reg .b32 t;
mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""")
_ASM_EVICT_LAST = tl.constexpr("""{
.reg .pred p; .reg .b32 t; .reg .b64 pol;
mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;
createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
mov.u32 $0, 0;
}""")


@triton.jit
def l2_prefetch_share(base_ptr, total_bytes, chunk_bytes, pid, POLICY: tl.constexpr):
    """Program `pid`'s share of a contiguous byte range: bytes [pid * chunk, (pid + 1) * chunk)
    of [base_ptr, base_ptr + total_bytes), clipped (nothing past the end). base_ptr points at
    any 16-byte aligned tensor; chunk_bytes and total_bytes are multiples of 16 (the host checks:
    `prefetch_chunk`)."""
    if POLICY > 0:
        lo = pid.to(tl.int64) * chunk_bytes
        size = tl.minimum(total_bytes - lo, chunk_bytes)
        if size > 0:
            addr = base_ptr.to(tl.pointer_type(tl.int8)) + lo
            if POLICY == 1:
                tl.inline_asm_elementwise(_ASM_NORMAL, "=r,l,r", [addr, size.to(tl.int32)], dtype=tl.int32,
                                          is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(_ASM_EVICT_LAST, "=r,l,r", [addr, size.to(tl.int32)], dtype=tl.int32,
                                          is_pure=False, pack=1)


def prefetch_chunk(nbytes: int, programs: int) -> int:
    """Bytes per program so `programs` shares cover `nbytes` (a multiple of 16, as the bulk
    prefetch needs)."""
    assert nbytes % 16 == 0 and programs > 0, (nbytes, programs)
    return (-(-nbytes // programs) + 15) // 16 * 16
