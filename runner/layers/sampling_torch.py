"""`TorchSampling`: the sampler's device work in torch ops (CPU, and CUDA without Triton).

Top-k / top-p by radix select on an order key (runner/layers/radix_select.py), min-p, and the
exponential race; penalties over gathered state rows. runner/layers/sampler.py has the semantics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runner.layers.noise import race_noise
from runner.layers.radix_select import order_key, thresholds
from runner.layers.sampling_batch import SamplingBatch
from runner.layers.slot_state import SlotState
from runner.layers.workspaces import Workspaces

_NEG_INF = float("-inf")


class TorchSampling:
    """The `SamplingBackend` of runner/layers/base.py in torch ops.

    Its [B, V] workspaces persist across steps on the CPU only (runner/layers/workspaces.py)."""

    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self._ws = Workspaces(device, persistent=device.type == "cpu")

    def apply_penalties(self, logits: Tensor, batch: SamplingBatch, state: SlotState, col0: int = 0) -> None:
        """Penalties with the reference roundings (x*p, x/p, x - f*c, x - p*1), each term only
        when some row uses it (the neutral values 1 / 0 are exact identities)."""
        prompt_mask, counts = state.gather_penalty_rows(batch.slots)  # [B, V] bool, [B, V] int32
        n = logits.shape[1]
        prompt_mask, counts = prompt_mask[:, col0 : col0 + n], counts[:, col0 : col0 + n]
        if batch.any_repetition:
            seen = counts > 0
            seen |= prompt_mask
            rep = batch.repetition_penalty.unsqueeze(1)  # [B, 1]
            penalized = torch.where(logits < 0, logits * rep, logits / rep)
            logits.copy_(torch.where(seen, penalized, logits))
        if batch.any_frequency:
            logits -= batch.frequency_penalty.unsqueeze(1) * counts.to(logits.dtype)
        if batch.any_presence:
            logits -= batch.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)

    def race_noise(self, seeds: Tensor, counters: Tensor, out: Tensor) -> Tensor:
        return race_noise(seeds, counters, out.shape[1], out=out)

    def filter_and_sample(self, logits: Tensor, batch: SamplingBatch, q: Tensor) -> Tensor:
        greedy_ids = logits.argmax(dim=-1) if batch.any_greedy else None  # [B], before scaling
        sampled = self.filter(logits, batch, q)
        return sampled if greedy_ids is None else torch.where(batch.temperature == 0, greedy_ids, sampled)

    def filter_logits(self, logits: Tensor, batch: SamplingBatch) -> None:
        self.filter(logits, batch, None)

    def record_tokens(self, last_token: Tensor, history: Tensor, counts: Tensor | None, slots: Tensor,
                      tokens: Tensor, out_index: Tensor) -> None:
        valid = slots >= 0
        rows = torch.where(valid, slots, last_token.shape[0] - 1)  # padding -> scratch row S
        toks = torch.where(valid, tokens, 0)
        idx = torch.where(valid, out_index, 0)
        # Duplicate indices only occur on the scratch row, where any winner is fine.
        last_token.index_put_((rows,), toks)
        history.index_put_((rows, idx), toks)
        if counts is not None:
            ones = torch.ones_like(toks, dtype=torch.int32)
            counts.index_put_((rows, toks), ones, accumulate=True)

    def filter(self, logits: Tensor, batch: SamplingBatch, q: Tensor | None) -> Tensor:
        """Stage 4 (+ 5 when q is given), in place on logits [B, V].

        q None: writes the filtered logits (scaled, -inf where dropped) and returns them.
        q given: returns the race winners [B] (logits are left scaled, not masked).
        """
        b, v = logits.shape
        temp = torch.where(batch.temperature == 0, 1.0, batch.temperature)  # greedy rows: keep scale
        logits.div_(temp.unsqueeze(1))  # y: the same division as transformers' warper
        filt = batch.any_top_k or batch.any_top_p
        need_e = q is not None or batch.any_top_p or batch.any_min_p
        e = None
        if need_e:
            # e = exp(y - max y) in [0, 1]: the row's unnormalised probabilities.
            e = self._ws.get("e", b, v, torch.float32)
            torch.sub(logits, logits.amax(dim=-1, keepdim=True), out=e).exp_()
        keep = None  # [B, V] bool, True = survives
        if filt:
            key_buf, tmp_buf = self._ws.get("key", b, v, torch.int32), self._ws.get("tmp", b, v, torch.int32)
            key = order_key(logits, out=key_buf, tmp=tmp_buf)
            t = thresholds(key, e, batch, self._ws)  # [B, 1] int32: keep key >= t
            keep = torch.ge(key, t, out=self._ws.get("keep", b, v, torch.bool))
        if batch.any_min_p:
            assert e is not None
            # p_i < min_p * p_max  <=>  e_i < min_p (p_max = 1/Z: the top token always survives).
            mp = e >= batch.min_p.unsqueeze(1)
            keep = mp if keep is None else keep.logical_and_(mp)
        if q is None:
            if keep is not None:
                logits.masked_fill_(keep.logical_not_(), _NEG_INF)
            return logits
        assert e is not None
        if keep is not None:
            e.masked_fill_(keep.logical_not_(), 0.0)
        q.clamp_(min=torch.finfo(q.dtype).tiny)  # race_noise is > 0; guards hand-made q (0/0 = NaN)
        return e.div_(q).argmax(dim=-1)
