"""Sesame CSM (transformers' CsmForConditionalGeneration) over omnistream's paged KV cache.

A frame is K codes (one per codebook). One frame step, for B rows:

    embeds = embed_frames(previous frames)              # or embed_prompt(...) for a prompt chunk
    hidden, logits0 = backbone_step(embeds, positions, kv_caches, meta, last_rows)
    code0 = sampler(logits0, 0)
    frames = depth_decode(hidden, code0, sampler)       # [B, K]; K - 1 batched sub-steps
    done = frame_is_eos(frames)                         # codebooks 0..K-2 all end-of-stream

`frame_step` chains the middle three. The backbone runs over the engine's flattened batch and
AttentionMetadata exactly like LlamaForCausalLM (runner/models/llama.py layers and backends);
the depth decoder keeps its per-frame KV in buffers allocated once (`allocate_depth_kv`).
Nothing in a step reads a device value on the host, so a decode step can be captured in a CUDA
graph (runner/engine/frame_graphs.py). The engine runs it through runner/engine/frame_runner.py.

Input embedding, as transformers: a text position embeds its id with `embed_text_tokens`; an
audio frame is the sum over k of `embed_audio_tokens[code_k + k * V]`; in a prompt the
`audio_token_id` positions take the prompt's audio frames in order and the `audio_eos_token_id`
positions the all-end-of-stream frame (transformers' `_merge_input_ids_with_input_values`).
The end rule is transformers' generate: a frame whose codebooks 0..K-2 all equal
`codebook_eos_token_id` ends the audio (and is itself returned by transformers).
"""

from __future__ import annotations

import torch
from torch import nn

from runner.layers import make_attention, make_ops
from runner.layers.base import AttentionBackend, OpsBackend
from runner.models.csm_config import CsmModelConfig
from runner.models.csm_parts import CsmDepthDecoder, DecoderStack, DepthKV
from runner.models.frame_model import FrameModel


class CsmModel(FrameModel):
    """Parameter names mirror transformers' (runner/models/csm_loader.py maps them; q/k/v and
    gate/up are fused as in LlamaForCausalLM)."""

    def __init__(self, cfg: CsmModelConfig, attn: AttentionBackend | None = None, ops: OpsBackend | None = None):
        super().__init__()
        self.cfg = cfg
        attn = attn if attn is not None else make_attention(None, torch.get_default_device())
        ops = ops if ops is not None else make_ops(None, torch.get_default_device())
        self.attn = attn  # the engine reads its capabilities (token rows), as of LlamaForCausalLM
        k, v, h = cfg.num_codebooks, cfg.codebook_size, cfg.backbone.hidden_size
        self.num_codebooks = k
        self.embed_text_tokens = nn.Embedding(cfg.text_vocab_size, h)
        self.embed_audio_tokens = nn.Embedding(k * v, h)
        self.backbone = DecoderStack(cfg.backbone, attn, ops)
        self.lm_head = nn.Linear(h, v, bias=False)  # codebook 0
        self.depth = CsmDepthDecoder(cfg.depth, k, h, attn, ops)
        self.register_buffer("codebook_offsets", torch.arange(k, dtype=torch.int64) * v, persistent=False)
        self.tie_embeddings()
        self.depth_kv: DepthKV | None = None

    def tie_embeddings(self) -> None:
        """Share the backbone's codebook table with the depth decoder where the config ties them
        (again after to_empty, which gives each module its own tensor)."""
        if self.cfg.tie_codebook_embeddings:
            self.depth.embed_tokens.weight = self.embed_audio_tokens.weight

    def reset_buffers(self, device: torch.device | str) -> None:
        """Non-parameter state on `device` after a meta-device build: RoPE tables, offsets."""
        self.backbone.rotary.reset(device)
        self.depth.rotary.reset(device)
        self.codebook_offsets = torch.arange(self.num_codebooks, dtype=torch.int64, device=device) * self.cfg.codebook_size

    @property
    def depth_decoder(self) -> CsmDepthDecoder:
        return self.depth

    @property
    def code0_head(self) -> nn.Linear:
        return self.lm_head

    # ---- input embeddings --------------------------------------------------------------------

    def embed_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """[N, K] int64 codes -> [N, H]: the sum of the frame's codebook embeddings."""
        return self.embed_audio_tokens(frames + self.codebook_offsets).sum(dim=1)

    def embed_prompt(self, text_ids: torch.Tensor, frames: torch.Tensor, is_frame: torch.Tensor) -> torch.Tensor:
        """A prompt chunk: text_ids [T] int64, frames [T, K] int64, is_frame [T] bool (from
        prompt_inputs) -> [T, H]: the frame's embedding where is_frame, the text id's elsewhere."""
        return torch.where(is_frame[:, None], self.embed_frames(frames), self.embed_text_tokens(text_ids))

    def prompt_inputs(self, input_ids: list[int], audio_frames: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host side of a prompt: its ids (text, audio_token_id, audio_eos_token_id) and the codes
        of its audio frames [F, K] (one per audio_token_id, in order) -> embed_prompt's inputs."""
        cfg, k = self.cfg, self.num_codebooks
        ids = torch.tensor(input_ids, dtype=torch.int64)
        is_audio = ids == cfg.audio_token_id
        is_eos = ids == cfg.audio_eos_token_id
        n_audio = int(is_audio.sum())
        got = 0 if audio_frames is None else audio_frames.shape[0]
        if got != n_audio:
            raise ValueError(f"prompt: {n_audio} audio_token_id position(s) but {got} audio frame(s)")
        frames = torch.zeros(len(input_ids), k, dtype=torch.int64)
        if audio_frames is not None and n_audio:
            if audio_frames.shape[1] != k:
                raise ValueError(f"prompt: audio frames have {audio_frames.shape[1]} codebooks, the model {k}")
            frames[is_audio] = audio_frames.to(torch.int64).cpu()
        frames[is_eos] = cfg.codebook_eos_id
        dev = self.lm_head.weight.device
        return ids.to(dev), frames.to(dev), (is_audio | is_eos).to(dev)

    def embed_inputs(self, ids: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """The engine's rows: ids [T] int64 (text ids; `audio_token_id` / `audio_eos_token_id`
        at frame positions), frames [T, K] int64 (read at frame positions only) -> [T, H]."""
        is_frame = (ids == self.cfg.audio_token_id) | (ids == self.cfg.audio_eos_token_id)
        return torch.where(is_frame[:, None], self.embed_frames(frames), self.embed_text_tokens(ids))

    # ---- the frame step ----------------------------------------------------------------------

    def frame_is_eos(self, frames: torch.Tensor) -> torch.Tensor:
        """[B, K] -> [B] bool: the frame ends its audio (transformers: codebooks 0..K-2 all eos)."""
        return (frames[:, :-1] == self.cfg.codebook_eos_id).all(dim=-1)

