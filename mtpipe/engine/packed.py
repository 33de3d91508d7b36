"""The float32 CPU decoding variant: every linear layer and the pre-softmax projection (section 3.4) multiplied by
oneDNN's linear kernel on copies of their weights in its pre-packed, blocked layout, made once from the weights when
the variant is prepared.

Why: torch's own float32 products on x86 are MKL's, which runs its AVX2 code on AMD CPUs even where they have
AVX-512, while oneDNN's kernel dispatches what the CPU has; and a decoding step multiplies a few rows by each weight
matrix, where oneDNN would otherwise reorder the weight into its blocked layout at every call. Measured as a whole
against torch's own products on the quickstart's model, faster on an AVX-512 CPU and on one restricted to AVX2
(docs/performance.md, "Decoding: each optimisation switched off"). Small products (a server's few sentences) stay on
torch's route, whose call costs less: the break-even lies lower where oneDNN runs AVX-512. Results equal the plain
products up to float rounding; training keeps torch's own products.

The variant is a snapshot: :func:`packed_copy` packs the weights it is given, once. When they change, prepare a new
one (:func:`mtpipe.engine.variants.prepare`).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtpipe import platform
from mtpipe.model import ops


# Whether the float32 CPU variant goes through oneDNN; False only inside torch_products.
_ONEDNN = True


@contextlib.contextmanager
def torch_products() -> Iterator[None]:
    """Inside the block, :func:`packed_copy` keeps torch's own products (the model and its logits): how
    ``bench/decode_speed.py`` times this variant's worth (``--plain onednn-packed``). Read when a variant is
    prepared."""
    global _ONEDNN
    before, _ONEDNN = _ONEDNN, False
    try:
        yield
    finally:
        _ONEDNN = before


def _min_macs() -> tuple[int, int]:
    """(products of fewer multiply-adds stay on torch's route; from this many the packed copy is used), lower where
    torch dispatches AVX-512 (measured: docs/journal/2026-11-benchmarks.md, "float32 products through oneDNN")."""
    avx512 = platform.cpu().capability == "AVX512"
    return (1 << 20, 1 << 20) if avx512 else (1 << 23, 1 << 21)


def _pack(kernel: platform.OneDNNLinear, w: Tensor) -> Tensor | None:
    """``w [out, in]`` (float32, CPU) packed for ``kernel``, or None for an inference tensor (as loaded under
    inference mode) or where the build cannot pack it."""
    if w.is_inference():
        return None
    try:
        with torch.inference_mode(False), torch.no_grad():
            return kernel.pack(w.detach())
    except (RuntimeError, AttributeError, NotImplementedError):  # an op this build lacks
        return None


class PackedLinear(nn.Module):
    """A :class:`mtpipe.model.ops.Linear` (the same ``weight`` and ``bias`` parameters, the same state-dict names)
    that, in inference mode in float32 on CPU, multiplies through oneDNN (by a packed copy of its weight made once,
    for products of at least the packed threshold). Elsewhere (``torch.compile``, gradients, bf16) it is
    :func:`mtpipe.model.ops.linear`."""

    def __init__(self, layer: nn.Linear, kernel: platform.OneDNNLinear) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias
        self.kernel = kernel
        self.small, self.packs_from = _min_macs()
        self.packed = _pack(kernel, layer.weight)

    def forward(self, x: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias
        # is_compiling first: the compiler cannot trace is_inference_mode_enabled (a graph break in every layer)
        if (not torch.compiler.is_compiling() and torch.is_inference_mode_enabled() and x.dtype == torch.float32
                and weight.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")):
            macs = x.numel() * self.out_features
            if macs >= self.packs_from and self.packed is not None:
                return self.kernel.linear(x, self.packed, bias)  # [..., in] -> [..., out]
            return self.kernel.linear(x, weight, bias) if macs >= self.small else F.linear(x, weight, bias)
        return ops.linear(x, weight, bias)


class PackedProjection:
    """``h W^T + b`` for a decoding step's rows ``h [R, D] -> [R, V]`` with ``W`` the model's output embedding
    (:meth:`mtpipe.model.transformer.Transformer.output_embedding`, FixNorm's unit rows included) packed once for
    oneDNN. Rows that are not float32 on the CPU (autocast) take the model's own :meth:`logits`."""

    def __init__(self, model: Any, kernel: platform.OneDNNLinear, packed: Tensor) -> None:
        self.logits, self.bias, self.kernel, self.packed = model.logits, model.out_bias, kernel, packed

    def __call__(self, h: Tensor) -> Tensor:
        if h.device.type != "cpu" or h.dtype != torch.float32:
            return self.logits(h)
        return self.kernel.linear(h, self.packed, self.bias)  # [R, D] -> [R, V]


def packed_copy(model: Any, own_weights: bool = False) -> tuple[Any, Callable[[Tensor], Tensor]]:
    """``model`` with its linear layers as :class:`PackedLinear` layers, and its :class:`PackedProjection`: new
    modules around ``model``'s own weight tensors (no copy of them), or with ``own_weights`` a copy of them too
    (a compiled step keyed by the weights' identity must not meet weights that changed in place). ``model`` itself
    is unchanged. Where this torch build has no oneDNN kernel, or the weights are not float32 on the CPU: the model
    (or its copy) and its own logits."""
    kernel = platform.onednn_linear() if _ONEDNN else None
    w = model.projection_weight()
    if kernel is None or w.device.type != "cpu" or w.dtype != torch.float32 or w.is_inference():
        twin = copy.deepcopy(model) if own_weights else model
        return twin, twin.logits
    shared = {} if own_weights else {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    twin = copy.deepcopy(model, shared)
    for module in list(twin.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, ops.Linear):
                setattr(module, name, PackedLinear(child, kernel))
    with torch.no_grad():
        packed = _pack(kernel, twin.output_embedding().detach())
    return twin, PackedProjection(twin, kernel, packed) if packed is not None else twin.logits


__all__ = ["PackedLinear", "PackedProjection", "packed_copy", "torch_products"]
