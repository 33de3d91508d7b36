"""Sampling instead of search (``decode.sampling_topk``, ``sampling_topp``, ``temperature``, ``seed``): each output
token drawn from the model's next-token distribution rather than taken as the best.

Why: back-translation at scale makes better synthetic sources from sampled outputs than from beam outputs (Edunov
et al. 2018, "Understanding Back-Translation at Scale", section 5): beam search concentrates on the mode and its
outputs are poorer in diversity; sampling, or sampling from the k most likely tokens, covers the distribution.

What a step draws from, per hypothesis: the model's log-probabilities divided by ``temperature``, then cut to the
``topk`` most likely tokens (``-1``: all of them), then to the smallest set of most likely tokens whose probability
(of what top-k left, renormalised) reaches ``topp`` (Holtzman et al. 2020, nucleus sampling; the most likely token
always stays), renormalised. ``topk`` 1, or a tiny ``topp``, is greedy search.

The draw is the Gumbel-max trick: the token with the highest ``log p + G`` where ``G = -log(-log U)`` follows that
distribution exactly. ``U`` is not taken from a random generator's stream but computed by a counter-based hash of
``(seed, sentence key, step, slot, token)`` (:func:`uniform`), so that a sentence's sample depends on nothing but
these: not on the other sentences in its batch, nor on the batch size, the order of the sentences, how a corpus is
cut into chunks or shards, the decoding processes it is dealt to, or the device. The sentence key is a hash of the
source's token ids (:func:`sentence_key`): the sentence's content, the one thing every way of feeding it to an
engine keeps. Two identical source lines therefore get the same sample under one seed; another ``seed`` draws again.

Scores stay the model's: a sampled hypothesis is ranked by its log-probability under the model (before temperature
and truncation) and the length penalty, as a searched one is. With ``decode.beam`` N > 1, each sentence draws N
independent samples (at the first step N tokens from the one start, then one token per sample and step; fairseq's
``--sampling --beam N``), and the ``nbest`` best of them by score are kept; the early stop that ends a beam search
also ends a sample that can no longer enter the ``nbest``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

# splitmix64's constants (Steele, Lea and Flood 2014), as signed int64: torch's int64 arithmetic wraps as uint64's.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shift(z: Tensor, bits: int) -> Tensor:
    """``z >> bits`` as an unsigned 64-bit shift (torch shifts int64 arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: Tensor) -> Tensor:
    """splitmix64's finaliser: every output bit depends on every input bit."""
    z = (z ^ _shift(z, 30)) * _MIX1
    z = (z ^ _shift(z, 27)) * _MIX2
    return z ^ _shift(z, 31)


def uniform(seed: int, keys: Tensor, steps: Tensor, slots: Tensor, vocab: int) -> Tensor:
    """Uniform numbers in (0, 1), float64 ``[c, d, V]``: one per (sentence ``keys[i]`` at step ``steps[i]``, slot
    ``slots[j]``, token), each a hash of those and ``seed`` alone (module docstring: nothing else changes them)."""
    device = keys.device
    z = _mix(keys * _GOLDEN + seed)  # [c]
    z = _mix((z + steps * _GOLDEN)[:, None] + slots[None, :] * _MIX1)  # [c, d]
    tokens = torch.arange(vocab, dtype=torch.long, device=device) * _GOLDEN  # [V]
    z = _mix(z[:, :, None] + tokens)  # [c, d, V]
    return (_shift(z, 11).double() + 0.5) / float(1 << 53)  # 53 random bits, never 0 nor 1


def sentence_key(tokens: Sequence[int]) -> int:
    """A source's key for its samples: a hash of its token ids (int64), the same in every process and run."""
    digest = hashlib.blake2b(b",".join(str(t).encode() for t in tokens), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass(frozen=True)
class Sampler:
    """What a sampling step draws from (module docstring): ``topk`` (-1: every token), ``topp`` (1: no cut),
    ``temperature``, and the ``seed`` of the draws."""

    topk: int = -1
    topp: float = 1.0
    temperature: float = 1.0
    seed: int = 0

    def truncated(self, logp: Tensor) -> Tensor:
        """``[R, V]`` log-probabilities -> the log-weights drawn from (temperature, top-k, top-p; unnormalised, the
        tokens cut at -inf)."""
        x = logp if self.temperature == 1.0 else logp / self.temperature
        vocab = x.size(-1)
        if 0 < self.topk < vocab:
            values, index = x.topk(self.topk, dim=-1)  # [R, K]
            x = torch.full_like(x, float("-inf")).scatter_(-1, index, values)
        if self.topp < 1.0:
            probs = torch.softmax(x, dim=-1)  # [R, V]
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # a token is cut when the more likely ones already reach topp (the first one never is)
            cut_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= self.topp
            cut = torch.empty_like(cut_sorted).scatter_(-1, order, cut_sorted)
            x = x.masked_fill(cut, float("-inf"))
        return x

    def pick(self, logp: Tensor, scores: Tensor, keys: Tensor, steps: Tensor, m: int) -> tuple[Tensor, Tensor]:
        """The sampling counterpart of :func:`mtpipe.engine.search.top_candidates`: ``logp`` ``[c*k, V]`` (the k
        slots of a sentence in consecutive rows, masked by the search), ``scores`` ``[c, k]``, the sentences' keys
        and steps ``[c]`` -> values ``[c, m]`` (score + the model's log-probability of the drawn token) and indices
        ``slot * V + token``. From one slot (the first step) ``m`` draws, slots 0..m-1; else one draw per slot, which
        it continues (``k == m``). An empty slot (score -inf) gives a -inf value."""
        c, k = scores.shape
        vocab = logp.size(-1)
        draws = m if k == 1 else k
        slots = torch.arange(draws, device=logp.device)  # [d]
        weights = self.truncated(logp).view(c, k, vocab).double()  # [c*k, V] -> [c, k, V]
        u = uniform(self.seed, keys, steps, slots, vocab)  # [c, d, V]
        gumbel = -torch.log(-torch.log(u))
        token = (weights.expand(c, draws, vocab) + gumbel).argmax(dim=-1)  # [c, d]
        parent = torch.zeros_like(token) if k == 1 else slots.expand(c, draws)  # [c, d]
        rows = torch.arange(c, device=logp.device)[:, None] * k + parent  # [c, d] rows of logp
        values = scores.gather(1, parent) + logp[rows, token]  # [c, d]
        return values, parent * vocab + token


__all__ = ["Sampler", "sentence_key", "uniform"]
