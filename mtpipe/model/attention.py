"""Multi-head attention (section 3.2) and its uses in the layers: self-attention (the encoder's, the decoder's
causal one, restricted to a window of r positions as section 4 discusses), encoder-decoder attention, and DropHead.

Tensors are batch-first: ``[B, L, d_model]`` hidden states, ``[B, h, L, d]`` per-head queries, keys and values.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtpipe.model.ops import Linear, attention_weights, banded_attention, banded_min_length, cached_attention
from mtpipe.model.ops import dropout, explicit_attention, prefer_explicit_attention, window_mask

# --------------------------------------------------------------------------------------------------------------------
# 3.2 Attention
# --------------------------------------------------------------------------------------------------------------------

# One layer's self-attention cache in incremental decoding (Transformer.step): given the newest position's
# keys/values [R, h, 1, d] (kept, to be written after the step), the earlier positions' [R, h, t, d] and their mask
# [R, 1, 1, t] (True = may attend) where rows started at different steps, else None.
KVCache = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, "Tensor | None"]]


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                                 p: float) -> Tensor:
    """``Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V`` (section 3.2.1), dropout ``p`` on the weights (5.4).

    ``q`` ``[B, h, Lq, d_k]``, ``k`` ``[B, h, Lk, d_k]``, ``v`` ``[B, h, Lk, d_v]`` -> ``[B, h, Lq, d_v]``; ``mask``
    broadcasts to ``[B, h, Lq, Lk]`` (True = may attend); ``causal``: query i sees keys j <= i (section 3.2.3).
    torch's fused kernel, or the same formula as two matmuls where that is faster (:mod:`mtpipe.model.ops`).
    """
    if prefer_explicit_attention(q):
        return explicit_attention(q, k, v, mask, causal, p)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)


def drop_heads(o: Tensor, p: Tensor) -> Tensor:
    """DropHead (Zhou et al. 2020): every head of every sample, ``o`` ``[B, h, L, d_v]``, is dropped (zeroed) with
    probability ``p``, before the heads are concatenated and projected by W^O.

    The kept heads are rescaled by ``h / (number of heads kept in that sample)``, the normalisation of the paper's
    algorithm (as DropBlock normalises by the kept count), rather than dropout's constant ``1/(1-p)``: the scale
    then follows the draw, so each sample's sum over heads keeps its magnitude. A sample that loses all h heads
    (probability p^h) gets a zero attention output, as its mask says.
    """
    b, h = o.shape[:2]
    keep = torch.rand(b, h, 1, 1, device=o.device) >= p  # [B, h, 1, 1], True = kept
    scale = h / keep.sum(dim=1, keepdim=True).clamp_min(1)  # [B, 1, 1, 1]
    return o * (keep * scale).to(o.dtype)


class AttentionWeights(nn.Identity):
    """The attention weights ``softmax(Q K^T / sqrt(d_k))`` ``[B, h, Lq, Lk]`` of a forward pass, passed through
    unchanged: where a forward hook (``register_forward_hook``) sees them, as ``mtpipe attention`` draws them (the
    paper's Figures 3-5). The attention calls it only while a hook is registered on it
    (:meth:`MultiHeadAttention.observed`), the weights then computed as a matrix of their own; otherwise attention
    may take a fused kernel that never materialises them, and this module is not called."""


class MultiHeadAttention(nn.Module):
    """``MultiHead(Q, K, V) = Concat(head_1..head_h) W^O`` with ``head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)``
    (section 3.2.2).

    The h per-head projections are one matrix each (``h * d_k`` outputs). For self-attention Q, K and V come from
    one fused ``[d_model -> h*(2 d_k + d_v)]`` matmul, for encoder-decoder attention K and V from one
    ``[d_model -> h*(d_k+d_v)]`` matmul over the encoder output: fewer, larger matmuls are faster on every backend.
    The layers call :meth:`self_attend` or :meth:`attend_memory` (section 3.2.3's three uses of attention). The
    weights of every head pass through :attr:`weights` while a forward hook observes it (:class:`AttentionWeights`).
    """

    def __init__(self, d_model: int, heads: int, d_k: int, d_v: int, dropout: float, self_attention: bool,
                 window: int = 0):
        super().__init__()
        self.heads, self.d_k, self.d_v, self.dropout = heads, d_k, d_v, dropout
        self.self_attention = self_attention
        self.window = window  # restricted self-attention's r (section 4); 0 = every position
        self.weights = AttentionWeights()  # the softmax weights, for a forward hook (`mtpipe attention`)
        # DropHead probability (Transformer.set_drophead; None = off, the default): a 0-dim buffer updated in place,
        # not a float, so a new value each update is data to torch.compile, not a reason to recompile.
        self.register_buffer("drophead", None, persistent=False)
        if self_attention:
            self.qkv = Linear(d_model, heads * (2 * d_k + d_v))
        else:
            self.q = Linear(d_model, heads * d_k)
            self.kv = Linear(d_model, heads * (d_k + d_v))
        self.out = Linear(heads * d_v, d_model)

    def fairseq_init(self) -> None:
        """``model.init=fairseq``: each query, key and value matrix Xavier-uniform with gain 1/sqrt(2) (bound
        sqrt(3 / (d_model + h d_k)), as fairseq initialises them, per matrix, not over the fused shape), their biases
        U(+-1/sqrt(d_model)) (nn.Linear's default). W^O keeps its Xavier-uniform weight and zero bias, as in fairseq."""
        with torch.no_grad():
            hk, hv = self.heads * self.d_k, self.heads * self.d_v
            parts = [(self.qkv, [hk, hk, hv])] if self.self_attention else [(self.q, [hk]), (self.kv, [hk, hv])]
            for lin, sizes in parts:
                fan_in = lin.weight.size(1)
                for w in lin.weight.split(sizes, dim=0):  # views [h*d, D] of the fused matrix: W^Q, W^K, W^V
                    nn.init.xavier_uniform_(w, gain=2**-0.5)
                nn.init.uniform_(lin.bias, -(fan_in**-0.5), fan_in**-0.5)

    def observed(self) -> bool:
        """Whether a forward hook is registered on :attr:`weights` (then the weights pass through it)."""
        # _modules["weights"], not self.weights: nn.Module's attribute lookup would cost more than the rest of the
        # check, paid by every attention of every decoding step
        return bool(self._modules["weights"]._forward_hooks)

    def _split(self, x: Tensor, d: int) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, self.heads, d).transpose(1, 2)  # [B, L, h*d] -> [B, L, h, d] -> [B, h, L, d]

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Encoder-decoder keys/values of the encoder output ``[B, S, D]``: ``[B, h, S, d_k]``, ``[B, h, S, d_v]``."""
        k, v = self.kv(memory).split([self.heads * self.d_k, self.heads * self.d_v], dim=-1)
        return self._split(k, self.d_k), self._split(v, self.d_v)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention queries, keys and values of ``x`` ``[B, L, D]``, each ``[B, h, L, d]``."""
        hk, hv = self.heads * self.d_k, self.heads * self.d_v
        q, k, v = self.qkv(x).split([hk, hk, hv], dim=-1)
        return self._split(q, self.d_k), self._split(k, self.d_k), self._split(v, self.d_v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False,
               banded: bool = False) -> Tensor:
        """The h heads' scaled dot-product attention, DropHead in training, and the output projection W^O:
        ``[B, h, Lq, d]`` queries -> ``[B, Lq, D]``. ``banded``: restricted self-attention computed band by band
        (:func:`mtpipe.model.ops.banded_attention`), ``mask`` then being the keys' padding mask. While
        :attr:`weights` is observed, the weights are computed as one full matrix and passed through it."""
        p = self.dropout if self.training else 0.0
        if self.observed():
            if banded:  # the full matrix, so that it can be observed
                mask, causal = self._window_mask(q.size(2), mask, causal), False
            weights = self.weights(attention_weights(q, k, mask, causal))  # [B, h, Lq, Lk]
            o = torch.matmul(dropout(weights, p, True).to(v.dtype), v)  # [B, h, Lq, Lk] x [B, h, Lk, d_v]
        elif banded:
            o = banded_attention(q, k, v, mask, self.window, causal, p)
        else:
            o = scaled_dot_product_attention(q, k, v, mask, causal, p)
        if self.drophead is not None and self.training:
            o = drop_heads(o, self.drophead)
        b, _, length, _ = o.shape
        return self.out(o.transpose(1, 2).reshape(b, length, self.heads * self.d_v))  # [B, Lq, h*d_v] -> [B, Lq, D]

    def self_attend(self, x: Tensor, mask: Tensor | None = None, causal: bool = False,
                    cache: KVCache | None = None) -> Tensor:
        """Self-attention of ``x`` ``[B, L, D]`` -> ``[B, L, D]`` (section 3.2.3): the encoder's (``mask``: the
        source padding) or the decoder's (``causal``).

        With ``cache`` (incremental decoding), ``x`` is the newest position ``[R, 1, D]``: its query attends to the
        cached positions and to itself (:meth:`attend_step`; no causal mask: later positions do not exist yet; a row
        that joined the batch later masks the cache slots from before its start), or, restricted (``window`` r), to
        itself and the r positions before it.

        Restricted self-attention (section 4) over a whole sequence: a band mask ``|i - j| <= r`` (causal:
        ``0 <= i - j <= r``) joins the padding mask, or, from :func:`mtpipe.model.ops.banded_min_length` on, only the
        band is computed.
        """
        q, k, v = self.project_qkv(x)  # each [B, h, L, d]
        if cache is not None:
            k_prev, v_prev, prev_mask = cache(k, v)  # earlier positions [R, h, t, d]; mask [R, 1, 1, t] or None
            if self.window:  # itself and the r before it
                k_prev, v_prev = k_prev[:, :, -self.window:], v_prev[:, :, -self.window:]  # [R, h, <= r, d]
                prev_mask = prev_mask[..., -self.window:] if prev_mask is not None else None
            return self.attend_step(q, k, v, k_prev, v_prev, prev_mask)
        length = x.size(1)
        if self.window and length > self.window + 1:  # shorter: every pair is within r anyway
            if length >= banded_min_length(self.window):
                return self.attend(q, k, v, mask, causal, banded=True)
            return self.attend(q, k, v, self._window_mask(length, mask, causal))
        return self.attend(q, k, v, mask, causal)

    def attend_step(self, q: Tensor, k: Tensor, v: Tensor, k_prev: Tensor, v_prev: Tensor,
                    prev_mask: Tensor | None) -> Tensor:
        """Incremental self-attention: the newest position's queries ``q`` ``[R, h, 1, d_k]`` attend to the earlier
        positions ``k_prev``/``v_prev`` ``[R, h, t, d]`` (``prev_mask`` ``[R, 1, 1, t]``, True = may attend, or None)
        and to their own key/value ``k``/``v`` ``[R, h, 1, d]``; then W^O: ``[R, 1, D]``.

        The same ``softmax(q [K_prev; k]^T / sqrt(d_k)) [V_prev; v]`` as :meth:`attend` (section 3.2.1) over the
        t + 1 positions, with the new position's score and value taken apart instead of first written into the
        cache: a step then reads the cache and writes it once, after all layers
        (:meth:`mtpipe.model.transformer.Transformer.step`), and the step is a pure function of its inputs, which is
        what ``torch.compile`` needs (``decode.compile``).
        Inference only: no dropout, no DropHead. The weights ``[R, h, 1, t+1]`` pass through :attr:`weights` while
        it is observed."""
        observe = self.weights if self.observed() else None
        o = cached_attention(q, k, v, k_prev, v_prev, prev_mask, observe)  # [R, h, 1, d_v]
        b = o.size(0)
        return self.out(o.transpose(1, 2).reshape(b, 1, self.heads * self.d_v))  # [R, 1, h*d_v] -> [R, 1, D]

    def _window_mask(self, length: int, key_mask: Tensor | None, causal: bool) -> Tensor:
        """The restricted self-attention mask (True = may attend) over ``length`` positions joined with the keys'
        padding mask ``[B, 1, 1, L]``: ``[L, L]`` or ``[B, 1, L, L]``. A padded query may attend to itself, so
        that no row is empty (its output is never used)."""
        band = window_mask(length, self.window, causal, self.out.weight.device)  # [L, L]
        if key_mask is None:
            return band
        return (band & key_mask) | torch.eye(length, dtype=torch.bool, device=band.device)  # [B, 1, L, L]

    def attend_memory(self, x: Tensor, mem_k: Tensor, mem_v: Tensor, src_mask: Tensor) -> Tensor:
        """Encoder-decoder attention (section 3.2.3): decoder states ``x`` ``[R, L, D]`` query the encoder output's
        keys/values ``mem_k``/``mem_v`` ``[n, h, S, d]`` (:meth:`project_kv`), ``src_mask`` ``[n, 1, 1, S]``.

        In training R = n. In beam search R = n * beams, the beams of a sentence in consecutive rows: they share
        its source, so the rows are regrouped as n sentences of ``beams * L`` queries each (queries are independent):
        the encoder keys/values are never copied per beam, and each sentence's attention is one small matmul
        instead of ``beams`` vector products.
        """
        rows, length, d_model = x.shape
        n = mem_k.size(0)
        y = x.reshape(n, rows // n * length, d_model)  # [R, L, D] -> [n, beams*L, D]
        q = self._split(self.q(y), self.d_k)  # [n, beams*L, h*d_k] -> [n, h, beams*L, d_k]
        o = self.attend(q, mem_k, mem_v, src_mask)  # [n, beams*L, D]
        return o.view(rows, length, d_model)  # [n, beams*L, D] -> [R, L, D]
