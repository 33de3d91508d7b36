"""Reference implementations the tests check the product against (and bench/decode_speed.py's naive row): slow,
plain, obviously right, and not part of mtpipe itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


# --------------------------------------------------------------------------------------------------------------------
# Decoding without a cache: the reference the incremental step is checked against
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class PrefixState:
    """Decoding state without a cache: the encoder output and the whole target prefix ``[N, t]``."""

    memory: Tensor
    src_mask: Tensor
    prefix: Tensor

    def select(self, index: Tensor, beams: int | None = None) -> "PrefixState":
        return PrefixState(self.memory.index_select(0, index), self.src_mask.index_select(0, index),
                           self.prefix.index_select(0, index))


def uncached_step(model: Any) -> Callable[[Tensor, PrefixState], tuple[Tensor, PrefixState]]:
    """A step function that re-runs the whole decoder over the prefix each step (cross-attention keys/values
    included): the naive reference that the incremental (cached) step must match."""

    def step(tokens: Tensor, state: PrefixState) -> tuple[Tensor, PrefixState]:
        prefix = torch.cat([state.prefix, tokens[:, None]], dim=1)  # [N, t] -> [N, t+1]
        x = model.decode(prefix, state.memory, state.src_mask)  # [N, t+1, D]
        logp = F.log_softmax(model.logits(x[:, -1]).float(), dim=-1)  # [N, t+1, D] -> [N, D] -> [N, V]
        return logp, PrefixState(state.memory, state.src_mask, prefix)

    return step


def translate_uncached(model: Any, sources: Sequence[Sequence[int]], cfg: Any,
                       device: torch.device | str = "cpu") -> list[list[Any]]:
    """:func:`testkit.decoding.translate` with :func:`uncached_step`: the same batches and search, the whole
    prefix re-decoded at every step by the float32 model (under bf16 autocast for precision bf16)."""
    from mtpipe.engine.search import DecodeRules

    return search_uncached(model, sources, DecodeRules.from_config(cfg), cfg.max_tokens, cfg.precision,
                           torch.device(device))


def search_uncached(model: Any, sources: Sequence[Sequence[int]], rules: Any, max_tokens: int, precision: str,
                    device: torch.device) -> list[list[Any]]:
    """:func:`translate_uncached` under ``rules`` (:class:`~mtpipe.engine.search.DecodeRules`); also the naive row
    of ``bench/decode_speed.py``."""
    from mtpipe.engine.translate import search_batches
    from mtpipe.engine.variants import decoding_context

    model.eval()

    def start(memory: Tensor, src_mask: Tensor) -> PrefixState:
        return PrefixState(memory, src_mask, torch.zeros(memory.size(0), 0, dtype=torch.long, device=device))

    with torch.inference_mode(), decoding_context(device, precision):
        return search_batches(model, sources, rules, max_tokens=max_tokens, device=device,
                              step=uncached_step(model), start=start)


def reference_label_smoothed_nll(logits: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Label-smoothed cross-entropy (section 5.4) as the textbook formula on the whole ``[N, V]`` logits,
    differentiated by autograd: the definition that :func:`mtpipe.training.loss.projected_label_smoothed_nll` is
    tested against. Returns ``(loss_sum, nll_sum)``, float32."""
    lprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # [N, 1] -> [N]
    if eps == 0.0:
        nll_sum = nll.sum()
        return nll_sum, nll_sum
    smooth = -lprobs.mean(dim=-1)  # [N]: eps is spread uniformly, eps / V on every entry
    loss = (1.0 - eps) * nll + eps * smooth
    return loss.sum(), nll.sum()
