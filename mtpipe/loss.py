"""Label-smoothed cross-entropy (paper section 5.4, "Label Smoothing", epsilon_ls = 0.1).

Convention: Szegedy et al. (2016), the paper's reference [36]. The smoothed target distribution over the K = V
vocabulary entries (special ids included) is

    q'(k) = (1 - eps) * [k == y] + eps / V

so the loss per target token is

    H(q', p) = -sum_k q'(k) log p(k) = (1 - eps) * NLL + eps * mean_k(-log p(k)).

This is what ``torch.nn.functional.cross_entropy(..., label_smoothing=eps)`` computes. (fairseq and tensor2tensor
instead spread eps / (V - 1) over the non-target entries only; the two differ by a factor V / (V - 1) ~ 1.0001 on
the smoothing term, immaterial at V = 37000 but a different number, so it is named here.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def reference_label_smoothed_nll(logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The textbook formula, differentiated by autograd: the definition that :func:`label_smoothed_nll` is tested
    against. Same arguments and returns."""
    lprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [N, 1] -> [N]
    if eps == 0.0:
        nll_sum = nll.sum()
        return nll_sum, nll_sum
    smooth = -lprobs.mean(dim=-1)  # [N]: eps is spread uniformly, eps / V on every entry
    loss = (1.0 - eps) * nll + eps * smooth
    return loss.sum(), nll.sum()


class _SmoothedNLL(torch.autograd.Function):
    """:func:`reference_label_smoothed_nll` with a hand-written backward.

    Why: autograd of the textbook formula makes about eight passes over the ``[N, V]`` logits (log-softmax and its
    backward, the mean's expanded gradient, gather's zero-filled scatter, their sum, dtype casts), 20-35 % of a small
    bf16 training step on CPU. Here: one float32 log-softmax that reads the (bf16) logits directly, and a backward
    ``(g_loss + g_nll) * softmax(z) - g_loss * eps / V`` computed in place in the saved log-probabilities and written
    straight in the logits' dtype, then the target term at the N target positions.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        lprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [N, V]
        nll = -lprobs.gather(-1, target[:, None]).sum()  # [N, 1] -> scalar
        smooth = -lprobs.sum() / lprobs.size(-1)
        ctx.save_for_backward(lprobs, target)
        ctx.eps, ctx.dtype = eps, logits.dtype
        return (1.0 - eps) * nll + eps * smooth, nll

    @staticmethod
    def backward(ctx: Any, g_loss: Tensor, g_nll: Tensor) -> tuple[Tensor, None, None]:
        lprobs, target = ctx.saved_tensors
        eps, n, v = ctx.eps, lprobs.size(0), lprobs.size(-1)
        # d loss / dz = softmax(z) - ((1 - eps) onehot + eps / V);  d nll / dz = softmax(z) - onehot
        scaled = lprobs.exp_().mul_(g_loss + g_nll)  # in place: g * softmax(z), [N, V] float32
        grad = torch.sub(scaled, g_loss * (eps / v), out=torch.empty(scaled.shape, dtype=ctx.dtype,
                                                                         device=scaled.device))  # cast on write
        flat = torch.arange(n, device=grad.device) * v + target  # [N] offsets of the targets in grad.view(-1)
        # index_add_, not scatter_add_: the latter is ~1000x slower on bf16 CPU tensors.
        grad.view(-1).index_add_(0, flat, (-(g_loss * (1.0 - eps) + g_nll)).to(grad.dtype).expand(n))
        return grad, None, None


def label_smoothed_nll(logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Summed smoothed loss and summed plain NLL over ``N`` target tokens.

    ``logits``: ``[N, V]`` (pads already removed: every row is a real target token); ``target``: ``[N]`` ids.
    Computed in float32 whatever the autocast dtype of ``logits`` (a bf16 log-softmax over 37k entries loses the
    small probabilities that the smoothing term sums); the gradient comes back in the logits' dtype. Returns
    ``(loss_sum, nll_sum)``, both float32 scalars.
    """
    return _SmoothedNLL.apply(logits, target, eps)
