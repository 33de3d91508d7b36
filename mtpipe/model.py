"""The Transformer of Vaswani et al. (2017), "Attention Is All You Need", read top to bottom.

Section 3 of the paper, with its numbers as the ``base``/``big`` presets in :mod:`mtpipe.config`:

* 3.1  encoder and decoder stacks of N layers; every sub-layer is wrapped as ``LayerNorm(x + Dropout(Sublayer(x)))``
       (post-norm, section 5.4 "Residual Dropout").
* 3.2  multi-head scaled dot-product attention, ``softmax(QK^T / sqrt(d_k)) V`` over h heads
       (``torch.nn.functional.scaled_dot_product_attention``: a fused kernel on CPU and GPU; CPU training uses
       the explicit three-op form, see :meth:`MultiHeadAttention.attend`).
* 3.3  position-wise feed-forward network ``max(0, x W1 + b1) W2 + b2``.
* 3.4  one embedding matrix shared by the source embedding, the target embedding and the pre-softmax projection
       (joint BPE vocabulary), multiplied by sqrt(d_model) in the embedding layers.
* 3.5  sinusoidal positional encodings added to the embeddings, then dropout on the sum (section 5.4).

Tensors are batch-first: ``src`` is ``[B, S]`` token ids, ``tgt`` is ``[B, T]``; hidden states are ``[B, L, d_model]``.
Padding is on the right and uses :data:`mtpipe.artifacts.PAD_ID`.

For decoding, :meth:`Transformer.encode` runs the encoder once, :meth:`Transformer.start` projects every decoder
layer's cross-attention keys/values once per sentence (its beams query them together), and
:meth:`Transformer.step` writes each layer's self-attention keys/values of the new position into a preallocated
cache (:class:`SelfAttentionCache`; incremental decoding). :meth:`DecoderState.select` reorders or shrinks the batch
(beam reordering, finished sentences leaving the batch).

Variants (``model`` params, saved in the checkpoint's model config, so decoding rebuilds them; each off by default,
and the default model runs exactly the code above -- every choice is made when the model is built):

* ``norm_position=pre`` -- ``x + Dropout(F(Norm(x)))`` with one more norm after the last layer of each stack
  (Nguyen & Salazar 2019, "Transformers without Tears"; trains without warmup, suits low-resource pairs).
* ``norm=scale`` -- ScaleNorm ``g * x / ||x||`` (:class:`ScaleNorm`) in place of every LayerNorm; ``fixnorm`` --
  unit-length word embeddings times one learned scalar (:meth:`Transformer.embed_tokens`,
  :meth:`Transformer.output_embedding`). Usable together (the paper's "ScaleNorm + FixNorm").
* ``positions=learned`` -- a learned ``[max_positions, d_model]`` table instead of the sinusoids (Table 3 row E).
* ``layerdrop=p`` -- LayerDrop (Fan et al. 2019): in training each layer of both stacks is skipped with probability
  p; at inference :func:`prune` removes layers (the "every other" strategy or an explicit list), no fine-tuning.
* DropHead (Zhou et al. 2020) -- whole attention heads dropped in training with a probability the trainer sets each
  update (:meth:`Transformer.set_drophead`; its V-shaped schedule is :func:`mtpipe.train.drophead_rate`).

Speed on CPU (measured with ``bench/train_throughput.py``; the choices only change how, never what, is computed):
dropout masks come from 16 random bits per element instead of ``bernoulli_`` (:func:`keep_mask`), mask, scale and
residual add are one ``addcmul``, training attention avoids the slow fused CPU backward, and under bf16 autocast
the activations between sub-layers stay bf16. In fp32 eval under ``no_grad`` (validation, decoding) the outputs are
bit-identical to the plain formulation; with gradients on, the explicit attention differs by float rounding only.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtpipe.artifacts import PAD_ID
from mtpipe.config import ModelConfig
from mtpipe.errors import MtpipeError

# --------------------------------------------------------------------------------------------------------------------
# 3.5 Positional encoding
# --------------------------------------------------------------------------------------------------------------------


def sinusoids(length: int, d_model: int) -> Tensor:
    """``PE(pos, 2i) = sin(pos / 10000^(2i/d_model))``, ``PE(pos, 2i+1) = cos(...)`` (section 3.5).

    Sines fill the first half of the vector and cosines the second (the tensor2tensor / Marian layout): a fixed
    permutation of the paper's interleaving, which keeps exported models compatible with those toolkits.
    Returns ``[length, d_model]``.
    """
    half = d_model // 2
    pos = torch.arange(length, dtype=torch.float64).unsqueeze(1)  # [length, 1]
    freq = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64) * 2.0 / d_model)  # [half]
    angles = pos * freq  # [length, half]
    pe = torch.zeros(length, d_model, dtype=torch.float64)
    pe[:, :half] = torch.sin(angles)
    pe[:, half : 2 * half] = torch.cos(angles)
    return pe.float()


# --------------------------------------------------------------------------------------------------------------------
# 5.4 Dropout
# --------------------------------------------------------------------------------------------------------------------

# Masks are drawn 16 bits per element: p is applied as a multiple of 2^-16.
_MASK_BITS = 16


def keep_mask(like: Tensor, p: float) -> tuple[Tensor, float]:
    """A Bernoulli(1 - p) keep-mask shaped like ``like`` (1 = keep, 0 = drop, in ``like``'s dtype) and the
    ``1/(1-p)`` scale that dropout multiplies the kept values by (applied by the caller in float32 arithmetic).

    Why not ``F.dropout``: on CPU it draws one ``bernoulli_`` per element, about 6.5 ns each here (torch 2.x; the
    anchors profiled it at 22 % of a training step). Instead one full-range int64 ``random_`` per four elements gives
    16 uniform random bits per element (about 0.8 ns per element), and an element is kept when its bits, read as an
    int16, are at least ``round(p * 2^16) - 2^15`` (one comparison written straight into ``like``'s dtype). So the
    drop probability is ``p`` rounded to a multiple of 2^-16 (off by at most 7.6e-6) and the scale is
    ``1/(1 - that p)``: the mean of ``mask * scale`` is exactly 1, as dropout's must be. The bits come from torch's
    default generator, so seeding and saved RNG states reproduce the masks exactly. (Full range matters:
    ``random_()`` without bounds leaves the sign bit of an int64 at 0.)
    """
    levels = 1 << _MASK_BITS
    dropped = round(p * levels)  # the drop probability is dropped / 2^16
    n = like.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=like.device).random_(-(2**63), 2**63 - 1)
    bits = words.view(torch.int16)[:n].view(like.shape)  # [ceil(n/4)] int64 -> [4 ceil(n/4)] int16 -> like's shape
    keep = torch.ge(bits, dropped - levels // 2, out=torch.empty_like(like))
    return keep, levels / (levels - dropped)


def _fused_dropout_available(x: Tensor) -> bool:
    """``F.dropout`` is cheap on GPUs (one fused kernel), and under ``torch.compile`` it is what dynamo can trace
    (``random_`` would break the graph; inductor draws the random numbers inside its own kernels). Only eager CPU
    code needs :func:`keep_mask`."""
    return x.device.type != "cpu" or torch.compiler.is_compiling()


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``Dropout(x)`` (section 5.4): the cheap mask above in eager CPU code, ``F.dropout`` elsewhere."""
    if not training or p == 0.0:
        return x
    if _fused_dropout_available(x):
        return F.dropout(x, p, training=True)
    keep, scale = keep_mask(x, p)
    return x * keep * scale


def residual(x: Tensor, sublayer_out: Tensor, p: float, training: bool) -> Tensor:
    """``x + Dropout(Sublayer(x))``, the residual connection of section 5.4 (the LayerNorm follows).

    On CPU the mask, the scale and the residual add are one ``addcmul`` pass computed in float32 (``value`` is the
    exact ``1/(1-p)`` even for bf16 tensors), and autograd keeps only the mask for the backward pass."""
    if not training or p == 0.0:
        return x + sublayer_out
    if _fused_dropout_available(x):
        return x + F.dropout(sublayer_out, p, training=True)
    keep, scale = keep_mask(sublayer_out, p)
    return torch.addcmul(x, sublayer_out, keep, value=scale)


# --------------------------------------------------------------------------------------------------------------------
# Linear layers
# --------------------------------------------------------------------------------------------------------------------

# In CPU bf16 training, linear layers see their row count rounded up to a multiple of this (see `linear`).
_ROW_BLOCK = 128


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` over the last dimension of ``x``, as ``F.linear``.

    Training under CPU bf16 autocast runs the matmuls in oneDNN, which JIT-compiles a kernel for every new
    (rows, in, out) shape and caches it: rows = batch x length differs in nearly every token-bucketed batch, so each
    new batch paid ~55 ms of kernel generation (the logits' input gradient alone 18 ms), about 14 % of a small-model
    bf16 step, and the cache (1024 kernels by default) grew the process by ~25 MB per new batch shape. Padding the
    rows up to a multiple of 128 (zeros, sliced off again; at most 127 rows of extra work) makes the shapes repeat,
    so the kernels are reused from the cache: +6-12 % tokens/s from the second epoch on, 1.3-1.9 GB less memory.
    Not when decoding (no grad): a few beams' rows would be padded to 128. Elsewhere this is plain ``F.linear``.
    """
    if (x.device.type != "cpu" or not torch.is_grad_enabled() or not torch.is_autocast_enabled("cpu")
            or torch.compiler.is_compiling()):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.size(-1)
    pad = -rows % _ROW_BLOCK
    if pad == 0:
        return F.linear(x, weight, bias)
    padded = F.pad(x.reshape(rows, x.size(-1)), (0, 0, 0, pad))  # [..., in] -> [rows, in] -> [rows + pad, in]
    y = F.linear(padded, weight, bias)[:rows]  # [rows + pad, out] -> [rows, out] (a contiguous prefix)
    return y.view(*x.shape[:-1], y.size(-1))  # [rows, out] -> [..., out]


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict names) computed by :func:`linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


# --------------------------------------------------------------------------------------------------------------------
# Normalisation: LayerNorm (section 3.1) or ScaleNorm (Nguyen & Salazar 2019)
# --------------------------------------------------------------------------------------------------------------------


class ScaleNorm(nn.Module):
    """``ScaleNorm(x) = g * x / max(||x||, eps)`` over the last dimension, with one learned scalar ``g`` initialised
    to sqrt(d_model) (Nguyen & Salazar 2019): the output vector has length g, whatever x's length.

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


# Guards FixNorm's division (mtpipe.model.Transformer.embed_tokens) for PAD's all-zero embedding row.
_FIXNORM_EPS = 1e-6


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The normalisation layer ``model.norm`` asks for."""
    return ScaleNorm(cfg.d_model) if cfg.norm == "scale" else nn.LayerNorm(cfg.d_model)


# --------------------------------------------------------------------------------------------------------------------
# 3.2 Attention
# --------------------------------------------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """``MultiHead(Q, K, V) = Concat(head_1..head_h) W^O`` with ``head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)``.

    The h per-head projections are one matrix each (``h * d_k`` outputs). For self-attention Q, K and V come from
    one fused ``[d_model -> h*(2 d_k + d_v)]`` matmul, for cross-attention K and V from one ``[d_model -> h*(d_k+d_v)]``
    matmul over the encoder output: fewer, larger matmuls are faster on every backend.
    """

    def __init__(self, d_model: int, heads: int, d_k: int, d_v: int, dropout: float, self_attention: bool):
        super().__init__()
        self.heads, self.d_k, self.d_v, self.dropout = heads, d_k, d_v, dropout
        self.self_attention = self_attention
        # DropHead probability (Transformer.set_drophead; None = off, the default): a 0-dim buffer updated in place,
        # not a float, so a new value each update is data to torch.compile, not a reason to recompile.
        self.register_buffer("drophead", None, persistent=False)
        if self_attention:
            self.qkv = Linear(d_model, heads * (2 * d_k + d_v))
        else:
            self.q = Linear(d_model, heads * d_k)
            self.kv = Linear(d_model, heads * (d_k + d_v))
        self.out = Linear(heads * d_v, d_model)

    def _split(self, x: Tensor, d: int) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, self.heads, d).transpose(1, 2)  # [B, L, h*d] -> [B, h, L, d]

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention keys and values of the encoder output, ``[B, h, S, d_k]`` and ``[B, h, S, d_v]``."""
        k, v = self.kv(memory).split([self.heads * self.d_k, self.heads * self.d_v], dim=-1)
        return self._split(k, self.d_k), self._split(v, self.d_v)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention queries, keys and values, each ``[B, h, L, d]``."""
        hk, hv = self.heads * self.d_k, self.heads * self.d_v
        q, k, v = self.qkv(x).split([hk, hk, hv], dim=-1)
        return self._split(q, self.d_k), self._split(k, self.d_k), self._split(v, self.d_v)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
        """Scaled dot-product attention (section 3.2.1) and the output projection. ``mask``: True = may attend.

        Fused ``scaled_dot_product_attention`` everywhere except training and decoding on CPU, where the explicit
        form below is faster: torch's CPU flash-attention backward, on these short sentences (L ~ 10-60, d_k 64),
        measured 1.1-1.5x slower than three plain ops in fp32 and 3-5x slower in bf16 (it was 40 % of a bf16 training
        step).
        """
        p = self.dropout if self.training else 0.0
        if q.device.type == "cpu" and (torch.is_grad_enabled() or q.size(2) <= 8):
            # Also decoding (a step's query per row, or its `beams` queries per sentence in cross-attention): there
            # two batched matmuls ran 1.5-3x faster than the fused kernel, which reads the keys/values at a fraction
            # of memory bandwidth on these shapes (a bf16 decode took 18 % less time without it, AMD Zen 4).
            o = explicit_attention(q, k, v, mask, causal, p)  # [B, h, Lq, d_v]
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        if self.drophead is not None and self.training:
            o = drop_heads(o, self.drophead)
        b, _, length, _ = o.shape
        return self.out(o.transpose(1, 2).reshape(b, length, self.heads * self.d_v))  # [B, Lq, h*d_v] -> [B, Lq, D]


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, p: float) -> Tensor:
    """``softmax(Q K^T / sqrt(d_k) + bias) V`` (section 3.2.1) with ``bias`` = -inf where attending is not allowed.

    ``q`` ``[B, h, Lq, d_k]``, ``k`` ``[B, h, Lk, d_k]``, ``v`` ``[B, h, Lk, d_v]``; ``mask`` broadcasts to
    ``[B, h, Lq, Lk]`` (True = may attend). The scale and the bias are applied in one ``add`` pass over the scores.
    Every row keeps at least one key (a source has its EOS, a causal row its own position), so no row is all -inf.
    """
    scores = torch.matmul(q, k.transpose(-1, -2))  # [B, h, Lq, d_k] x [B, h, d_k, Lk] -> [B, h, Lq, Lk]
    lq, lk = scores.shape[-2:]
    bias = torch.zeros((lq, lk) if mask is None else mask.shape, dtype=scores.dtype, device=scores.device)
    if mask is not None:
        bias.masked_fill_(~mask, float("-inf"))
    if causal:  # position i sees keys j <= i (section 3.2.3)
        bias = bias + torch.full((lq, lk), float("-inf"), dtype=scores.dtype, device=scores.device).triu_(1)
    weights = torch.softmax(torch.add(bias, scores, alpha=q.size(-1) ** -0.5), dim=-1)  # [B, h, Lq, Lk]
    return torch.matmul(dropout(weights, p, True).to(v.dtype), v)  # [B, h, Lq, Lk] x [B, h, Lk, d_v]


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


# --------------------------------------------------------------------------------------------------------------------
# 3.1 / 3.3 Layers
# --------------------------------------------------------------------------------------------------------------------


class FeedForward(nn.Module):
    """``FFN(x) = max(0, x W1 + b1) W2 + b2`` (section 3.3), inner size d_ff."""

    def __init__(self, d_model: int, d_ff: int, relu_dropout: float):
        super().__init__()
        self.w1, self.w2 = Linear(d_model, d_ff), Linear(d_ff, d_model)
        self.relu_dropout = relu_dropout

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(dropout(F.relu(self.w1(x)), self.relu_dropout, self.training))


class Sublayers(nn.Module):
    """Where a layer's norms sit around its sub-layers F (section 3.1 / Nguyen & Salazar 2019):

    * post-norm (the paper): ``x <- Norm(x + Dropout(F(x)))``;
    * pre-norm: ``x <- x + Dropout(F(Norm(x)))`` (the residual path is never normalised; the stack ends with a norm).

    A layer computes ``F(self.norm_in(x, norm))`` and then ``x = self.add_norm(x, out, norm)``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.dropout = cfg.dropout

    def norm_in(self, x: Tensor, norm: nn.Module) -> Tensor:
        """The sub-layer's input: ``Norm(x)`` in a pre-norm layer, ``x`` itself in a post-norm one."""
        return norm(x) if self.pre_norm else x

    def add_norm(self, x: Tensor, out: Tensor, norm: nn.Module) -> Tensor:
        """``x + Dropout(out)``, then the norm in a post-norm layer (section 5.4)."""
        x = residual(x, out, self.dropout, self.training)
        return x if self.pre_norm else norm(x)


class EncoderLayer(Sublayers):
    """Self-attention, then feed-forward; each ``LayerNorm(x + Dropout(sublayer(x)))`` (sections 3.1, 5.4), or
    pre-normed (:class:`Sublayers`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.d_k, cfg.d_v, cfg.attention_dropout, True)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout)
        self.norm1, self.norm2 = make_norm(cfg), make_norm(cfg)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        q, k, v = self.self_attn.project_qkv(self.norm_in(x, self.norm1))
        x = self.add_norm(x, self.self_attn.attend(q, k, v, src_mask), self.norm1)
        return self.add_norm(x, self.ffn(self.norm_in(x, self.norm2)), self.norm2)


class DecoderLayer(Sublayers):
    """Masked self-attention, encoder-decoder attention, feed-forward; each sub-layer post-normed (section 3.1), or
    pre-normed (:class:`Sublayers`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.d_k, cfg.d_v, cfg.attention_dropout, True)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.d_k, cfg.d_v, cfg.attention_dropout, False)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout)
        self.norm1, self.norm2, self.norm3 = (make_norm(cfg) for _ in range(3))

    def forward(self, x: Tensor, mem_k: Tensor, mem_v: Tensor, src_mask: Tensor) -> Tensor:
        """``x``: ``[B, T, D]``, the whole shifted target; the causal mask keeps position i from seeing positions
        > i (section 3.2.3). ``mem_k``/``mem_v``: this layer's cross-attention keys/values of the encoder output."""
        q, k, v = self.self_attn.project_qkv(self.norm_in(x, self.norm1))
        x = self.add_norm(x, self.self_attn.attend(q, k, v, None, causal=True), self.norm1)
        cq = self.cross_attn.q(self.norm_in(x, self.norm2))  # [B, T, h*d_k]
        cq = self.cross_attn._split(cq, self.cross_attn.d_k)  # [B, T, h*d_k] -> [B, h, T, d_k]
        x = self.add_norm(x, self.cross_attn.attend(cq, mem_k, mem_v, src_mask), self.norm2)
        return self.add_norm(x, self.ffn(self.norm_in(x, self.norm3)), self.norm3)

    def step(self, x: Tensor, state: "DecoderState", layer: int) -> Tensor:
        """One decoding step: ``x`` ``[R, 1, D]`` is the newest position of each of the R = n * beams rows.

        Self-attention: the new position's key/value is written into the cache at position t and its query attends
        to positions 0..t of its own row (no mask needed: later positions do not exist yet). Cross-attention: the
        beams of a sentence share its source, so the rows are regrouped as n sentences of ``beams`` queries each,
        ``[n, beams, D]``, against that sentence's keys/values ``[n, h, S, d]``: the encoder keys/values are never
        copied per beam, and each sentence's attention is one small matmul instead of ``beams`` vector products.
        """
        q, k, v = self.self_attn.project_qkv(self.norm_in(x, self.norm1))  # each [R, h, 1, d]
        k, v = state.append(layer, k, v)  # [R, h, t+1, d] views of the cache
        x = self.add_norm(x, self.self_attn.attend(q, k, v, None), self.norm1)
        mem_k, mem_v = state.cross[layer]
        n, rows, d_model = mem_k.size(0), x.size(0), x.size(-1)
        y = self.norm_in(x, self.norm2).view(n, rows // n, d_model)  # [R, 1, D] -> [n, beams, D]
        cq = self.cross_attn._split(self.cross_attn.q(y), self.cross_attn.d_k)  # [n, h, beams, d_k]
        c = self.cross_attn.attend(cq, mem_k, mem_v, state.src_mask)  # [n, beams, D]
        x = self.add_norm(x, c.view(rows, 1, d_model), self.norm2)  # [n, beams, D] -> [R, 1, D]
        return self.add_norm(x, self.ffn(self.norm_in(x, self.norm3)), self.norm3)


# --------------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------------


class SelfAttentionCache:
    """Every decoder layer's self-attention keys and values for the positions decoded so far, time-major:
    ``keys`` ``[capacity, layers, R, h, d_k]`` and ``values`` likewise, views over flat storages so that a storage can
    be reused at another row count.

    Why this layout: step t writes one block ``[t, layer]`` in place (no concatenation, which copies the whole cache
    every step); the positions in use are always a contiguous prefix ``[:t]``, so a beam reorder gathers exactly that
    prefix into another storage with one ``index_select`` (no scattered 4 KB pages first-touched per row, which cost
    more than the copy itself on CPU), and growing (doubling the capacity) copies one contiguous block. Attention
    reads a layer's ``[t, R, h, d]`` slice as ``[R, h, t, d]`` through strides; torch's CPU attention kernel ran as fast
    or faster on that layout than on a row-major cache.
    """

    def __init__(self, k_store: Tensor, v_store: Tensor, shape: tuple[int, ...], d_k: int, d_v: int):
        capacity, layers, rows, heads = shape
        self.k_store, self.v_store = k_store, v_store
        self.keys = k_store[: capacity * layers * rows * heads * d_k].view(capacity, layers, rows, heads, d_k)
        self.values = v_store[: capacity * layers * rows * heads * d_v].view(capacity, layers, rows, heads, d_v)

    @staticmethod
    def allocate(like: Tensor, shape: tuple[int, ...], d_k: int, d_v: int,
                 stores: tuple[Tensor, Tensor] | None = None) -> "SelfAttentionCache":
        """A cache of ``shape`` = (capacity, layers, rows, heads), in ``stores`` when they are large enough."""
        n = math.prod(shape)
        if stores is None or stores[0].numel() < n * d_k or stores[1].numel() < n * d_v:
            stores = (like.new_empty(n * d_k), like.new_empty(n * d_v))
        return SelfAttentionCache(stores[0], stores[1], shape, d_k, d_v)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.keys.shape[:4])

    @property
    def stores(self) -> tuple[Tensor, Tensor]:
        return self.k_store, self.v_store


@dataclass
class DecoderState:
    """What incremental decoding carries from step to step: R = n * ``beams`` rows, the beams of each of the n
    sentences in consecutive rows.

    Per sentence (shared by its beams): ``src_mask`` ``[n, 1, 1, S]`` and ``cross[l]``, layer l's encoder
    keys/values ``[n, h, S, d]`` (projected once, :meth:`Transformer.start`). Per row: the self-attention keys/values
    of the ``length`` positions decoded so far (:class:`SelfAttentionCache`, allocated at the first step).

    :meth:`select` gathers rows into ``spare`` storages, which then hold the new state's cache while this state's
    storages become its spare: one copy per step into memory that is already mapped. Contract:
    :meth:`Transformer.step` writes position ``length`` of this state's cache and returns a state that shares it;
    :meth:`select` never changes this state's cache, but the returned state reuses this state's storages as its
    spare, so only the newest state may be selected from or stepped after that.
    """

    src_mask: Tensor
    cross: list[tuple[Tensor, Tensor]]
    cache: SelfAttentionCache | None = None
    spare: tuple[Tensor, Tensor] | None = None
    length: int = 0
    beams: int = 1  # rows per sentence: 1 until the first select widens the beam

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write layer ``layer``'s keys/values ``[R, h, 1, d]`` of position ``length``; return positions
        ``0..length`` of that layer, ``[R, h, length+1, d]``."""
        t = self.length
        if self.cache is None or self.cache.keys.size(0) <= t:
            self._grow(k, v)
        assert self.cache is not None
        self.cache.keys[t, layer] = k[:, :, 0]  # [R, h, 1, d] -> [R, h, d]
        self.cache.values[t, layer] = v[:, :, 0]
        keys, values = self.cache.keys[: t + 1, layer], self.cache.values[: t + 1, layer]  # [t+1, R, h, d]
        return keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)  # [t+1, R, h, d] -> [R, h, t+1, d] (strides only)

    def _grow(self, k: Tensor, v: Tensor) -> None:
        """Allocate the cache at the first step (16 positions, enough for most sentences); double it when full."""
        t, rows, heads = self.length, k.size(0), k.size(1)
        capacity = 16 if self.cache is None else 2 * self.cache.keys.size(0)
        # In the keys' own dtype (bf16 when decoding in bf16): with attention as two matmuls (MultiHeadAttention.attend)
        # a bf16 cache decoded 15 % faster than a float32 one, which cast every new key/value and every query.
        like = k.new_empty(0)
        grown = SelfAttentionCache.allocate(like, (capacity, len(self.cross), rows, heads), k.size(-1), v.size(-1),
                                            self.spare)
        if self.cache is not None:
            grown.keys[:t] = self.cache.keys[:t]  # contiguous prefixes: one block copy each
            grown.values[:t] = self.cache.values[:t]
            self.spare = self.cache.stores
        self.cache = grown

    def select(self, index: Tensor, beams: int | None = None) -> "DecoderState":
        """A state of rows ``index`` of this one (beam reordering, finished sentences leaving the batch), grouped
        ``beams`` consecutive rows per sentence (default: as now). Each group's sentence is that of its first row;
        the per-sentence tensors are copied only when the sentences change, the cache only when the rows do."""
        beams = self.beams if beams is None else beams
        n_new = index.numel() // beams
        sentences = index.view(n_new, beams)[:, 0] // self.beams  # [n'*beams] -> [n', beams] -> [n']
        src_mask, cross = self.src_mask, self.cross
        if n_new != src_mask.size(0) or not torch.equal(sentences, torch.arange(n_new, device=index.device)):
            src_mask = src_mask.index_select(0, sentences)
            cross = [(k.index_select(0, sentences), v.index_select(0, sentences)) for k, v in cross]
        t, old = self.length, self.cache
        if old is None or t == 0:
            return DecoderState(src_mask, cross, length=t, beams=beams)
        rows = index.numel()
        if rows == old.keys.size(2) and torch.equal(index, torch.arange(rows, device=index.device)):
            return DecoderState(src_mask, cross, old, self.spare, t, beams)  # nothing moved (e.g. greedy search)
        capacity, layers, _, heads = old.shape
        new = SelfAttentionCache.allocate(old.keys, (capacity, layers, rows, heads), old.keys.size(-1),
                                          old.values.size(-1), self.spare)
        torch.index_select(old.keys[:t], 2, index, out=new.keys[:t])  # [t, layers, R, h, d] -> [t, layers, R', h, d]
        torch.index_select(old.values[:t], 2, index, out=new.values[:t])
        return DecoderState(src_mask, cross, new, old.stores, t, beams)


class Transformer(nn.Module):
    """Encoder-decoder Transformer (section 3) over a joint vocabulary with three-way tied embeddings (3.4)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        self.cfg = cfg = cfg.resolved()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD_ID)
        self.scale = math.sqrt(cfg.d_model)  # 3.4: embeddings are multiplied by sqrt(d_model)
        if cfg.fixnorm:  # FixNorm: the fixed sqrt(d_model) becomes the learned length of every word embedding
            self.embed_g = nn.Parameter(torch.empty(()))
        if cfg.positions == "learned":  # Table 3 row E
            self.positions = nn.Parameter(torch.empty(cfg.max_positions, cfg.d_model))
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
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projections and N(0, d_model^-0.5) embeddings (as tensor2tensor initialised the paper's
        models): with the sqrt(d_model) scale the embedded inputs start at unit variance, like the positions.
        Learned positions start at N(0, d_model^-0.5) (fairseq's choice); ScaleNorm's and FixNorm's g at
        sqrt(d_model) (Nguyen & Salazar 2019)."""
        for name, p in self.named_parameters():
            if p.dim() == 2 and name not in ("embed.weight", "positions"):
                nn.init.xavier_uniform_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
        nn.init.normal_(self.embed.weight, mean=0.0, std=self.cfg.d_model**-0.5)
        with torch.no_grad():
            self.embed.weight[PAD_ID].zero_()
        if isinstance(self.positions, nn.Parameter):
            nn.init.normal_(self.positions, mean=0.0, std=self.cfg.d_model**-0.5)
        if self.cfg.fixnorm:
            nn.init.constant_(self.embed_g, self.scale)
        for m in self.modules():
            if isinstance(m, ScaleNorm):
                m.reset_parameters()

    # -- embeddings ----------------------------------------------------------------------------------------------

    def embed_tokens(self, tokens: Tensor, offset: int = 0) -> Tensor:
        """``Dropout(E[tokens] * sqrt(d_model) + PE[offset : offset+L])``, ``[B, L] -> [B, L, D]``.

        FixNorm: ``g * E[t] / ||E[t]||`` instead of ``E[t] * sqrt(d_model)`` (PAD's zero row stays zero).
        """
        length = tokens.size(1)
        if offset + length > self.cfg.max_positions:
            raise MtpipeError(
                f"sequence of {offset + length} positions exceeds model.max_positions={self.cfg.max_positions}"
            )
        e = self.embed(tokens)
        if self.cfg.fixnorm:
            e = e * (self.embed_g / torch.linalg.vector_norm(e, dim=-1, keepdim=True).clamp_min(_FIXNORM_EPS))
        else:
            e = e * self.scale
        x = e + self.positions[offset : offset + length]
        if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # Mixed precision on CPU: the activations between sub-layers are kept in the autocast dtype (bf16) from
            # here on (CPU autocast keeps LayerNorm's output in its input dtype, and the residual sums stay bf16), so
            # no linear layer has to cast its input and every elementwise pass moves half the bytes: +5-7 % tokens/s
            # on a small-model bf16 step. Weights, gradients and Adam stay float32; LayerNorm statistics, softmax and
            # the loss are computed in float32 internally.
            x = x.to(torch.get_autocast_dtype("cpu"))
        return dropout(x, self.dropout, self.training)

    def output_embedding(self) -> Tensor:
        """The pre-softmax projection matrix ``[V, D]``: the embedding matrix itself (3.4).

        With FixNorm, its rows normalised to unit length (the same unit vectors the input side scales by g; no g
        here): a logit is then ``|h| cos(h, e_y)``, so the decoder output's own length -- the gain of the last norm
        -- sets the softmax temperature, as the fixed-norm output layer of Nguyen & Chiang (2018) intends. PAD's row
        stays zero (a constant logit that is never a target) and gets no gradient, as with ``padding_idx``.
        """
        w = self.embed.weight
        if not self.cfg.fixnorm:
            return w
        inv = torch.linalg.vector_norm(w, dim=-1, keepdim=True).clamp_min(_FIXNORM_EPS).reciprocal()  # [V, 1]
        return w * inv.index_fill(0, torch.tensor([PAD_ID], device=w.device), 0.0)

    def logits(self, h: Tensor) -> Tensor:
        """Pre-softmax projection with the shared embedding matrix (3.4): ``[..., D] -> [..., V]``."""
        return linear(h, self.output_embedding(), None)

    # -- training ------------------------------------------------------------------------------------------------

    def _layers(self, stack: nn.ModuleList) -> Iterable[nn.Module]:
        """The layers a forward pass runs. LayerDrop (Fan et al. 2019): in training each is skipped with probability
        ``layerdrop``, drawn per forward pass from torch's default CPU generator (the one dropout and the saved
        RNG states of :mod:`mtpipe.train` use, so a resumed run draws the same skips). Processes draw
        independently; DDP is told to expect unused parameters (:class:`mtpipe.train.Updater`)."""
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
        x = self.embed_tokens(tgt_in)
        for layer in self._layers(self.decoder):
            mk, mv = layer.cross_attn.project_kv(memory)
            x = layer(x, mk, mv, src_mask)
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

    # -- incremental decoding ------------------------------------------------------------------------------------

    def start(self, memory: Tensor, src_mask: Tensor) -> DecoderState:
        """Project every decoder layer's cross-attention keys/values once for the whole decode (one row per
        sentence; :meth:`DecoderState.select` widens to the beam)."""
        # Contiguous [n, h, S, d]: the head split is a strided view, which the attention matmuls would otherwise
        # copy at every step of every layer (10 % of a CPU decode step).
        cross = [(k.contiguous(), v.contiguous()) for k, v in (layer.cross_attn.project_kv(memory)
                                                               for layer in self.decoder)]
        return DecoderState(src_mask=src_mask, cross=cross)

    def step(self, tokens: Tensor, state: DecoderState, lazy: bool = False) -> tuple[Any, DecoderState]:
        """Log-probabilities ``[R, V]`` of the token after ``tokens [R]`` (the last decoded position of each row).

        Only the new position is computed; earlier positions' self-attention keys/values come from ``state``.
        ``lazy``: return instead a function ``log_probs(lo, hi)`` giving rows ``lo:hi`` only, so that beam search
        can project, normalise and rank a few hundred rows at a time while they are in the CPU's cache, rather than
        stream a ``[R, V]`` float32 matrix through memory four times (it was a quarter of a CPU decode step).
        """
        x = self.embed_tokens(tokens[:, None], offset=state.length)  # [R] -> [R, 1] -> [R, 1, D]
        for i, layer in enumerate(self.decoder):
            x = layer.step(x, state, i)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        h = x[:, 0]  # [R, 1, D] -> [R, D]

        def log_probs(lo: int, hi: int) -> Tensor:
            # float32 straight from (bf16) logits: one pass, no separate cast of the logits
            return F.log_softmax(self.logits(h[lo:hi]), dim=-1, dtype=torch.float32)  # [hi-lo, V]

        new_state = dataclasses.replace(state, length=state.length + 1)
        return (log_probs if lazy else log_probs(0, h.size(0))), new_state


def build_model(model_config: dict | ModelConfig, vocab_size: int) -> Transformer:
    """A Transformer from a (checkpoint's) config dict or a :class:`ModelConfig`."""
    cfg = model_config if isinstance(model_config, ModelConfig) else ModelConfig(**model_config)
    return Transformer(cfg, vocab_size)


# --------------------------------------------------------------------------------------------------------------------
# LayerDrop pruning (Fan et al. 2019): a shallower sub-network at inference, without fine-tuning
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrunePlan:
    """The layers a pruned model keeps: 0-based indexes into the encoder and decoder stacks, in order."""

    encoder: tuple[int, ...]
    decoder: tuple[int, ...]

    def describe(self, cfg: ModelConfig) -> str:
        return (f"encoder layers {list(self.encoder)} of {cfg.encoder_layers}, "
                f"decoder layers {list(self.decoder)} of {cfg.decoder_layers}")


def every_other(n_layers: int, rate: float) -> tuple[int, ...]:
    """Fan et al.'s "every other" strategy at pruning rate ``rate``: drop the layers at depth d (1-based, d = 1 is
    the layer next to the embeddings) with ``d % floor(1/rate) == 0``; returns the 0-based indexes kept. Rate 0.5
    keeps the odd depths 1, 3, 5 (indexes 0, 2, 4) of six; rate 0.2 drops depth 5 only."""
    k = math.floor(1.0 / rate + 1e-9)  # the epsilon keeps 1/0.2 = 4.999... from flooring to 4
    return tuple(d - 1 for d in range(1, n_layers + 1) if d % k)


def prune_plan(cfg: ModelConfig, spec: str, where: str = "prune") -> PrunePlan | None:
    """Parse a prune spec (``decode.prune`` / ``average.prune``) for a model of config ``cfg``; None = no pruning.

    * ``every_other`` -- :func:`every_other` at the model's own ``layerdrop`` (an error for a model trained
      without LayerDrop, whose layers were never trained to be left out);
    * ``every_other:R`` -- the same at pruning rate R, e.g. 0.5 for half depth from a model trained with p = 0.2;
    * ``enc:0,2,4;dec:0,2,4`` -- the 0-based layer indexes to keep (``encoder``/``decoder`` spelled out also work);
      a side left out keeps all its layers.
    """
    spec = spec.strip()
    if not spec:
        return None
    cfg = cfg.resolved()
    if spec.split(":", 1)[0].strip() == "every_other":
        rest = spec.split(":", 1)[1].strip() if ":" in spec else ""
        if rest:
            try:
                rate = float(rest)
            except ValueError:
                raise MtpipeError(f"{where}: {spec!r}: the rate after 'every_other:' is not a number") from None
        elif cfg.layerdrop == 0.0:
            raise MtpipeError(f"{where}: 'every_other' uses the model's LayerDrop rate, but it was trained with "
                              "model.layerdrop=0; give a rate ('every_other:0.5') or the layers to keep "
                              "('enc:0,2,4;dec:0,2,4')")
        else:
            rate = cfg.layerdrop
        if not 0.0 < rate < 1.0:
            raise MtpipeError(f"{where}: {spec!r}: the pruning rate {rate} is not in (0, 1)")
        plan = PrunePlan(every_other(cfg.encoder_layers, rate), every_other(cfg.decoder_layers, rate))
    else:
        sides = {"encoder": tuple(range(cfg.encoder_layers)), "decoder": tuple(range(cfg.decoder_layers))}
        given: set[str] = set()
        for part in filter(None, (x.strip() for x in spec.split(";"))):
            name, sep, items = part.partition(":")
            side = {"enc": "encoder", "dec": "decoder"}.get(name.strip(), name.strip())
            if not sep or side not in sides:
                raise MtpipeError(f"{where}: {spec!r} is not 'every_other', 'every_other:RATE' or a keep list like "
                                  "'enc:0,2,4;dec:0,2,4'")
            if side in given:
                raise MtpipeError(f"{where}: {spec!r} names the {side} twice")
            given.add(side)
            n = len(sides[side])
            try:
                keep = [int(x) for x in items.split(",") if x.strip()]
            except ValueError:
                raise MtpipeError(f"{where}: {spec!r}: the {side} list is not comma-separated layer indexes") from None
            bad = [i for i in keep if not 0 <= i < n]
            if bad:
                raise MtpipeError(f"{where}: {spec!r}: {side} layer {bad[0]} does not exist (the model has {n}, "
                                  f"indexed 0..{n - 1})")
            if len(set(keep)) != len(keep):
                raise MtpipeError(f"{where}: {spec!r}: the {side} list repeats a layer")
            sides[side] = tuple(sorted(keep))
        plan = PrunePlan(sides["encoder"], sides["decoder"])
    for side, kept in (("encoder", plan.encoder), ("decoder", plan.decoder)):
        if not kept:
            raise MtpipeError(f"{where}: {spec!r} leaves the {side} without layers")
    return plan


def pruned_config(cfg: ModelConfig, plan: PrunePlan) -> ModelConfig:
    """The config of the pruned model: fewer layers; ``layerdrop`` kept as a record of how it was trained."""
    return dataclasses.replace(cfg.resolved(), encoder_layers=len(plan.encoder), decoder_layers=len(plan.decoder))


def prune_state_dict(state: dict[str, Tensor], plan: PrunePlan) -> dict[str, Tensor]:
    """A state dict without the pruned layers, the kept ones renumbered from 0 (``encoder.4.`` -> ``encoder.2.``);
    every other entry (embeddings, final norms) as is."""
    renumber = {"encoder": {old: new for new, old in enumerate(plan.encoder)},
                "decoder": {old: new for new, old in enumerate(plan.decoder)}}
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        side, _, rest = name.partition(".")
        if side in renumber and rest.split(".", 1)[0].isdigit():
            index, _, tail = rest.partition(".")
            if int(index) in renumber[side]:
                out[f"{side}.{renumber[side][int(index)]}.{tail}"] = t
        else:
            out[name] = t
    return out


def prune(model: Transformer, plan: PrunePlan) -> Transformer:
    """A copy of ``model`` with only the layers of ``plan`` (``model`` itself is unchanged); its ``cfg`` has the
    reduced layer counts, so its checkpoint rebuilds without any pruning flag."""
    out = copy.deepcopy(model)
    out.cfg = pruned_config(model.cfg, plan)
    out.encoder = nn.ModuleList(out.encoder[i] for i in plan.encoder)
    out.decoder = nn.ModuleList(out.decoder[i] for i in plan.decoder)
    return out
