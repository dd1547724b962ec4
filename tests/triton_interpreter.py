"""Test-only fixes for Triton 3.6 interpreter gaps, shared by the Triton kernel tests that run
under TRITON_INTERPRET=1 on CPU. The compiled (GPU) path is unaffected. Idempotent: patches are
applied once per session whichever test file imports this first.

* numpy >= 2.4 refuses int() of a 1-element 1-d array, which the interpreter uses for
  `range(lo, hi)` with bounds loaded from tensors (attention loop bounds, runtime K loops).
* the interpreter stores bf16 as raw uint16 and feeds those bits to np.matmul in tl.dot: widen
  them to float32 first (exact).
* fp32 -> bf16 casts truncate in the interpreter where the GPU and torch round to nearest even;
  without the fix every bf16 comparison would be off by up to an ulp. bf16 -> fp32 becomes an
  exact bit shift.
"""

from __future__ import annotations


def patch_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if getattr(interp, "_omnistream_patched", False):
        return
    interp._omnistream_patched = True

    orig_patch_tensor = interp._patch_lang_tensor

    def patch_tensor(tensor, scope):
        orig_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch_tensor

    orig_dot = interp.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar == tl.bfloat16 and h.data.dtype == np.uint16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = create_dot

    def f32_to_bf16(data):
        bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
        rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        return np.where(is_nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)

    def exact_bf16(fallback):
        def cast(self, src, dst_type, *rest):
            s, d = src.dtype.scalar, dst_type.scalar
            if s == tl.float32 and d == tl.bfloat16:
                return interp.TensorHandle(f32_to_bf16(src.data), tl.bfloat16)
            if s == tl.bfloat16 and d == tl.float32:
                return interp.TensorHandle((src.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return fallback(self, src, dst_type, *rest)

        return cast

    # create_fp_ext / create_fp_trunc / ... call self.cast_impl, so patching it covers them.
    interp.InterpreterBuilder.cast_impl = exact_bf16(interp.InterpreterBuilder.cast_impl)
    interp.InterpreterBuilder.create_fp_to_fp = exact_bf16(interp.InterpreterBuilder.create_fp_to_fp)
