"""Parity of runner.models.llama (through runner.models.loader and the torch paged attention) with transformers."""

from __future__ import annotations

import pytest
import torch

from runner.config import ModelConfig
from runner.layers import make_attention
from runner.layers.attention import (
    AttentionMetadata,
    TorchPagedAttention,
    allocate_kv_cache,
    kv_bytes_per_token,
)
from runner.models import (
    MODEL_REGISTRY,
    model_class_for,
)
from runner.models.llama import LlamaForCausalLM, build_random_model, rope_inv_freq
from runner.models.loader import load_model
from tests.support.tiny_models import EOS_ID, load_hf

BLOCK_SIZE = 4
NUM_BLOCKS = 48
ATOL = 1e-4

FAMILIES = {
    "llama": dict(rope_llama3=True, tie=False),
    "qwen2": dict(tie=True),
    # head_dim 32 != hidden 64 / heads 4: exercises the explicit head_dim path.
    "qwen3": dict(tie=False, head_dim=32),
}


class PagedSequences:
    """Minimal block bookkeeping for tests: blocks are handed out in a scrambled order so a
    sequence's blocks are never contiguous, and block 0 (the padding entry) is also in use."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """chunks: (sequence id, new token ids) in batch order -> (input_ids, positions, meta)."""
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for sid, toks in chunks:
            start = self.lens.get(sid, 0)
            blocks = self.blocks.setdefault(sid, [])
            for p in range(start, start + len(toks)):
                if p // self.block_size == len(blocks):
                    blocks.append(self.free.pop())
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
                pos.append(p)
            ids += toks
            self.lens[sid] = start + len(toks)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(self.lens[sid])
        width = max(len(self.blocks[sid]) for sid, _ in chunks) + 1  # +1: a padded entry in every row
        table = [self.blocks[sid] + [0] * (width - len(self.blocks[sid])) for sid, _ in chunks]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(table, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tiny_model_dir):
    family = request.param
    path = tiny_model_dir(family, seed=7, **FAMILIES[family])
    cfg = ModelConfig.from_pretrained(path)
    ours = load_model(cfg, torch.device("cpu"), torch.float32)
    return cfg, ours, load_hf(path)


def hf_forward(hf, tokens: list[int]):
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
    return out.logits[0].float(), [h[0] for h in out.hidden_states]


def test_family_features_are_exercised(pair):
    cfg, ours, _ = pair
    expected = {
        "llama": (cfg.rope.rope_type == "llama3", not cfg.tie_word_embeddings),
        "qwen2": (cfg.attention_bias, cfg.tie_word_embeddings),
        "qwen3": (cfg.qk_norm, cfg.head_dim * cfg.num_heads != cfg.hidden_size),
    }[cfg.decoder]
    assert all(expected), cfg
    if cfg.tie_word_embeddings:
        assert ours.lm_head_weight is ours.embed_tokens.weight


@torch.no_grad()
def test_prefill_chunked_prefill_and_decode_match_transformers(pair):
    cfg, ours, hf = pair
    L = cfg.num_layers
    gen = torch.Generator().manual_seed(3)
    # Sequence 2's prompt is 23 tokens, prefilled as a 17-token chunk then a 6-token chunk.
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 11, 23)]
    first_chunk = [prompts[0], prompts[1], prompts[2][:17]]
    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE)
    kv = allocate_kv_cache(cfg, NUM_BLOCKS, BLOCK_SIZE, "cpu", torch.float32)

    # (1) three prompts in one flattened forward; logits and hidden states at every position.
    ids, pos, meta = seqs.step(list(enumerate(first_chunk)))
    hidden, captured = ours(ids, pos, kv, meta, capture_layers=(0, 1, L))
    assert sorted(captured) == [0, 1, L]
    logits = ours.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), cfg.vocab_size)
    torch.testing.assert_close(captured[L], hidden, rtol=0, atol=0)
    histories = []
    for b, toks in enumerate(first_chunk):
        rows = slice(meta.query_start_loc[b], meta.query_start_loc[b + 1])
        ref_logits, ref_hidden = hf_forward(hf, toks)
        torch.testing.assert_close(logits[rows], ref_logits, rtol=0, atol=ATOL)
        for layer in (0, 1, L):
            torch.testing.assert_close(captured[layer][rows], ref_hidden[layer], rtol=0, atol=ATOL)
        histories.append(list(toks))
    last = {b: logits[meta.query_start_loc[b + 1] - 1].argmax().item() for b in range(3)}

    # (2) chunked prefill mixed with decode: seq 0 and 1 decode one token, seq 2 gets its rest.
    chunks = [(0, [last[0]]), (2, prompts[2][17:]), (1, [last[1]])]
    for step in range(6):
        ids, pos, meta = seqs.step(chunks)
        logits = ours.compute_logits(ours(ids, pos, kv, meta)[0])
        nxt = {}
        for b, (sid, toks) in enumerate(chunks):
            histories[sid] += toks
            q0, q1 = meta.query_start_loc[b].item(), meta.query_start_loc[b + 1].item()
            ref_logits, _ = hf_forward(hf, histories[sid])
            torch.testing.assert_close(logits[q0:q1], ref_logits[-len(toks) :], rtol=0, atol=ATOL)
            nxt[sid] = logits[q1 - 1].argmax().item()
        # Pure decode from here on, in a different batch order each step.
        order = [2, 0, 1] if step % 2 == 0 else [1, 2, 0]
        chunks = [(sid, [nxt[sid]]) for sid in order]
    assert [len(h) for h in histories] == [11, 17, 28]


@torch.no_grad()
def test_greedy_generation_matches_hf_generate(pair):
    cfg, ours, hf = pair
    prompt = torch.randint(3, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(11)).tolist()
    ref = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=32,
        min_new_tokens=32,  # EOS suppressed on both sides: always compare 32 tokens
    )[0, len(prompt) :].tolist()

    seqs = PagedSequences(NUM_BLOCKS, BLOCK_SIZE, seed=5)
    kv = allocate_kv_cache(cfg, NUM_BLOCKS, BLOCK_SIZE, "cpu", torch.float32)
    out: list[int] = []
    new = prompt
    while len(out) < 32:
        ids, pos, meta = seqs.step([(0, new)])
        logits = ours.compute_logits(ours(ids, pos, kv, meta)[0][-1:])[0]
        logits[EOS_ID] = float("-inf")
        out.append(int(logits.argmax()))
        new = [out[-1]]
    assert out == ref
    assert len(set(out)) > 4, "degenerate tiny model: greedy output barely varies"


def test_paged_attention_matches_dense_reference_bf16_and_gqa():
    """The backend alone, against a per-sequence dense causal reference (GQA 8 q / 2 kv heads)."""
    torch.manual_seed(0)
    hq, hkv, d, bs = 8, 2, 16, 4
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 16,
            "hidden_size": hq * d,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": hq,
            "num_key_value_heads": hkv,
        }
    )
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        seqs = PagedSequences(32, bs, seed=1)
        cache = allocate_kv_cache(cfg, 32, bs, "cpu", dtype)[0]
        lens = {0: 9, 1: 1, 2: 14}
        all_k = {s: torch.randn(n + 3, hkv, d, dtype=dtype) for s, n in lens.items()}
        all_v = {s: torch.randn(n + 3, hkv, d, dtype=dtype) for s, n in lens.items()}
        all_q = {s: torch.randn(n + 3, hq, d, dtype=dtype) for s, n in lens.items()}
        attn = TorchPagedAttention()
        # Prefill, then a mixed step: seq 0 decodes, seq 1 gets 3 tokens, seq 2 decodes.
        for step in ({0: (0, 9), 1: (0, 1), 2: (0, 14)}, {2: (14, 15), 1: (1, 4), 0: (9, 10)}):
            _, _, meta = seqs.step([(s, [0] * (e - b)) for s, (b, e) in step.items()])
            q = torch.cat([all_q[s][b:e] for s, (b, e) in step.items()])
            k = torch.cat([all_k[s][b:e] for s, (b, e) in step.items()])
            v = torch.cat([all_v[s][b:e] for s, (b, e) in step.items()])
            out = attn.forward(q, k, v, cache, meta, d**-0.5)
            ref = []
            for s, (b, e) in step.items():
                kk = all_k[s][:e].float().repeat_interleave(hq // hkv, dim=1)  # [e, Hq, D]
                vv = all_v[s][:e].float().repeat_interleave(hq // hkv, dim=1)
                scores = torch.einsum("qhd,khd->hqk", all_q[s][b:e].float(), kk) * d**-0.5
                causal = torch.arange(e)[None, :] <= torch.arange(b, e)[:, None]
                probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
                ref.append(torch.einsum("hqk,khd->qhd", probs, vv))
            assert out.shape == q.shape and out.dtype == dtype
            torch.testing.assert_close(out.float(), torch.cat(ref), rtol=0, atol=atol)


def test_rope_inv_freq_matches_transformers(pair):
    cfg, _, hf = pair
    ref = hf.model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(rope_inv_freq(cfg.rope, cfg.head_dim), ref, rtol=0, atol=0)


def test_build_random_model_and_kv_helpers():
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 128,
        }
    )
    a = build_random_model(cfg, "cpu", torch.bfloat16, seed=1)
    b = build_random_model(cfg, "cpu", torch.bfloat16, seed=1)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu"
        assert torch.equal(p, q), name
        if name.endswith("norm.weight"):
            assert torch.all(p == 1), name
        else:
            assert 0.015 < p.float().std().item() < 0.025, name
    assert a.rotary.cos.dtype == torch.float32 and a.rotary.cos.shape == (128, 16)
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 3 * 2 * 16 * 2
    kv = allocate_kv_cache(cfg, 8, 4, "cpu", torch.bfloat16)
    assert len(kv) == 3 and kv[0].shape == (2, 8, 4, 2, 16)
    seqs = PagedSequences(8, 4)
    ids, pos, meta = seqs.step([(0, [1, 2, 3, 4, 5]), (1, [6])])
    hidden, cap = a(ids, pos, kv, meta, capture_layers=(2,))
    assert hidden.shape == (6, 32) and cap[2].shape == (6, 32) and torch.isfinite(hidden).all()
    assert isinstance(make_attention(None, torch.device("cpu")), TorchPagedAttention)


def test_registry_maps_architectures_to_the_class():
    """config.json's `architectures` -> the decoder variant (runner.config) -> the class
    (runner.models' registry); every accepted architecture has a class, others are refused
    naming the field."""
    from runner.config import SUPPORTED_ARCHITECTURES, ConfigError

    assert set(SUPPORTED_ARCHITECTURES.values()) <= set(MODEL_REGISTRY)
    base = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    cfg = ModelConfig.from_dict({"architectures": ["SomethingElse", "Qwen2ForCausalLM"], **base})
    assert cfg.decoder == "qwen2" and model_class_for(cfg) is LlamaForCausalLM
    with pytest.raises(ConfigError, match="architectures"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], **base})
