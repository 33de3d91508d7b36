"""The Transformer of Vaswani et al. (2017), "Attention Is All You Need", read top to bottom in the paper's order.

Section 3 of the paper, with its numbers as the ``base``/``big`` presets in :mod:`mtpipe.config`:

* 3.4  one embedding matrix shared by the source embedding, the target embedding and the pre-softmax projection
       (joint BPE vocabulary), multiplied by sqrt(d_model) in the embedding layers.
* 3.5  sinusoidal positional encodings added to the embeddings, then dropout on the sum (section 5.4).
* 3.2  multi-head scaled dot-product attention, ``softmax(QK^T / sqrt(d_k)) V`` over h heads.
* 3.3  position-wise feed-forward network ``max(0, x W1 + b1) W2 + b2``.
* 3.1  encoder and decoder stacks of N layers; every sub-layer is wrapped as ``LayerNorm(x + Dropout(Sublayer(x)))``
       (post-norm, section 5.4 "Residual Dropout").

Tensors are batch-first: ``src`` is ``[B, S]`` token ids, ``tgt`` is ``[B, T]``; hidden states are ``[B, L, d_model]``.
Padding is on the right and uses :data:`mtpipe.artifacts.PAD_ID`.

Decoding: :meth:`Transformer.encode` runs the encoder once, :meth:`Transformer.start` projects each decoder layer's
cross-attention keys/values once per sentence, and :meth:`Transformer.step` runs the decoder layers
(:meth:`Transformer.step_layers`: the same :meth:`DecoderLayer.forward` as training; ``decode.compile`` runs it through
``torch.compile``, ``decode.cuda_graphs`` replays it on a GPU from CUDA graphs, :mod:`mtpipe.engine.cuda_graphs`) on the
newest position only, its self-attention keys/values cached (:class:`DecoderState`,
whose ``select`` reorders or shrinks the batch in beam search, and whose ``admit`` lets new sentences join a running
batch: continuous batching, :mod:`mtpipe.engine.streaming`).

Variants (``model`` params, saved in the checkpoint's model config, so decoding rebuilds them; each off by default,
and the default model runs exactly the code above -- every choice is made when the model is built):

* ``norm_position=pre`` -- ``x + Dropout(F(Norm(x)))`` with one more norm after the last layer of each stack
  (Nguyen & Salazar 2019, "Transformers without Tears"; trains without warmup, suits low-resource pairs).
* ``norm=scale`` -- ScaleNorm ``g * x / ||x||`` (:class:`ScaleNorm`) in place of every LayerNorm; ``fixnorm`` --
  unit-length word embeddings times one learned scalar (:meth:`Transformer.embed_tokens`,
  :meth:`Transformer.output_embedding`). Usable together (the paper's "ScaleNorm + FixNorm").
* ``positions=learned`` -- a learned ``[max_positions, d_model]`` table instead of the sinusoids (Table 3 row E);
  ``learned-per-stack`` -- one such table for each stack (fairseq's learned positions).
* ``share_embeddings=decoder|none`` -- untie the source embedding (decoder: target embedding = projection), or all
  three matrices; ``output_bias`` -- a bias on the pre-softmax projection; ``decoder_start=eos`` -- the decoder starts
  from ``</s>`` instead of ``<s>``. Together they represent fairseq models exactly (:mod:`mtpipe.stages.importer`).
* ``layerdrop=p`` -- LayerDrop (Fan et al. 2019): in training each layer of both stacks is skipped with probability
  p; at inference :func:`mtpipe.engine.pruning.prune` removes layers, no fine-tuning.
* DropHead (Zhou et al. 2020) -- whole attention heads dropped in training with a probability the trainer sets each
  update (:meth:`Transformer.set_drophead`; its V-shaped schedule is :func:`mtpipe.training.train.drophead_rate`).
* ``attention_window=r`` -- restricted self-attention (section 4): in the encoder each position attends to the
  positions within r of it, in the decoder to itself and the r before it; encoder-decoder attention stays full.
  Long inputs take a banded computation (:func:`mtpipe.model.kernels.banded_attention`), O(n r d) instead of O(n^2 d);
  incremental decoding attends to the last r + 1 cached positions only.

CPU speed tricks (dropout masks, linear shapes, bf16 activations, matmul attention): :mod:`mtpipe.model.kernels`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
from mtpipe.config import ModelConfig
from mtpipe.errors import MtpipeError
from mtpipe.model.kernels import DecodingProjection, Linear, attention_weights, autocast_activations, banded_attention
from mtpipe.model.kernels import banded_min_length, cached_attention, dropout, explicit_attention, linear
from mtpipe.model.kernels import prefer_explicit_attention, residual, window_mask
from mtpipe.engine.runtime import separate_compile_cache

# --------------------------------------------------------------------------------------------------------------------
# 3.4 Embeddings and 3.5 positional encoding
# --------------------------------------------------------------------------------------------------------------------

# Guards FixNorm's divisions for PAD's all-zero embedding row.
_FIXNORM_EPS = 1e-6


def sinusoids(length: int, d_model: int) -> Tensor:
    """``PE(pos, 2i) = sin(pos / 10000^(2i/d_model))``, ``PE(pos, 2i+1) = cos(...)`` (section 3.5).

    ``[length, D]``. Sines fill the first half of the vector and cosines the second (the tensor2tensor / Marian
    layout): a fixed permutation of the paper's interleaving, which keeps exported models compatible with those.
    """
    half = d_model // 2
    pos = torch.arange(length, dtype=torch.float64).unsqueeze(1)  # [length] -> [length, 1]
    freq = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64) * 2.0 / d_model)  # [half]
    angles = pos * freq  # [length, half]
    pe = torch.zeros(length, d_model, dtype=torch.float64)
    pe[:, :half] = torch.sin(angles)
    pe[:, half : 2 * half] = torch.cos(angles)
    return pe.float()


def scale_embeddings(e: Tensor, scale: float, fixnorm_g: Tensor | None) -> Tensor:
    """Embedded tokens ``[..., D]`` times sqrt(d_model) (section 3.4); with FixNorm (Nguyen & Chiang 2018),
    ``g * e / ||e||`` instead: every word vector gets the same learned length g (PAD's zero row stays zero)."""
    if fixnorm_g is None:
        return e * scale
    return e * (fixnorm_g / torch.linalg.vector_norm(e, dim=-1, keepdim=True).clamp_min(_FIXNORM_EPS))


def unit_rows(w: Tensor) -> Tensor:
    """FixNorm's output side: the embedding matrix ``[V, D]`` with every row scaled to unit length, PAD's row zero
    (a constant logit that is never a target; it gets no gradient, as with ``padding_idx``)."""
    inv = torch.linalg.vector_norm(w, dim=-1, keepdim=True).clamp_min(_FIXNORM_EPS).reciprocal()  # [V, 1]
    # the index made on the device (not copied from the host): decode.cuda_graphs records this in a CUDA graph
    return w * inv.index_fill(0, torch.full((1,), PAD_ID, device=w.device), 0.0)


# --------------------------------------------------------------------------------------------------------------------
# 3.2 Attention
# --------------------------------------------------------------------------------------------------------------------

# One layer's self-attention cache in incremental decoding (Transformer.step_layers): given the newest position's
# keys/values [R, h, 1, d] (kept, to be written after the step), the earlier positions' [R, h, t, d] and their mask
# [R, 1, 1, t] (True = may attend) where rows started at different steps, else None.
KVCache = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, "Tensor | None"]]


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                                 p: float) -> Tensor:
    """``Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V`` (section 3.2.1), dropout ``p`` on the weights (5.4).

    ``q`` ``[B, h, Lq, d_k]``, ``k`` ``[B, h, Lk, d_k]``, ``v`` ``[B, h, Lk, d_v]`` -> ``[B, h, Lq, d_v]``; ``mask``
    broadcasts to ``[B, h, Lq, Lk]`` (True = may attend); ``causal``: query i sees keys j <= i (section 3.2.3).
    torch's fused kernel, or the same formula as two matmuls where that is faster (:mod:`mtpipe.model.kernels`).
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


class MultiHeadAttention(nn.Module):
    """``MultiHead(Q, K, V) = Concat(head_1..head_h) W^O`` with ``head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)``
    (section 3.2.2).

    The h per-head projections are one matrix each (``h * d_k`` outputs). For self-attention Q, K and V come from
    one fused ``[d_model -> h*(2 d_k + d_v)]`` matmul, for encoder-decoder attention K and V from one
    ``[d_model -> h*(d_k+d_v)]`` matmul over the encoder output: fewer, larger matmuls are faster on every backend.
    The layers call :meth:`self_attend` or :meth:`attend_memory` (section 3.2.3's three uses of attention).
    """

    def __init__(self, d_model: int, heads: int, d_k: int, d_v: int, dropout: float, self_attention: bool,
                 window: int = 0):
        super().__init__()
        self.heads, self.d_k, self.d_v, self.dropout = heads, d_k, d_v, dropout
        self.self_attention = self_attention
        self.window = window  # restricted self-attention's r (section 4); 0 = every position
        # Attention weights [B, h, Lq, Lk] of every forward pass are appended here while a list is set
        # (Transformer.recording, for `mtpipe attention`): the same forward, the weights kept instead of discarded.
        self.record: list[Tensor] | None = None
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
        (:func:`mtpipe.model.kernels.banded_attention`), ``mask`` then being the keys' padding mask."""
        p = self.dropout if self.training else 0.0
        if self.record is not None:
            if banded:  # the full matrix, so that it can be kept
                mask, causal = self._window_mask(q.size(2), mask, causal), False
            weights = attention_weights(q, k, mask, causal)  # [B, h, Lq, Lk]
            self.record.append(weights.detach().float())
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
        ``0 <= i - j <= r``) joins the padding mask, or, from :func:`mtpipe.model.kernels.banded_min_length` on, only the
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
        cache: a step then reads the cache and writes it once, after all layers (:meth:`Transformer.step`), and
        the step is a pure function of its inputs, which is what ``torch.compile`` needs (``decode.compile``).
        Inference only: no dropout, no DropHead."""
        o = cached_attention(q, k, v, k_prev, v_prev, prev_mask, self.record)  # [R, h, 1, d_v]
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


# --------------------------------------------------------------------------------------------------------------------
# 3.3 Position-wise feed-forward networks
# --------------------------------------------------------------------------------------------------------------------


class FeedForward(nn.Module):
    """``FFN(x) = max(0, x W1 + b1) W2 + b2`` (section 3.3), inner size d_ff, dropout on the ReLU output."""

    def __init__(self, d_model: int, d_ff: int, relu_dropout: float):
        super().__init__()
        self.w1, self.w2 = Linear(d_model, d_ff), Linear(d_ff, d_model)
        self.relu_dropout = relu_dropout

    def fairseq_init(self) -> None:
        """``model.init=fairseq``: nn.Linear's default for both layers, weights and biases U(+-1/sqrt(fan_in))."""
        for lin in (self.w1, self.w2):
            nn.Linear.reset_parameters(lin)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(dropout(F.relu(self.w1(x)), self.relu_dropout, self.training))


# --------------------------------------------------------------------------------------------------------------------
# 3.1 Encoder and decoder layers
# --------------------------------------------------------------------------------------------------------------------


class ScaleNorm(nn.Module):
    """``ScaleNorm(x) = g * x / max(||x||, eps)`` over the last dimension, with one learned scalar ``g`` initialised
    to sqrt(d_model) (Nguyen & Salazar 2019): the output vector has length g, whatever x's length. Replaces the
    LayerNorm of section 3.1 with ``model.norm=scale``.

    The length is computed in float32 (bf16 autocast included) and the output keeps x's dtype, as LayerNorm does
    under CPU autocast. ``eps`` only guards an all-zero vector (real activations have length ~sqrt(d_model)).
    """

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.d_model, self.eps = d_model, eps
        self.g = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.g, math.sqrt(self.d_model))

    def forward(self, x: Tensor) -> Tensor:
        length = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)  # [..., 1]
        return x * (self.g / length.clamp_min(self.eps)).to(x.dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The normalisation layer ``model.norm`` asks for: LayerNorm (section 3.1) or :class:`ScaleNorm`."""
    return ScaleNorm(cfg.d_model) if cfg.norm == "scale" else nn.LayerNorm(cfg.d_model)


class Sublayers(nn.Module):
    """A layer's residual connections and norms around each sub-layer F (sections 3.1, 5.4), :meth:`sublayer`:

    * post-norm (the paper): ``x <- Norm(x + Dropout(F(x)))``;
    * pre-norm (Nguyen & Salazar 2019): ``x <- x + Dropout(F(Norm(x)))`` (the stack ends with a norm).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.dropout = cfg.dropout

    def sublayer(self, x: Tensor, norm: nn.Module, f: Callable[[Tensor], Tensor]) -> Tensor:
        """One sub-layer ``f`` ``[B, L, D] -> [B, L, D]`` with its residual connection and ``norm``."""
        if self.pre_norm:
            return residual(x, f(norm(x)), self.dropout, self.training)
        return norm(residual(x, f(x), self.dropout, self.training))


class EncoderLayer(Sublayers):
    """Self-attention, then feed-forward, each wrapped by :meth:`Sublayers.sublayer` (section 3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.d_k, cfg.d_v, cfg.attention_dropout, True,
                                            cfg.attention_window)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout)
        self.norm1, self.norm2 = make_norm(cfg), make_norm(cfg)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        """``x`` ``[B, S, D]``, ``src_mask`` ``[B, 1, 1, S]`` (True = real token) -> ``[B, S, D]``."""
        x = self.sublayer(x, self.norm1, lambda y: self.self_attn.self_attend(y, src_mask))
        return self.sublayer(x, self.norm2, self.ffn)


class DecoderLayer(Sublayers):
    """Masked self-attention, encoder-decoder attention, feed-forward, each wrapped by :meth:`Sublayers.sublayer`
    (section 3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.d_k, cfg.d_v, cfg.attention_dropout, True,
                                            cfg.attention_window)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.d_k, cfg.d_v, cfg.attention_dropout, False)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout)
        self.norm1, self.norm2, self.norm3 = (make_norm(cfg) for _ in range(3))

    def forward(self, x: Tensor, memory: tuple[Tensor, Tensor], src_mask: Tensor,
                cache: KVCache | None = None) -> Tensor:
        """``x`` ``[B, T, D]``: the whole shifted target, where the causal mask keeps position i from seeing
        positions > i (section 3.2.3); or, with ``cache`` (incremental decoding), the newest position ``[R, 1, D]``
        of each row, earlier positions' keys/values coming from the cache. ``memory``: this layer's
        encoder-decoder keys/values of the encoder output (:meth:`MultiHeadAttention.project_kv`)."""
        x = self.sublayer(x, self.norm1, lambda y: self.self_attn.self_attend(y, causal=True, cache=cache))
        x = self.sublayer(x, self.norm2, lambda y: self.cross_attn.attend_memory(y, *memory, src_mask))
        return self.sublayer(x, self.norm3, self.ffn)


# --------------------------------------------------------------------------------------------------------------------
# The Transformer (section 3)
# --------------------------------------------------------------------------------------------------------------------


class Transformer(nn.Module):
    """Encoder-decoder Transformer (section 3) over a joint vocabulary with three-way tied embeddings (3.4)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg = cfg.resolved()
        self.vocab_size = vocab_size
        # 3.4: one matrix for everything (``embed``); untied variants add the target side's and the projection's.
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD_ID)
        self.embed_tgt = (nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD_ID)
                          if cfg.share_embeddings != "all" else None)
        self.out_proj = nn.Parameter(torch.empty(vocab_size, cfg.d_model)) if cfg.share_embeddings == "none" else None
        self.out_bias = nn.Parameter(torch.zeros(vocab_size)) if cfg.output_bias else None
        self.start_id = EOS_ID if cfg.decoder_start == "eos" else BOS_ID  # the first decoder input (tgt_in[:, 0])
        self.scale = math.sqrt(cfg.d_model)  # 3.4: embeddings are multiplied by sqrt(d_model)
        if cfg.fixnorm:  # FixNorm: the fixed sqrt(d_model) becomes the learned length of every word embedding
            self.embed_g = nn.Parameter(torch.empty(()))
        self.tgt_positions = None
        if cfg.positions != "sinusoidal":  # Table 3 row E
            self.positions = nn.Parameter(torch.empty(cfg.max_positions, cfg.d_model))
            if cfg.positions == "learned-per-stack":
                self.tgt_positions = nn.Parameter(torch.empty(cfg.max_positions, cfg.d_model))
        else:  # Not a parameter and not saved: rebuilt from the config, so checkpoints hold learned weights only.
            self.register_buffer("positions", sinusoids(cfg.max_positions, cfg.d_model), persistent=False)
        self.dropout = cfg.dropout  # 5.4: dropout on the sums of embeddings and positional encodings
        self.layerdrop = cfg.layerdrop
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # Pre-norm: the residual stream is never normalised inside the layers, so each stack ends with a norm.
        pre = cfg.norm_position == "pre"
        self.encoder_norm = make_norm(cfg) if pre else None
        self.decoder_norm = make_norm(cfg) if pre else None
        # Incremental decoding's copy of the pre-softmax matrix (decoding_logits)
        self._decoding_projection = DecodingProjection()
        # compile_step's function and the id of the model it compiled: a copy (bf16_copy, prune) inherits both, and
        # must not run its original's weights, so it uses its own or none.
        self._compiled_step: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None
        self._compiled_for = 0
        self._frozen_key: tuple | None = None  # the weights a frozen compiled step was built with (_weights_key)
        # compile_step's lone_graph; a lone sentence's encoder keys/values and source mask, doubled for the compiled
        # step when it runs as two (_cached_layers)
        self._lone_graph = False
        self._lone_twin: tuple[list, list[tuple[Tensor, Tensor]], Tensor] | None = None
        # graph_step's graphs and the id of the model they run (as for compile_step; a deep copy gets none)
        self._graphed: Any = None
        self._graphed_for = 0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections and N(0, d_model^-0.5) embeddings (as tensor2tensor initialised the paper's
        models): with the sqrt(d_model) scale the embedded inputs start at unit variance, like the positions.
        Learned positions start at N(0, d_model^-0.5) (fairseq's choice); ScaleNorm's and FixNorm's g at
        sqrt(d_model) (Nguyen & Salazar 2019). ``model.init=fairseq`` then re-draws the attention and feed-forward
        layers as fairseq does (:meth:`MultiHeadAttention.fairseq_init`, :meth:`FeedForward.fairseq_init`)."""
        tables = ("embed.weight", "embed_tgt.weight", "out_proj", "positions", "tgt_positions")
        for name, p in self.named_parameters():
            if p.dim() == 2 and name not in tables:
                nn.init.xavier_uniform_(p)
            elif name.endswith(".bias") or name == "out_bias":
                nn.init.zeros_(p)
        for name, p in self.named_parameters():
            if name in tables:
                nn.init.normal_(p, mean=0.0, std=self.cfg.d_model**-0.5)
        with torch.no_grad():
            for e in (self.embed, self.embed_tgt):
                if e is not None:
                    e.weight[PAD_ID].zero_()
        if self.cfg.fixnorm:
            nn.init.constant_(self.embed_g, self.scale)
        for m in self.modules():
            if isinstance(m, ScaleNorm):
                m.reset_parameters()
            elif self.cfg.init == "fairseq" and isinstance(m, (MultiHeadAttention, FeedForward)):
                m.fairseq_init()

    # -- 3.4 / 3.5 embeddings --------------------------------------------------------------------------------------

    def embed_tokens(self, tokens: Tensor, offset: int | Tensor = 0, target: bool = False) -> Tensor:
        """``Dropout(E[tokens] * sqrt(d_model) + PE[offset : offset+L])`` (sections 3.4, 3.5, 5.4),
        ``[B, L] -> [B, L, D]``; FixNorm: :func:`scale_embeddings`. ``target``: the decoder's side (its own
        matrix and position table where the model has them). ``offset``: the first position, one for all rows, or
        ``[B, 1]`` one per row (rows of a continuous batch are at different positions)."""
        length = tokens.size(1)
        last = (int(offset.max()) if isinstance(offset, Tensor) else offset) + length
        if last > self.cfg.max_positions:
            raise MtpipeError(f"sequence of {last} positions exceeds model.max_positions={self.cfg.max_positions}")
        table = self.embed_tgt if target and self.embed_tgt is not None else self.embed
        positions = self.tgt_positions if target and self.tgt_positions is not None else self.positions
        e = scale_embeddings(table(tokens), self.scale, self.embed_g if self.cfg.fixnorm else None)
        if isinstance(offset, Tensor):
            pe = positions[offset + torch.arange(length, device=offset.device)]  # [B, 1] + [L] -> [B, L] -> [B, L, D]
        else:
            pe = positions[offset : offset + length]  # [L, D]
        x = autocast_activations(e + pe)  # [B, L, D]
        return dropout(x, self.dropout, self.training)

    def output_embedding(self) -> Tensor:
        """The pre-softmax projection matrix ``[V, D]``: the embedding matrix itself (3.4), or the target
        embedding / the projection's own matrix in the untied variants.

        With FixNorm, its rows normalised to unit length (:func:`unit_rows`; the same unit vectors the input side
        scales by g; no g here): a logit is then ``|h| cos(h, e_y)``, so the decoder output's own length -- the gain
        of the last norm -- sets the softmax temperature, as the fixed-norm output layer of Nguyen & Chiang (2018)
        intends.
        """
        w = self._projection_weight()
        return unit_rows(w) if self.cfg.fixnorm else w

    def _projection_weight(self) -> Tensor:
        """The stored ``[V, D]`` matrix behind :meth:`output_embedding` (before FixNorm's normalisation)."""
        return (self.out_proj if self.out_proj is not None
                else self.embed_tgt.weight if self.embed_tgt is not None else self.embed.weight)

    def logits(self, h: Tensor) -> Tensor:
        """Pre-softmax projection with the shared embedding matrix (3.4): ``[..., D] -> [..., V]``."""
        return linear(h, self.output_embedding(), self.out_bias)

    def decoding_logits(self, h: Tensor) -> Tensor:
        """:meth:`logits` of a decoding step's rows ``[R, D] -> [R, V]``: on CPU in float32 through
        :class:`mtpipe.model.kernels.DecodingProjection`, which keeps a copy of the matrix (FixNorm's unit rows with it) in
        the layout fastest for a few rows, made again when the weights change. bf16 and GPUs keep :meth:`logits`."""
        w = self._projection_weight()
        if h.device.type != "cpu" or h.dtype != torch.float32 or w.dtype != torch.float32 or w.is_inference():
            return self.logits(h)
        return self._decoding_projection(h, (w.data_ptr(), w._version, w.device), self.output_embedding, self.out_bias)

    # -- 3.1 the stacks, training ----------------------------------------------------------------------------------

    def _layers(self, stack: nn.ModuleList) -> Iterable[nn.Module]:
        """The layers a forward pass runs. LayerDrop (Fan et al. 2019): in training each is skipped with probability
        ``layerdrop``, drawn per forward pass from torch's default CPU generator (the one dropout and the saved
        RNG states of :mod:`mtpipe.training.train` use, so a resumed run draws the same skips). Processes draw
        independently; DDP is told to expect unused parameters (:class:`mtpipe.training.train.Updater`)."""
        if not self.training or self.layerdrop == 0.0:
            return stack
        keep = (torch.rand(len(stack)) >= self.layerdrop).tolist()
        return [layer for layer, k in zip(stack, keep) if k]

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """Encoder stack. Returns ``memory [B, S, D]`` and the source mask ``[B, 1, 1, S]`` (True = real token)."""
        src_mask = (src != PAD_ID)[:, None, None, :]  # [B, S] -> [B, 1, 1, S], broadcast over heads and queries
        x = self.embed_tokens(src)
        for layer in self._layers(self.encoder):
            x = layer(x, src_mask)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x, src_mask

    def decode(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """Decoder stack over a whole (shifted) target ``[B, T]`` with the causal mask: ``[B, T, D]``."""
        x = self.embed_tokens(tgt_in, target=True)
        for layer in self._layers(self.decoder):
            x = layer(x, layer.cross_attn.project_kv(memory), src_mask)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return x

    def features(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Decoder output states ``[B, T, D]`` for the shifted target ``tgt_in`` (teacher forcing)."""
        return self.decode(tgt_in, *self.encode(src))

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Logits ``[B, T, V]`` of the next target token at every position."""
        return self.logits(self.features(src, tgt_in))

    def set_drophead(self, p: float | None) -> None:
        """DropHead probability of every attention layer for the next training forward passes (None = off)."""
        if p is not None and not 0.0 <= p < 1.0:
            raise MtpipeError(f"DropHead probability {p} is not in [0, 1)")
        for m in self.modules():
            if isinstance(m, MultiHeadAttention):
                if p is None:
                    m.drophead = None
                elif m.drophead is None:
                    m.drophead = torch.tensor(float(p), device=m.out.weight.device)
                else:
                    m.drophead.fill_(float(p))

    @contextlib.contextmanager
    def recording(self) -> Iterator[dict[str, list[list[Tensor]]]]:
        """Keep the attention weights of every forward pass run inside the block (for ``mtpipe attention``, the
        paper's Figures 3-5): ``{"encoder": ..., "decoder": ..., "cross": ...}``, each one list per layer of the
        ``[B, h, Lq, Lk]`` float32 weights of every call, in call order (one per :meth:`step` when decoding).

        The weights are those of the forward pass itself (:func:`mtpipe.model.kernels.attention_weights`, the formula the
        CPU paths compute anyway), not of a second implementation."""
        groups = {"encoder": [layer.self_attn for layer in self.encoder],
                  "decoder": [layer.self_attn for layer in self.decoder],
                  "cross": [layer.cross_attn for layer in self.decoder]}
        kept: dict[str, list[list[Tensor]]] = {name: [] for name in groups}
        for name, modules in groups.items():
            for m in modules:
                m.record = []
                kept[name].append(m.record)
        try:
            yield kept
        finally:
            for modules in groups.values():
                for m in modules:
                    m.record = None

    # -- incremental decoding --------------------------------------------------------------------------------------

    def start(self, memory: Tensor, src_mask: Tensor) -> DecoderState:
        """Project every decoder layer's encoder-decoder keys/values once for the whole decode (one row per
        sentence; :meth:`DecoderState.select` widens to the beam)."""
        # Contiguous [n, h, S, d]: the head split is a strided view, which the attention matmuls would otherwise
        # copy at every step of every layer.
        cross = [(k.contiguous(), v.contiguous()) for k, v in (layer.cross_attn.project_kv(memory)
                                                               for layer in self.decoder)]
        if self._graphed_for == id(self):
            self._graphed.check()  # graphs read the weights where they were recorded: not after model.to(...)
        if self._compiled():
            self._refreeze()  # a frozen graph holds the weights it was built with
        return DecoderState(src_mask=src_mask, cross=cross)

    def step(self, tokens: Tensor, state: DecoderState, lazy: bool = False) -> tuple[Any, DecoderState]:
        """Log-probabilities ``[R, V]`` of the token after ``tokens [R]`` (the last decoded position of each row).

        Only the new position is computed (:meth:`step_layers`); earlier positions' self-attention keys/values come
        from ``state``, and the new ones are written into it once the layers are done. ``lazy``: return instead a
        function ``log_probs(lo, hi)`` giving rows ``lo:hi`` only, so that beam search can project, normalise and
        rank a few hundred rows at a time while they are in the CPU's cache, rather than stream a ``[R, V]`` float32
        matrix through memory four times.
        """
        # Each row's own position: the step count, less the cache slot it started at when it joined later.
        offset = state.length if state.start is None else state.length - state.start[:, None]  # int or [R, 1]
        x = self.embed_tokens(tokens[:, None], offset=offset, target=True)  # [R] -> [R, 1] -> [R, 1, D]
        graphed = None
        if self._graphed_for == id(self) and self._graphed.takes(x.size(0)) and not self._recording():
            # decode.cuda_graphs: layers, projection and log-softmax replayed from a recorded graph
            graphed = self._graphed(x, state)  # [R, V], [layers, R, h, d] x 2; None: no graph (the eager step)
        if graphed is not None:
            logp, k_new, v_new = graphed

            def log_probs(lo: int, hi: int) -> Tensor:
                return logp[lo:hi]  # [hi-lo, V], a view of the graph's output
        else:
            h, k_new, v_new = self._cached_layers(x, state)

            def log_probs(lo: int, hi: int) -> Tensor:
                # float32 straight from (bf16) logits: one pass, no separate cast of the logits
                return F.log_softmax(self.decoding_logits(h[lo:hi]), dim=-1, dtype=torch.float32)  # [hi-lo, V]
        state.write(k_new, v_new)
        new_state = dataclasses.replace(state, length=state.length + 1)
        return (log_probs if lazy else log_probs(0, x.size(0))), new_state

    def _cached_layers(self, x: Tensor, state: DecoderState) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`step_layers` on ``state``'s cache, compiled (``decode.compile``) from a batch's third step on."""
        k_prev, v_prev, index, prev_mask = state.prefix(x, len(self.decoder), self.cfg.heads, self.cfg.d_k,
                                                        self.cfg.d_v, self.cfg.attention_window)
        if self._compiled() and state.length >= 2 and not self._recording():
            if k_prev.size(1) * k_prev.element_size() < _GATHER_IN_GRAPH_BYTES:
                # Short rows (a position's keys of one layer): gathered here, in one copy, before the graph.
                k_prev, v_prev = state.gathered(state.length - index.size(1))  # [w, layers, R, h, d]
                index = None
            rows, cross, src_mask = x.size(0), state.cross, state.src_mask
            lone = src_mask.size(0) == 1 and not self._lone_graph
            if lone:
                x, k_prev, v_prev, index, prev_mask = _twice(x, k_prev, v_prev, index, prev_mask)
                twin = self._lone_twin  # read once: another thread's decode may replace it
                if twin is None or twin[0] is not cross:
                    # the sentence's encoder keys/values [1, h, S, d] -> [2, h, S, d] and source mask [1, 1, 1, S]
                    # -> [2, 1, 1, S], copied once per sentence (views with stride 0 would fail the graph's guards
                    # on strides and build another graph)
                    twin = (cross, [(k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)) for k, v in cross],
                            src_mask.repeat(2, 1, 1, 1))
                    self._lone_twin = twin
                cross, src_mask = twin[1], twin[2]
            mark_step_dynamic(x, k_prev, v_prev, index, prev_mask, cross, src_mask)
            frozen = self._frozen_key is not None
            try:
                # The settings are read while a graph is traced, which happens inside the call: entered here only
                # when the caller has not entered them around the whole decode (compile_settings)
                with contextlib.nullcontext() if getattr(_entered, "frozen", None) is frozen else _settings(frozen):
                    h, k_new, v_new = self._compiled_step(x, k_prev, v_prev, prev_mask, cross, src_mask, index)
                # a lone sentence ran as two copies of itself: the first copy's rows
                return (h[:rows], k_new[:, :rows], v_new[:, :rows]) if lone else (h, k_new, v_new)
            except torch._dynamo.exc.TorchDynamoException as e:  # building the graph failed (e.g. no C++ compiler)
                first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
                raise MtpipeError(f"decode.compile: torch.compile could not build the decoder step ({first.strip()}); "
                                  "decode without --compile") from e
        return self.step_layers(x, k_prev, v_prev, prev_mask, state.cross, state.src_mask, index)

    def step_layers(self, x: Tensor, k_prev: Tensor, v_prev: Tensor, prev_mask: Tensor | None,
                    cross: list[tuple[Tensor, Tensor]], src_mask: Tensor,
                    index: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The decoder stack on the newest position ``x`` ``[R, 1, D]`` (the same :meth:`DecoderLayer.forward` as
        training, with a cache): the earlier positions' keys/values, each layer's encoder-decoder keys/values
        ``cross``, the source mask ``[n, 1, 1, S]``. Returns the top of the stack ``[R, D]`` and the new position's
        keys/values ``[layers, R, h, d]``, for :meth:`DecoderState.write`.

        The earlier positions: with ``index`` ``[layers, w, R]`` (:meth:`DecoderState.prefix`), the rows of the
        flat cache ``k_prev``/``v_prev`` ``[N, h * d]`` that hold each layer's w positions of each row, gathered
        here, inside the step, so that under ``torch.compile`` the gather is part of attention's one pass over the
        cache rather than a copy of it; without, ``k_prev``/``v_prev`` ``[w, layers, R, h, d]`` in the rows' order
        (the CUDA graphs' buffers, :mod:`mtpipe.engine.cuda_graphs`). ``prev_mask`` ``[R, 1, 1, w]`` or None masks them.

        A pure function of its inputs (nothing written in place): ``decode.compile`` runs it through
        ``torch.compile`` (:meth:`compile_step`)."""
        rows = x.size(0)
        heads, d_k, d_v = self.cfg.heads, self.cfg.d_k, self.cfg.d_v
        new_k: list[Tensor] = []
        new_v: list[Tensor] = []
        for i, layer in enumerate(self.decoder):
            def cache(k: Tensor, v: Tensor, i: int = i) -> tuple[Tensor, Tensor, Tensor | None]:
                new_k.append(k[:, :, 0])  # [R, h, 1, d] -> [R, h, d]
                new_v.append(v[:, :, 0])
                if index is None:  # [w, R, h, d] -> [R, h, w, d] (strides only)
                    return k_prev[:, i].permute(1, 2, 0, 3), v_prev[:, i].permute(1, 2, 0, 3), prev_mask
                rows_i = index[i].reshape(-1)  # [w, R] -> [w * R]
                # [w * R, h * d] -> [w, R, h, d] -> [R, h, w, d]: time-major, so that the eager matmuls see [R * h]
                # batches of [w, d] without a copy
                keys = k_prev.index_select(0, rows_i).view(-1, rows, heads, d_k).permute(1, 2, 0, 3)
                values = v_prev.index_select(0, rows_i).view(-1, rows, heads, d_v).permute(1, 2, 0, 3)
                return keys, values, prev_mask

            x = layer(x, cross[i], src_mask, cache=cache)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return x[:, 0], torch.stack(new_k), torch.stack(new_v)  # [R, 1, D] -> [R, D]; [layers, R, h, d]

    def compile_step(self, lone_graph: bool | None = None) -> None:
        """``decode.compile``: run :meth:`step_layers` through ``torch.compile`` from the third step of a batch on
        (the first two, with 0 and 1 cached positions, would each need a graph of their own).

        A lone sentence (a batch's tail, a single request): torch specialises a dimension of size 1, so it would need
        a graph of its own. By default it runs as two copies of itself in the graph built for several sentences
        (:func:`_twice`): one graph fewer to build in every process (30 s instead of 48 s on the quickstart model,
        2-vCPU Zen 4), for steps 0.92x as fast as in its own graph (BENCHMARKS.md, "A lone sentence as two").
        ``lone_graph``: build its own graph instead, for long-lived processes that translate one sentence at a time
        (``mtpipe serve``, stdin), which build it once in their warm-up; None: as set before (default as two).

        Why: a step for a few sentences (a server's batch, interactive input) is ~35 small operations per layer whose
        fixed cost of dispatch dominates; compiled, the element-wise ones are fused into a few generated kernels.
        Dimensions are marked dynamic (rows, cached positions, sentences, source length), so one graph serves every
        batch; a new one is built only for the few shapes torch specialises (greedy search, beams past 8, a
        continuous batch's masked rows, a lone sentence with ``lone_graph``: ``mtpipe serve`` builds them all in its
        warm-up). Building a graph takes tens of seconds on a small CPU (25-40 s on a 2-vCPU Zen 3: tracing, code
        generation, the C++ compiler), once per process: torch caches the generated kernels on disk, but not the
        frozen graph itself (its packed oneDNN weights do not pickle, so inductor's graph cache skips it). Hence,
        in float32 on CPU, the step is packaged ahead of time instead and kept on disk (:mod:`mtpipe.engine.step_package`:
        built by the first process, loaded in seconds by the next), torch.compile's graph serving only the shapes
        a package refuses. On CPU the graph's wrapper is generated C++ (inductor's ``cpp_wrapper``) instead of
        Python: the wrapper's per-kernel cost is what is left of a small batch's step (1.03-1.04x at ~8 sentences a
        batch, none at 8,000 tokens, the same build time; BENCHMARKS.md)."""
        if lone_graph is not None:
            self._lone_graph = lone_graph
        if not self._compiled():
            self._build_compiled_step()

    def _build_compiled_step(self) -> None:
        """:meth:`compile_step`'s ``torch.compile``; on CPU with the weights frozen into the graph, and in float32
        packaged ahead of time (:class:`~mtpipe.engine.step_package.PackagedStep`) unless ``MTPIPE_STEP_PACKAGE=0``.

        Why frozen (inductor's ``freezing``): the weights become constants of the graph, which inductor packs once
        into oneDNN's blocked layout for the products (as the eager step's :class:`~mtpipe.model.kernels.PackedWeight`
        does); unfrozen, the graph multiplies by the plain weights. The compiled step ran 1.06-1.11x the eager one
        frozen, for a server's ~8 sentences and for 8,000-token batches, at d 128 and d 256 (unfrozen 0.84-1.22x;
        frozen without the packing the same as unfrozen; BENCHMARKS.md, "The compiled step with frozen weights").

        A frozen graph would go on computing with the weights it was built with after they change in place
        (``load_state_dict``, an optimizer step): torch guards on the weights' identity, not on their values.
        :meth:`start` compares the weights' versions with :attr:`_frozen_key` and builds again
        (:meth:`_refreeze`). float32 weights only: each of the bf16 copies that :func:`mtpipe.stages.decode.translate`
        makes per call would build a graph of its own (unfrozen, the compiled bf16 step already runs 1.4x the eager
        one). Not on GPU, where it is untested (CUDA graphs are the GPU's way, ``decode.cuda_graphs``)."""
        weight = next(self.parameters())
        on_cpu = weight.device.type == "cpu"
        separate_compile_cache()
        compiled = torch.compile(self.step_layers, dynamic=True, options={"cpp_wrapper": True} if on_cpu else None)
        frozen = on_cpu and weight.dtype == torch.float32
        from mtpipe.engine.step_package import PackagedStep, packaging_enabled

        if frozen and packaging_enabled():
            # Compiled ahead of time and kept on disk (mtpipe.engine.step_package): built once, loaded by later processes;
            # torch.compile's step only where the package does not apply
            compiled = PackagedStep(self, compiled, step_dynamic_dims)
        self._compiled_step = compiled
        self._compiled_for = id(self)
        self._frozen_key = self._weights_key() if frozen else None

    @contextlib.contextmanager
    def compile_settings(self) -> Iterator[None]:
        """``decode.compile``'s torch settings (:func:`_settings`) for the graphs traced inside the block, in this
        thread: entered once around a whole decode (:func:`mtpipe.stages.decode.translate_batches`' batches, a server's
        decoding loop) rather than by every compiled step, where entering them cost ~90 us a step (torch's config
        patches are slow to enter and leave), more than a server's step of a few sentences (1-3 ms) can spare.
        Nothing without ``decode.compile``."""
        if not self._compiled():
            yield
            return
        frozen = self._frozen_key is not None
        outer = getattr(_entered, "frozen", None)
        with _settings(frozen):
            _entered.frozen = frozen
            try:
                yield
            finally:
                _entered.frozen = outer

    def _weights_key(self) -> tuple:
        """Where each parameter and buffer lives and how often it was changed in place (its version counter; an
        inference tensor has none, and counts by its storage only)."""
        return tuple((t.data_ptr(), -1 if t.is_inference() else t._version)
                     for t in itertools.chain(self.parameters(), self.buffers()))

    def _refreeze(self) -> None:
        """Build the frozen compiled step again (:meth:`_build_compiled_step`) if the weights changed since it was
        built. torch's compile caches are reset first: a new ``torch.compile`` of the same method would find the
        graph built for the old weights."""
        if self._frozen_key is not None and self._frozen_key != self._weights_key():
            torch.compiler.reset()
            self._build_compiled_step()

    def graph_step(self, capture: bool = True) -> None:
        """``decode.cuda_graphs``: run :meth:`step`'s layers, projection and log-softmax as CUDA graphs over fixed
        shapes (:mod:`mtpipe.engine.cuda_graphs`: on a GPU a few sentences' step is bound by launching its ~200 kernels).
        Not with restricted self-attention (its window is the last r cached positions, which the graphs' padded
        cache would move) nor with ``decode.compile`` (the compiled step runs instead). ``capture=False``: the same
        padded computation without recording graphs (the tests, on CPU)."""
        from mtpipe.engine.cuda_graphs import GraphedStep

        if self.cfg.attention_window or self._compiled():
            return
        if self._graphed_for != id(self) or self._graphed.capture != capture:  # else keep the graphs recorded so far
            self._graphed, self._graphed_for = GraphedStep(self, capture=capture), id(self)

    def _compiled(self) -> bool:
        return self._compiled_step is not None and self._compiled_for == id(self)

    def _recording(self) -> bool:
        return any(layer.self_attn.record is not None or layer.cross_attn.record is not None for layer in self.decoder)


# decode.compile: the compiled step gathers the cached keys/values itself (fused into attention's pass over them, no
# copy of the cache) when a position's keys of one layer take at least this many bytes; shorter rows are gathered
# before the graph. Measured against the reorder it replaced (8,000-token batches, 2 threads, identical outputs;
# BENCHMARKS.md, "The cache's slot table"): gathering in the graph ran float32 d 256 (1 KiB rows) 1.03-1.10x as fast,
# but d 128 float32 and d 256 bf16 (512-byte rows) 0.87-1.03x (median 0.99x) and 0.87-1.02x; gathered first, d 128
# float32 ran 1.01-1.02x. d 512 bf16 (1 KiB rows): in the graph 1.00-1.14x (median 1.06x) as fast as gathered before it.
_GATHER_IN_GRAPH_BYTES = 1024


# Which compile settings (frozen or not) this thread has entered around a whole decode: Transformer.compile_settings.
_entered = threading.local()


def _settings(frozen: bool) -> contextlib.ExitStack:
    """The settings ``decode.compile`` traces its graphs under (torch keeps them per thread):

    - inductor's ``freezing`` when ``frozen`` (:meth:`Transformer._build_compiled_step`). Not ``torch.compile``'s
      ``options``: those reach inductor only, after the tracer has already taken the weights for inputs, so nothing
      would be frozen.
    - dynamo's ``specialize_float``: the step's Python floats (the norms' eps) are constants. Else dynamo traces
      them as symbols under ``dynamic=True``, then starts again once inductor has to make them constants: a second
      trace, 33 s rather than 24 s to build a graph on a 2-vCPU Zen 3."""
    import torch._dynamo.config
    import torch._inductor.config

    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
    if frozen:
        stack.enter_context(torch._inductor.config.patch(freezing=True))
    return stack


def _twice(x: Tensor, k_prev: Tensor, v_prev: Tensor, index: Tensor | None,
           prev_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """:meth:`Transformer.step_layers`' per-row inputs for one sentence (R rows) as for two copies of it (2R rows;
    its per-sentence inputs are doubled once per sentence, :meth:`Transformer._cached_layers`). Why: torch
    specialises a dimension of size 1, so ``decode.compile`` would build a second graph for a lone sentence (the
    tail of every batch, a server's single request: 25-40 s on a small CPU, in every process); as two sentences it
    runs in the graph built for several, for the cost of computing R more rows (BENCHMARKS.md, "A lone sentence as
    two")."""
    def two(t: Tensor, dim: int) -> Tensor:
        return torch.cat([t, t], dim)

    x = two(x, 0)  # [R, 1, D] -> [2R, 1, D]
    if index is None:  # gathered [w, layers, R, h, d] -> [w, layers, 2R, h, d]
        k_prev, v_prev = two(k_prev, 2), two(v_prev, 2)
    else:  # the rows to gather [layers, w, R] -> [layers, R, w] -> [layers, 2R, w] -> [layers, w, 2R]: each row twice,
        # laid out as DecoderState.prefix lays them out (w contiguous), which the graph's guards check
        index = two(index.transpose(1, 2), 1).transpose(1, 2)
    prev_mask = None if prev_mask is None else two(prev_mask, 0)  # [R, 1, 1, w] -> [2R, 1, 1, w]
    return x, k_prev, v_prev, index, prev_mask


def mark_step_dynamic(x: Tensor, k_prev: Tensor, v_prev: Tensor, index: Tensor | None, prev_mask: Tensor | None,
                      cross: list[tuple[Tensor, Tensor]], src_mask: Tensor) -> None:
    """Tell ``torch.compile`` which dimensions of :meth:`Transformer.step_layers`' inputs vary from call to call
    (:func:`step_dynamic_dims`), so that it builds one graph for all of them rather than one per shape."""
    for tensor, dim, _ in step_dynamic_dims(x, k_prev, v_prev, index, prev_mask, cross, src_mask):
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


def step_dynamic_dims(x: Tensor, k_prev: Tensor, v_prev: Tensor, index: Tensor | None, prev_mask: Tensor | None,
                      cross: list[tuple[Tensor, Tensor]], src_mask: Tensor) -> list[tuple[Tensor, int, str]]:
    """The ``(tensor, dim, size)`` of :meth:`Transformer.step_layers`' inputs that vary from call to call, ``size``
    naming which: ``rows`` R, ``cache`` (the flat cache's size), ``positions`` w (cached), ``sentences`` n,
    ``source`` S (the rest are the model's sizes)."""
    dims = [(x, 0, "rows"), (src_mask, 0, "sentences"), (src_mask, 3, "source")]
    if index is not None:  # the flat cache [N, h * d] and the rows to gather [layers, w, R]
        dims += [(k_prev, 0, "cache"), (v_prev, 0, "cache"), (index, 1, "positions"), (index, 2, "rows")]
    else:  # gathered [w, layers, R, h, d]
        dims += [(k_prev, 0, "positions"), (k_prev, 2, "rows"), (v_prev, 0, "positions"), (v_prev, 2, "rows")]
    dims += [(kv, d, size) for pair in cross for kv in pair for d, size in ((0, "sentences"), (2, "source"))]
    if prev_mask is not None:
        dims += [(prev_mask, 0, "rows"), (prev_mask, 3, "positions")]  # [R, 1, 1, w]
    return dims


def build_model(model_config: dict | ModelConfig, vocab_size: int) -> Transformer:
    """A Transformer from a (checkpoint's) config dict or a :class:`ModelConfig`."""
    cfg = model_config if isinstance(model_config, ModelConfig) else ModelConfig(**model_config)
    return Transformer(cfg, vocab_size)


# --------------------------------------------------------------------------------------------------------------------
# Incremental decoding state: the self-attention cache and the per-sentence encoder keys/values
# --------------------------------------------------------------------------------------------------------------------


class SelfAttentionCache:
    """Every decoder layer's self-attention keys/values so far, stored time-major: ``keys``
    ``[capacity, layers, slots, h, d_k]`` and ``values`` likewise. Step p writes its rows' keys/values into slots
    ``0 .. R_p - 1`` of position p, once, and nothing moves them afterwards: which slot holds a row's position p is
    :class:`DecoderState`'s ``slots`` table.

    Why a table instead of reordering: in beam search a hypothesis continues another row's prefix, so the rows'
    cached prefixes change order at every step (and shrink as sentences finish). Gathering the whole cache into the
    new order each step copied ``t x layers x R x h x d`` values twice over (keys and values), 8-11 % of a decode's
    CPU time at 8,000-token batches; the table's reorder copies ``R x capacity`` integers, and attention reads each
    row's keys through the table (:meth:`DecoderState.prefix`). Growing (doubling the capacity, or more slots when
    the rows outgrow them) gathers the live rows' written prefix into a new cache, once.
    """

    def __init__(self, keys: Tensor, values: Tensor):
        self.keys, self.values = keys, values  # [capacity, layers, slots, h, d]

    @staticmethod
    def allocate(like: Tensor, shape: tuple[int, ...], d_k: int, d_v: int) -> SelfAttentionCache:
        """A cache of ``shape`` = (capacity, layers, slots, heads), in ``like``'s dtype and device."""
        return SelfAttentionCache(like.new_empty(*shape, d_k), like.new_empty(*shape, d_v))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.keys.shape[:4])

    def flat(self) -> tuple[Tensor, Tensor]:
        """Keys and values as ``[capacity * layers * slots, h * d]``: row ``(p * layers + l) * slots + s`` is layer
        l's key (value) of position p in slot s. The form :meth:`Transformer.step_layers` gathers from."""
        return (self.keys.view(-1, self.keys.size(-2) * self.keys.size(-1)),
                self.values.view(-1, self.values.size(-2) * self.values.size(-1)))


@dataclass
class DecoderState:
    """What incremental decoding carries from step to step: R = n * ``beams`` rows, the beams of each of the n
    sentences in consecutive rows.

    Per sentence (shared by its beams): ``src_mask`` ``[n, 1, 1, S]`` and ``cross[l]``, layer l's encoder
    keys/values ``[n, h, S, d]`` (projected once, :meth:`Transformer.start`). Per row: the self-attention keys/values
    of the ``length`` positions decoded so far, in the :class:`SelfAttentionCache` (allocated at the first step) at
    the slots ``slots[r, p]`` (``[R, capacity]``; position p of row r).

    :meth:`select` reorders and shrinks the rows by reordering ``slots`` (never the cache); :meth:`write` adds a
    position in place. Contract: :meth:`Transformer.step` writes position ``length`` of this state's cache and
    returns a state that shares it, and states made by :meth:`select` share it too, so only the newest state may be
    stepped.
    """

    src_mask: Tensor
    cross: list[tuple[Tensor, Tensor]]
    cache: SelfAttentionCache | None = None
    slots: Tensor | None = None  # [R, capacity] int64: the cache slot of each row's position p (p < length)
    length: int = 0
    beams: int = 1  # rows per sentence: 1 until the first select widens the beam
    # Continuous batching (:meth:`admit`): each row's first cache slot ``[R]``, its position 0; None = all rows 0.
    start: Tensor | None = None

    def prefix(self, like: Tensor, layers: int, heads: int, d_k: int, d_v: int,
               window: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """What :meth:`Transformer.step_layers` reads the earlier positions from: the cache's keys and values
        ``[N, h * d]`` (:meth:`SelfAttentionCache.flat`; empty, in ``like``'s dtype, before the first step), the rows
        of them holding each layer's positions ``[layers, w, R]`` (w = the ``length`` positions decoded so far, or
        the last ``window`` of them for restricted self-attention), and their mask ``[R, 1, 1, w]`` (False: the
        slots before a row's ``start``), or None when every row started at slot 0."""
        t, rows = self.length, like.size(0)
        w = min(t, window) if window else t
        if self.cache is None or t == 0:
            keys, values = like.new_empty(0, heads * d_k), like.new_empty(0, heads * d_v)
            index = torch.zeros(layers, 0, rows, dtype=torch.long, device=like.device)
        else:
            keys, values = self.cache.flat()
            index = self._flat_rows(t - w)  # [layers, w, R]
        mask = None
        if self.start is not None:
            slots = torch.arange(t - w, t, device=self.start.device)
            mask = (slots[None, :] >= self.start[:, None])[:, None, None, :]  # [R, w] -> [R, 1, 1, w]
        return keys, values, index, mask

    def _flat_rows(self, first: int) -> Tensor:
        """The rows of the flat cache (:meth:`SelfAttentionCache.flat`) that hold each layer's positions ``first`` ..
        ``length - 1`` of each row, ``[layers, t', R]``: row ``(p * layers + l) * slots + slots[r, p]``."""
        assert self.cache is not None and self.slots is not None
        layers, slots_per_position = self.cache.keys.shape[1:3]
        positions = torch.arange(first, self.length, device=self.slots.device)  # [t']
        layer = torch.arange(layers, device=self.slots.device)
        return ((positions[None, :, None] * layers + layer[:, None, None]) * slots_per_position
                + self.slots[:, first : self.length].t()[None])  # [R, t'] -> [t', R] -> [1, t', R]

    def gathered(self, first: int = 0, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """The cached keys and values of positions ``first`` .. ``length - 1`` in the rows' order,
        ``[length - first, layers, R, h, d]``: a copy, into ``out`` when given (contiguous tensors of that shape).
        The CUDA graphs' buffers take them in this form (:mod:`mtpipe.engine.cuda_graphs`), and :meth:`_compacted`."""
        index = self._flat_rows(first).transpose(0, 1)  # [layers, t', R] -> [t', layers, R]
        shape = index.shape
        index = index.reshape(-1)  # -> [t' * layers * R]
        assert self.cache is not None
        result = []
        for flat, store, into in zip(self.cache.flat(), (self.cache.keys, self.cache.values), out or (None, None)):
            got = (flat.index_select(0, index) if into is None  # [t' * layers * R, h * d]
                   else torch.index_select(flat, 0, index, out=into.view(-1, flat.size(1))))
            result.append(got.view(*shape, *store.shape[3:]))  # -> [t', layers, R, h, d]
        return result[0], result[1]

    def _compacted(self, first: int, capacity: int) -> tuple[SelfAttentionCache, Tensor]:
        """A new cache of ``capacity`` positions with a slot per row, holding this state's positions ``first`` ..
        ``length - 1`` gathered in the rows' order (one copy of the live rows; the slots of rows that left are not
        carried over), and its slots table."""
        assert self.cache is not None and self.slots is not None
        t, rows = self.length - first, self.slots.size(0)
        _, layers, _, heads = self.cache.shape
        new = SelfAttentionCache.allocate(self.cache.keys, (capacity, layers, rows, heads), self.cache.keys.size(-1),
                                          self.cache.values.size(-1))
        self.gathered(first, out=(new.keys[:t], new.values[:t]))  # [t, layers, R, h, d], contiguous prefixes
        table = torch.zeros(rows, capacity, dtype=torch.long, device=self.slots.device)
        table[:, :t] = torch.arange(rows, device=self.slots.device)[:, None]
        return new, table

    def write(self, k: Tensor, v: Tensor) -> None:
        """Write every layer's keys/values ``[layers, R, h, d]`` of position ``length`` into the cache (in place):
        row r into slot r."""
        t, rows = self.length, k.size(1)
        if self.cache is None or self.cache.keys.size(0) <= t or self.cache.keys.size(2) < rows:
            self._grow(k, v)
        assert self.cache is not None and self.slots is not None
        self.cache.keys[t, :, :rows] = k
        self.cache.values[t, :, :rows] = v
        self.slots[:, t] = torch.arange(rows, device=self.slots.device)

    def _grow(self, k: Tensor, v: Tensor) -> None:
        """Allocate the cache at the first step (16 positions, enough for most sentences, and a slot per row); when
        the positions are full (double them) or the rows outnumber the slots (after the first step's beam widening,
        or sentences that joined), a new cache with a slot per row, the written prefix gathered into it in the rows'
        order: one copy of the live rows (the slots of rows that left are not carried over)."""
        t, (layers, rows, heads) = self.length, k.shape[:3]
        old = self.cache
        if old is not None and t > 0:
            self.cache, self.slots = self._compacted(0, old.keys.size(0) * (2 if old.keys.size(0) <= t else 1))
            return
        # In the keys' own dtype (bf16 when decoding in bf16): with attention as two matmuls (mtpipe.model.kernels) a bf16
        # cache is faster than a float32 one, which would cast every new key/value and every query.
        self.cache = SelfAttentionCache.allocate(k, (16, layers, rows, heads), k.size(-1), v.size(-1))
        self.slots = torch.zeros(rows, 16, dtype=torch.long, device=k.device)

    def select(self, index: Tensor, beams: int | None = None) -> DecoderState:
        """A state of rows ``index`` of this one (beam reordering, finished sentences leaving the batch), grouped
        ``beams`` consecutive rows per sentence (default: as now). Each group's sentence is that of its first row;
        the per-sentence tensors are copied only when the sentences change; the cache is not copied (the rows'
        ``slots`` are), except in a continuous batch when the oldest positions are no one's any more."""
        beams = self.beams if beams is None else beams
        n_new = index.numel() // beams
        sentences = index.view(n_new, beams)[:, 0] // self.beams  # [n'*beams] -> [n', beams] -> [n']
        src_mask, cross = self.src_mask, self.cross
        if n_new != src_mask.size(0) or not torch.equal(sentences, torch.arange(n_new, device=index.device)):
            src_mask = src_mask.index_select(0, sentences)
            cross = [(k.index_select(0, sentences), v.index_select(0, sentences)) for k, v in cross]
        t = self.length
        start, first = self.start, 0
        if start is not None:
            # Continuous batching: the slots before every kept row's start belonged to rows that have left; the copy
            # below drops them, so a batch that never empties keeps its cache (and attention span) bounded.
            start = start.index_select(0, index)
            first = int(start.min())
            start = start - first if bool((start != first).any()) else None  # None: every row starts at slot 0
        if self.cache is None or t == 0:
            return DecoderState(src_mask, cross, length=t, beams=beams, start=start)
        assert self.slots is not None
        slots = self.slots.index_select(0, index)  # [R', capacity]
        if first == 0:
            return DecoderState(src_mask, cross, self.cache, slots, t, beams, start)
        # The positions before `first` are dropped: the kept rows' positions first..t-1 gathered into a new cache.
        new, table = DecoderState(src_mask, cross, self.cache, slots, t, beams)._compacted(first, self.cache.shape[0])
        return DecoderState(src_mask, cross, new, table, t - first, beams, start)

    def admit(self, fresh: DecoderState) -> DecoderState:
        """Continuous batching: this state's rows, then ``fresh``'s sentences (:meth:`Transformer.start`: one row
        each, nothing decoded yet) with ``beams`` rows each, joining at position ``length`` of the cache.

        The per-sentence encoder tensors are padded to the longer source (padding masked in ``src_mask``); the new
        rows' positions before ``length`` are hidden by their key mask, and their positions count from their
        ``start`` (:meth:`Transformer.step`), so a sentence decodes as it would alone."""
        if fresh.length != 0 or fresh.cache is not None or fresh.beams != 1:
            raise MtpipeError("DecoderState.admit: the joining sentences must be fresh (Transformer.start)")
        beams, t = self.beams, self.length
        width = max(self.src_mask.size(-1), fresh.src_mask.size(-1))

        def pad(x: Tensor, dim: int, value: float | bool) -> Tensor:  # along the source positions, to `width`
            extra = width - x.size(dim)
            if extra == 0:
                return x
            shape = list(x.shape)
            shape[dim] = extra
            return torch.cat([x, x.new_full(shape, value)], dim=dim)

        src_mask = torch.cat([pad(self.src_mask, -1, False), pad(fresh.src_mask, -1, False)])  # [n+m, 1, 1, S]
        cross = [(torch.cat([pad(k, 2, 0.0), pad(k2, 2, 0.0)]), torch.cat([pad(v, 2, 0.0), pad(v2, 2, 0.0)]))
                 for (k, v), (k2, v2) in zip(self.cross, fresh.cross)]  # each [n+m, h, S, d]
        old_rows = self.src_mask.size(0) * beams
        rows = old_rows + fresh.src_mask.size(0) * beams
        device = self.src_mask.device
        start = torch.cat([self.start if self.start is not None else torch.zeros(old_rows, dtype=torch.long,
                                                                                 device=device),
                           torch.full((rows - old_rows,), t, dtype=torch.long, device=device)])  # [R + m*beams]
        if self.cache is None or t == 0:
            return DecoderState(src_mask, cross, length=t, beams=beams, start=start)
        assert self.slots is not None
        # The joining rows' positions before `length` are hidden by the key mask; their slots point at slot 0, which
        # every position has written (finite values: a masked weight is exactly 0, and 0 * NaN would be NaN). Their
        # own positions get slots when the next step writes more rows than the cache has (DecoderState.write).
        slots = torch.cat([self.slots, self.slots.new_zeros(rows - old_rows, self.slots.size(1))])  # [R + m*beams, T]
        return DecoderState(src_mask, cross, self.cache, slots, t, beams, start)

