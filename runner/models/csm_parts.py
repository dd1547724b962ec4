"""CSM's two transformers: a Llama decoder stack over input embeddings (the backbone) and the
depth decoder with its per-frame KV buffers.

Both stacks are runner/models/llama.py's `DecoderLayer`s (same attention and ops backends, same
numerics as transformers) run over the paged KV layout of runner/layers/attention.py. The
backbone's KV is the engine's paged cache; the depth decoder's is `DepthKV`: one block of K
slots per batch row (num_blocks = max_rows, block_size = K), allocated once and overwritten by
every frame (position p of a frame writes slot p before any query reads it, and the attention
masks slots >= seq_len, so nothing is cleared between frames).

The depth decoder of one frame, as transformers' CsmDepthDecoderForCausalLM.generate runs it:
position 0 is the backbone's last hidden state, position 1 the code of codebook 0, position
p >= 2 the code of codebook p - 1 (embedded at its codebook's offset in the shared codebook
table: (p - 1) * V for CSM); every input goes through `inputs_embeds_projector` (backbone width
-> depth width), and the output at position p (p >= 1) gives codebook p through its own head.
`DepthDecoder` is that loop for any table offsets, projector (with or without bias, or none)
and head layout; `CsmDepthDecoder` is CSM's, Qwen3-TTS's code predictor
(runner/models/qwen3_tts.py) the other.
A code's projected embedding is a row of `projected_codes`, computed once from the weights.
Positions 0 and 1 go in one forward (two query rows per batch row, as transformers' first
call), then one row per batch row per sub-step: K - 1 forwards per frame.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runner.config import ModelConfig
from runner.layers.attention import AttentionMetadata
from runner.layers.base import AttentionBackend, OpsBackend
from runner.layers.ops import padded_rows
from runner.models.csm_sampling import CodebookSampler
from runner.models.llama import DecoderLayer, RMSNorm, RotaryEmbedding, run_decoder

if TYPE_CHECKING:  # runner/kernels needs triton: imported where the kernels run
    from runner.kernels.depth_step import StepKernel


class DecoderStack(nn.Module):
    """Llama decoder layers + final norm over input embeddings [T, H] (no token embedding, no head)."""

    def __init__(self, cfg: ModelConfig, attn: AttentionBackend, ops: OpsBackend):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, attn, self.rotary, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """[T, H] input embeddings -> [T, H] final hidden states after the norm (what
        transformers' `last_hidden_state` and `hidden_states[-1]` hold)."""
        return self.forward_capture(h, positions, kv_caches, meta)[0]

    def forward_capture(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                        meta: AttentionMetadata, capture_layers: tuple[int, ...] = ()
                        ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """forward, and {layer: [T, H]} for the layers asked for (llama.run_decoder's indexing)."""
        return run_decoder(self.layers, self.norm, self.ops, h, positions, kv_caches, meta, capture_layers)


class DepthKV:
    """The depth decoder's KV for up to `max_rows` rows of one frame, and every metadata tensor
    its K - 1 forwards read, built once: a sub-step slices them (views of fixed addresses, as a
    CUDA graph wants) and allocates nothing on the device.

    Layout: per layer [2, max_rows, K, Hkv, D] (runner/layers/attention.py's paged layout with
    one block of K slots per row; row r's table is [r]). Slot of row r, position p: r * K + p.
    """

    def __init__(self, cfg: ModelConfig, num_codebooks: int, max_rows: int, device: torch.device | str,
                 dtype: torch.dtype):
        k = num_codebooks
        self.max_rows = max_rows
        self.num_codebooks = k
        # one allocation [L, 2, R, K, Hkv, D] (zeroed, as allocate_kv_cache's): the layers' caches
        # are its views, and runner/kernels/depth_step.py reaches every layer from one pointer
        self.stacked = torch.zeros(cfg.num_layers, 2, max_rows, k, cfg.num_kv_heads, cfg.head_dim, device=device,
                                   dtype=dtype)
        self.caches = [self.stacked[i] for i in range(cfg.num_layers)]
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        rows = torch.arange(max_rows, **i64)
        self.block_tables = rows.to(torch.int32)[:, None].contiguous()  # [R, 1]
        self.qsl_pairs = torch.arange(0, 2 * max_rows + 1, 2, **i32)  # [R + 1]: two queries a row
        self.qsl_single = torch.arange(max_rows + 1, **i32)  # [R + 1]: one query a row
        # the first forward: positions 0, 1 of each row, interleaved (row r owns query rows 2r, 2r+1)
        self.pair_positions = torch.arange(2, **i64).repeat(max_rows)  # [2R]
        self.pair_slots = (rows[:, None] * k + torch.arange(2, **i64)).reshape(-1)  # [2R]
        # sub-step at position p (2 <= p < K): row r's position, slot and context length
        pos = torch.arange(k, **i64)[:, None].expand(k, max_rows)
        self.positions = pos.contiguous()  # [K, R]
        self.slots = (rows[None, :] * k + pos).contiguous()  # [K, R]
        self.seq_lens = (pos + 1).to(torch.int32).contiguous()  # [K, R]

    def pair_meta(self, b: int) -> AttentionMetadata:
        """Positions 0 and 1 of b rows in one forward (a 2-token prefill per row)."""
        return AttentionMetadata(query_start_loc=self.qsl_pairs[: b + 1], seq_lens=self.seq_lens[1, :b],
                                 block_tables=self.block_tables[:b], slot_mapping=self.pair_slots[: 2 * b],
                                 max_query_len=2, max_seq_len=2)

    def step_meta(self, b: int, p: int) -> AttentionMetadata:
        """Position p of b rows, one query each (a pure decode step)."""
        return AttentionMetadata(query_start_loc=self.qsl_single[: b + 1], seq_lens=self.seq_lens[p, :b],
                                 block_tables=self.block_tables[:b], slot_mapping=self.slots[p, :b],
                                 max_query_len=1, max_seq_len=p + 1, num_decodes=b, pure_decode=True)


class DepthDecoder(DecoderStack):
    """A depth decoder: its decoder stack, the codebook table (backbone width; usually the
    backbone's own table, tied by the model), the projector to its own width and one head per
    codebook 1..K-1 (`head_weights`, the subclass's parameter layout).

    The table holds codebook k's codes at rows `code_offsets[k]`.. : uniform (k * V) for CSM,
    non-uniform for Qwen3-TTS (code 0 shares the talker's 3072-row codec table, groups 1.. have
    2048-row tables of their own). The projector is a Linear (bias or not), or none where the
    depth decoder is as wide as the backbone (projector_bias None)."""

    def __init__(self, cfg: ModelConfig, code_offsets: tuple[int, ...], table_rows: int, backbone_hidden: int,
                 attn: AttentionBackend, ops: OpsBackend, projector_bias: bool | None):
        # its KV is one block of K slots a row (DepthKV): never split-K (AttentionBackend.unsplit)
        super().__init__(cfg, attn.unsplit(), ops)
        self.num_codebooks = len(code_offsets)
        self.codebook_size = cfg.vocab_size  # V: the width of every head (codebooks 1..K-1)
        self.code_offsets = code_offsets  # host ints: a sub-step's gather offset is a constant
        self.embed_tokens = nn.Embedding(table_rows, backbone_hidden)
        self.projects = projector_bias is not None
        self.inputs_embeds_projector = (nn.Linear(backbone_hidden, cfg.hidden_size, bias=projector_bias)
                                        if projector_bias is not None else nn.Identity())
        self.projected_codes: torch.Tensor | None = None  # [table_rows, H_depth]: prepare_decode()
        self.heads: torch.Tensor | None = None  # [K - 1, V, H_depth] row-major: prepare_decode()
        # [K - 1, V', H_depth]: `heads` as the first V rows of each zero-padded head (cuBLAS
        # alignment, ops.padded_rows), or None: prepare_decode()
        self.heads_padded: torch.Tensor | None = None
        # sub-steps of <= step_rows rows as one persistent launch each, where the ops have the
        # kernel for this shape (CUDA; the interpreter in tests) and the layers no biases
        self.step_rows = 0 if cfg.attention_bias else ops.depth_step_rows(cfg.hidden_size, cfg.intermediate_size)
        self.step: StepKernel | None = None  # the kernels' weights and scratch: prepare_decode()

    def head_weights(self) -> torch.Tensor:
        """The heads as one [K - 1, V, H_depth] tensor (head k at [k - 1]; any strides)."""
        raise NotImplementedError

    def adopt_heads(self, heads: torch.Tensor) -> None:
        """Re-point the heads' parameter at `heads` [K - 1, V, H_depth] (prepare_decode's
        row-major, maybe padded copy), so that the weights are held once."""
        raise NotImplementedError

    def prepare_decode(self, head_row_multiple: int = 1) -> None:
        """Layouts of the loaded weights for decoding, computed once (again if the weights change):
        * the codebook table through the input projector, [rows, H_depth]: a sub-step's input is
          a row gather instead of a gather and a GEMM reading the projector (the projector is
          affine, so row c is projector(embed(c)); it differs from the per-step product only in
          the GEMM's summation order);
        * the heads [K - 1, V, H] (head_weights): head k is a row-major [V, H] weight, the
          layout of every other GEMM, and the first V rows of a [V', H] zero-padded one
          (`heads_padded`; V' = V rounded up to head_row_multiple, ops.padded_rows)."""
        w = self.embed_tokens.weight
        proj = self.inputs_embeds_projector
        self.projected_codes = F.linear(w, proj.weight, proj.bias) if self.projects else w
        self.heads, self.heads_padded = padded_rows(self.head_weights().detach(), head_row_multiple)
        self.adopt_heads(self.heads)
        # 16-bit weights on CUDA (an fp32 dot there is TF32; the interpreter computes in fp32)
        if self.step_rows and (self.heads.dtype != torch.float32 or self.heads.device.type != "cuda"):
            from runner.kernels.depth_step import fits, row_fits

            cfg = self.cfg
            widths = (cfg.hidden_size, cfg.intermediate_size)
            if (row_fits(*widths, cfg.num_heads * cfg.head_dim) if self.step_rows == 1
                    else fits(*widths, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)):
                self.step = self.kernel_layout()

    def kernel_layout(self) -> StepKernel:
        """runner/kernels/depth_step.py's inputs: the layers' weights stacked per kind (each
        parameter re-pointed to its view of the stack, so nothing is held twice), the scratch,
        the grid (one program per SM on CUDA) and whether it synchronises in one launch (CUDA) or
        runs a launch per phase (the interpreter)."""
        from runner.kernels.depth_step import StepKernel, StepScratch, StepWeights

        cfg, layers = self.cfg, self.layers

        def stack(get) -> torch.Tensor:
            params = [get(layer) for layer in layers]
            stacked = torch.stack([p.detach() for p in params])
            for i, p in enumerate(params):
                p.data = stacked[i]
            return stacked

        d = cfg.head_dim
        ones = torch.ones(len(layers), d, device=self.heads.device, dtype=self.heads.dtype)
        weights = StepWeights(
            qkv=stack(lambda l: l.self_attn.qkv_proj.weight), o=stack(lambda l: l.self_attn.o_proj.weight),
            gate_up=stack(lambda l: l.mlp.gate_up_proj.weight), down=stack(lambda l: l.mlp.down_proj.weight),
            ln1=stack(lambda l: l.input_layernorm.weight), ln2=stack(lambda l: l.post_attention_layernorm.weight),
            q_norm=stack(lambda l: l.self_attn.q_norm.weight) if cfg.qk_norm else ones,
            k_norm=stack(lambda l: l.self_attn.k_norm.weight) if cfg.qk_norm else ones,
            norm=self.norm.weight.detach(), heads=self.heads)
        dev = self.heads.device
        scratch = StepScratch(cfg.hidden_size, cfg.num_heads * d, cfg.intermediate_size, self.codebook_size,
                              self.num_codebooks, dev, self.heads.dtype)
        cuda = dev.type == "cuda"
        programs = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 3
        return StepKernel(weights, scratch, programs, sync=cuda)

    def _fused_logits(self, frames: torch.Tensor, p: int, kv: DepthKV) -> torch.Tensor:
        """Codebook p's logits [B, V] from the code of codebook p - 1, position p through every
        layer in one launch (runner/kernels/depth_step.py)."""
        from runner.kernels.depth_step import depth_step

        s, rot = self.step, self.rotary
        return depth_step(s.weights, s.scratch, kv.stacked, self.projected_codes, frames[:, p - 1],
                          self.code_offsets[p - 1], p, rot.cos, rot.sin, self.cfg.rms_norm_eps, self.cfg.num_heads,
                          self.cfg.qk_norm, s.programs, sync=s.sync)

    def codebook_logits(self, h: torch.Tensor, codebook: int) -> torch.Tensor:
        """[B, H] depth hidden at position `codebook` -> [B, V] in the model dtype (as transformers)."""
        padded = self.heads_padded[codebook - 1] if self.heads_padded is not None else None
        return self.ops.head(h, self.heads[codebook - 1], padded)

    def decode(self, hidden: torch.Tensor, code0: torch.Tensor, sampler: CodebookSampler, kv: DepthKV) -> torch.Tensor:
        """hidden [B, H_backbone] (the backbone's last hidden state of each row), code0 [B] int64
        -> the frames [B, K] int64 (column 0 is code0). All rows' sub-steps run batched; nothing
        reads a device value on the host."""
        b, k, offsets = hidden.shape[0], self.num_codebooks, self.code_offsets
        if b > kv.max_rows:
            raise ValueError(f"depth decode of {b} rows: its KV holds {kv.max_rows} (allocate_depth_kv(max_rows))")
        table = self.projected_codes
        if table is None:
            raise RuntimeError("depth decode: call prepare_decode() (the model's allocate_depth_kv) first")
        frames = torch.empty(b, k, dtype=torch.int64, device=hidden.device)
        frames[:, 0] = code0
        # positions 0 and 1: [projector(hidden_r), projector(embed(code0_r))] interleaved per row
        first = table.index_select(0, code0 + offsets[0] if offsets[0] else code0)
        x = torch.stack((self.inputs_embeds_projector(hidden), first), dim=1)
        h = self(x.reshape(2 * b, -1), kv.pair_positions[: 2 * b], kv.caches, kv.pair_meta(b))
        h = h.view(b, 2, -1)[:, 1]  # position 1 predicts codebook 1
        fused = self.step is not None and b <= self.step_rows
        if fused:
            self.step.scratch.counters.zero_()  # the sub-steps' grid barriers count from 0
        for p in range(1, k):
            if p == 1:
                logits = self.codebook_logits(h, 1)
            elif fused:
                logits = self._fused_logits(frames, p, kv)
            else:
                # codebook p - 1's code sits at position p, embedded at row offsets[p - 1] + code
                x = table.index_select(0, frames[:, p - 1] + offsets[p - 1])
                h = self(x, kv.positions[p, :b], kv.caches, kv.step_meta(b, p))
                logits = self.codebook_logits(h, p)
            sampler(logits, p, out=frames[:, p])
        return frames


class CsmDepthDecoder(DepthDecoder):
    """transformers' CsmDepthDecoderForCausalLM: K codebooks of V ids in one [K * V] table at
    offsets k * V, a bias-free projector and the heads as one [K - 1, H, V] parameter."""

    def __init__(self, cfg: ModelConfig, num_codebooks: int, backbone_hidden: int, attn: AttentionBackend,
                 ops: OpsBackend):
        k, v = num_codebooks, cfg.vocab_size
        super().__init__(cfg, tuple(p * v for p in range(k)), k * v, backbone_hidden, attn, ops, projector_bias=False)
        # [K - 1, H, V]: codebook k's logits are h @ codebooks_head[k - 1] (transformers' layout)
        self.codebooks_head = nn.Parameter(torch.empty(k - 1, cfg.hidden_size, v))

    def head_weights(self) -> torch.Tensor:
        return self.codebooks_head.detach().transpose(1, 2)

    def adopt_heads(self, heads: torch.Tensor) -> None:
        """The parameter keeps its [K - 1, H, V] shape and values as a transposed view of the
        row-major [K - 1, V, H] copy (a column-major head ran in a slow cuBLAS kernel at 64 rows)."""
        self.codebooks_head.data = heads.transpose(1, 2)
