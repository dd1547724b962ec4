"""Paged KV-cache block manager with prefix caching.

Blocks are fixed-size pages of `block_size` token slots. A request owns a block table (list of
block ids); position p lives in block_table[p // block_size] at offset p % block_size.

Prefix caching: a block whose tokens are all known on the host and whose KV is computed gets a
chain hash h_i = hash((h_{i-1}, tokens of block i)). A later request whose prompt starts with
the same blocks reuses them (ref count +1) instead of recomputing. Freed blocks keep their hash
and stay in the free queue in LRU order, so they can be revived until they are reallocated.

Invariants: every block is either referenced (ref > 0) or in the free queue, never both;
`num_free_blocks` counts blocks with ref == 0, cached or not.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from runner.config import EngineConfig
from runner.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # chain hash -> block id
        # free queue: block id -> None, oldest-freed first (evicted first). Uncached blocks are
        # pushed to the front so cached ones survive longer.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # per request (by id): chain hashes computed so far; how many of them are published is
        # the request's num_hashed_blocks
        self._hashes: dict[int, list[int]] = {}
        self.hit_tokens_total = 0

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(req.block_ids))

    # ---- prefix cache ----------------------------------------------------------------------

    def _chain_hashes(self, req: Request, upto_blocks: int) -> list[int]:
        hashes = self._hashes.setdefault(id(req), [])
        bs = self.block_size
        tokens = None
        while len(hashes) < upto_blocks:
            if tokens is None:
                tokens = req.all_token_ids
            i = len(hashes)
            parent = hashes[-1] if hashes else (req.vectors.key if req.vectors is not None else 0)
            block = tuple(tokens[i * bs : (i + 1) * bs])
            if req.frames is not None:  # frame positions differ by their codes, not their ids
                hashes.append(hash((parent, block, req.frames.rows(i * bs, (i + 1) * bs).tobytes())))
            else:
                hashes.append(hash((parent, block)))
        return hashes

    def match_prefix(self, req: Request) -> int:
        """Attach cached blocks for the longest cached prefix of a request that has no blocks.
        Returns the number of tokens served from the cache. At least one token is always left
        to compute, since the last position must run through the model to produce logits."""
        assert not req.block_ids
        if not self.enable_prefix_caching or req.wants_hidden_states:
            # hidden states are returned for every computed position; cached positions have none
            return 0
        max_blocks = (len(req.all_token_ids) - 1) // self.block_size
        hashes = self._chain_hashes(req, max_blocks)
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            req.block_ids.append(b)
        n = len(req.block_ids) * self.block_size
        req.num_hashed_blocks = len(req.block_ids)
        self.hit_tokens_total += n
        return n

    def register_full_blocks(self, req: Request, num_known_tokens: int) -> None:
        """Publish the hashes of blocks whose tokens are confirmed on the host and whose KV is
        computed, so later requests can share them. `num_known_tokens` must not count in-flight
        (placeholder) tokens."""
        if not self.enable_prefix_caching:
            return
        full = min(num_known_tokens, req.num_computed_tokens) // self.block_size
        done = req.num_hashed_blocks
        if full <= done:
            return
        hashes = self._chain_hashes(req, full)
        for i in range(done, full):
            b, h = req.block_ids[i], hashes[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b
        req.num_hashed_blocks = full

    # ---- allocation ----------------------------------------------------------------------

    def _pop_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        h = self.block_hash[b]
        if h is not None:  # evict the stale cache entry
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]
        return b

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold num_computed_tokens + num_new_tokens."""
        need = self.blocks_needed(req, num_new_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            b = self._pop_free()
            self.ref[b] = 1
            req.block_ids.append(b)
        return True

    def free_request(self, req: Request) -> None:
        """Release the request's blocks (finish, abort or preemption). Idempotent."""
        for b in reversed(req.block_ids):  # tail blocks first: they are least likely to be shared
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} freed twice"
            if self.ref[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)  # uncached: reuse first
        req.block_ids = []
        req.num_hashed_blocks = 0
        self._hashes.pop(id(req), None)


def num_kv_blocks(cfg: EngineConfig, bytes_per_token: int) -> int:
    """Blocks from an explicit count, a memory budget, or (default) enough for every sequence
    at full length, capped by 90% of free device memory on CUDA / 2 GiB on the CPU."""
    c, s = cfg.cache, cfg.scheduler
    if c.num_blocks is not None:
        return c.num_blocks
    per_block = bytes_per_token * c.block_size
    if c.kv_memory_gb is not None:
        return max(1, int(c.kv_memory_gb * 2**30) // per_block)
    want = s.max_num_seqs * -(-s.max_model_len // c.block_size)
    if cfg.runner.torch_device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(cfg.runner.torch_device)
        cap = int(free * 0.9) // per_block
    else:
        cap = (2 * 2**30) // per_block
    return max(1, min(want, cap))
