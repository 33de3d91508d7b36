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

import torch
from torch import Tensor


def label_smoothed_nll(logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Summed smoothed loss and summed plain NLL over ``N`` target tokens.

    ``logits``: ``[N, V]`` (pads already removed: every row is a real target token); ``target``: ``[N]`` ids.
    Computed in float32 whatever the autocast dtype of ``logits`` (a bf16 log-softmax over 37k entries loses the
    small probabilities that the smoothing term sums). Returns ``(loss_sum, nll_sum)``, both float32 scalars.
    """
    lprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [N, 1] -> [N]
    if eps == 0.0:
        nll_sum = nll.sum()
        return nll_sum, nll_sum
    smooth = -lprobs.mean(dim=-1)  # [N]: eps is spread uniformly, eps / V on every entry
    loss = (1.0 - eps) * nll + eps * smooth
    return loss.sum(), nll.sum()
