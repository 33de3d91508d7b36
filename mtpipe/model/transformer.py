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

Decoding: :meth:`Transformer.encode` runs the encoder once, :meth:`Transformer.project_memory` projects each decoder
layer's cross-attention keys/values once per sentence, and :meth:`Transformer.step` runs the decoder layers (the same
:meth:`DecoderLayer.forward` as training) on the newest position only, the earlier positions' self-attention
keys/values given from a cache. The step is a pure function; the cache and how the step is run (eagerly, compiled,
replayed from CUDA graphs) are the engine's (:mod:`mtpipe.engine.cache`, :mod:`mtpipe.engine.variants`).

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
  update (:meth:`Transformer.set_drophead`; its V-shaped schedule is :func:`mtpipe.training.update.drophead_rate`).
* ``attention_window=r`` -- restricted self-attention (section 4): in the encoder each position attends to the
  positions within r of it, in the decoder to itself and the r before it; encoder-decoder attention stays full.
  Long inputs take a banded computation (:func:`mtpipe.model.ops.banded_attention`), O(n r d) instead of O(n^2 d);
  incremental decoding attends to the last r + 1 cached positions only.

CPU speed choices (dropout masks, linear shapes, bf16 activations, matmul attention): :mod:`mtpipe.model.ops`.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor, nn

from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
from mtpipe.config import ModelConfig
from mtpipe.errors import MtpipeError
from mtpipe.model.attention import MultiHeadAttention
from mtpipe.model.layers import DecoderLayer, EncoderLayer, FeedForward, ScaleNorm, make_norm
from mtpipe.model.ops import autocast_activations, dropout, linear

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
        w = self.projection_weight()
        return unit_rows(w) if self.cfg.fixnorm else w

    def projection_weight(self) -> Tensor:
        """The stored ``[V, D]`` matrix behind :meth:`output_embedding` (before FixNorm's normalisation)."""
        return (self.out_proj if self.out_proj is not None
                else self.embed_tgt.weight if self.embed_tgt is not None else self.embed.weight)

    def logits(self, h: Tensor) -> Tensor:
        """Pre-softmax projection with the shared embedding matrix (3.4): ``[..., D] -> [..., V]``."""
        return linear(h, self.output_embedding(), self.out_bias)

    # -- 3.1 the stacks, training ----------------------------------------------------------------------------------

    def _layers(self, stack: nn.ModuleList) -> Iterable[nn.Module]:
        """The layers a forward pass runs. LayerDrop (Fan et al. 2019): in training each is skipped with probability
        ``layerdrop``, drawn per forward pass from torch's default CPU generator (the one dropout and the saved
        RNG states of :mod:`mtpipe.training.train` use, so a resumed run draws the same skips). Processes draw
        independently; DDP is told to expect unused parameters (:class:`mtpipe.training.update.Updater`)."""
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

    # -- incremental decoding --------------------------------------------------------------------------------------

    def project_memory(self, memory: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every decoder layer's encoder-decoder keys/values of the encoder output ``memory`` ``[n, S, D]``, projected
        once for a whole decode (section 3.2.3), each ``[n, h, S, d]``."""
        # Contiguous: the head split is a strided view, which the attention matmuls would otherwise copy at every step
        # of every layer.
        return [(k.contiguous(), v.contiguous()) for k, v in (layer.cross_attn.project_kv(memory)
                                                              for layer in self.decoder)]

    def step(self, x: Tensor, k_prev: Tensor, v_prev: Tensor, prev_mask: Tensor | None,
             cross: list[tuple[Tensor, Tensor]], src_mask: Tensor,
             index: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """One decoding step: the decoder stack on the newest position of each row, ``x`` ``[R, 1, D]`` (its token
        embedded at its position, :meth:`embed_tokens` with ``target=True``), with the same
        :meth:`DecoderLayer.forward` as training; the earlier positions' self-attention keys/values come from a
        cache. Returns the top of the stack ``[R, D]`` (:meth:`logits` projects it) and the new position's keys/values
        ``[layers, R, h, d]``, for the caller to write into its cache.

        ``cross``: each layer's encoder-decoder keys/values (:meth:`project_memory`); ``src_mask`` ``[n, 1, 1, S]``.
        The earlier positions: with ``index`` ``[layers, w, R]``, the rows of the flat cache ``k_prev``/``v_prev``
        ``[N, h * d]`` that hold each layer's w positions of each row, gathered here, inside the step, so that a
        compiler can fuse the gather into attention's one pass over the cache rather than copy it; without,
        ``k_prev``/``v_prev`` ``[w, layers, R, h, d]`` in the rows' order. ``prev_mask`` ``[R, 1, 1, w]`` or None
        masks them.

        A pure function of its inputs: nothing is written in place and nothing is kept, so the engine may run it
        eagerly, compiled or replayed from recorded graphs (:mod:`mtpipe.engine.runners`)."""
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


def build_model(model_config: dict | ModelConfig, vocab_size: int) -> Transformer:
    """A Transformer from a (checkpoint's) config dict or a :class:`ModelConfig`."""
    cfg = model_config if isinstance(model_config, ModelConfig) else ModelConfig(**model_config)
    return Transformer(cfg, vocab_size)
