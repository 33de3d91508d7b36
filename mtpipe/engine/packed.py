"""The float32 CPU decoding variant: every linear layer and the pre-softmax projection (section 3.4) on copies of
their weights in oneDNN's pre-packed, blocked layout, made once from the weights when the variant is prepared.

Why: a decoding step multiplies a few rows by each weight matrix, and oneDNN's linear kernel would otherwise reorder
the weight into its blocked layout at every call (:func:`mtpipe.model.ops.linear`); the projection's cost is then
streaming the whole ``V x D`` matrix, fastest in the packed layout (or, without oneDNN, as a ``[D, V]`` copy under
``addmm``). Results equal the plain products up to float rounding.

The variant is a snapshot: :func:`packed_copy` packs the weights it is given, once. When they change, prepare a new
one (:func:`mtpipe.engine.variants.prepare`).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtpipe.model import ops

# Whether decoding's linear layers may use oneDNN-packed copies of their weights (bench/decode_speed.py --plain
# layer-packing sets it False, to time the unpacked route).
PACK_DECODING_LINEARS = True
# Whether the projection may use oneDNN's pre-packed layout (bench/decode_speed.py --plain packing sets it False).
PACK_DECODING_PROJECTION = True
# Inference products of at least this many multiply-adds use the packed copy (:class:`PackedLinear`): the break-even
# against torch's own product, lower where torch dispatches AVX-512 (results files: bench/results).
_PACKED_MIN_MACS = 1 << 20 if ops.AVX512 else 1 << 21


def _pack(w: Tensor) -> Tensor | None:
    """``w [out, in]`` (float32, CPU) in oneDNN's pre-packed, blocked layout for :func:`mtpipe.model.ops._dnn`, or
    None where this torch build cannot make it, or for an inference tensor (as loaded under inference mode)."""
    if not ops._ONEDNN_AVAILABLE or w.is_inference():
        return None
    try:
        with torch.inference_mode(False), torch.no_grad():
            # the row count is a hint for the blocking; any count works with the packed matrix
            return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 256)
    except (RuntimeError, AttributeError, NotImplementedError):  # an op this build lacks
        return None


class PackedLinear(nn.Module):
    """A :class:`mtpipe.model.ops.Linear` (the same ``weight`` and ``bias`` parameters, the same state-dict names)
    that, in inference mode in float32 on CPU, multiplies by a packed copy of its weight made once, for products of
    at least :data:`_PACKED_MIN_MACS` multiply-adds. Elsewhere (``torch.compile``, gradients, bf16) it is
    :func:`mtpipe.model.ops.linear`."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias
        self.packed = _pack(layer.weight) if PACK_DECODING_LINEARS else None

    def forward(self, x: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias
        # is_compiling first: the compiler cannot trace is_inference_mode_enabled (a graph break in every layer)
        if (not torch.compiler.is_compiling() and torch.is_inference_mode_enabled() and weight.dtype == x.dtype
                and ops._onednn_open(x)):
            # Decoding: the route decided here once, since a step makes dozens of these calls for a few rows each,
            # where ops.linear's general checks would be a noticeable share of each call.
            macs = x.numel() * self.out_features
            if PACK_DECODING_LINEARS and macs >= _PACKED_MIN_MACS and self.packed is not None:
                return ops._dnn(x, self.packed, bias)  # [..., in] -> [..., out]
            return ops._dnn(x, weight, bias) if macs >= ops._ONEDNN_MIN_MACS else F.linear(x, weight, bias)
        return ops.linear(x, weight, bias)


class PackedProjection:
    """``h W^T + b`` for a decoding step's rows ``h [R, D] -> [R, V]`` with ``W`` the model's output embedding
    (:meth:`mtpipe.model.transformer.Transformer.output_embedding`, FixNorm's unit rows included) copied once into
    the layout fastest for a few rows: oneDNN's packed layout where torch has it, else ``[D, V]`` for ``addmm``.
    Rows that are not float32 on the CPU (autocast) take the model's own :meth:`logits`."""

    def __init__(self, model: Any) -> None:
        self.logits, self.bias = model.logits, model.out_bias
        with torch.no_grad():
            w = model.output_embedding().detach()
        self.packed = _pack(w) if PACK_DECODING_PROJECTION else None
        self.matrix = self.packed if self.packed is not None else w.t().contiguous()  # [V, D] packed, or [D, V]

    def __call__(self, h: Tensor) -> Tensor:
        if h.device.type != "cpu" or h.dtype != torch.float32:
            return self.logits(h)
        if self.packed is not None:
            return ops._dnn(h, self.packed, self.bias)  # [R, D] -> [R, V]
        return h @ self.matrix if self.bias is None else torch.addmm(self.bias, h, self.matrix)  # [R, D] x [D, V]


def packable(model: Any) -> bool:
    """Whether ``model``'s projection is float32 on the CPU and not an inference tensor: what the packed variant
    is for (bf16 copies, GPUs and weights loaded under inference mode keep the plain products)."""
    w = model.projection_weight()
    return w.device.type == "cpu" and w.dtype == torch.float32 and not w.is_inference()


def packed_copy(model: Any, own_weights: bool = False) -> tuple[Any, Callable[[Tensor], Tensor]]:
    """``model`` with its linear layers as :class:`PackedLinear` layers, and its :class:`PackedProjection`: new
    modules around ``model``'s own weight tensors (no copy of them), or with ``own_weights`` a copy of them too
    (a compiled step keyed by the weights' identity must not meet weights that changed in place). ``model`` itself
    is unchanged."""
    shared = {} if own_weights else {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    twin = copy.deepcopy(model, shared)
    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, ops.Linear):
                setattr(module, name, PackedLinear(child))
    return twin, PackedProjection(twin) if packable(twin) else twin.logits


__all__ = ["PackedLinear", "PackedProjection", "packable", "packed_copy"]
