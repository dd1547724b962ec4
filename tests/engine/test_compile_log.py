"""runner.engine.compile_log: the hooks Triton calls around a JIT compile log the kernel."""

from __future__ import annotations

import logging

import pytest


def test_compile_hooks_log_the_kernel(caplog):
    knobs = pytest.importorskip("triton").knobs
    from runner.engine.compile_log import install

    old = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        assert install(logging.getLogger("test.compile"))

        class Info:
            module, name = "runner.kernels.sampling", "_race_noise_kernel"

        kw = dict(key="k", repr="_race_noise_kernel[num_warps=4](...)", fn=Info(), compile={},
                  is_manual_warmup=False, already_compiled=False)
        # the pre-compile hook must not skip the compile (a truthy return would)
        assert not knobs.runtime.jit_cache_hook(**kw)
        with caplog.at_level(logging.WARNING, logger="test.compile"):
            knobs.runtime.jit_post_compile_hook(**kw)
        assert "runner.kernels.sampling._race_noise_kernel" in caplog.text and "after start-up" in caplog.text
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = old


def test_recording_collects_compiles_and_restores_the_hook():
    knobs = pytest.importorskip("triton").knobs
    from runner.engine.compile_log import recording

    class Info:
        module, name = "runner.kernels.sampling", "_penalty_kernel"

    kw = dict(key="[('*fp32', 'D'), ('i32', '')]", repr="_penalty_kernel[...]", fn=Info(), compile={},
              is_manual_warmup=False, already_compiled=False)
    seen = []
    old = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **k: seen.append(k["key"]) or False
    try:
        outer = knobs.runtime.jit_post_compile_hook
        with recording() as compiled:
            assert not knobs.runtime.jit_post_compile_hook(**kw)  # never skips the compile
        assert compiled == ["runner.kernels.sampling._penalty_kernel: [('*fp32', 'D'), ('i32', '')]"]
        assert seen == [kw["key"]]  # the hook installed before still ran
        assert knobs.runtime.jit_post_compile_hook is outer
    finally:
        knobs.runtime.jit_post_compile_hook = old


def test_describe_names_each_argument_and_its_specialisation():
    """What tells two variants of a kernel apart (a pointer's alignment, an int's value of 1, a
    constexpr) is named by argument: a truncated key once hid it."""
    from runner.engine.compile_log import describe

    class Jit:
        arg_names = ["q_ptr", "pos_ptr", "stride_qt", "n", "WRITE_KV"]

    class Info:
        module, name, jit_function = "runner.kernels.fused_ops", "_rope_kernel", Jit()

    key = "[('*bf16', 'D'), ('*i64', None), ('i32', 'D'), ('constexpr', 1), ('constexpr', True)]{'num_warps': 4}"
    assert describe(dict(key=key, fn=Info())) == ("runner.kernels.fused_ops._rope_kernel: q_ptr:*bf16:16, "
                                                  "pos_ptr:*i64, stride_qt:i32:16, n=1, WRITE_KV=True "
                                                  "{'num_warps': 4}")
    # a key of another form, or of another length than the names: as it is
    assert describe(dict(key="k", fn=Info())) == "runner.kernels.fused_ops._rope_kernel: k"
    assert describe(dict(key="[('*bf16', 'D')]{}", fn=Info())).endswith(": [('*bf16', 'D')]{}")
