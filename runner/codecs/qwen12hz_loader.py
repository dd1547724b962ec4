"""Qwen3-TTS's 12 Hz codec (tokenizer v2) from its folder: the decoder's config and tensors, checked
for what the streaming decoder (runner/codecs/qwen12hz.py) runs, and the encoder as transformers'
MimiModel.

The folder is the model's `speech_tokenizer/` (or the model folder holding it): config.json
(`Qwen3TTSTokenizerV2Config`: `decoder_config`, `encoder_config` = a MimiConfig, rates) and
safetensors with `decoder.*` and `encoder.*` tensors, as qwen-tts's save_pretrained writes them.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import MimiModel

from runner.codecs.config import CodecError
from runner.codecs.mimi_loader import prefixed_tensors, write_mimi_folder

_DECODER = "decoder."  # the decoder's tensors in the tokenizer's safetensors
_ENCODER = "encoder."

# speech_tokenizer/config.json's decoder_config of the released Qwen3-TTS-Tokenizer-12Hz (as
# ports of the released folders print it; keys the decoder ignores included): what the
# benchmarks build at random and a test reads
RELEASED_DECODER_CONFIG = {
    "latent_dim": 1024, "codebook_dim": 512, "codebook_size": 2048, "decoder_dim": 1536, "hidden_size": 512,
    "intermediate_size": 1024, "layer_scale_initial_scale": 0.01, "head_dim": 64, "num_attention_heads": 16,
    "num_hidden_layers": 8, "num_key_value_heads": 16, "num_quantizers": 16, "num_semantic_quantizers": 1,
    "rms_norm_eps": 1e-05, "rope_theta": 10000, "semantic_codebook_size": 4096, "sliding_window": 72,
    "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2]}

@dataclass(frozen=True)
class Qwen12HzConfig:
    """The decoder's shape (`decoder_config` of the tokenizer's config.json) and the codec's rates."""

    codebook_size: int  # codes per codebook (2048)
    num_quantizers: int  # codebooks a frame: 1 semantic + the acoustic rest (16)
    codebook_dim: int  # the quantizer's output width; its codebooks are codebook_dim // 2 wide
    latent_dim: int
    hidden_size: int  # the transformer's
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int
    sliding_window: int  # frames each transformer step attends back (72)
    rope_theta: float
    rms_norm_eps: float
    upsampling_ratios: tuple[int, ...]  # transposed conv + ConvNeXt stages after the transformer
    upsample_rates: tuple[int, ...]  # the vocoder blocks'
    decoder_dim: int
    sample_rate: int

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)


def tokenizer_dir(path: str | Path) -> Path:
    """The tokenizer folder: `path` itself, or its `speech_tokenizer/` (a Qwen3-TTS model folder)."""
    path = Path(path)
    if (path / "speech_tokenizer" / "config.json").is_file():
        return path / "speech_tokenizer"
    if not (path / "config.json").is_file():
        raise CodecError(f"Qwen3-TTS 12 Hz codec path: no config.json in {str(path)!r} or its speech_tokenizer/")
    return path


def read_config(path: str | Path) -> Qwen12HzConfig:
    """The decoder config of the tokenizer at `path`, refusing what the streaming decoder does not
    run (naming the config field)."""
    raw = json.loads((tokenizer_dir(path) / "config.json").read_text())
    dec = raw.get("decoder_config")
    if not isinstance(dec, dict):
        raise CodecError("Qwen3TTSTokenizerV2Config.decoder_config: missing (not a 12 Hz tokenizer folder?)")
    # fields the reference reads with these defaults (configuration_qwen3_tts_tokenizer_v2.py)
    get = {**dict(codebook_size=2048, hidden_size=1024, latent_dim=1024, rope_theta=10000.0, num_attention_heads=16,
                  num_key_value_heads=16, attention_bias=False, sliding_window=72, intermediate_size=3072,
                  hidden_act="silu", rms_norm_eps=1e-5, num_hidden_layers=8, num_quantizers=16,
                  upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=1536), **dec}
    checks = (("hidden_act", get["hidden_act"], "silu"), ("attention_bias", get["attention_bias"], False))
    for name, got, want in checks:
        if got != want:
            raise CodecError(f"decoder_config.{name}: the streaming decoder runs {want!r}, got {got!r}")
    rope = get.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CodecError(f"decoder_config.rope_scaling: the streaming decoder runs plain RoPE, got {rope!r}")
    if "codebook_dim" not in get:
        raise CodecError("decoder_config.codebook_dim: missing")
    if int(get["num_quantizers"]) < 2:
        raise CodecError(f"decoder_config.num_quantizers: 1 semantic + at least 1 acoustic, got {get['num_quantizers']}")
    cfg = Qwen12HzConfig(
        codebook_size=int(get["codebook_size"]), num_quantizers=int(get["num_quantizers"]),
        codebook_dim=int(get["codebook_dim"]), latent_dim=int(get["latent_dim"]), hidden_size=int(get["hidden_size"]),
        num_attention_heads=int(get["num_attention_heads"]), num_key_value_heads=int(get["num_key_value_heads"]),
        head_dim=int(get.get("head_dim") or get["hidden_size"] // get["num_attention_heads"]),
        intermediate_size=int(get["intermediate_size"]), num_hidden_layers=int(get["num_hidden_layers"]),
        sliding_window=int(get["sliding_window"]), rope_theta=float(get["rope_theta"]),
        rms_norm_eps=float(get["rms_norm_eps"]), upsampling_ratios=tuple(int(r) for r in get["upsampling_ratios"]),
        upsample_rates=tuple(int(r) for r in get["upsample_rates"]), decoder_dim=int(get["decoder_dim"]),
        sample_rate=int(raw.get("output_sample_rate", 24000)))
    if cfg.sliding_window < 1:
        raise CodecError(f"decoder_config.sliding_window: streaming decode needs a window >= 1, got {cfg.sliding_window}")
    rate = int(raw.get("decode_upsample_rate", 1920))
    if rate != cfg.samples_per_frame:
        raise CodecError(f"decode_upsample_rate: {rate}, but the decoder's rates make {cfg.samples_per_frame} "
                         "samples a frame")
    return cfg


def decoder_shapes(cfg: Qwen12HzConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the decoder (names without the `decoder.` prefix) and its shape, in the
    reference's layout (modeling_qwen3_tts_tokenizer_v2.py Qwen3TTSTokenizerV2Decoder)."""
    s: dict[str, tuple[int, ...]] = {}
    q, cb, half = cfg.codebook_size, cfg.codebook_dim, cfg.codebook_dim // 2
    for group, n in (("rvq_first", 1), ("rvq_rest", cfg.num_quantizers - 1)):
        p = f"quantizer.{group}."
        s[p + "input_proj.weight"] = (half, cb, 1)  # the encoder side: loaded, unused by a decode
        s[p + "output_proj.weight"] = (cb, half, 1)
        for i in range(n):
            s[p + f"vq.layers.{i}._codebook.cluster_usage"] = (q,)
            s[p + f"vq.layers.{i}._codebook.embedding_sum"] = (q, half)
    lat, hid, inter = cfg.latent_dim, cfg.hidden_size, cfg.intermediate_size
    s["pre_conv.conv.weight"], s["pre_conv.conv.bias"] = (lat, cb, 3), (lat,)
    t = "pre_transformer."
    s[t + "input_proj.weight"], s[t + "input_proj.bias"] = (hid, lat), (hid,)
    s[t + "output_proj.weight"], s[t + "output_proj.bias"] = (lat, hid), (lat,)
    s[t + "norm.weight"] = (hid,)
    qd, kvd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"{t}layers.{i}."
        s[p + "self_attn.q_proj.weight"], s[p + "self_attn.o_proj.weight"] = (qd, hid), (hid, qd)
        s[p + "self_attn.k_proj.weight"] = s[p + "self_attn.v_proj.weight"] = (kvd, hid)
        s[p + "mlp.gate_proj.weight"] = s[p + "mlp.up_proj.weight"] = (inter, hid)
        s[p + "mlp.down_proj.weight"] = (hid, inter)
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn_layer_scale.scale",
                     "mlp_layer_scale.scale"):
            s[p + name] = (hid,)
    for i, r in enumerate(cfg.upsampling_ratios):
        p = f"upsample.{i}."
        s[p + "0.conv.weight"], s[p + "0.conv.bias"] = (lat, lat, r), (lat,)  # ConvTranspose1d: (in, out, k)
        s[p + "1.dwconv.conv.weight"], s[p + "1.dwconv.conv.bias"] = (lat, 1, 7), (lat,)
        s[p + "1.pwconv1.weight"], s[p + "1.pwconv1.bias"] = (4 * lat, lat), (4 * lat,)
        s[p + "1.pwconv2.weight"], s[p + "1.pwconv2.bias"] = (lat, 4 * lat), (lat,)
        s[p + "1.norm.weight"] = s[p + "1.norm.bias"] = s[p + "1.gamma"] = (lat,)
    dim = cfg.decoder_dim
    s["decoder.0.conv.weight"], s["decoder.0.conv.bias"] = (dim, lat, 7), (dim,)
    for i, r in enumerate(cfg.upsample_rates):
        p, din, dout = f"decoder.{i + 1}.block.", dim // 2**i, dim // 2 ** (i + 1)
        s[p + "0.alpha"] = s[p + "0.beta"] = (din,)
        s[p + "1.conv.weight"], s[p + "1.conv.bias"] = (din, dout, 2 * r), (dout,)
        for j in range(3):  # residual units, dilations 1, 3, 9
            u = f"{p}{j + 2}."
            for name in ("act1.alpha", "act1.beta", "act2.alpha", "act2.beta", "conv1.conv.bias", "conv2.conv.bias"):
                s[u + name] = (dout,)
            s[u + "conv1.conv.weight"], s[u + "conv2.conv.weight"] = (dout, dout, 7), (dout, dout, 1)
    out, n = dim // 2 ** len(cfg.upsample_rates), len(cfg.upsample_rates)
    s[f"decoder.{n + 1}.alpha"] = s[f"decoder.{n + 1}.beta"] = (out,)
    s[f"decoder.{n + 2}.conv.weight"], s[f"decoder.{n + 2}.conv.bias"] = (1, out, 7), (1,)
    return s


def load_decoder_tensors(path: str | Path, cfg: Qwen12HzConfig) -> dict[str, torch.Tensor]:
    """The decoder's tensors of the tokenizer at `path` (names without `decoder.`, on the CPU, as
    stored), each checked against decoder_shapes: a missing, misshapen or unknown one is an error
    naming it."""
    folder = tokenizer_dir(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CodecError(f"Qwen3-TTS 12 Hz codec: no safetensors in {str(folder)!r}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for key in st.keys():
                if key.startswith(_DECODER):
                    tensors[key.removeprefix(_DECODER)] = st.get_tensor(key)
    want = decoder_shapes(cfg)
    for name, shape in want.items():
        if name not in tensors:
            raise CodecError(f"Qwen3-TTS 12 Hz codec: tensor {_DECODER}{name} missing from {str(folder)!r}")
        if tuple(tensors[name].shape) != shape:
            raise CodecError(f"Qwen3-TTS 12 Hz codec: tensor {_DECODER}{name} has shape "
                             f"{tuple(tensors[name].shape)}, the config makes it {shape}")
    unknown = sorted(set(tensors) - set(want))
    if unknown:  # another layout (q/k norms, biases): decoding without them would be silently wrong
        raise CodecError(f"Qwen3-TTS 12 Hz codec: unexpected tensor {_DECODER}{unknown[0]} "
                         f"({len(unknown)} unknown) in {str(folder)!r}")
    return tensors


def random_decoder_tensors(cfg: Qwen12HzConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random `decoder.*` tensors of every shape in decoder_shapes (tests' tiny codecs, the
    benchmarks' real-shaped one), at scales that keep the signal O(1) through the vocoder:
    codebook statistics and norms near their trained ranges, unit-gain weights, the residual
    branches and the output conv scaled down so the PCM stays clear of the clamp."""
    g = torch.Generator().manual_seed(seed)
    last = f"decoder.{len(cfg.upsample_rates) + 2}.conv."  # the output conv (its name inside the decoder)
    tensors = {}
    for name, shape in decoder_shapes(cfg).items():
        if name.endswith("cluster_usage"):
            t = torch.rand(shape, generator=g) * 1.5 + 0.5
        elif name.endswith(("alpha", "beta")):
            t = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(("scale", "gamma")):
            t = 0.5 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith(("norm.weight", "layernorm.weight")):
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith("bias"):
            t = 0.05 * torch.randn(shape, generator=g)
        elif name.endswith("embedding_sum"):
            t = torch.randn(shape, generator=g)
        else:  # weights: unit gain ((out, in, k) convs; (in, out, k) transposed: close enough)
            fan_in = shape[1] * (shape[2] if len(shape) == 3 else 1)
            t = torch.randn(shape, generator=g) * fan_in**-0.5
            if name.endswith("conv2.conv.weight"):
                t = t * 0.3  # residual branches: the signal stays O(1) through 12 residual units
        if name.startswith(last):
            t = t * 0.3
        tensors[_DECODER + name] = t.contiguous()
    return tensors


def load_encoder(path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32) -> MimiModel:
    """The tokenizer's encoder: transformers' MimiModel from `encoder_config` and the `encoder.*`
    tensors (the reference's Qwen3TTSTokenizerV2Encoder is a MimiModel with its decoder parts set
    to None: those stay at their init here, unused). Its `encode(wav)` gives the reference's codes
    in its first `encoder_valid_num_quantizers` (16) rows; the reference keeps ceil(samples / 1920)
    frames of them."""
    folder = tokenizer_dir(path)
    raw = json.loads((folder / "config.json").read_text())
    if not isinstance(raw.get("encoder_config"), dict):
        raise CodecError("Qwen3TTSTokenizerV2Config.encoder_config: missing")
    state = prefixed_tensors(folder, _ENCODER)
    if not state:
        raise CodecError(f"Qwen3-TTS 12 Hz codec encoder: no {_ENCODER}* tensors in {str(folder)!r}")
    # the checkpoint's (4.57-era) names mapped by transformers' loader, as load_csm_codec does
    with tempfile.TemporaryDirectory() as tmp:
        model, info = MimiModel.from_pretrained(write_mimi_folder(tmp, raw["encoder_config"], state), dtype=dtype,
                                                local_files_only=True, output_loading_info=True)
    missing = [k for k in info["missing_keys"] if not k.startswith(_MIMI_DECODER_SIDE)]
    if missing or info["unexpected_keys"]:
        bad = f"missing {_ENCODER}{missing[0]}" if missing else f"unexpected {_ENCODER}{info['unexpected_keys'][0]}"
        raise CodecError(f"Qwen3-TTS 12 Hz codec encoder: {bad} ({len(missing)} missing, "
                         f"{len(info['unexpected_keys'])} unknown) in {str(folder)!r}")
    return model.to(device=device).eval()


_MIMI_DECODER_SIDE = ("decoder", "upsample", "decoder_transformer")  # MimiModel's, in either 5.x layout
