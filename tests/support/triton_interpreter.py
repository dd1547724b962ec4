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


def interpret_without_cuda() -> bool:
    """Whether CUDA is available. Without it, set TRITON_INTERPRET=1 (left set for the session:
    triton reads it lazily in other places too), so the runner's Triton kernels run under the
    interpreter on CPU tensors. @triton.jit decides at decoration time: call this before any
    runner module with Triton kernels is imported."""
    import os

    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return cuda


def interpreted_or_skip(kernel, module: str) -> None:
    """On CPU, at a test module's top: skip the whole module unless `kernel` (a @triton.jit
    function of runner module `module`) became an interpreted one, i.e. `module` was first
    imported after interpret_without_cuda() set TRITON_INTERPRET=1; then patch_interpreter()."""
    import pytest

    if type(kernel).__name__ != "InterpretedFunction":
        pytest.skip(f"{module} was imported before TRITON_INTERPRET=1 was set; run this file on its own on CPU",
                    allow_module_level=True)
    patch_interpreter()


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


# ---- offline compile for sm_90 (no GPU needed) ---------------------------------------------------


def has_nvidia_backend() -> bool:
    """Whether triton's NVIDIA compiler backend is importable (compiling needs no GPU)."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:
        return False
    return True


def compile_sm90(fn, sig: dict, consts: dict, divisible: tuple[str, ...] = (), **options):
    """Compile one @triton.jit kernel for sm_90 without a GPU: `sig` types the runtime
    arguments ("*bf16", "i32", ...), `consts` fixes the constexprs, `divisible` names the
    arguments to specialise as multiples of 16 (pointers: 16-byte aligned), as a launch on the
    GPU does for such values (without it the loads cannot become cp.async, and Triton does not
    software-pipeline the loops), `options` are the launch options (num_warps, num_stages,
    launch_pdl, ...). Returns the compiled kernel (its .asm). For the scripts compile_offline runs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = ASTSource(fn, dict(sig, **{k: "constexpr" for k in consts}), constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def assert_mma_not_serialised(ptx: str, what: object = "") -> None:
    """Assemble `ptx` for sm_90a with Triton's own ptxas and fail on warning C7514 ("wgmma.mma_async
    instructions are serialized"): a silent ~0.24 us per K step (tests/kernels/test_triton_linear.py says
    where it hid). For the scripts compile_offline runs."""
    import os
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", src + ".cubin"], capture_output=True, text=True,
                             check=True)
    assert "C7514" not in out.stdout + out.stderr, (what, out.stderr[-600:])


def compile_offline(script: str, timeout: float) -> None:
    """Run a script that compiles kernels for a GPU target, in a subprocess without
    TRITON_INTERPRET (this process may have set it, which turns @triton.jit kernels into
    interpreted ones); it must print "compiled". Catches lowering errors the interpreter
    cannot see."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = Path(__file__).resolve().parents[2]  # the repository root
    proc = subprocess.run([sys.executable, "-c", script], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
