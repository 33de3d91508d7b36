"""Label-smoothed cross-entropy (paper section 5.4, "Label Smoothing", epsilon_ls = 0.1) of the pre-softmax
projection (section 3.4), computed a block of target positions at a time.

Convention: Szegedy et al. (2016), the paper's reference [36]. The smoothed target distribution over the K = V
vocabulary entries (special ids included) is

    q'(k) = (1 - eps) * [k == y] + eps / V

so the loss per target token is

    H(q', p) = -sum_k q'(k) log p(k) = (1 - eps) * NLL + eps * mean_k(-log p(k)).

This is what ``torch.nn.functional.cross_entropy(..., label_smoothing=eps)`` computes. (fairseq and tensor2tensor
instead spread eps / (V - 1) over the non-target entries only; the two differ by a factor V / (V - 1) ~ 1.0001 on
the smoothing term, immaterial at V = 37000 but a different number, so it is named here.)

:func:`projected_label_smoothed_nll` is what training runs: the logits ``h W^T + b`` of the decoder states are made,
turned into the loss and its gradient, and dropped, one block of rows at a time. The tests hold it to the textbook
formula on whole logits, differentiated by autograd (``testkit/oracles.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from mtpipe.model.ops import _ROW_BLOCK


# The float32 logits of one block stay below this many bytes. On CPU the block size barely matters for speed
# (``bench/train_throughput.py --plain loss`` times the blocks against the whole logits); what the blocks save is
# memory, there and on a GPU (the paper's 25k-token batches over 37k pieces would take 3.7 GB per float32 copy of
# the whole logits).
_BLOCK_BYTES = {"cpu": 32 << 20, "other": 1 << 30}
# CPU rows per block are a multiple of mtpipe.model.ops' row block, and the last block is padded up to one: under CPU
# bf16 autocast the products run in oneDNN, which compiles a kernel per shape (mtpipe.model.ops.linear), so the shapes
# must repeat.
_ROW_MULTIPLE = _ROW_BLOCK


# Whether the loss is computed a block of rows at a time; False only inside whole_logits.
_blocked = True


@contextlib.contextmanager
def whole_logits() -> Iterator[None]:
    """Inside the block, :func:`projected_label_smoothed_nll` makes the whole ``[N, V]`` logits and the textbook loss
    on them, differentiated by autograd (the NLL too), as a plain implementation would: how
    ``bench/train_throughput.py`` times the blocks' worth (``--plain loss``)."""
    global _blocked
    before, _blocked = _blocked, False
    try:
        yield
    finally:
        _blocked = before


def _on_whole_logits(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
    lprobs = torch.log_softmax(F.linear(h, weight, bias).float(), dim=-1)  # [N, V]
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [N, 1] -> [N]
    if eps == 0.0:
        return nll.sum(), nll.sum()
    return ((1.0 - eps) * nll + eps * -lprobs.mean(dim=-1)).sum(), nll.sum()


def _block_rows(device: torch.device, vocab: int) -> int:
    budget = _BLOCK_BYTES["cpu" if device.type == "cpu" else "other"]
    rows = budget // (4 * vocab)
    return max(_ROW_MULTIPLE, rows - rows % _ROW_MULTIPLE)


def _compute_dtype(h: Tensor, weight: Tensor) -> torch.dtype:
    """The products' dtype: autocast's where it is on (bf16 on CPU), else the inputs' common dtype."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(h.dtype, weight.dtype)


def _blocks(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, eps: float, want_grad: bool):
    """The loss, the NLL and (``want_grad``) the gradients of the loss with respect to ``h``, ``weight`` and
    ``bias``, one block of rows at a time; nothing of size ``[N, V]`` is ever held.

    Per block of logits ``z``: ``l = log_softmax(z)`` (float32), ``nll = -l[y]``, ``smooth = -mean(l)``; and
    ``dloss/dz = softmax(z) - (1 - eps) onehot(y) - eps / V``, then ``dh = G W`` and ``dW += G^T h``, ``db += sum
    G``. The products run in the compute dtype (bf16 under CPU autocast, with the log-softmax, the loss and the
    accumulated ``dW`` in float32), as the logits' matmul and its backward would.

    Why the gradient is made this way: the block's ``[c, V]`` passes are a third of this function's time on CPU in
    bf16. ``softmax(z)`` comes straight from the bf16 logits in the compute dtype (one pass; float32 inside the
    kernel), not as ``exp(l) - eps / V`` cast to bf16 (three passes over float32); in float32 it is ``l``
    exponentiated in place. The ``- eps / V`` on every entry is the same constant everywhere, so its share of the
    gradients is added once at the end, exactly, in float32: ``-eps / V * colsum(W)`` on every row of ``dh``,
    ``-eps / V * colsum(h)`` on every row of ``dW``, ``-eps / V * N`` on ``db``. The target's ``-(1 - eps)`` is an
    ``index_add_`` on the flat block (``scatter_add_`` on a bf16 tensor takes milliseconds on CPU).
    """
    n, vocab = h.size(0), weight.size(0)
    cdtype = _compute_dtype(h, weight)
    w = weight.to(cdtype)
    b = bias.float() if bias is not None else None
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    nll = torch.zeros((), dtype=torch.float32, device=h.device)
    grads = _Grads(h, weight, bias, cdtype) if want_grad else None
    rows = _block_rows(h.device, vocab)
    pad_to = _ROW_MULTIPLE if h.device.type == "cpu" and cdtype != torch.float32 else 1
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        x = h[lo:hi].to(cdtype)  # [c, D]
        extra = -(hi - lo) % pad_to
        if extra:  # zero rows, so that the shapes repeat; sliced off below
            x = torch.cat([x, x.new_zeros(extra, x.size(1))])  # [c + extra, D]
        z = torch.mm(x, w.t())[: hi - lo]  # [c, D] x [D, V] -> [c, V]
        if b is not None:
            z = z + b
        y = target[lo:hi, None]  # [c, 1]
        lprobs = torch.log_softmax(z, dim=-1, dtype=torch.float32)  # [c, V] float32, one pass
        block_nll = -lprobs.gather(1, y).sum()
        nll += block_nll
        loss += (1.0 - eps) * block_nll - eps * lprobs.sum() / vocab
        if grads is not None:
            grads.add_block(z, lprobs, x, target[lo:hi], w, eps, lo, extra)
    if grads is None:
        return loss, nll, None, None, None
    return (loss, nll, *grads.finish(w, eps, n))


class _Grads:
    """The gradients of the loss that :func:`_blocks` accumulates block by block, in float32: ``dh`` (``[N, D]``),
    ``dW`` and ``db`` (``[V]``), and ``colsum(h)`` for the smoothing's share (:meth:`finish`)."""

    def __init__(self, h: Tensor, weight: Tensor, bias: Tensor | None, cdtype: torch.dtype):
        self.vocab, self.cdtype = weight.size(0), cdtype
        self.h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        # dW accumulates transposed, [D, V], in float32 products on CPU (X^T G a block, returned as a view): the
        # order of the sums, and so training's float32 results, stay those of earlier runs
        self.wide = cdtype == torch.float32 and h.device.type == "cpu"
        self.w = torch.zeros(weight.shape[::-1] if self.wide else weight.shape, dtype=torch.float32, device=h.device)
        self.b = torch.zeros(self.vocab, dtype=torch.float32, device=h.device) if bias is not None else None
        self.h_sum = torch.zeros(h.size(1), dtype=torch.float32, device=h.device)  # colsum(h), [D]

    def add_block(self, z: Tensor, lprobs: Tensor, x: Tensor, target: Tensor, w: Tensor, eps: float, lo: int,
                  extra: int) -> None:
        """The block of rows ``lo:lo + c``: its logits ``z`` ``[c, V]``, their float32 log-probabilities
        ``lprobs`` (consumed: exponentiated in place in float32), its inputs ``x`` ``[c + extra, D]`` (``extra``
        zero rows) and targets ``[c]``."""
        vocab, c = self.vocab, z.size(0)
        if self.cdtype == torch.float32:
            gc = lprobs.exp_()  # in place: softmax(z), [c, V]
        else:
            gc = torch.softmax(z, dim=-1).to(self.cdtype)  # [c, V] in bf16 from the logits (a no-op .to without bias)
        at_target = torch.arange(c, device=x.device) * vocab + target  # [c]: flat index of z[i, y_i]
        gc.view(-1).index_add_(0, at_target, gc.new_full((c,), -(1.0 - eps)))  # [c, V] -> [c V]
        if self.b is not None:
            self.b += gc.sum(0, dtype=torch.float32)
        self.h_sum += x.sum(0, dtype=torch.float32)
        if extra:
            gc = torch.cat([gc, gc.new_zeros(extra, vocab)])  # [c + extra, V]: the zero rows add nothing to dW
        self.h[lo : lo + c] = torch.mm(gc, w)[:c]  # [c, V] x [V, D] -> [c, D]
        if self.wide:
            self.w += torch.mm(x.t(), gc)  # [D, c] x [c, V] -> [D, V]
        else:
            self.w += torch.mm(gc.t(), x)

    def finish(self, w: Tensor, eps: float, n: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(dh, dW, db)``, with the smoothing's ``- eps / V`` on every entry of every block added in one exact
        float32 step."""
        if eps:
            self.h -= (eps / self.vocab) * w.sum(0, dtype=torch.float32)  # [D], on every row
            self.w -= (eps / self.vocab) * (self.h_sum[:, None] if self.wide else self.h_sum)  # [D], on every row of dW
            if self.b is not None:
                self.b -= eps * n / self.vocab
        return self.h, self.w.t() if self.wide else self.w, self.b  # dW [D, V] -> [V, D] (a view) when wide


class _ProjectedSmoothedNLL(torch.autograd.Function):
    """:func:`projected_label_smoothed_nll` with gradients. The loss is the last node of the graph, so its gradient
    is known up to the upstream factor already in the forward pass: computed there block by block (no ``[N, V]``
    tensor is saved for the backward pass, which only scales the saved ``dh``, ``dW``, ``db``)."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                eps: float) -> tuple[Tensor, Tensor]:
        loss, nll, grad_h, grad_w, grad_b = _blocks(h, weight, bias, target, eps, want_grad=True)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(nll)  # reported, never trained on
        return loss, nll

    @staticmethod
    def backward(ctx: Any, g_loss: Tensor, g_nll: Tensor) -> tuple[Tensor | None, ...]:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        return ((grad_h * g_loss).to(h_dtype), (grad_w * g_loss).to(w_dtype),
                None if grad_b is None else (grad_b * g_loss).to(b_dtype), None, None)


def projected_label_smoothed_nll(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                                 eps: float) -> tuple[Tensor, Tensor]:
    """Summed smoothed loss and summed plain NLL of the logits ``h W^T + b`` (the pre-softmax projection, section
    3.4) over ``N`` target tokens.

    ``h``: ``[N, D]`` decoder output states (pads already removed: every row is a real target token); ``weight``:
    ``[V, D]`` (the shared embedding matrix); ``bias``: ``[V]`` or None; ``target``: ``[N]`` ids. Returns
    ``(loss_sum, nll_sum)``, float32 scalars; only the loss carries a gradient (the NLL is reported, not trained on).

    Why blocks: the ``[N, V]`` logits are the largest tensors of a training step (V = 8k-37k pieces), and autograd
    keeps several copies of them (the logits, their log-softmax, their gradient). A block of rows is projected,
    normalised, turned into its share of the loss and of the gradients of ``h``, ``W`` and ``b``, then dropped: the
    same values with the same matmul FLOPs, at the same speed on CPU (``bench/train_throughput.py --plain loss``
    measures it), in a fraction of the memory. Everything but the products is float32, whatever
    the autocast dtype (a bf16 softmax over 37k entries loses the small probabilities that the smoothing term sums).
    """
    if not _blocked:
        return _on_whole_logits(h, weight, bias, target, eps)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _ProjectedSmoothedNLL.apply(h, weight, bias, target, eps)
    loss, nll, *_ = _blocks(h, weight, bias, target, eps, want_grad=False)
    return loss, nll
