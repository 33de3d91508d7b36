"""Speed choices behind :mod:`mtpipe.model.transformer` (CPU tricks, and one GPU kernel choice for decoding): how its
operations are computed, never what they compute, given the device they run on (the machine itself is
:mod:`mtpipe.platform`'s to describe).

Each CPU function here is a drop-in for a plain torch formulation (named in its docstring) that was measurably slow on
CPU for this model's shapes; the measurements are in docs/performance.md and docs/journal/2026-11-benchmarks.md
(``bench/train_throughput.py``, ``bench/decode_speed.py``). On GPUs, under ``torch.compile`` and wherever the trick
does not apply, each falls back to the plain formulation. :func:`explicit_attention` differs from the fused kernel
by float rounding with gradients on; everything else is bit-identical to its plain formulation in fp32 eval under
``no_grad``. A benchmark times a trick's worth by switching it off for a block (:func:`fused_attention`,
:func:`fused_dropout`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# --------------------------------------------------------------------------------------------------------------------
# Dropout (section 5.4) from cheap random bits
# --------------------------------------------------------------------------------------------------------------------

# Masks are drawn 16 bits per element: p is applied as a multiple of 2^-16.
_MASK_BITS = 16


def keep_mask(like: Tensor, p: float) -> tuple[Tensor, float]:
    """A Bernoulli(1 - p) keep-mask shaped like ``like`` (1 = keep, 0 = drop, in ``like``'s dtype) and the
    ``1/(1-p)`` scale that dropout multiplies the kept values by (applied by the caller in float32 arithmetic).

    Why not ``F.dropout``: on CPU it draws one ``bernoulli_`` per element, a large share of a training step. Instead
    one full-range int64 ``random_`` per four elements gives 16 uniform random bits per element, and an element is
    kept when its bits, read as an int16, are at least ``round(p * 2^16) - 2^15`` (one comparison written straight
    into ``like``'s dtype). So the drop probability is ``p`` rounded to a multiple of 2^-16 (off by at most 7.6e-6)
    and the scale is ``1/(1 - that p)``: the mean of ``mask * scale`` is exactly 1, as dropout's must be. The bits
    come from torch's default generator, so seeding and saved RNG states reproduce the masks exactly. (Full range
    matters: ``random_()`` without bounds leaves the sign bit of an int64 at 0.)
    """
    levels = 1 << _MASK_BITS
    dropped = round(p * levels)  # the drop probability is dropped / 2^16
    n = like.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=like.device).random_(-(2**63), 2**63 - 1)
    bits = words.view(torch.int16)[:n].view(like.shape)  # [ceil(n/4)] int64 -> [4 ceil(n/4)] int16 -> like's shape
    keep = torch.ge(bits, dropped - levels // 2, out=torch.empty_like(like))
    return keep, levels / (levels - dropped)


# Whether eager CPU dropout draws the masks of keep_mask; False only inside fused_dropout.
_cheap_masks = True


@contextlib.contextmanager
def fused_dropout() -> Iterator[None]:
    """Inside the block, dropout is ``F.dropout`` on the CPU too, where :func:`keep_mask`'s masks would be drawn: how
    ``bench/train_throughput.py`` times that trick's worth (``--plain dropout``). A step compiled inside the block
    uses ``F.dropout`` anyway."""
    global _cheap_masks
    before, _cheap_masks = _cheap_masks, False
    try:
        yield
    finally:
        _cheap_masks = before


def _fused_dropout_available(x: Tensor) -> bool:
    """``F.dropout`` is cheap on GPUs (one fused kernel), and under ``torch.compile`` it is what dynamo can trace
    (``random_`` would break the graph; inductor draws the random numbers inside its own kernels). Only eager CPU
    code needs :func:`keep_mask` (outside :func:`fused_dropout`)."""
    return not _cheap_masks or x.device.type != "cpu" or torch.compiler.is_compiling()


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``Dropout(x)`` (section 5.4): the cheap mask of :func:`keep_mask` in eager CPU code, ``F.dropout`` elsewhere."""
    if not training or p == 0.0:
        return x
    if _fused_dropout_available(x):
        return F.dropout(x, p, training=True)
    keep, scale = keep_mask(x, p)
    return x * keep * scale


def residual(x: Tensor, sublayer_out: Tensor, p: float, training: bool) -> Tensor:
    """``x + Dropout(Sublayer(x))``, the residual connection of section 5.4 (the LayerNorm follows).

    Why: on CPU the mask, the scale and the residual add become one ``addcmul`` pass computed in float32 (``value``
    is the exact ``1/(1-p)`` even for bf16 tensors), and autograd keeps only the mask for the backward pass."""
    if not training or p == 0.0:
        return x + sublayer_out
    if _fused_dropout_available(x):
        return x + F.dropout(sublayer_out, p, training=True)
    keep, scale = keep_mask(sublayer_out, p)
    return torch.addcmul(x, sublayer_out, keep, value=scale)


# --------------------------------------------------------------------------------------------------------------------
# Linear layers under CPU bf16 autocast in training
# --------------------------------------------------------------------------------------------------------------------

# In CPU bf16 training, linear layers see their row count rounded up to a multiple of this (see `linear`).
_ROW_BLOCK = 128


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` over the last dimension of ``x``, as ``F.linear``.

    Why, under CPU bf16 autocast in training: the products run in oneDNN, which JIT-compiles a kernel for every new
    (rows, in, out) shape and caches it. rows = batch x length differs in nearly every token-bucketed batch, so each
    new batch paid for kernel generation and grew the kernel cache. Padding the rows up to a multiple of 128 (zeros,
    sliced off again; at most 127 rows of extra work) makes the shapes repeat, so the kernels are reused from the
    cache. Not when decoding (no grad): a few beams' rows would be padded to 128. Not while ``torch.compile`` traces
    (the compiler's own products). Elsewhere this is plain ``F.linear``.
    """
    if (torch.compiler.is_compiling() or x.device.type != "cpu" or not torch.is_grad_enabled()
            or not torch.is_autocast_enabled("cpu")):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.size(-1) if x.size(-1) else 0
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
# bf16 activations under CPU autocast
# --------------------------------------------------------------------------------------------------------------------


def autocast_activations(x: Tensor) -> Tensor:
    """``x`` in the CPU autocast dtype (bf16) when CPU autocast is on, else ``x`` itself.

    Why: applied to the embedded inputs, it keeps the activations between sub-layers in bf16 from there on (CPU
    autocast keeps LayerNorm's output in its input dtype, and the residual sums stay bf16), so no linear layer has
    to cast its input and every elementwise pass moves half the bytes. Weights, gradients and Adam stay float32;
    LayerNorm statistics, softmax and the loss are computed in float32 internally.
    """
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return x.to(torch.get_autocast_dtype("cpu"))
    return x


# --------------------------------------------------------------------------------------------------------------------
# Scaled dot-product attention (section 3.2.1) as two matmuls
# --------------------------------------------------------------------------------------------------------------------


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """On a GPU, ``F.scaled_dot_product_attention`` limited to the flash, memory-efficient and math kernels (for
    training's forward passes and for decoding); elsewhere nothing.

    Why: for bf16 and fp16 on recent GPUs torch may pick cuDNN's attention, which builds an execution graph for every
    new input shape; the other kernels need no per-shape set-up. A decoding step's keys grow by one position each
    step and its batch shrinks as sentences finish, so nearly every call is a new shape: with cuDNN's kernel, bf16
    beam search spent most of its time inside ``scaled_dot_product_attention`` and ran far slower than fp32; without
    it, close to fp32. Training meets every bucket's shape once an epoch, and a large corpus has thousands of them:
    bf16 training with cuDNN's kernel was several times slower through its first epoch than without (measured:
    docs/journal/2026-11-benchmarks.md, "On one GPU, again: bf16 decoding mended"). fp32 never uses cuDNN's kernel.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


# Queries up to which inference attention on CPU is two matmuls rather than torch's fused kernel. For an encoder
# layer's attention at this model's sizes, two matmuls beat the fused kernel for sentences up to about this many
# positions (more clearly on 2 threads than on 1), and lose to it on longer ones on 1 thread (at best tie on 2); whole
# decodes give the same fp32 translations either way (bf16 and int8 round differently). Measured:
# docs/journal/2026-11-benchmarks.md, "Decoding on two threads".
_EXPLICIT_MAX_QUERIES = 64


# Whether the CPU attention below may be two matmuls; False only inside fused_attention.
_explicit_attention = True


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """Inside the block, attention is torch's fused ``F.scaled_dot_product_attention`` wherever
    :func:`prefer_explicit_attention` would choose two matmuls (training's, the encoder's and a decoding step's
    cross-attention): how ``bench/train_throughput.py`` and ``bench/decode_speed.py`` time that trick's worth
    (``--plain attention``). A step compiled inside the block keeps the choice it was compiled with."""
    global _explicit_attention
    before, _explicit_attention = _explicit_attention, False
    try:
        yield
    finally:
        _explicit_attention = before


def prefer_explicit_attention(q: Tensor) -> bool:
    """Whether :func:`explicit_attention` beats ``F.scaled_dot_product_attention`` for queries ``q [B, h, Lq, d]``.

    Why, on CPU only: in training (gradients on), torch's CPU flash-attention backward is slower than three plain
    ops on these short sentences (L ~ 10-60, d_k 64), in fp32 and much more so in bf16. In decoding (a step's query
    per row, or a sentence's ``beams`` queries in cross-attention: at most 8 queries), two batched matmuls beat the
    fused kernel, which reads the keys/values at a fraction of memory bandwidth on these shapes. Without gradients
    (encoding a batch to decode it, validation) up to :data:`_EXPLICIT_MAX_QUERIES` queries too: torch's CPU kernel
    did not run faster on 2 threads than on 1 for sentences of 18-60 positions, where the two matmuls did.
    """
    return (_explicit_attention and q.device.type == "cpu"
            and (torch.is_grad_enabled() or q.size(2) <= _EXPLICIT_MAX_QUERIES))


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """``softmax(Q K^T / sqrt(d_k) + bias)`` (section 3.2.1) with ``bias`` = -inf where attending is not allowed:
    the attention weights ``[B, h, Lq, Lk]`` (float32 softmax for bf16 scores is not needed: rows sum to 1 either way).

    ``q`` ``[B, h, Lq, d_k]``, ``k`` ``[B, h, Lk, d_k]``; ``mask`` broadcasts to ``[B, h, Lq, Lk]`` (True = may attend);
    ``causal``: query i sees keys j <= i (section 3.2.3). The scale and the bias are applied in one ``add`` pass over
    the scores. Every row keeps at least one key (a source has its EOS, a causal or windowed row its own position),
    so no row is all -inf. Also what ``mtpipe attention`` plots
    (:class:`mtpipe.model.attention.AttentionWeights`).
    """
    scores = torch.matmul(q, k.transpose(-1, -2))  # [B, h, Lq, d_k] x [B, h, d_k, Lk] -> [B, h, Lq, Lk]
    lq, lk = scores.shape[-2:]
    bias = torch.zeros((lq, lk) if mask is None else mask.shape, dtype=scores.dtype, device=scores.device)
    if mask is not None:
        bias.masked_fill_(~mask, float("-inf"))
    if causal:  # position i sees keys j <= i (section 3.2.3)
        bias = bias + torch.full((lq, lk), float("-inf"), dtype=scores.dtype, device=scores.device).triu_(1)
    return torch.softmax(torch.add(bias, scores, alpha=q.size(-1) ** -0.5), dim=-1)  # [B, h, Lq, Lk]


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, p: float) -> Tensor:
    """``softmax(Q K^T / sqrt(d_k) + bias) V`` (section 3.2.1) as two matmuls (:func:`attention_weights`), attention
    dropout ``p`` on the weights (section 5.4). ``v`` ``[B, h, Lk, d_v]``; returns ``[B, h, Lq, d_v]``."""
    weights = attention_weights(q, k, mask, causal)
    return torch.matmul(dropout(weights, p, True).to(v.dtype), v)  # [B, h, Lq, Lk] x [B, h, Lk, d_v]


def cached_attention(q: Tensor, k: Tensor, v: Tensor, k_prev: Tensor, v_prev: Tensor, prev_mask: Tensor | None,
                     observe: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Incremental decoding's self-attention (section 3.2.1 for one new position): ``softmax(q [K_prev; k]^T /
    sqrt(d_k)) [V_prev; v]`` with the queries ``q`` ``[R, h, 1, d_k]``, the earlier positions ``k_prev`` / ``v_prev``
    ``[R, h, t, d]`` (``prev_mask`` ``[R, 1, 1, t]``, True = may attend, or None) and the new position's own ``k`` /
    ``v`` ``[R, h, 1, d]``; returns ``[R, h, 1, d_v]``. The weights ``[R, h, 1, t+1]`` pass through ``observe``
    when it is given (:class:`mtpipe.model.attention.AttentionWeights`, for ``mtpipe attention``).

    Two forms of the same sums. Eagerly, batched matmuls (one small product per row and head). Under
    ``torch.compile`` (``decode.compile``), element-wise products summed over ``d`` and over ``t``: the compiler
    fuses each into one pass over the cache, which ran several times faster than the matmuls, while eagerly the same
    products, materialised, ran slower than the matmuls (measured: docs/journal/2026-11-benchmarks.md, "Compiled
    decoding step")."""
    t = k_prev.size(2)
    fused = torch.compiler.is_compiling()
    q = q * q.size(-1) ** -0.5  # scaled once, for both scores
    if fused:
        s_prev = (q * k_prev).sum(dim=-1)[:, :, None, :]  # [R, h, 1, d] * [R, h, t, d] -> [R, h, t] -> [R, h, 1, t]
        s_new = (q * k).sum(dim=-1, keepdim=True)  # [R, h, 1, 1]
    else:
        s_prev = torch.matmul(q, k_prev.transpose(-1, -2))  # [R, h, 1, d] x [R, h, d, t] -> [R, h, 1, t]
        s_new = torch.matmul(q, k.transpose(-1, -2))  # [R, h, 1, d] x [R, h, d, 1] -> [R, h, 1, 1]: one operation
    if prev_mask is not None:
        s_prev = s_prev.masked_fill(~prev_mask, float("-inf"))
    # Every row keeps its own position, so no row is all -inf.
    weights = torch.softmax(torch.cat([s_prev, s_new], dim=-1), dim=-1)  # [R, h, 1, t+1]
    if observe is not None:
        weights = observe(weights)
    weights = weights.to(v.dtype)
    w_prev, w_new = weights[..., :t], weights[..., t:]  # [R, h, 1, t], [R, h, 1, 1]
    if fused:
        o = (w_prev.transpose(-1, -2) * v_prev).sum(dim=2, keepdim=True)  # [R, h, t, 1] * [R, h, t, d] -> [R, h, 1, d]
    else:
        o = torch.matmul(w_prev, v_prev)  # [R, h, 1, t] x [R, h, t, d] -> [R, h, 1, d]
    return torch.addcmul(o, w_new, v)  # + the new position's share of its own value


# --------------------------------------------------------------------------------------------------------------------
# Restricted self-attention (section 4): each query sees the keys within r positions
# --------------------------------------------------------------------------------------------------------------------


def window_mask(length: int, window: int, causal: bool, device: torch.device) -> Tensor:
    """``[L, L]`` bool, True where query i may attend key j: ``|i - j| <= r`` (``causal``: ``0 <= i - j <= r``)."""
    pos = torch.arange(length, device=device)
    rel = pos[:, None] - pos[None, :]  # [L, 1] - [1, L] -> [L, L], i - j
    return (rel <= window) & (rel >= (0 if causal else -window))


def window_block(window: int) -> int:
    """Queries per block of :func:`banded_attention`: small blocks waste few scores outside the band (each block
    scores ``block + 2r`` keys per query for the ``2r + 1`` it needs), large ones make fewer, larger matmuls."""
    return max(32, window + 1)


def banded_min_length(window: int) -> int:
    """From this length on :func:`banded_attention` is used (shorter inputs take the masked full score matrix).

    Why this rule: the banded form scores about ``L (block + 2r)`` query-key pairs against the full form's ``L^2``,
    but pays for padding, the unfolded views and more, smaller matmuls, so it wins only from some length on, which
    grows with r. ``max(256, 4r + 128)`` lies inside or just above the crossover measured for each r tried (one
    layer, forward + backward, the banded form forced at every length; ``bench/complexity.py``, in git history at
    a632779; measured: docs/journal/2026-11-benchmarks.md, "The paper's Table 1, measured")."""
    return max(256, 4 * window + 128)


def banded_attention(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, window: int, causal: bool,
                     p: float) -> Tensor:
    """Restricted self-attention (section 4) in ``O(L r d)`` time and memory instead of ``O(L^2 d)``: the queries
    are cut into blocks of c (:func:`window_block`), and each block attends to the ``c + 2r`` keys around it
    (``c + r`` when ``causal``) -- one batched matmul over all blocks, the band's edges masked.

    ``q``/``k`` ``[B, h, L, d_k]``, ``v`` ``[B, h, L, d_v]``, ``key_mask`` broadcastable ``[B, 1, 1, L]`` (True = real
    key) or None. Query i attends key j where ``|i - j| <= r`` (``causal``: ``0 <= i - j <= r``) and key j is real or
    j = i (a padded query attends to itself, so no row is all -inf). Equal to :func:`explicit_attention` with
    :func:`window_mask` (and the same rule) up to float rounding. Returns ``[B, h, L, d_v]``.
    """
    b, h, length, d_k = q.shape
    c = window_block(window)
    before, after = window, (0 if causal else window)
    width = c + before + after  # keys per block
    blocks = -(-length // c)
    tail = blocks * c - length  # queries padded to whole blocks
    qb = F.pad(q, (0, 0, 0, tail)).view(b, h, blocks, c, d_k)  # [B, h, L, d] -> [B, h, nb*c, d] -> [B, h, nb, c, d]
    # Keys/values padded by the band on both sides, then every block's window as a strided view (no copy):
    # [B, h, r + nb*c + r', d] -> unfold -> [B, h, nb, d, width]
    kw = F.pad(k, (0, 0, before, tail + after)).unfold(2, width, c)
    vw = F.pad(v, (0, 0, before, tail + after)).unfold(2, width, c)
    scores = torch.matmul(qb, kw)  # [B, h, nb, c, d] x [B, h, nb, d, width] -> [B, h, nb, c, width]
    # Query a of a block at key slot m is key j = i + m - r - a: in the band iff 0 <= m - a <= r + r'.
    slot = torch.arange(width, device=q.device)
    row = torch.arange(c, device=q.device)
    rel = slot[None, :] - row[:, None]  # [c, 1], [1, width] -> [c, width], m - a
    allowed = (rel >= 0) & (rel <= before + after)  # [c, width]
    if key_mask is None:
        key_mask = torch.ones(b, 1, 1, length, dtype=torch.bool, device=q.device)
    real = F.pad(key_mask.reshape(key_mask.size(0), 1, length), (before, tail + after), value=False)  # [B, 1, r+L+r']
    real = real.unfold(2, width, c).unsqueeze(-2)  # [B, 1, nb, width] -> [B, 1, nb, 1, width]
    itself = rel == before  # [c, width]: key j = i
    ok = (allowed & real) | itself  # [B, 1, nb, c, width]
    bias = torch.zeros(ok.shape, dtype=scores.dtype, device=q.device).masked_fill_(~ok, float("-inf"))
    weights = torch.softmax(torch.add(bias, scores, alpha=d_k**-0.5), dim=-1)  # [B, h, nb, c, width]
    o = torch.matmul(dropout(weights, p, True).to(v.dtype), vw.transpose(-1, -2))  # [B, h, nb, c, d_v]
    return o.reshape(b, h, blocks * c, v.size(-1))[:, :, :length]  # [B, h, nb, c, d_v] -> [B, h, L, d_v]
