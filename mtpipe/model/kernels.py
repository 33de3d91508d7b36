"""Speed choices behind :mod:`mtpipe.model.transformer` (CPU tricks, and one GPU kernel choice for decoding): how its operations
are computed, never what they compute.

Each CPU function here is a drop-in for a plain torch formulation (named in its docstring) that was measurably slow on
CPU for this model's shapes; the measurements are in BENCHMARKS.md (``bench/train_throughput.py``,
``bench/decode_speed.py``). On GPUs, under ``torch.compile`` and wherever the trick does not apply, each falls back
to the plain formulation. The float32 products through oneDNN (:func:`linear`, :func:`mm`, :class:`Linear`'s packed
weights when decoding, :class:`DecodingProjection`) differ from torch's own by float rounding only, as does
:func:`explicit_attention` from the fused kernel with gradients on; everything else is bit-identical to its plain
formulation in fp32 eval under ``no_grad``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

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


def _fused_dropout_available(x: Tensor) -> bool:
    """``F.dropout`` is cheap on GPUs (one fused kernel), and under ``torch.compile`` it is what dynamo can trace
    (``random_`` would break the graph; inductor draws the random numbers inside its own kernels). Only eager CPU
    code needs :func:`keep_mask`."""
    return x.device.type != "cpu" or torch.compiler.is_compiling()


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
# float32 matrix products through oneDNN on CPU
# --------------------------------------------------------------------------------------------------------------------

# Whether torch dispatches AVX-512 kernels on this CPU (ATEN_CPU_CAPABILITY can lower it): the products' thresholds
# and training's route below depend on it.
_AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
# Whether float32 products may run in oneDNN (bench/train_throughput.py and bench/decode_speed.py --plain onednn set it
# False, to time torch's own route).
ONEDNN_FP32 = True
# Whether training's float32 products (those autograd differentiates) take the route too: only where torch dispatches
# AVX-512. With AVX2 only, on a real AMD Zen 3, a training step ran 0.83x (d 256) and 0.87x (d 128) as fast with the
# route as with torch's own products (the route's 1.08x on a Zen 5 restricted to AVX2 did not carry over), while
# decoding's products stayed within 0.93-1.09x (BENCHMARKS.md, "Decoding and training on a real AVX2-only CPU").
ONEDNN_FP32_TRAINING = _AVX512
# Products of fewer multiply-adds than this stay on torch's route: oneDNN's call costs ~10-13 us more (its kernel
# and the weights' blocked layout are made per call), so small products, e.g. a server's few-sentence decoding step
# at d 128, ran slower through it. Break-even measured on a 2-core AMD EPYC Zen 5 (1 and 2 threads, d 128-1,024): ~1M
# multiply-adds with AVX-512, ~6-8M with the CPU restricted to AVX2 (BENCHMARKS.md, "float32 products through
# oneDNN"). A training step's products and a decoding step's of a full batch are hundreds of times larger.
_ONEDNN_MIN_MACS = 1 << 20 if _AVX512 else 1 << 23


def _probe_onednn() -> bool:
    """Whether this torch build can run a float32 product through oneDNN's linear kernel (x86 and aarch64 builds)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x = torch.ones(2, 3)
        return bool(torch.ops.mkldnn._linear_pointwise(x, torch.ones(4, 3), None, "none", [], "").eq(3).all())
    except (RuntimeError, AttributeError, NotImplementedError):  # an op this build lacks
        return False


# Probed once at import, not per product (and never traced by torch.compile: torch.backends calls break graphs).
_ONEDNN_AVAILABLE = _probe_onednn()


def _onednn_worth(a: Tensor, macs: int) -> bool:
    """Whether a float32 CPU product of ``macs`` multiply-adds should run in oneDNN rather than torch's ``mm``.

    Why: torch's float32 ``mm`` / ``addmm`` on x86 is MKL's, and MKL runs its AVX2 code on AMD CPUs even where they
    have AVX-512: on a 2-core AMD EPYC Zen 5 a 1,024^3 product ran ~205 GFLOP/s through torch and ~460 through oneDNN's
    linear kernel (which dispatches AVX-512 there), and 1.1-1.3x faster through oneDNN with the CPU restricted to AVX2
    (BENCHMARKS.md, "float32 products through oneDNN"); a training step on a real AVX2-only CPU was not, hence
    :data:`ONEDNN_FP32_TRAINING`. Small products stay on torch's (:data:`_ONEDNN_MIN_MACS`).
    Not under autocast (its bf16 products already run in oneDNN), nor while ``torch.compile`` traces: inductor's own
    oneDNN lowering takes only frozen, pre-packed weights, and the product as an opaque custom op cost ~8 us more per
    call in the compiled graph (24 products of 16 rows x 128 x 384: 0.71x inductor's own), which is what a compiled
    step for a server's few sentences is made of (BENCHMARKS.md)."""
    return macs >= _ONEDNN_MIN_MACS and not torch.compiler.is_compiling() and _onednn_open(a)


def _onednn_open(a: Tensor) -> bool:
    """Whether the oneDNN route is open to ``a`` at all, whatever the product's size (float32 on CPU, outside
    autocast, where this torch build has it); the caller has checked that ``torch.compile`` is not tracing."""
    return (ONEDNN_FP32 and _ONEDNN_AVAILABLE and a.dtype == torch.float32 and a.device.type == "cpu"
            and not torch.is_autocast_enabled("cpu"))


def _dnn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x weight^T + bias`` by oneDNN's linear kernel; ``x [..., K]``, ``weight [N, K]`` (any strides)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for 2-D ``a [M, K]`` and ``b [K, N]``, as ``torch.mm``; through oneDNN where :func:`_onednn_worth`
    says so (float32 on CPU), the result then equal to ``torch.mm``'s up to float rounding.

    oneDNN's kernel reads both operands with any strides, but ran at half speed when ``a`` is a transposed view
    (column-major, as in the ``dW = dY^T X`` of a backward pass) and the output has more rows than columns (146
    against 420 GFLOP/s for a 4,096-row ``dY^T X`` with 256 x 8,000 outputs); then ``(b^T a^T)^T`` is computed
    instead, the same product, returned as a transposed view."""
    if not _onednn_worth(a, a.size(0) * a.size(1) * b.size(1)):
        return torch.mm(a, b)
    if a.stride(0) == 1 and a.size(0) > b.size(1):  # column-major a, tall output
        return _dnn(b.t(), a).t()  # ([N, K] x [K, M])^T = [M, N]
    return _dnn(a, b.t())  # [M, K] x [K, N]


class _LinearFunction(torch.autograd.Function):
    """``F.linear`` for float32 CPU tensors with the forward and both backward products through :func:`mm`'s
    oneDNN route: ``y = x W^T + b``, ``dx = dy W``, ``dW = dy^T x``, ``db = sum dy`` (``x`` as ``[rows, in]``)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _dnn(x, weight, bias)  # [rows, in] -> [rows, out]

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        dx = mm(dy, weight) if ctx.needs_input_grad[0] else None  # [rows, out] x [out, in]
        dw = mm(dy.t(), x) if ctx.needs_input_grad[1] else None  # [out, rows] x [rows, in]
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None  # [out]
        return dx, dw, db


# In CPU bf16 training, linear layers see their row count rounded up to a multiple of this (see `linear`).
_ROW_BLOCK = 128


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` over the last dimension of ``x``, as ``F.linear``.

    Why, in float32 on CPU: the products (forward, and with gradients both backward ones) run in oneDNN where
    :func:`_onednn_worth` says so, ~2.2x torch's own on an AVX-512 AMD CPU; with gradients only where
    :data:`ONEDNN_FP32_TRAINING` (AVX-512).

    Why, under CPU bf16 autocast in training: the products run in oneDNN, which JIT-compiles a kernel for every new
    (rows, in, out) shape and caches it. rows = batch x length differs in nearly every token-bucketed batch, so each
    new batch paid for kernel generation and grew the kernel cache. Padding the rows up to a multiple of 128 (zeros,
    sliced off again; at most 127 rows of extra work) makes the shapes repeat, so the kernels are reused from the
    cache. Not when decoding (no grad): a few beams' rows would be padded to 128. Elsewhere this is plain
    ``F.linear``.
    """
    if torch.compiler.is_compiling():  # the compiler's own products (see _onednn_worth)
        return F.linear(x, weight, bias)
    if weight.dtype == x.dtype and _onednn_worth(x, x.numel() * weight.size(0)):
        if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad
                                                or (bias is not None and bias.requires_grad)):
            return _dnn(x, weight, bias)  # [..., in] -> [..., out]
        if not ONEDNN_FP32_TRAINING:
            return F.linear(x, weight, bias)
        rows = x.numel() // x.size(-1) if x.size(-1) else 0
        y = _LinearFunction.apply(x.reshape(rows, x.size(-1)), weight, bias)  # [..., in] -> [rows, in] -> [rows, out]
        return y.view(*x.shape[:-1], y.size(-1))  # [rows, out] -> [..., out]
    if x.device.type != "cpu" or not torch.is_grad_enabled() or not torch.is_autocast_enabled("cpu"):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.size(-1) if x.size(-1) else 0
    pad = -rows % _ROW_BLOCK
    if pad == 0:
        return F.linear(x, weight, bias)
    padded = F.pad(x.reshape(rows, x.size(-1)), (0, 0, 0, pad))  # [..., in] -> [rows, in] -> [rows + pad, in]
    y = F.linear(padded, weight, bias)[:rows]  # [rows + pad, out] -> [rows, out] (a contiguous prefix)
    return y.view(*x.shape[:-1], y.size(-1))  # [rows, out] -> [..., out]


# Whether decoding's linear layers may use oneDNN-packed copies of their weights (bench/decode_speed.py --plain
# layer-packing sets it False, to time the unpacked route).
PACK_DECODING_LINEARS = True
# Inference products of at least this many multiply-adds use the packed copy (:class:`Linear`). Break-even against
# torch's product on one thread of a 2-core AMD EPYC Zen 5, d 128-512, 4-256 rows: ~0.8M multiply-adds with AVX-512,
# ~2M with the CPU restricted to AVX2 (BENCHMARKS.md, "Decoding's linear layers on packed weights").
_PACKED_MIN_MACS = 1 << 20 if _AVX512 else 1 << 21


def _pack(w: Tensor) -> Tensor | None:
    """``w [out, in]`` (float32, CPU) in oneDNN's pre-packed, blocked layout for :func:`_dnn`, or None where this
    torch build cannot make it."""
    if not _ONEDNN_AVAILABLE:
        return None
    try:
        # the row count is a hint for the blocking; any count works with the packed matrix
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 256)
    except (RuntimeError, AttributeError, NotImplementedError):  # an op this build lacks
        return None


class PackedWeight:
    """A copy of a weight in oneDNN's packed layout (:func:`_pack`), made again only when the weight changes (another
    tensor, other storage, or an in-place update: its version counter). A deep copy (the model's, for bf16 / int8 /
    pruning) starts empty: oneDNN's packed tensors are opaque and cannot be copied, and the copy's weights may differ
    anyway."""

    def __init__(self) -> None:
        self._source: weakref.ref | None = None
        self._key: tuple = ()
        self._packed: Tensor | None = None

    def __deepcopy__(self, memo: dict) -> "PackedWeight":
        return PackedWeight()

    def clear(self) -> None:
        self._source, self._key, self._packed = None, (), None

    def get(self, w: Tensor) -> Tensor | None:
        """The packed copy of ``w`` (None where oneDNN cannot pack it, or for an inference tensor, which has no
        version counter to tell an in-place update by)."""
        if w.is_inference():
            return None
        key = (w.data_ptr(), w._version, w.shape)
        if self._source is None or self._source() is not w or self._key != key:
            self._packed = None  # free the old copy first
            with torch.inference_mode(False), torch.no_grad():
                self._packed = _pack(w)
            self._source, self._key = weakref.ref(w), key
        return self._packed


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict names) computed by :func:`linear`.

    Why, in inference mode (decoding) in float32 on CPU: products of at least :data:`_PACKED_MIN_MACS` run in oneDNN
    on a kept, pre-packed copy of the weight (:class:`PackedWeight`), which skips the per-call packing of
    :func:`linear`'s oneDNN route: for a decoding step's few rows (64 down to 4 rows x 512 x 2,048) 1.1-2.2x that
    route with AVX-512 and 1.1-2.0x with AVX2 only, 1.0-1.1x for hundreds of rows (BENCHMARKS.md, "Decoding's linear
    layers on packed weights"). Training, validation loss and compiled steps keep :func:`linear`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()

    def forward(self, x: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias
        # is_compiling first: the compiler cannot trace is_inference_mode_enabled (a graph break in every layer)
        if (not torch.compiler.is_compiling() and torch.is_inference_mode_enabled() and weight.dtype == x.dtype
                and _onednn_open(x)):
            # Decoding: the route decided here once, since a step makes ~25 of these calls for a few rows each,
            # where :func:`linear`'s general checks cost ~2 us a call.
            macs = x.numel() * self.out_features
            if PACK_DECODING_LINEARS and macs >= _PACKED_MIN_MACS:
                packed = self.packed.get(weight)
                if packed is not None:
                    return _dnn(x, packed, bias)  # [..., in] -> [..., out]
            return _dnn(x, weight, bias) if macs >= _ONEDNN_MIN_MACS else F.linear(x, weight, bias)
        return linear(x, weight, bias)


# --------------------------------------------------------------------------------------------------------------------
# The pre-softmax projection (section 3.4) of a decoding step
# --------------------------------------------------------------------------------------------------------------------

# Whether DecodingProjection may use oneDNN's pre-packed layout (bench/decode_speed.py --plain packing sets it False).
PACK_DECODING_PROJECTION = True


class DecodingProjection:
    """``h W^T + b`` for a decoding step's rows ``h [R, D] -> [R, V]`` (CPU, float32), with a copy of the ``[V, D]``
    matrix kept in the layout fastest for it, made again only when the weights change (``key``).

    Why: a step projects a few hundred rows at most, and then the product's cost is streaming the whole ``V x D``
    matrix. Where torch has oneDNN (x86 and aarch64 builds), the copy is oneDNN's pre-packed, blocked layout and the
    product oneDNN's linear kernel (the one ``torch.compile`` uses for frozen weights): for 4-256 rows x 128 x 8k on
    one AVX2 core it ran 1.1-2.1x faster than ``addmm`` on a ``[D, V]`` copy, which in turn ran 1.2-1.6x faster than
    ``F.linear`` on the ``[V, D]`` matrix for 4-16 rows; whole decoding 1.06x (BENCHMARKS.md, "The output projection
    through oneDNN"). Without oneDNN the ``[D, V]`` copy is used. Results equal ``F.linear``'s up to float rounding
    (the same hypotheses on every sentence measured).

    A deep copy (the model's, for bf16 / int8 / pruning) starts empty: oneDNN's packed tensors are opaque and cannot
    be copied, and the copy's weights may differ anyway.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._matrix: Tensor | None = None  # oneDNN-packed [V, D], or [D, V]
        self._packed = False

    def __deepcopy__(self, memo: dict) -> "DecodingProjection":
        return DecodingProjection()

    def clear(self) -> None:
        self._key, self._matrix, self._packed = None, None, False

    def __call__(self, h: Tensor, key: tuple, weight: Callable[[], Tensor], bias: Tensor | None) -> Tensor:
        """``h [R, D]`` times ``weight() [V, D]`` (transposed) plus ``bias``; ``key`` names the weights' version, and
        ``weight`` is called only when it changes."""
        key = (*key, PACK_DECODING_PROJECTION)
        if self._key != key:
            self._matrix, self._packed = None, False  # free the old copy first: it may be large (V x D)
            with torch.no_grad():
                w = weight().detach()
                if PACK_DECODING_PROJECTION:
                    self._matrix = _pack(w)
                    self._packed = self._matrix is not None
                if self._matrix is None:
                    self._matrix = w.t().contiguous()  # [V, D] -> [D, V]
            self._key = key
        if self._packed:
            return torch.ops.mkldnn._linear_pointwise(h, self._matrix, bias, "none", [], "")  # [R, D] -> [R, V]
        return h @ self._matrix if bias is None else torch.addmm(bias, h, self._matrix)  # [R, D] x [D, V]


def drop_decoding_copies(model: nn.Module) -> None:
    """Free the weight copies decoding keeps (:class:`PackedWeight`, :class:`DecodingProjection`) in ``model``: for
    training's valid BLEU, whose copies would be stale at the next validation and would hold another copy of the
    weights in memory until then."""
    for module in model.modules():
        for kept in vars(module).values():
            if isinstance(kept, (PackedWeight, DecodingProjection)):
                kept.clear()


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
    step and its batch shrinks as sentences finish, so nearly every call is a new shape. Seen on an H200 (torch
    2.11, CUDA 13): bf16 beam search of the quickstart model ran at 66-76 sentences/s against fp32's 860-940, with
    10.4 of its 13.7 s inside ``scaled_dot_product_attention`` (1,516 calls); with cuDNN's kernel left out, 366-372
    against fp32's 422-546 on an H100. Training meets every bucket's shape once an epoch, and a large corpus has
    thousands of them: on an H100, bf16, 300 updates of the quickstart (2.3 epochs of its 133 batches) took 0.79 min
    with cuDNN's kernel (20k target tokens/s) and 0.15 min without (106k). fp32 never uses cuDNN's kernel.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


# Queries up to which inference attention on CPU is two matmuls rather than torch's fused kernel. Measured on a 2-core
# AMD EPYC Zen 5 (an encoder layer's attention, d_k 32-64, 4-16 heads, padding mask, warm allocator): 18-60
# positions, two matmuls 1.05-1.3x the fused kernel on 1 thread and 1.6-3.4x on 2; at 128 positions 0.86x / 1.29x;
# at 256, 0.83x / 1.0x. On whole decodes at 2 threads 1.01-1.02x, the same fp32 translations (bf16 and int8 round
# differently: BENCHMARKS.md, "Decoding on two threads").
_EXPLICIT_MAX_QUERIES = 64


def prefer_explicit_attention(q: Tensor) -> bool:
    """Whether :func:`explicit_attention` beats ``F.scaled_dot_product_attention`` for queries ``q [B, h, Lq, d]``.

    Why, on CPU only: in training (gradients on), torch's CPU flash-attention backward is slower than three plain
    ops on these short sentences (L ~ 10-60, d_k 64), in fp32 and much more so in bf16. In decoding (a step's query
    per row, or a sentence's ``beams`` queries in cross-attention: at most 8 queries), two batched matmuls beat the
    fused kernel, which reads the keys/values at a fraction of memory bandwidth on these shapes. Without gradients
    (encoding a batch to decode it, validation) up to :data:`_EXPLICIT_MAX_QUERIES` queries too: torch's CPU kernel
    did not run faster on 2 threads than on 1 for sentences of 18-60 positions, where the two matmuls did.
    """
    return q.device.type == "cpu" and (torch.is_grad_enabled() or q.size(2) <= _EXPLICIT_MAX_QUERIES)


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """``softmax(Q K^T / sqrt(d_k) + bias)`` (section 3.2.1) with ``bias`` = -inf where attending is not allowed:
    the attention weights ``[B, h, Lq, Lk]`` (float32 softmax for bf16 scores is not needed: rows sum to 1 either way).

    ``q`` ``[B, h, Lq, d_k]``, ``k`` ``[B, h, Lk, d_k]``; ``mask`` broadcasts to ``[B, h, Lq, Lk]`` (True = may attend);
    ``causal``: query i sees keys j <= i (section 3.2.3). The scale and the bias are applied in one ``add`` pass over
    the scores. Every row keeps at least one key (a source has its EOS, a causal or windowed row its own position),
    so no row is all -inf. Also what ``mtpipe attention`` plots (:meth:`mtpipe.model.transformer.Transformer.recording`).
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
                     record: list[Tensor] | None = None) -> Tensor:
    """Incremental decoding's self-attention (section 3.2.1 for one new position): ``softmax(q [K_prev; k]^T /
    sqrt(d_k)) [V_prev; v]`` with the queries ``q`` ``[R, h, 1, d_k]``, the earlier positions ``k_prev`` / ``v_prev``
    ``[R, h, t, d]`` (``prev_mask`` ``[R, 1, 1, t]``, True = may attend, or None) and the new position's own ``k`` /
    ``v`` ``[R, h, 1, d]``; returns ``[R, h, 1, d_v]``. The weights ``[R, h, 1, t+1]`` are appended to ``record``
    when it is a list (``mtpipe attention``).

    Two forms of the same sums. Eagerly, batched matmuls (one small product per row and head). Under
    ``torch.compile`` (``decode.compile``), element-wise products summed over ``d`` and over ``t``: the compiler
    fuses each into one pass over the cache, which ran 2.7-3.5x faster than the matmuls (32 and 1,260 rows, an AVX2
    core), while eagerly the same products, materialised, ran 2.5x slower than the matmuls for 1,260 rows."""
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
    if record is not None:
        record.append(weights.detach().float())
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
    but pays for padding, the unfolded views and more, smaller matmuls. A benchmark (``bench/complexity.py``, in git
    history at a632779: one layer, fp32, forward + backward, d = 512, 2 CPU threads, the banded form forced at every
    length) measured where it starts to win: for r = 16 between n = 128 and 256, r = 64 between 256 and 512 (about
    even at 384), r = 256 between 512 and 1,024 (BENCHMARKS.md). ``max(256, 4r + 128)`` lies inside or just above each interval."""
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
