"""The Transformer's layers (section 3.1): the position-wise feed-forward network (3.3), the norms (LayerNorm, or
ScaleNorm), the residual connections around each sub-layer (post-norm as in the paper, or pre-norm), and the encoder
and decoder layers built from them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtpipe.config import ModelConfig
from mtpipe.model.attention import KVCache, MultiHeadAttention
from mtpipe.model.ops import Linear, dropout, residual

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
