"""Qwen3-TTS (12 Hz): the talker and its code predictor over omnistream's paged KV cache
(docs/qwen3_tts.md §1-2; reference: qwen-tts 0.1.1's Qwen3TTSTalkerForConditionalGeneration;
M:n is line n of its qwen_tts/core/models/modeling_qwen3_tts.py, as in the doc).

A frame is K codes (code 0 from the talker, groups 1..K-1 from the code predictor). One frame
step, for B rows, is CSM's (runner/models/csm.py) with other tables:

    embeds = embed_inputs(ids, rows)                    # rows: codes + text id (prompt or generated)
    hidden, logits0 = backbone_step(embeds, positions, kv_caches, meta, last_rows)
    code0 = sampler(logits0, 0)                         # over codec_vocab_size ids (codes + specials)
    frames = depth_decode(hidden, code0, sampler)       # [B, K]; K - 1 batched sub-steps
    done = frame_is_eos(frames)                         # code 0 == codec eos

The reference runs frame n's code predictor at the start of talker forward n + 1 (M:1661);
the order of operations, and so the numbers, are the same as here.

Every input position is a text part plus a codec part (M:2022-2234):
  text part   text_projection(text_embedding(id)) (a SiLU MLP), or nothing;
  codec part  the sum over g of table_g(codes[g]) for the codes present: table_0 is the talker's
              codec table (codes of group 0 and every special id: pad, bos, speakers, languages,
              think tags), table_g (g >= 1) the code predictor's own (M:1441, M:1030). A lone
              special id is codes [id, -1, ...]; a codec frame is all K codes.
Both parts of a position come as host-built rows (`embed_inputs`): the prompt's layout is the
front end's business (a later stage), and a generated step's row is its frame plus the step's
trailing text id (or tts_pad). The talker's stack is `backbone`, as CSM's (the frame runner's
name for it). The tables live in one concatenated parameter `codec_embedding`
[codec_vocab_size + (K - 1) * V, H] at `cfg.table_offsets`, shared with the code predictor
(its code 0 and group inputs read the same rows). Parameter names follow qwen-tts's
(runner/models/qwen3_tts_loader.py maps them; q/k/v and gate/up fused as in LlamaForCausalLM).

Sampling constraints of code 0 (the window of codes + eos, eos barred for the first two
frames, the repetition penalty) are the sampler's, not the model's: logits0 covers the whole
codec table, as the reference's codec_head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runner.layers import make_attention, make_ops
from runner.layers.base import AttentionBackend, OpsBackend
from runner.models.csm_parts import DecoderStack, DepthDecoder, DepthKV
from runner.models.frame_model import FrameModel
from runner.models.qwen3_tts_config import Qwen3TtsConfig

NO_TEXT = -1  # text_ids entry of a position without a text part
NO_CODE = -1  # codes entry of a table a position does not read


class Qwen3TtsCodePredictor(DepthDecoder):
    """qwen-tts's Qwen3TTSTalkerCodePredictorModelForConditionalGeneration: 5 Qwen3 layers,
    `small_to_mtp_projection` (Linear with bias, or the Identity when as wide as the talker),
    heads `lm_head[g - 1]` [V, H] for groups 1..K-1, stored as one [(K - 1) * V, H] parameter."""

    def __init__(self, cfg: Qwen3TtsConfig, attn: AttentionBackend, ops: OpsBackend):
        k, v, h = cfg.num_code_groups, cfg.codebook_size, cfg.predictor.hidden_size
        rows = cfg.codec_vocab_size + (k - 1) * v
        super().__init__(cfg.predictor, cfg.table_offsets, rows, cfg.talker.hidden_size, attn, ops,
                         projector_bias=True if cfg.predictor_projects else None)
        self.lm_head = nn.Parameter(torch.empty((k - 1) * v, h))

    def head_weights(self) -> torch.Tensor:
        return self.lm_head.view(self.num_codebooks - 1, self.codebook_size, -1)

    def adopt_heads(self, heads: torch.Tensor) -> None:
        # [(K - 1) * V, H] views only an unpadded copy; a padded one (V not a multiple of the
        # padding, never 2048) leaves the parameter its own storage
        if heads.is_contiguous():
            self.lm_head.data = heads.view(-1, heads.shape[-1])


class TextProjection(nn.Module):
    """qwen-tts's Qwen3TTSTalkerResizeMLP (M:808): fc2(silu(fc1(x))), both with bias; text
    width -> talker width."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Qwen3TtsModel(FrameModel):
    def __init__(self, cfg: Qwen3TtsConfig, attn: AttentionBackend | None = None, ops: OpsBackend | None = None):
        super().__init__()
        self.cfg = cfg
        attn = attn if attn is not None else make_attention(None, torch.get_default_device())
        ops = ops if ops is not None else make_ops(None, torch.get_default_device())
        self.attn = attn  # the engine reads its capabilities (token rows), as of LlamaForCausalLM
        k, h, th = cfg.num_code_groups, cfg.talker.hidden_size, cfg.text_hidden_size
        self.num_codebooks = k
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, th)
        self.text_projection = TextProjection(th, h)
        self.codec_embedding = nn.Embedding(cfg.codec_vocab_size + (k - 1) * cfg.codebook_size, h)
        self.backbone = DecoderStack(cfg.talker, attn, ops)  # the talker's stack (the engine's backbone)
        self.codec_head = nn.Linear(h, cfg.codec_vocab_size, bias=False)  # code 0 (and the special ids)
        self.predictor = Qwen3TtsCodePredictor(cfg, attn, ops)
        self.register_buffer("table_offsets", torch.tensor(cfg.table_offsets, dtype=torch.int64), persistent=False)
        self.tie_embeddings()
        self.depth_kv: DepthKV | None = None

    def tie_embeddings(self) -> None:
        """The code predictor reads the talker's concatenated codec table (again after
        to_empty, which gives each module its own tensor)."""
        self.predictor.embed_tokens.weight = self.codec_embedding.weight

    def reset_buffers(self, device: torch.device | str) -> None:
        """Non-parameter state on `device` after a meta-device build: RoPE tables, offsets."""
        self.backbone.rotary.reset(device)
        self.predictor.rotary.reset(device)
        self.table_offsets = torch.tensor(self.cfg.table_offsets, dtype=torch.int64, device=device)

    @property
    def depth_decoder(self) -> Qwen3TtsCodePredictor:
        return self.predictor

    @property
    def code0_head(self) -> nn.Linear:
        return self.codec_head

    # ---- input embeddings --------------------------------------------------------------------

    def embed_text(self, text_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 text ids -> [T, H]: text_projection(text_embedding(id))."""
        return self.text_projection(self.text_embedding(text_ids))

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """[T, K] int64 (NO_CODE where a table is not read) -> [T, H]: the sum of table_g(codes[:, g])
        over the codes present (column 0 indexes the whole talker table: codes and special ids)."""
        present = codes >= 0
        rows = self.codec_embedding(codes.clamp(min=0) + self.table_offsets)  # [T, K, H]
        return (rows * present[..., None].to(rows.dtype)).sum(dim=1)

    def embed_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """[N, K] int64 codes (all present) -> [N, H]: the frame's codec part."""
        return self.codec_embedding(frames + self.table_offsets).sum(dim=1)

    def embed_parts(self, text_ids: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """text_ids [T] int64 (NO_TEXT: no text part), codes [T, K] int64 (NO_CODE entries:
        tables not read) -> [T, H] = text part + codec part. An x-vector speaker position
        (Base) is added over its row by the caller."""
        has_text = (text_ids >= 0)[:, None]
        text = self.embed_text(text_ids.clamp(min=0)) * has_text.to(self.codec_embedding.weight.dtype)
        return text + self.embed_codes(codes)

    def embed_inputs(self, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The engine's rows (runner/families/qwen3_tts.py's layout): rows [T, K + 1] int64 =
        a position's K codes (NO_CODE: table not read), then its text id (NO_TEXT: none) ->
        [T, H]. ids [T] (the scheduler's view of the positions) carry nothing more: every
        prompt id is its row's text id, and a generated position's text id is packed in its
        row by the host (its trailing text)."""
        k = self.num_codebooks
        return self.embed_parts(rows[:, k], rows[:, :k])

    # ---- the frame step ----------------------------------------------------------------------

    def frame_is_eos(self, frames: torch.Tensor) -> torch.Tensor:
        """[B, K] -> [B] bool: code 0 is the codec eos (M:2280); that frame is not audio (its
        groups are drawn in the same frame step all the same, and never decoded). Positions
        are 0..P-1 per sequence: the reference's MRoPE streams are identical and unpadded here."""
        return frames[:, 0] == self.cfg.codec.eos

