"""Cost model of the SNAC decoder: multiply-accumulates and activation bytes per stage, for the
torch path and for the fused kernels (runner/kernels/snac.py). Used by benchmarks and tests."""

from __future__ import annotations

import json
from pathlib import Path

from snac import SNAC
from snac.layers import NoiseBlock

from runner.codecs.config import CodecConfig


def codec_flops_and_bytes(model_or_config: SNAC | dict | CodecConfig, frames: int = 1, dtype_bytes: int = 4) -> list[dict]:
    """Per-stage cost of decoding `frames` codec frames (one window row; scale by the batch).

    model_or_config: a SNAC model, its config.json dict or a CodecConfig. Rows: stage, macs,
    torch_bytes (the torch path, counting every eager elementwise kernel: Snake as SNAC writes
    it is 5 kernels = 11 tensor passes, unfused), fused_bytes (runner/kernels/snac.py: each
    layer one kernel, halo re-reads assumed to hit cache). Activation bytes only: weights are
    read once per call and are small at batch >= 64. Both paths use the same matmul work.

    snac_24khz (latent 768, decoder 1024, rates 8/8/4/2, noise), fp32, per frame:

        stage      MMAC  torch MB  fused MB   channels x samples per frame
        latent      3.2      0.18      0.13   768 x 4 -> 1024 x 4
        block0     67.5      6.44      1.00   1024 x 4 -> 512 x 32
        block1    135.6     25.85      4.00   512 x 32 -> 256 x 256
        block2    137.0     53.61      8.13   256 x 256 -> 128 x 1024
        block3     69.9     57.41      8.39   128 x 1024 -> 64 x 2048
        final       0.9      6.32      0.53   64 x 2048 -> 1 x 2048
        total     414.0    149.81     22.17

    The torch column at ~3.6 TB/s is ~42 us/frame, about what the GPU measures for 256 12-frame
    windows: the torch path is bound by activation traffic, not by its 0.83 GFLOP.
    The fused path moves 6.8x fewer bytes (~6 us/frame) and runs the same matmuls as 3xTF32 on
    tensor cores (~2.5 GFLOP of TF32 work, ~5 us/frame at ~500 TFLOP/s; 1/3 of that as
    matmul_precision="tf32"), in the same kernels, so the two overlap in part.
    """
    if isinstance(model_or_config, SNAC):
        m = model_or_config
        conf = {"latent_dim": m.latent_dim, "decoder_dim": m.decoder_dim, "decoder_rates": list(m.decoder_rates),
                "vq_strides": list(m.vq_strides), "noise": any(isinstance(x, NoiseBlock) for x in m.decoder.modules())}
    elif isinstance(model_or_config, CodecConfig):
        conf = json.loads((Path(model_or_config.path) / "config.json").read_text())
    else:
        conf = dict(model_or_config)
    latent = conf.get("latent_dim") or conf["encoder_dim"] * 2 ** len(conf["encoder_rates"])
    noise = conf.get("noise", True)
    t = frames * int(conf["vq_strides"][0])
    c = int(conf["decoder_dim"])
    snake = 11  # passes of one eager Snake: alpha*x, sin, pow, mul (2 each), add (3)
    b = dtype_bytes
    rows = []
    # latent: from_codes (3 out_proj convs, repeat_interleave, 2 adds ~ 10 passes of the latent)
    # then depthwise k7 and 1x1 convs. Fused: table gathers + adds, one kernel writing Snake(x).
    rows.append({"stage": "latent", "macs": t * latent * (7 + c),
                 "torch_bytes": b * (10 * latent * t + 2 * latent * t + latent * t + c * t),
                 "fused_bytes": b * (8 * latent * t + latent * t + c * t)})
    for i, s in enumerate(conf["decoder_rates"]):
        c_in, c_out, t_out = c, c // 2, t * s
        n_in, n_out = c_in * t, c_out * t_out
        macs = t_out * c_in * c_out * 2  # transposed conv: kernel 2s, stride s -> 2 taps
        tb = snake * n_in + n_in + n_out
        fb = n_in + n_out
        if noise:
            macs += t_out * c_out * c_out
            # linear (2), noise * h (2), x + (3); ~40 int64 hash kernels over (B, T), 16 B each
            tb += 7 * n_out + 40 * 4 * t_out
            fb += 3 * n_out  # read y, write x1 and Snake(x1)
        else:
            fb += n_out  # the transposed conv also writes Snake(y)
        macs += 3 * t_out * c_out * (c_out + 7)
        tb += 3 * (2 * snake + 2 + 2 + 3) * n_out  # Snake, dw conv, Snake, 1x1 conv, residual add
        fb += (4 + 4 + 3) * n_out  # read u, x; write x (not after the last unit), Snake(x)
        rows.append({"stage": f"block{i}", "macs": macs, "torch_bytes": b * tb, "fused_bytes": b * fb})
        c, t = c_out, t_out
    rows.append({"stage": "final", "macs": 7 * c * t,
                 "torch_bytes": b * (snake * c * t + c * t + t + 2 * t), "fused_bytes": b * (c * t + t)})
    return rows
