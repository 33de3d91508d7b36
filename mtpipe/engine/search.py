"""What every decoding engine honours (:class:`DecodeRules`), and mtpipe's beam search.

The paper decodes with "beam search with a beam size of 4 and length penalty alpha = 0.6 ... We set the maximum output
length during inference to input length + 50, but terminate early when possible" (section 6.1). Its numbers come
from tensor2tensor, whose length penalty is GNMT's (Wu et al. 2016, section 7)::

    gnmt:     lp(Y) = ((5 + |Y|) / 6) ^ alpha          (the paper, tensor2tensor; the default)
    fairseq:  lp(Y) = |Y| ^ alpha                       (fairseq's --lenpen; CTranslate2's only penalty)

and a finished hypothesis is ranked by ``log P(Y | X) / lp(Y)`` (:meth:`LengthPenalty.score`). ``|Y|`` counts the
generated tokens including the final EOS (as tensor2tensor and fairseq both count). :class:`DecodeRules` holds
these rules once -- the penalty and its score, the maximum output length, the stopping rule -- for
:mod:`mtpipe.engine.translate` (mtpipe's engine) and :mod:`mtpipe.engine.ct2` (CTranslate2) alike.

The search (:func:`beam_search`), per sentence:

* the beam at step t is the ``beam`` best one-token extensions (by log-probability) of the live hypotheses; the ones
  that end in EOS leave the beam as *finished* hypotheses, the others stay *live* (the next step refills the beam to
  ``beam`` from their extensions). PAD and BOS are never generated.
* the output may hold at most ``max_len = max_len_a * S + max_len_b`` tokens before EOS (S = source tokens without
  EOS; capped so that the positions fit the model); at that length only EOS may follow.
* **early stopping** -- a sentence is done when no live hypothesis can still beat the finished ones. Log-probabilities
  only decrease as tokens are added, and ``lp`` is monotonic in ``|Y|``, so a live hypothesis with log-probability
  ``s <= 0`` that has ``t`` tokens now can finish with a score of at most ``s / max(lp(t + 1), lp(max_len + 1))``
  (for alpha >= 0 that is ``s / lp(max_len + 1)``, tensor2tensor's bound). When the best live bound is no higher than
  the ``nbest``-th best finished score, nothing better can appear and the sentence stops; it also stops when no
  hypothesis is live. The best result therefore does not depend on ``nbest``.
* ``decode.stop=finished`` is fairseq's and CTranslate2's search instead: the ``2 x beam`` best extensions are
  ranked, those among the top ``beam`` that end in EOS finish, the live beam is refilled to ``beam`` from the best
  ones that do not, and a sentence stops once ``round(beam x patience)`` of its hypotheses have finished (patience
  1 by default; as in fairseq, no more than that many finish: the lower-ranked EOS extensions of the last step are
  dropped). It takes fewer decoder steps and keeps no empty beam slots, but can miss a better, longer
  hypothesis under a length penalty: the opt-in fast mode, and the rule to compare those tools under.
* ``decode.min_len`` (0 by default): the fewest tokens before EOS. fairseq and CTranslate2 use 1 by default (an
  output is never empty); under ``stop=finished`` an empty output that finishes at the first step fills one of the
  finished places, so the two tools' output needs ``min_len`` 1 to be reproduced exactly.
* **beam 1 is greedy search**: the single best extension is taken each step, and when it is EOS the beam is empty.
* **sampling** (``decode.sampling_topk`` != 0): each slot's next token is drawn from the model's distribution
  instead (:mod:`mtpipe.engine.sampling`); ``beam`` is then the number of samples per sentence, and the rest of the
  above (finishing, the length limit, ``min_len``, the early stop, ``nbest``) holds as it is.

The search works on any ``step(tokens [N], state) -> (log_probs [N, V], state)`` whose state has
``select(index, beams)`` (:class:`mtpipe.engine.cache.DecoderState`, or the tests' own: the uncached
reference step of ``testkit/oracles.py``).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import Tensor

from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
from mtpipe.config import DecodeConfig
from mtpipe.engine.sampling import Sampler
from mtpipe.errors import MtpipeError

PENALTIES = ("gnmt", "fairseq")
STOPS = ("bound", "finished")


# --------------------------------------------------------------------------------------------------------------------
# The rules (section 6.1; GNMT section 7)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthPenalty:
    """``lp(|Y|)``: ``gnmt`` = ((5 + |Y|) / 6) ^ alpha (tensor2tensor, the paper), ``fairseq`` = |Y| ^ alpha."""

    kind: str = "gnmt"
    alpha: float = 0.6

    def __post_init__(self) -> None:
        # Also built in code (the CTranslate2 engine, the tests), where no DecodeConfig has checked the kind.
        if self.kind not in PENALTIES:
            raise MtpipeError(f"decode.length_penalty: unknown penalty {self.kind!r} "
                              f"(choose from {', '.join(PENALTIES)})")

    def __call__(self, length: int) -> float:
        if self.kind == "gnmt":
            return ((5.0 + length) / 6.0) ** self.alpha
        return float(length) ** self.alpha

    def score(self, logprob: float, length: int) -> float:
        """A finished hypothesis' rank: ``log P(Y + EOS | X) / lp(length)``, ``length`` counting the EOS."""
        return logprob / self(length)

    def logprob(self, score: float, length: int) -> float:
        """:meth:`score` inverted: the log-probability of a hypothesis of ``length`` tokens (EOS counted)."""
        return score * self(length)


@dataclass
class Hypothesis:
    """A finished translation: ``tokens`` without EOS, ``score`` = ``logprob / lp(len(tokens) + 1)``."""

    tokens: list[int]
    score: float
    logprob: float


def max_source_len(max_positions: int) -> int:
    """Source tokens a model of ``max_positions`` positions accepts: one position is its EOS."""
    return max_positions - 1


@dataclass(frozen=True)
class DecodeRules:
    """The decoding rules every engine follows (paper section 6.1: beam 4, alpha 0.6, max length input + 50).

    Built from a :class:`~mtpipe.config.DecodeConfig` (:meth:`from_config`) or keyword by keyword; construction checks
    the rules that span several keys (``nbest <= beam``), and the single-key ones again for code that passes
    plain values (``DecodeConfig`` checks those when it is built).
    """

    beam: int = 4
    nbest: int = 1
    penalty: LengthPenalty = field(default_factory=LengthPenalty)
    max_len_a: float = 1.0
    max_len_b: int = 50
    stop: str = "bound"  # "bound": the exact early stop; "finished": fairseq's and CTranslate2's quota
    patience: float = 1.0
    min_len: int = 0  # fewest tokens before EOS (fairseq's and CTranslate2's default: 1)
    # Sampling instead of search (:mod:`mtpipe.engine.sampling`): 0 = search; K > 0: the K most likely; -1: all
    sampling_topk: int = 0
    sampling_topp: float = 1.0
    temperature: float = 1.0
    seed: int = 1

    def __post_init__(self) -> None:
        if self.beam < 1:
            raise MtpipeError(f"decode.beam: {self.beam} is not >= 1")
        if not 1 <= self.nbest <= self.beam:
            raise MtpipeError(f"decode.nbest: {self.nbest} is not between 1 and decode.beam ({self.beam})")
        if not math.isfinite(self.penalty.alpha):
            raise MtpipeError(f"decode.alpha: {self.penalty.alpha} is not a finite number")
        if self.max_len_a < 0 or self.max_len_b < 0:
            raise MtpipeError(f"decode.max_len_a / max_len_b: {self.max_len_a} / {self.max_len_b} must be >= 0")
        if self.stop not in STOPS:
            raise MtpipeError(f"decode.stop = {self.stop!r} is not one of {', '.join(STOPS)}")
        if not (math.isfinite(self.patience) and self.patience >= 1):
            raise MtpipeError(f"decode.patience: {self.patience} must be >= 1 (a sentence stops once beam x "
                              "patience hypotheses have finished)")
        if self.min_len < 0:
            raise MtpipeError(f"decode.min_len: {self.min_len} is not >= 0")
        if self.sampling_topk < -1:
            raise MtpipeError(f"decode.sampling_topk: {self.sampling_topk} is not >= -1 (0: search; K > 0: sample "
                              "from the K most likely tokens; -1: from all)")
        if not 0 < self.sampling_topp <= 1:
            raise MtpipeError(f"decode.sampling_topp: {self.sampling_topp} is not in (0, 1]")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise MtpipeError(f"decode.temperature: {self.temperature} is not a number > 0")

    @classmethod
    def from_config(cls, cfg: DecodeConfig, stop: str | None = None) -> "DecodeRules":
        """The rules of ``cfg``; ``stop`` overrides ``cfg.stop`` (CTranslate2 always stops by ``finished``)."""
        return cls(beam=cfg.beam, nbest=cfg.nbest, penalty=LengthPenalty(cfg.length_penalty, cfg.alpha),
                   max_len_a=cfg.max_len_a, max_len_b=cfg.max_len_b, stop=stop or cfg.stop, patience=cfg.patience,
                   min_len=cfg.min_len, sampling_topk=cfg.sampling_topk, sampling_topp=cfg.sampling_topp,
                   temperature=cfg.temperature, seed=cfg.seed)

    @property
    def sampler(self) -> Sampler | None:
        """What each step samples from (:mod:`mtpipe.engine.sampling`), or None: search (``sampling_topk`` 0)."""
        if self.sampling_topk == 0:
            return None
        return Sampler(self.sampling_topk, self.sampling_topp, self.temperature, self.seed)

    def max_output_len(self, src_len: int, max_positions: int) -> int:
        """``floor(max_len_a * S + max_len_b)`` tokens before EOS (S without EOS; the paper: S + 50), capped so that
        BOS + the tokens fit the model's ``max_positions``."""
        return max(0, min(int(math.floor(self.max_len_a * src_len + self.max_len_b)), max_positions - 1))

    @property
    def stop_after(self) -> int | None:
        """:func:`beam_search`'s ``stop_after``: None for the exact bound; for ``finished``, ``round(beam x
        patience)`` finished hypotheses (rounded as CTranslate2 does, std::round: halves away from zero), never
        fewer than ``nbest``."""
        if self.stop != "finished":
            return None
        return max(self.nbest, int(math.floor(self.beam * self.patience + 0.5)))


# --------------------------------------------------------------------------------------------------------------------
# Beam search over any step function
# --------------------------------------------------------------------------------------------------------------------


class State(Protocol):
    def select(self, index: Tensor, beams: int) -> "State": ...

    def admit(self, fresh: "State") -> "State": ...


StepFn = Callable[[Tensor, Any], "tuple[Tensor | Callable[[int, int], Tensor], Any]"]

# Rows of log-probabilities ranked at a time (:func:`beam_search`): 256 x 8k vocabulary x 4 bytes = 8 MB, which stays
# in a server CPU's cache between the projection, the softmax and the ranking.
_BLOCK_ROWS = 256


# Vocabulary entries per chunk in :func:`top_candidates`: contiguous runs whose maxima torch reduces in vectorised
# passes, far cheaper per entry than a top-k over a sentence's k x V entries (the width is bench/decode_speed.py's
# "ranking" row's to measure).
_CHUNK = 128


@contextlib.contextmanager
def one_top_k() -> Iterator[None]:
    """Inside the block, :func:`top_candidates` ranks with one top-k over every extension instead of by chunks: how
    ``bench/decode_speed.py`` times the chunks' worth (``--plain ranking``)."""
    global _CHUNK
    before, _CHUNK = _CHUNK, 1 << 40
    try:
        yield
    finally:
        _CHUNK = before


def top_candidates(logp: Tensor, scores: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """The ``m`` best one-token extensions of each sentence, best first: ``logp`` ``[n*k, V]`` (the k beams of a
    sentence in consecutive rows), ``scores`` ``[n, k]`` the beams' log-probabilities so far -> values ``[n, m]``
    (score + log-probability) and indices into each sentence's ``k * V`` extensions (``beam * V + token``).

    Exact, and much cheaper than a top-k over all ``k * V`` sums, which read every entry in scalar code: the
    vocabulary is cut into chunks of ``_CHUNK`` entries, each chunk's maximum (one vectorised pass) plus its beam's
    score ranks the chunks, and only the best ``m`` chunks are searched. That is exact because each of the ``m``
    best extensions lies in a chunk whose maximum is at least as high, and at most ``m`` chunks can have a higher
    maximum than the m-th best extension (each such maximum is itself a better extension); ties may resolve to a
    different one of equal value, as a top-k's may. ``logp`` is not changed."""
    rows, vocab = logp.shape
    n, k = scores.shape
    if vocab < 4 * _CHUNK or m >= k * -(-vocab // _CHUNK):  # few chunks (tiny vocabularies): one top-k is as cheap
        cand = (logp.view(n, k, vocab) + scores.unsqueeze(2)).view(n, k * vocab)  # [n*k, V] -> [n, k*V]
        return cand.topk(min(m, k * vocab), dim=1)
    whole = vocab // _CHUNK * _CHUNK
    peaks = logp[:, :whole].view(rows, whole // _CHUNK, _CHUNK).amax(-1)  # [n*k, V'] -> [n*k, V'/C, C] -> [n*k, J]
    if whole < vocab:  # the last, shorter chunk
        peaks = torch.cat([peaks, logp[:, whole:].amax(-1, keepdim=True)], dim=1)  # [n*k, J]
    chunks = peaks.size(1)
    peaks = peaks.view(n, k, chunks).add_(scores.unsqueeze(2)).view(n, k * chunks)  # [n*k, J] -> [n, k*J]
    _, best = peaks.topk(min(m, k * chunks), dim=1)  # [n, m'] chunk ids: beam * J + chunk
    beam_of = best // chunks  # [n, m']
    first = (best % chunks) * _CHUNK  # [n, m'] the chunk's first vocabulary entry
    cols = first.unsqueeze(2) + torch.arange(_CHUNK, device=logp.device)  # [n, m', C]
    row = torch.arange(n, device=logp.device).unsqueeze(1) * k + beam_of  # [n, m'] rows of logp
    # [n, m', C] entries of the chosen chunks; past the vocabulary's end (the last chunk) -> -inf
    values = logp.view(-1)[(row.unsqueeze(2) * vocab + cols.clamp(max=vocab - 1)).view(-1)].view(cols.shape)
    values = values.add_(scores.gather(1, beam_of).unsqueeze(2)).masked_fill_(cols >= vocab, float("-inf"))
    top, j = values.view(n, -1).topk(min(m, k * vocab), dim=1)  # [n, m'*C] -> [n, m]
    pick = j // _CHUNK  # [n, m] which chosen chunk
    token = first.gather(1, pick) + j % _CHUNK
    return top, beam_of.gather(1, pick) * vocab + token


class BeamSearch:
    """The beam search of the module docstring, one :meth:`advance` (decoder step) at a time, over the sentences
    :meth:`admit` has let in; each sentence leaves as soon as it is done.

    :func:`beam_search` admits one batch and advances until it is empty. ``mtpipe serve`` (:mod:`mtpipe.engine.streaming`)
    admits new requests' sentences between steps while others are still decoding: iteration-level batching (Yu et
    al. 2022, "Orca"), so that a short sentence is answered when it ends rather than when the longest sentence of its
    batch ends, and the batch stays full. A sentence's result does not depend on what else is in the batch: the rows
    never interact, each sentence counts its own steps (its positions, its length limit, its length penalty), and a
    sentence that joins later attends only to its own cache slots (:meth:`mtpipe.engine.cache.DecoderState.admit`).

    ``step(tokens [N], state) -> (log_probs, state)`` as in :func:`beam_search`; the state also needs
    ``admit(fresh)`` when sentences join a non-empty search (:class:`mtpipe.engine.cache.DecoderState`).
    ``sampler`` (:class:`mtpipe.engine.sampling.Sampler`): each slot's next token is drawn instead of the best
    extensions taken (``beam`` samples per sentence, each continued in its own slot); :meth:`admit` then takes each
    sentence's sampling key. (The step body is one method on purpose: it reads as the algorithm it is.)
    """

    def __init__(self, step: StepFn, beam: int, penalty: LengthPenalty, nbest: int = 1,
                 device: torch.device | str = "cpu", stop_after: int | None = None, start_id: int = BOS_ID,
                 min_len: int = 0, sampler: Sampler | None = None) -> None:
        if stop_after is not None and stop_after < nbest:
            raise MtpipeError(f"beam search: stop_after {stop_after} is below nbest {nbest}")
        if beam < 1:
            raise MtpipeError(f"decode.beam: {beam} is not >= 1")
        self.step_fn, self.beam, self.penalty, self.nbest = step, beam, penalty, nbest
        self.device, self.stop_after, self.start_id, self.min_len = device, stop_after, start_id, min_len
        self.sampler = sampler
        self._banned = torch.tensor([PAD_ID, BOS_ID], device=device)  # never generated
        self.state: Any = None
        self.keys: list[Any] = []  # the sentences in the batch, in the order of their row blocks
        self.pools: list[list[Hypothesis]] = []  # each one's nbest best finished hypotheses so far
        self.n_finished: list[int] = []  # hypotheses each has finished (its pool keeps the nbest best)
        self.k = 1  # slots per sentence: 1 at the start, since every beam would hold the same BOS prefix
        self._reset()

    def _reset(self) -> None:
        device = self.device
        self.k = 1
        self.tokens = torch.zeros(0, dtype=torch.long, device=device)  # [n*k] the last token of each row
        self.scores = torch.zeros(0, 1, device=device)  # [n, k] log-probabilities of the live hypotheses (-inf: empty)
        self.history = torch.zeros(0, 0, dtype=torch.long, device=device)  # [n*k, W] tokens after BOS, right-aligned
        self.limits = torch.zeros(0, dtype=torch.long, device=device)  # [n] the most tokens before EOS
        self.steps = torch.zeros(0, dtype=torch.long, device=device)  # [n] tokens each sentence has decoded
        self.sample_keys = torch.zeros(0, dtype=torch.long, device=device)  # [n] sampling only: each one's key
        self.state = None

    def __len__(self) -> int:
        """Sentences in the batch."""
        return len(self.keys)

    def admit(self, keys: Sequence[Any], state: State, max_lens: Sequence[int],
              sample_keys: Sequence[int] | None = None) -> None:
        """Let sentences in: ``state`` has one row per sentence and nothing decoded yet
        (:meth:`~mtpipe.engine.variants.Prepared.start`), ``max_lens[i]`` the most tokens sentence ``keys[i]`` may
        have before its EOS. Into a running search they join with ``k`` slots each, the first holding BOS at
        log-probability 0 and the others empty (-inf), which ranks exactly as one slot would. ``sample_keys``: with a
        sampler, each sentence's key (:func:`mtpipe.engine.sampling.sentence_key`)."""
        m = len(keys)
        if m == 0:
            return
        device, k = self.device, self.k
        limits = torch.tensor(list(max_lens), dtype=torch.long, device=device)  # [m]
        if not self.keys:
            self._reset()
            self.state, k = state, 1
        else:
            self.state = self.state.admit(state)
        scores = torch.full((m, k), float("-inf"), device=device)
        scores[:, 0] = 0.0
        self.tokens = torch.cat([self.tokens, torch.full((m * k,), self.start_id, dtype=torch.long, device=device)])
        self.scores = torch.cat([self.scores, scores])  # [n+m, k]
        self.history = torch.cat([self.history, self.history.new_zeros(m * k, self.history.size(1))])
        self.limits = torch.cat([self.limits, limits])
        self.steps = torch.cat([self.steps, torch.zeros(m, dtype=torch.long, device=device)])
        if self.sampler is not None:
            if sample_keys is None or len(sample_keys) != m:
                raise MtpipeError("beam search: sampling needs each sentence's sample key")
            self.sample_keys = torch.cat([self.sample_keys,
                                          torch.tensor(list(sample_keys), dtype=torch.long, device=device)])
        self.keys.extend(keys)
        self.pools.extend([] for _ in range(m))
        self.n_finished.extend(0 for _ in range(m))

    def advance(self) -> list[tuple[Any, list[Hypothesis]]]:
        """One decoder step for every sentence in the batch; returns the sentences that are done, each with its
        ``nbest`` best hypotheses (best first), and drops them from the batch."""
        if not self.keys:
            return []
        beam, k, device, penalty, nbest = self.beam, self.k, self.device, self.penalty, self.nbest
        stop_after = self.stop_after
        neg_inf = float("-inf")
        # stop_after (fairseq's and CTranslate2's search): rank 2 x beam candidates, so that the live beam is refilled
        # to `beam` hypotheses from the runners-up when some of the top `beam` end in EOS.
        refill = stop_after is not None
        candidates = 2 * beam if refill else beam
        banned = self._banned
        out, state = self.step_fn(self.tokens, self.state)  # [n*k, V] (fresh: updated in place below), or on demand
        n = len(self.keys)
        forced = self.limits == self.steps  # [n] sentences at their length limit: only EOS may follow
        any_forced = bool(forced.any())
        # [n] sentences with fewer than min_len tokens: EOS may not follow yet (unless the length limit forces it)
        early = (self.steps < self.min_len) & ~forced if self.min_len > 0 else None
        any_early = early is not None and bool(early.any())
        # Rank the candidates a block of sentences at a time: each block's log-probabilities are made, masked,
        # added to the hypotheses' scores and ranked while they are in the CPU's cache.
        block = max(1, _BLOCK_ROWS // k)  # sentences per block
        tops, idxs = [], []
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            logp = out(lo * k, hi * k) if callable(out) else out[lo * k : hi * k]
            logp = logp.float().index_fill_(1, banned, neg_inf)  # [c*k, V]
            vocab = logp.size(-1)
            if any_forced:
                f = forced[lo:hi].repeat_interleave(k)[:, None]  # [c*k, 1]
                eos = logp[:, EOS_ID].clone()
                logp.masked_fill_(f, neg_inf)[:, EOS_ID] = eos
            if any_early:
                logp[:, EOS_ID].masked_fill_(early[lo:hi].repeat_interleave(k), neg_inf)  # [c*k]
            if self.sampler is None:
                top, idx = top_candidates(logp, self.scores[lo:hi], candidates)  # [c, candidates], best first
            else:  # [c, beam] drawn, in slot order
                top, idx = self.sampler.pick(logp, self.scores[lo:hi], self.sample_keys[lo:hi], self.steps[lo:hi],
                                             beam)
            tops.append(top)
            idxs.append(idx)
        top, idx = (tops[0], idxs[0]) if len(tops) == 1 else (torch.cat(tops), torch.cat(idxs))  # [n, cands]
        width = min(beam, top.size(1))
        parent, token = idx // vocab, idx % vocab
        is_eos, finite = token == EOS_ID, torch.isfinite(top)
        ends = is_eos & finite
        ends[:, width:] = False  # only the top `beam` candidates finish (with refill, as fairseq and CTranslate2)
        if refill:
            # The live beam: the first `width` candidates that do not end in EOS, in rank order (stable: a
            # candidate's key is its rank, pushed past every valid one when it is EOS or impossible).
            valid = ~is_eos & finite
            cols = torch.arange(top.size(1), device=device)
            order = (cols + (~valid).long() * top.size(1)).argsort(dim=1)[:, :width]  # [n, width]
            live = top.gather(1, order).masked_fill_(~valid.gather(1, order), neg_inf)
            next_parent, next_token = parent.gather(1, order), token.gather(1, order)
        else:
            live = top.masked_fill(is_eos | ~finite, neg_inf)  # [n, width]
            next_parent, next_token = parent, token

        # Finished hypotheses: a little Python per EOS candidate (at most `width` per sentence and step).
        steps = self.steps.tolist()  # tokens before this step's: an EOS now makes a hypothesis of steps + 1
        where = ends.nonzero().tolist()
        if where:
            parents = parent.tolist()
            rows = torch.tensor([i * k + parents[i][j] for i, j in where], device=device)
            prefixes = self.history.index_select(0, rows).tolist()  # [e, W], right-aligned
            logprobs = top[ends].tolist()  # row-major, the same order as `where`
            w = self.history.size(1)
            for (i, _), prefix, lprob in zip(where, prefixes, logprobs):
                if stop_after is not None and self.n_finished[i] >= stop_after:
                    # fairseq keeps the first stop_after to finish, in rank order within a step: a lower-ranked EOS
                    # of the same step is dropped, although under a length penalty it may outscore a shorter
                    # hypothesis that finished earlier (never one of its own step: same length, lower log-prob)
                    continue
                pool = self.pools[i]
                self.n_finished[i] += 1
                pool.append(Hypothesis(tokens=prefix[w - steps[i]:], score=penalty.score(lprob, steps[i] + 1),
                                       logprob=lprob))
                pool.sort(key=lambda h: -h.score)
                del pool[nbest:]

        # Which sentences are done: nothing live, or no live hypothesis can beat the nbest-th finished one (or, with
        # stop_after, enough hypotheses have finished).
        best_live = live[:, 0] if width == 1 else live.max(dim=1).values
        best_live_l, limits_l = best_live.tolist(), self.limits.tolist()
        keep, done = [], []
        for i, (s, lim) in enumerate(zip(best_live_l, limits_l)):
            pool = self.pools[i]
            # a live hypothesis has steps + 1 tokens now, so at least steps + 2 with its EOS
            if s == neg_inf or (stop_after is not None and self.n_finished[i] >= stop_after) or (
                    stop_after is None and len(pool) >= nbest
                    and s / max(penalty(steps[i] + 2), penalty(lim + 1)) <= pool[-1].score):
                done.append((self.keys[i], pool))
            else:
                keep.append(i)
        if not keep:
            self.keys, self.pools, self.n_finished = [], [], []
            self._reset()
            return done

        # Reorder the beams and drop the finished sentences from the batch in one select.
        keep_t = torch.tensor(keep, device=device)
        rows = (keep_t[:, None] * k + next_parent.index_select(0, keep_t)).view(-1)  # [n', width] -> [n'*width]
        self.state = state.select(rows, width)
        self.tokens = next_token.index_select(0, keep_t).view(-1)  # [n'*width]
        self.steps = self.steps.index_select(0, keep_t) + 1
        # Right-aligned: each sentence's tokens are its last `steps` columns; columns no sentence needs are dropped.
        span = int(self.steps.max())
        self.history = torch.cat([self.history.index_select(0, rows)[:, self.history.size(1) - (span - 1):],
                                  self.tokens[:, None]], dim=1)  # [n'*width, span]
        self.scores = live.index_select(0, keep_t)
        self.limits = self.limits.index_select(0, keep_t)
        if self.sampler is not None:
            self.sample_keys = self.sample_keys.index_select(0, keep_t)
        if len(keep) < n:
            self.keys = [self.keys[i] for i in keep]
            self.pools = [self.pools[i] for i in keep]
            self.n_finished = [self.n_finished[i] for i in keep]
        self.k = width
        return done


def beam_search(step: StepFn, state: State, max_lens: Sequence[int], beam: int, penalty: LengthPenalty,
                nbest: int = 1, device: torch.device | str = "cpu",
                on_done: Callable[[int], None] | None = None,
                stop_after: int | None = None, start_id: int = BOS_ID, min_len: int = 0,
                sampler: Sampler | None = None,
                sample_keys: Sequence[int] | None = None) -> list[list[Hypothesis]]:
    """Beam search for ``len(max_lens)`` sentences at once (:class:`BeamSearch` over one batch); returns each
    sentence's ``nbest`` best, best first.

    ``state`` has one row per sentence; ``step(tokens [N], state)`` gives the log-probabilities ``[N, V]`` of the
    next token after ``tokens`` (BOS first; a new tensor each call, which the search overwrites), or a function
    ``(lo, hi) -> [hi - lo, V]`` that makes rows ``lo:hi`` of them on demand
    (:meth:`~mtpipe.engine.variants.Prepared.step` with ``lazy``), and the advanced state. ``max_lens[b]``: the most
    tokens sentence b may have before its EOS. ``on_done(n)`` is called as n sentences finish. After each step the
    state is narrowed with ``state.select(rows, beams)``: rows of the kept hypotheses, ``beams`` consecutive rows per
    sentence still in the batch. ``stop_after=None`` stops a sentence by the exact bound, ``stop_after=m`` once m of
    its hypotheses have finished (fairseq's and CTranslate2's rule, ``decode.stop=finished``; m >= nbest). See the
    module docstring for the search rules. ``start_id``: the decoder's first input (the model's ``start_id``: BOS,
    or EOS for ``model.decoder_start=eos``). ``min_len``: EOS may not follow fewer tokens than this
    (``decode.min_len``), unless the length limit forces it. ``sampler``: sample instead
    (:mod:`mtpipe.engine.sampling`), each sentence by its ``sample_keys`` entry.
    """
    search = BeamSearch(step, beam, penalty, nbest, device, stop_after, start_id, min_len, sampler)
    results: list[list[Hypothesis]] = [[] for _ in max_lens]
    search.admit(range(len(max_lens)), state, max_lens, sample_keys)
    while len(search):
        done = search.advance()
        for key, hyps in done:
            results[key] = hyps
        if on_done is not None and done:
            on_done(len(done))
    return results


__all__ = ["BeamSearch", "DecodeRules", "Hypothesis", "LengthPenalty", "PENALTIES", "STOPS", "State", "StepFn",
           "beam_search", "max_source_len", "top_candidates"]
