"""A depth decoder's sub-step as one persistent kernel (runner/kernels/depth_step.py; one row:
runner/kernels/depth_row.py).

Compiled on CUDA (one launch, grid barriers); under Triton's interpreter on CPU, one launch per
phase (the interpreter runs programs one after another, so a barrier would never open);
skipped without `triton` (CPU CI). tests/gpu/test_frame_graphs.py runs the barrier path in
the engine's graphs.

What is checked, on tiny depth decoders with CSM's layout (no q/k norms) and Qwen3-TTS's
(per-head q/k norms, a projector with a bias, uneven table offsets):
* teacher-forced, every sub-step's logits and the K/V it writes equal the layer-by-layer path's
  (runner/models/llama.py over TorchOps) within a bf16 rounding, at 1 row (runner/kernels/
  depth_row.py's kernel; also with gate_up and down streamed in K chunks), 3
  and 17 rows (one and two row blocks); no other cache slot changes;
* in fp32, greedy frames of DepthDecoder.decode with the kernel equal those without it.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import (
    compile_offline,
    has_nvidia_backend,
    interpret_without_cuda,
    interpreted_or_skip,
)

_CUDA = interpret_without_cuda()
triton = pytest.importorskip("triton", reason="triton not installed (CPU torch wheel does not bring it)")

from runner.config import ModelConfig, RopeConfig
from runner.kernels.depth_step import _depth_step_kernel
from runner.layers.attention import TorchPagedAttention
from runner.layers.ops import TorchOps
from runner.models.csm_parts import CsmDepthDecoder, DepthDecoder, DepthKV
from runner.models.csm_sampling import GreedyCodebooks

DEVICE = "cuda" if _CUDA else "cpu"
if not _CUDA:
    interpreted_or_skip(_depth_step_kernel, "runner.kernels.depth_step")

K = 6  # codebooks
V = 40  # codes per codebook: the head's last column block is partial


def _cfg(qk_norm: bool) -> ModelConfig:
    return ModelConfig(path="", decoder="qwen3" if qk_norm else "llama", vocab_size=V, hidden_size=64,
                       intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       rms_norm_eps=1e-5, max_position_embeddings=K, tie_word_embeddings=False,
                       attention_bias=False, qk_norm=qk_norm, rope=RopeConfig())


class _KernelOps(TorchOps):
    """The reference ops, with the depth step kernel taken at every row count it has."""

    def depth_step_rows(self, hidden: int, inter: int) -> int:
        return 64


class _Uneven(DepthDecoder):
    """Qwen3-TTS's layout: code 0 in a wider table than the groups, a projector with a bias."""

    def __init__(self, cfg: ModelConfig):
        offsets = (0,) + tuple(50 + (p - 1) * V for p in range(1, K))
        super().__init__(cfg, offsets, 50 + (K - 1) * V, 48, TorchPagedAttention(), _KernelOps(), projector_bias=True)
        self.lm_head = torch.nn.Parameter(torch.empty((K - 1) * V, cfg.hidden_size))

    def head_weights(self) -> torch.Tensor:
        return self.lm_head.view(K - 1, V, -1)

    def adopt_heads(self, heads: torch.Tensor) -> None:
        self.lm_head.data = heads.reshape(-1, heads.shape[-1])


def _decoder(kind: str, dtype: torch.dtype, seed: int = 0) -> DepthDecoder:
    torch.manual_seed(seed)
    if kind == "csm":
        dec = CsmDepthDecoder(_cfg(False), K, 48, TorchPagedAttention(), _KernelOps())
    else:
        dec = _Uneven(_cfg(True))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in dec.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * r if name.endswith("norm.weight") else 0.2 * r)
    dec = dec.to(DEVICE, dtype)
    dec.rotary.reset(DEVICE)
    dec.prepare_decode()
    assert dec.step is not None  # the tiny widths fit the kernel
    return dec


def _pair(dec: DepthDecoder, kv: DepthKV, hidden: torch.Tensor, code0: torch.Tensor) -> None:
    """Positions 0 and 1 into the cache, as DepthDecoder.decode's first forward."""
    b = hidden.shape[0]
    first = dec.projected_codes.index_select(0, code0 + dec.code_offsets[0])
    x = torch.stack((dec.inputs_embeds_projector(hidden), first), dim=1)
    dec(x.reshape(2 * b, -1), kv.pair_positions[: 2 * b], kv.caches, kv.pair_meta(b))


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


@pytest.mark.parametrize("kind", ["csm", "uneven"])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_teacher_forced_substeps_match_the_layer_path(kind, rows):
    _teacher_forced(kind, rows)


@pytest.mark.parametrize("kind", ["csm", "uneven"])
def test_one_row_kernel_streams_k_chunks(kind, monkeypatch):
    """depth_row.py's gate_up and down in 4 K chunks each (the module's tiles take K whole at
    these widths, as they never do at a real model's)."""
    from runner.kernels.depth_step import ROW_TILES

    for name, value in (("gate_up_k", 16), ("down_k", 32)):
        monkeypatch.setitem(ROW_TILES, name, value)
    _teacher_forced(kind, 1)


def _teacher_forced(kind: str, rows: int) -> None:
    from runner.kernels.depth_step import depth_step

    dec = _decoder(kind, torch.bfloat16, seed=rows)
    weights, scratch, programs, sync = dec.step
    kv = DepthKV(dec.cfg, K, 20, DEVICE, torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(rows, 48, generator=g).to(DEVICE, torch.bfloat16)
    frames = torch.randint(0, V, (rows, K), generator=g).to(DEVICE)
    _pair(dec, kv, hidden, frames[:, 0])
    for p in range(2, K):
        before = kv.stacked.clone()
        x = dec.projected_codes.index_select(0, frames[:, p - 1] + dec.code_offsets[p - 1])
        h = dec(x, kv.positions[p, :rows], kv.caches, kv.step_meta(rows, p))
        want = dec.codebook_logits(h, p)
        wrote = kv.stacked.clone()
        kv.stacked.copy_(before)
        scratch.counters.zero_()
        got = depth_step(weights, scratch, kv.stacked, dec.projected_codes, frames[:, p - 1], dec.code_offsets[p - 1],
                         p, dec.rotary.cos, dec.rotary.sin, dec.cfg.rms_norm_eps, dec.cfg.num_heads, dec.cfg.qk_norm,
                         programs, sync=sync)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(kv.stacked.float(), wrote.float(), atol=2e-2, rtol=2e-2)
        slot_p = torch.zeros_like(kv.stacked, dtype=torch.bool)
        slot_p[:, :, :rows, p] = True
        assert torch.equal(kv.stacked[~slot_p], before[~slot_p]), "the kernel wrote outside position p of its rows"
        kv.stacked.copy_(wrote)  # go on from the layer path's state


@pytest.mark.skipif(_CUDA, reason="fp32 dots are TF32 on the GPU (the model runs the kernel for 16-bit weights only)")
@pytest.mark.parametrize("kind", ["csm", "uneven"])
@pytest.mark.parametrize("rows", [1, 5])  # depth_row.py's kernel, depth_step.py's
def test_greedy_frames_equal_the_layer_path_in_fp32(kind, rows):
    dec = _decoder(kind, torch.float32, seed=11)
    kv = DepthKV(dec.cfg, K, 8, DEVICE, torch.float32)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(rows, 48, generator=g).to(DEVICE)
    code0 = torch.randint(0, V, (rows,), generator=g).to(DEVICE)
    fused = dec.decode(hidden, code0, GreedyCodebooks(), kv)
    step, dec.step = dec.step, None
    plain = dec.decode(hidden, code0, GreedyCodebooks(), kv)
    dec.step = step
    assert torch.equal(fused, plain)
    assert fused.shape == (rows, K) and torch.equal(fused[:, 0], code0)


_COMPILE_SCRIPT = """
import os, subprocess, tempfile

import triton.backends.nvidia as nv

from runner.kernels import depth_row as m
from runner.kernels.depth_step import row_tiles
from tests.support.triton_interpreter import compile_sm90

P = "*bf16"
sig = dict(table_ptr=P, stride_t="i32", idx_ptr="*i64", idx_offset="i32", x_ptr=P, q_ptr=P, attn_ptr=P, act_ptr=P,
           logits_ptr=P, wqkv_ptr=P, wo_ptr=P, wgu_ptr=P, wd_ptr=P, ln1_ptr=P, ln2_ptr=P, qn_ptr=P, kn_ptr=P,
           norm_ptr=P, head_ptr=P, kv_ptr=P, cos_ptr="*fp32", sin_ptr="*fp32", counter_ptr="*i32", pos="i32", V="i32",
           first_phase="i32", last_phase="i32", eps="fp32", scale_log2e="fp32", stride_kvl="i32", stride_kv="i32",
           stride_cos="i32")
# CSM-1B's depth decoder and Qwen3-TTS 1.7B's code predictor, at the module's tiles
for layers, inter, hq, hkv, sb, qk_norm in ((4, 8192, 8, 2, 32, False), (5, 3072, 16, 8, 16, True)):
    consts = dict(LAYERS=layers, H=1024, I=inter, HQ=hq, HKV=hkv, HEAD_DIM=128, SB=sb, GP=16, QK_NORM=qk_norm,
                  **row_tiles(1024, inter), SYNC=True)
    # as a launch specialises them: 16-byte aligned tensors, strides that are multiples of 16
    aligned = tuple(a for a, t in sig.items() if t.startswith("*")) + ("stride_t", "stride_kvl", "stride_kv", "stride_cos")
    k = compile_sm90(m._depth_row_kernel, sig, consts, divisible=aligned, num_warps=8, num_stages=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump"), "-sass", path],
                              capture_output=True, text=True, check=True).stdout
    assert sass.count("STL") + sass.count("LDL") == 0, ("register spills", inter)  # the K chunks stay in registers
print("compiled")
"""


@pytest.mark.skipif(not has_nvidia_backend(), reason="triton's NVIDIA backend is not installed")
def test_one_row_kernel_compiles_for_sm90_without_spills():
    compile_offline(_COMPILE_SCRIPT, timeout=300)
