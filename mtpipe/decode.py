"""``mtpipe decode``: batched beam search with a length penalty, as the paper decodes (section 6.1).

"We used beam search with a beam size of 4 and length penalty alpha = 0.6 ... We set the maximum output length during
inference to input length + 50, but terminate early when possible." The paper's numbers come from tensor2tensor,
whose length penalty is GNMT's (Wu et al. 2016, section 7)::

    gnmt:     lp(Y) = ((5 + |Y|) / 6) ^ alpha          (the paper, tensor2tensor; the default)
    fairseq:  lp(Y) = |Y| ^ alpha                       (fairseq's --lenpen)

and a finished hypothesis is ranked by ``log P(Y | X) / lp(Y)``. ``|Y|`` counts the generated tokens including the
final EOS (as tensor2tensor and fairseq both count).

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
  1 by default). It takes fewer decoder steps and keeps no empty beam slots, but can miss a better, longer
  hypothesis under a length penalty: the opt-in fast mode, and the rule to compare those tools under
  (BENCHMARKS.md gives speed and BLEU of both rules on the same model).
* **beam 1 is greedy search**: the single best extension is taken each step, and when it is EOS the beam is empty.

The search works on any ``step(tokens [N], state) -> (log_probs [N, V], state)`` whose state has
``select(index, beams)`` (:class:`mtpipe.model.DecoderState`, :class:`PrefixState`, or a hand-made one in the
tests). Speed: sentences are sorted by length and packed into batches of at most ``max_tokens`` padded source
tokens; the encoder runs once per batch and its keys/values are projected once (:meth:`Transformer.start`) and kept
once per sentence, its beams attending to them together; each step computes the new position only (self-attention
cache written in place, :meth:`Transformer.step`); sentences that are done leave the batch at once
(``state.select``); ``torch.inference_mode`` and optional bf16 autocast (CPU and GPU).

Blank input lines are not decoded: they give blank output lines (so paragraph breaks survive). Sources longer than
the model's ``max_positions`` are truncated (with a warning naming how many and the first id):
one output line per input line matters more for scoring than failing the whole run.

``decode.prune`` decodes a LayerDrop-trained model with fewer layers (:func:`mtpipe.model.prune_plan`: ``every_other``,
``every_other:RATE`` or ``enc:0,2,4;dec:0,2,4``), pruned on the fly; ``mtpipe average --prune`` writes such a model
as a checkpoint instead, which decodes with no flag.

``decode.engine=ctranslate2`` decodes through CTranslate2 (:func:`translate_ct2`, :func:`mtpipe.export.ct2_translate`)
with the same inputs, outputs and settings: ``--checkpoint`` is a ``mtpipe export`` directory or a checkpoint
(exported to a temporary directory first). Greedy output is mtpipe's; at beam > 1 CTranslate2 stops a sentence once
``beam x patience`` hypotheses have finished (fairseq's rule, ``decode.stop=finished``) whatever ``decode.stop``
says, and its own length penalty is |Y|^alpha, so ``gnmt`` is applied by re-ranking the hypotheses it finished
(scores are mtpipe's).
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mtpipe import artifacts
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
from mtpipe.config import DecodeConfig, to_dict
from mtpipe.errors import MtpipeError

PENALTIES = ("gnmt", "fairseq")
PRECISIONS = ("fp32", "bf16")
ENGINES = ("mtpipe", "ctranslate2")
STOPS = ("bound", "finished")
INPUT_SPLIT = "input"  # file name ({INPUT_SPLIT}.parquet / .txt) of the output when translating --input text


# --------------------------------------------------------------------------------------------------------------------
# Length penalty (section 6.1; GNMT section 7)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthPenalty:
    """``lp(|Y|)``: ``gnmt`` = ((5 + |Y|) / 6) ^ alpha (tensor2tensor, the paper), ``fairseq`` = |Y| ^ alpha."""

    kind: str = "gnmt"
    alpha: float = 0.6

    def __post_init__(self) -> None:
        if self.kind not in PENALTIES:
            raise MtpipeError(f"decode.length_penalty: unknown penalty {self.kind!r} "
                              f"(choose from {', '.join(PENALTIES)})")

    def __call__(self, length: int) -> float:
        if self.kind == "gnmt":
            return ((5.0 + length) / 6.0) ** self.alpha
        return float(length) ** self.alpha


@dataclass
class Hypothesis:
    """A finished translation: ``tokens`` without EOS, ``score`` = ``logprob / lp(len(tokens) + 1)``."""

    tokens: list[int]
    score: float
    logprob: float


# --------------------------------------------------------------------------------------------------------------------
# Beam search over any step function
# --------------------------------------------------------------------------------------------------------------------


class State(Protocol):
    def select(self, index: Tensor, beams: int) -> "State": ...


StepFn = Callable[[Tensor, Any], "tuple[Tensor | Callable[[int, int], Tensor], Any]"]

# Rows of log-probabilities ranked at a time (:func:`beam_search`): 256 x 8k vocabulary x 4 bytes = 8 MB, which stays
# in a server CPU's cache between the projection, the softmax, the score update and the top-k.
_BLOCK_ROWS = 256


def beam_search(step: StepFn, state: State, max_lens: Sequence[int], beam: int, penalty: LengthPenalty,
                nbest: int = 1, device: torch.device | str = "cpu",
                on_done: Callable[[int], None] | None = None,
                stop_after: int | None = None) -> list[list[Hypothesis]]:
    """Beam search for ``len(max_lens)`` sentences at once; returns each sentence's ``nbest`` best, best first.

    ``state`` has one row per sentence; ``step(tokens [N], state)`` gives the log-probabilities ``[N, V]`` of the
    next token after ``tokens`` (BOS first; a new tensor each call, which the search overwrites), or a function
    ``(lo, hi) -> [hi - lo, V]`` that makes rows ``lo:hi`` of them on demand (:meth:`Transformer.step` with
    ``lazy``), and the advanced state. ``max_lens[b]``: the most tokens sentence b may have before its EOS.
    ``on_done(n)`` is called as n sentences finish. After each step the state is narrowed with
    ``state.select(rows, beams)``: rows of the kept hypotheses, ``beams`` consecutive rows per sentence still in the
    batch. ``stop_after=None`` stops a sentence by the exact bound, ``stop_after=m`` once m of its hypotheses have
    finished (fairseq's and CTranslate2's rule, ``decode.stop=finished``; m >= nbest). See the module docstring for
    the search rules.
    """
    if stop_after is not None and stop_after < nbest:
        raise MtpipeError(f"beam search: stop_after {stop_after} is below nbest {nbest}")
    if beam < 1:
        raise MtpipeError(f"decode.beam: {beam} is not >= 1")
    n_sent = len(max_lens)
    finished: list[list[Hypothesis]] = [[] for _ in range(n_sent)]
    n_finished = [0] * n_sent  # hypotheses each sentence has finished (its pool keeps the nbest best of them)
    if n_sent == 0:
        return finished
    neg_inf = float("-inf")
    # stop_after (fairseq's and CTranslate2's search): rank 2 x beam candidates, so that the live beam is refilled
    # to `beam` hypotheses from the runners-up when some of the top `beam` end in EOS.
    refill = stop_after is not None
    candidates = 2 * beam if refill else beam
    active = list(range(n_sent))  # the sentences still in the batch, in the order of their row blocks
    limits = torch.tensor(list(max_lens), dtype=torch.long, device=device)  # [n]
    k = 1  # slots per active sentence: 1 at the start, since every beam would hold the same BOS prefix
    tokens = torch.full((n_sent,), BOS_ID, dtype=torch.long, device=device)  # [n*k] the last token of each row
    scores = torch.zeros(n_sent, 1, device=device)  # [n, k] log-probabilities of the live hypotheses (-inf: empty)
    history = torch.zeros(n_sent, 0, dtype=torch.long, device=device)  # [n*k, t] tokens after BOS
    banned = torch.tensor([PAD_ID, BOS_ID], device=device)
    t = 0
    while active:
        out, state = step(tokens, state)  # [n*k, V] (a fresh tensor: updated in place below), or rows on demand
        n = len(active)
        forced = limits == t  # [n] sentences at their length limit: only EOS may follow
        any_forced = bool(forced.any())
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
            cand = logp.view(hi - lo, k, vocab).add_(scores[lo:hi].unsqueeze(2)).view(hi - lo, k * vocab)
            top, idx = cand.topk(min(candidates, k * vocab), dim=1)  # [c, candidates], best first
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
        where = ends.nonzero().tolist()
        if where:
            parents = parent.tolist()
            rows = torch.tensor([i * k + parents[i][j] for i, j in where], device=device)
            prefixes = history.index_select(0, rows).tolist()
            logprobs = top[ends].tolist()  # row-major, the same order as `where`
            lp = penalty(t + 1)
            for (i, _), prefix, lprob in zip(where, prefixes, logprobs):
                pool = finished[active[i]]
                n_finished[active[i]] += 1
                pool.append(Hypothesis(tokens=prefix, score=lprob / lp, logprob=lprob))
                pool.sort(key=lambda h: -h.score)
                del pool[nbest:]

        # Which sentences are done: nothing live, or no live hypothesis can beat the nbest-th finished one (or, with
        # stop_after, enough hypotheses have finished).
        best_live = live[:, 0] if width == 1 else live.max(dim=1).values
        best_live_l, limits_l = best_live.tolist(), limits.tolist()
        keep = []
        lp_next = penalty(t + 2)  # a live hypothesis has t+1 tokens now, so at least t+2 with its EOS
        for i, (s, lim) in enumerate(zip(best_live_l, limits_l)):
            pool = finished[active[i]]
            if s == neg_inf:
                continue
            if stop_after is not None:
                if n_finished[active[i]] >= stop_after:
                    continue
            elif len(pool) >= nbest and s / max(lp_next, penalty(lim + 1)) <= pool[-1].score:
                continue
            keep.append(i)
        if on_done is not None and len(keep) < n:
            on_done(n - len(keep))
        if not keep:
            break

        # Reorder the beams and drop the finished sentences from the batch in one select.
        keep_t = torch.tensor(keep, device=device)
        rows = (keep_t[:, None] * k + next_parent.index_select(0, keep_t)).view(-1)  # [n', width] -> [n'*width]
        state = state.select(rows, width)
        tokens = next_token.index_select(0, keep_t).view(-1)  # [n'*width]
        history = torch.cat([history.index_select(0, rows), tokens[:, None]], dim=1)  # [n'*width, t+1]
        scores = live.index_select(0, keep_t)
        limits = limits.index_select(0, keep_t)
        active = [active[i] for i in keep]
        k = width
        t += 1
    return finished


# --------------------------------------------------------------------------------------------------------------------
# Step functions: incremental (the model's cache) and the no-cache reference
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


def uncached_step(model: Any) -> StepFn:
    """A step function that re-runs the whole decoder over the prefix each step (cross-attention keys/values
    included): the naive reference that the tests check the incremental path against and that
    ``bench/decode_speed.py`` measures against."""

    def step(tokens: Tensor, state: PrefixState) -> tuple[Tensor, PrefixState]:
        prefix = torch.cat([state.prefix, tokens[:, None]], dim=1)  # [N, t] -> [N, t+1]
        x = model.decode(prefix, state.memory, state.src_mask)  # [N, t+1, D]
        logp = F.log_softmax(model.logits(x[:, -1]).float(), dim=-1)  # [N, t+1, D] -> [N, D] -> [N, V]
        return logp, PrefixState(state.memory, state.src_mask, prefix)

    return step


# --------------------------------------------------------------------------------------------------------------------
# Batching and translation
# --------------------------------------------------------------------------------------------------------------------


def make_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of at most ``max_tokens`` padded tokens, longest sentences first (a longer
    sentence alone over the budget gets a batch of its own). Sorting by length keeps padding, and so wasted
    encoder and cross-attention work, small."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = lengths[cur[0]] if cur else lengths[i]  # sorted longest first: the first one sets the padded width
        if cur and (len(cur) + 1) * width > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def precision_context(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast (matmuls in bf16, softmax/log-softmax in fp32) or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def bf16_copy(model: Any) -> Any:
    """A copy of ``model`` with bf16 weights for bf16 decoding. Autocast casts every float32 weight again at every
    matmul (it caches casts only for tensors that track gradients): in a decode step, whose matmuls are small, that
    was ~10 % of the time. The positional encodings stay float32, as autocast would use them."""
    twin = copy.deepcopy(model).to(torch.bfloat16)
    twin.positions = model.positions
    return twin


def max_output_len(src_len: int, cfg: DecodeConfig, max_positions: int) -> int:
    """``max_len_a * S + max_len_b`` tokens before EOS (S without EOS), capped so BOS + tokens fit the positions."""
    return max(0, min(int(math.floor(cfg.max_len_a * src_len + cfg.max_len_b)), max_positions - 1))


def stop_after_finished(cfg: DecodeConfig) -> int:
    """``decode.stop=finished``: a sentence stops once this many hypotheses have finished (CTranslate2 rounds
    ``beam x patience`` the same way; never fewer than ``nbest``)."""
    return max(cfg.nbest, int(math.floor(cfg.beam * cfg.patience + 0.5)))  # std::round: halves away from zero


def translate(model: Any, sources: Sequence[Sequence[int]], cfg: DecodeConfig, device: torch.device | str = "cpu",
              cache: bool = True, on_done: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
    """Translate token-id sources (without EOS; at most ``max_positions - 1`` tokens) with beam search.

    Returns the ``cfg.nbest`` best hypotheses of every source, in input order. An empty source (a blank input line)
    is not decoded: its translation is empty, with score 0. ``cache=False`` re-decodes the whole prefix each step
    (:func:`uncached_step`; for tests and the benchmark).
    """
    device = torch.device(device)
    penalty = LengthPenalty(cfg.length_penalty, cfg.alpha)
    max_positions = model.cfg.max_positions
    lengths = [len(s) + 1 for s in sources]  # + EOS
    results: list[list[Hypothesis]] = [[Hypothesis([], 0.0, 0.0)] if not s else [] for s in sources]
    todo = [i for i, s in enumerate(sources) if s]
    stop_after = stop_after_finished(cfg) if cfg.stop == "finished" else None
    model.eval()
    if cache and cfg.precision == "bf16":
        model = bf16_copy(model)
    step = (lambda tokens, state: model.step(tokens, state, lazy=True)) if cache else uncached_step(model)
    if on_done is not None and len(todo) < len(sources):
        on_done(len(sources) - len(todo))
    with torch.inference_mode(), precision_context(device, cfg.precision):
        for sub in make_batches([lengths[i] for i in todo], cfg.max_tokens):
            batch = [todo[j] for j in sub]
            width = lengths[batch[0]]
            src = torch.full((len(batch), width), PAD_ID, dtype=torch.long)  # [B, S] right-padded
            for row, i in enumerate(batch):
                src[row, : lengths[i]] = torch.tensor([*sources[i], EOS_ID], dtype=torch.long)
            src = src.to(device)
            memory, src_mask = model.encode(src)  # once per batch; the beams share it
            if cache:
                state: Any = model.start(memory, src_mask)  # cross-attention keys/values projected once
            else:
                state = PrefixState(memory, src_mask, torch.zeros(len(batch), 0, dtype=torch.long, device=device))
            max_lens = [max_output_len(lengths[i] - 1, cfg, max_positions) for i in batch]
            hyps = beam_search(step, state, max_lens, cfg.beam, penalty, cfg.nbest, device, on_done, stop_after)
            for i, h in zip(batch, hyps):
                results[i] = h
    return results


def translate_ct2(model: Any, sources: Sequence[Sequence[int]], cfg: DecodeConfig,
                  on_done: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
    """:func:`translate` through CTranslate2 (``decode.engine=ctranslate2``; ``model``: a loaded
    :class:`mtpipe.export.Ct2Model`): the same inputs and outputs -- each source's ``nbest`` hypotheses in input
    order with mtpipe's scores, blank sources give the empty output. :func:`mtpipe.export.ct2_translate` states
    where CTranslate2's search differs (only at beam > 1: its stopping rule).

    Sentences are sorted by length and handed over in blocks of about 4 x ``max_tokens`` source tokens: the progress
    bar moves, and each block still fills CTranslate2's ``max_tokens`` batches with sentences of similar lengths.
    """
    from mtpipe.export import ct2_translate

    penalty = LengthPenalty(cfg.length_penalty, cfg.alpha)
    results: list[list[Hypothesis]] = [[Hypothesis([], 0.0, 0.0)] if not s else [] for s in sources]
    todo = sorted((i for i, s in enumerate(sources) if s), key=lambda i: (len(sources[i]), i))
    if on_done is not None and len(todo) < len(sources):
        on_done(len(sources) - len(todo))
    blocks: list[list[int]] = [[]]
    size = 0
    for i in todo:
        if blocks[-1] and size + len(sources[i]) + 1 > 4 * cfg.max_tokens:
            blocks.append([])
            size = 0
        blocks[-1].append(i)
        size += len(sources[i]) + 1
    for block in blocks:
        if not block:
            continue
        hyps = ct2_translate(model, [sources[i] for i in block], beam=cfg.beam, alpha=cfg.alpha,
                             length_penalty=cfg.length_penalty, max_len_a=cfg.max_len_a, max_len_b=cfg.max_len_b,
                             nbest=cfg.nbest, patience=cfg.patience, max_tokens=cfg.max_tokens)
        for i, hs in zip(block, hyps):
            # logprob back from mtpipe's score: score = log P(Y + EOS | X) / lp(|Y| + 1)
            results[i] = [Hypothesis(list(h.ids), h.score, h.score * penalty(len(h.ids) + 1)) for h in hs]
        if on_done is not None:
            on_done(len(block))
    return results


# --------------------------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------------------------


def validate(cfg: DecodeConfig) -> None:
    """The decode params' rules that span several keys (each key's own range and choices are checked when the
    section is built, :mod:`mtpipe.config`)."""
    if cfg.nbest > cfg.beam:
        raise MtpipeError(f"decode.nbest: {cfg.nbest} is not between 1 and decode.beam ({cfg.beam})")
    if cfg.engine == "ctranslate2":
        from mtpipe.export import COMPUTE_TYPES

        if cfg.precision != "fp32":
            raise MtpipeError(f"decode.precision: {cfg.precision} applies to engine mtpipe; with engine ctranslate2 "
                              "set decode.ct2_compute_type (e.g. bfloat16, int8)")
        if cfg.ct2_compute_type not in COMPUTE_TYPES:
            raise MtpipeError(f"decode.ct2_compute_type: unknown type {cfg.ct2_compute_type!r} "
                              f"(choose from {', '.join(COMPUTE_TYPES)})")
        if cfg.prune:
            raise MtpipeError("decode.prune: not available with engine ctranslate2; write a pruned checkpoint with "
                              "`mtpipe average --prune` and decode (or export) that")


def _bare_sha(value: Any) -> str:
    text = str(value).strip().lower()
    return text.split(":", 1)[1] if text.startswith("sha256:") else text


def read_lines(path: Path) -> list[str]:
    """Raw text lines of a file or of stdin ('-'), NFC-normalised and stripped as ``fetch`` cleans text.

    Lines are split on ``\\n`` only (a trailing ``\\r`` is stripped), so the output has one line per input line.
    """
    name = "stdin" if str(path) == "-" else str(path)
    if str(path) == "-":
        stream = getattr(sys.stdin, "buffer", None)
        data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
    else:
        if not path.is_file():
            raise MtpipeError(f"{path}: input file not found")
        data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise MtpipeError(f"{name}: line {line} is not valid UTF-8") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    if not lines:
        raise MtpipeError(f"{name}: empty input (no lines to translate)")
    return [unicodedata.normalize("NFC", line).strip() for line in lines]


def run(cfg: DecodeConfig, checkpoint: Path, tokens: Path, input: Path | None = None,
        out: Path | None = None, *, force: bool = False) -> None:
    """Translate a split of the bpe artifact (``cfg.split``) or raw text (``input``; '-' = stdin).

    The translations go to stdout, one line per sentence in id order; with ``out`` also a ``hypotheses`` artifact
    (``{split}.parquet`` / ``{split}.txt``, or ``input.*`` for raw text) is written there. All checks run before any
    output is written.
    """
    import sentencepiece as spm

    from mtpipe.console import info, progress, table, warn
    from mtpipe.model import build_model, prune, prune_plan

    from rich.progress import TextColumn

    validate(cfg)
    if out is not None:
        artifacts.prepare_output(out, "hypotheses", inputs=[checkpoint, tokens, input], force=force)

    # -- inputs, all checked before any work --------------------------------------------------------------------
    ct2 = cfg.engine == "ctranslate2"
    ck: artifacts.Checkpoint | None = None
    source_manifest: artifacts.Manifest | None = None
    if ct2:
        from mtpipe.export import decode_source

        source_manifest = decode_source(checkpoint)  # a CTranslate2 export or a checkpoint, else one error line
        vocab = source_manifest.extra["vocab"]
        step = int(source_manifest.extra["checkpoint_step" if source_manifest.kind == "export" else "step"])
    else:
        if (Path(checkpoint) / artifacts.MANIFEST).is_file() and artifacts.read_manifest(checkpoint).kind == "export":
            raise MtpipeError(f"{checkpoint}: is an `mtpipe export` model; decode it with --engine ctranslate2 "
                              "(or give the checkpoint it was exported from)")
        ck = artifacts.load_checkpoint(checkpoint)
        vocab, step = ck.vocab, ck.step
    # An export carries its spm.model: raw text can be translated with the export alone (no bpe artifact at hand).
    export_spm = (source_manifest is not None and source_manifest.kind == "export" and input is not None
                  and not Path(tokens).exists())
    if export_spm:
        assert source_manifest is not None
        spm_path = artifacts.verify_file(checkpoint, "spm.model", source_manifest)
        spm_sha = _bare_sha(source_manifest.files["spm.model"])
    else:
        tm = artifacts.read_manifest(tokens, "tokens")
        spm_path = artifacts.verify_file(tokens, "spm.model", tm)
        spm_sha = _bare_sha(tm.files["spm.model"])
    if _bare_sha(vocab.get("spm_sha256")) != spm_sha:
        raise MtpipeError(f"{checkpoint}: trained with another SentencePiece model than {spm_path} "
                          f"(checkpoint vocab sha256 {_bare_sha(vocab.get('spm_sha256'))[:12]}..., "
                          f"spm.model {spm_sha[:12]}...)")
    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    if int(vocab.get("size", -1)) != sp.get_piece_size():
        raise MtpipeError(f"{checkpoint}: vocabulary size {vocab.get('size')} does not match {spm_path} "
                          f"({sp.get_piece_size()} pieces)")

    if input is None:
        split = cfg.split
        available = artifacts.splits_of(tokens, "tokens")
        if split not in available:
            raise MtpipeError(f"{tokens}: has no split '{split}' (decode.split; available: {', '.join(available)})")
        t = artifacts.read_table(tokens, f"{split}.parquet", "tokens", columns=["id", "src"])
        ids = t.column("id").to_pylist()
        sources = t.column("src").to_pylist()
        source_desc = f"{tokens}/{split}.parquet"
    else:
        split = None
        lines = read_lines(input)
        sources = sp.encode(lines, out_type=int)
        ids = list(range(len(lines)))
        source_desc = "stdin" if str(input) == "-" else str(input)

    plan = None
    if ct2:
        from mtpipe.export import open_for_decode

        assert source_manifest is not None
        if source_manifest.kind == "checkpoint":
            info(f"exporting {checkpoint} to CTranslate2 (float32) for this run; `mtpipe export` does it once")
        ct2_model = open_for_decode(checkpoint, source_manifest, tokens, compute_type=cfg.ct2_compute_type,
                                    threads=cfg.threads or torch.get_num_threads())
        max_positions = ct2_model.max_positions
    else:
        assert ck is not None
        try:
            model = build_model(ck.model_config, int(ck.vocab["size"]))
            model.load_state_dict(ck.state_dict)
        except (TypeError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise MtpipeError(f"{checkpoint}: weights do not fit the checkpoint's model config ({first})") from None
        plan = prune_plan(model.cfg, cfg.prune, where="decode.prune")
        if plan is not None:
            info(f"pruned (decode.prune={cfg.prune!r}): {plan.describe(model.cfg)}")
            model = prune(model, plan)
        max_positions = model.cfg.max_positions

    limit = max_positions - 1  # room for EOS
    long_rows = [i for i, s in enumerate(sources) if len(s) > limit]
    if long_rows:
        warn(f"{len(long_rows)} source(s) longer than the model's {limit} tokens (max_positions "
             f"{max_positions} with EOS) truncated, the first with id {ids[long_rows[0]]}")
        sources = [s[:limit] for s in sources]

    # -- decode --------------------------------------------------------------------------------------------------
    threads_before = torch.get_num_threads()
    if ct2:
        device_desc = f"{ct2_model.translator.device} (CTranslate2, compute type {cfg.ct2_compute_type})"
        numbers = f"stop finished, patience {cfg.patience:g}"
    else:
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":
            from mtpipe import runtime

            runtime.tune_cpu_allocator()
        model.to(device)
        device_desc, numbers = str(device), cfg.precision
        if cfg.beam > 1:
            numbers += f", stop {cfg.stop}" + (f" (patience {cfg.patience:g})" if cfg.stop == "finished" else "")
    info(f"decoding {len(sources):,} sentences of {source_desc} with {checkpoint} (step {step:,}) on {device_desc}, "
         f"beam {cfg.beam}, {cfg.length_penalty} alpha {cfg.alpha}, {numbers}")
    if ct2 and cfg.beam > 1:
        info("note: CTranslate2 stops a sentence once beam x patience hypotheses have finished (fairseq's rule, "
             "= --stop finished; mtpipe's default --stop bound stops when none can improve), so at beam > 1 outputs "
             "can differ from --engine mtpipe; "
             f"the {cfg.length_penalty} length penalty and the scores are mtpipe's"
             + (" (CTranslate2's own is |Y|^alpha: its finished hypotheses are re-ranked with GNMT)"
                if cfg.length_penalty == "gnmt" else ""))
    start = time.perf_counter()
    with progress(TextColumn("{task.fields[rate]}")) as bar:
        task = bar.add_task("decode", total=len(sources), rate="")
        done = 0

        def on_done(n: int) -> None:
            nonlocal done
            done += n
            rate = done / max(time.perf_counter() - start, 1e-9)
            bar.update(task, advance=n, rate=f"{rate:,.1f} sent/s")

        try:
            if ct2:
                results = translate_ct2(ct2_model, sources, cfg, on_done=on_done)
            else:
                results = translate(model, sources, cfg, device, on_done=on_done)
        finally:
            torch.set_num_threads(threads_before)  # run() may be called in-process (tests, notebooks)
    seconds = time.perf_counter() - start

    # -- write ---------------------------------------------------------------------------------------------------
    def detok(hyp_tokens: list[list[int]]) -> list[str]:
        # One line per hypothesis no matter what the model emits.
        return [s.replace("\r", " ").replace("\n", " ") for s in sp.decode(hyp_tokens)]

    best = [r[0] for r in results]
    texts = detok([h.tokens for h in best])
    nbest_texts = [detok([h.tokens for h in r]) if cfg.nbest > 1 else [] for r in results]
    rows = {
        "id": ids,
        "hypothesis": texts,
        "tokens": [h.tokens for h in best],
        "score": [h.score for h in best],
        "nbest": nbest_texts,
        "nbest_scores": [[h.score for h in r] if cfg.nbest > 1 else [] for r in results],
    }
    out_tokens = sum(len(h.tokens) + 1 for h in best)
    if out is not None:
        import pyarrow as pa

        name = split if split is not None else INPUT_SPLIT
        upstream = {"checkpoint": checkpoint} if export_spm else {"checkpoint": checkpoint, "tokens": tokens}
        with artifacts.ArtifactWriter(out, "hypotheses", {"decode": to_dict(cfg)}, upstream=upstream,
                                      force=force) as w:
            w.write_table(f"{name}.parquet", pa.table(rows, schema=artifacts.HYPOTHESES_SCHEMA))
            w.path(f"{name}.txt").write_text("".join(s + "\n" for s in texts), encoding="utf-8")
            w.extra.update({
                "split": split,
                "input": None if input is None else source_desc,
                "checkpoint": str(checkpoint),
                "checkpoint_step": step,
                "decode": to_dict(cfg),
                "device": device_desc,
                "truncated_sources": len(long_rows),
                "pruned": None if plan is None else {"encoder_kept": list(plan.encoder),
                                                     "decoder_kept": list(plan.decoder)},
            })
    sys.stdout.write("".join(s + "\n" for s in texts))
    sys.stdout.flush()
    table("decode", ["", "value"], [
        ["engine", cfg.engine],
        ["sentences", len(sources)],
        ["output tokens (with EOS)", out_tokens],
        ["seconds", round(seconds, 2)],
        ["sentences/s", len(sources) / max(seconds, 1e-9)],
        ["tokens/s", out_tokens / max(seconds, 1e-9)],
        ["mean score", sum(h.score for h in best) / max(len(best), 1)],
        ["written to", str(out) if out is not None else "stdout"],
    ])
