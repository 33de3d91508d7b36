"""Decoding through CTranslate2 (``decode.engine=ctranslate2``): a ``mtpipe export`` model, or a checkpoint exported
on the fly, under mtpipe's :class:`~mtpipe.engine.search.DecodeRules`.

:func:`translate_under_rules` decodes through ``ctranslate2.Translator`` with mtpipe's decode settings; its
docstring states exactly where CTranslate2's search and length penalty differ from
:func:`mtpipe.engine.search.beam_search` (only at beam > 1: its stopping rule). :class:`Ct2Engine` is the
:class:`~mtpipe.engine.protocol.Engine` that ``mtpipe decode`` runs: the same inputs and outputs as mtpipe's engine,
scores by mtpipe's formula. The conversion of a checkpoint is
:mod:`mtpipe.engine.ct2_convert`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from mtpipe import artifacts
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from mtpipe.config import DecodeConfig
from mtpipe.errors import MtpipeError
from mtpipe.engine.loading import artifact_spm, load_vocab, vocab_source
from mtpipe.engine.protocol import Lane, ModelSource, blank_results
from mtpipe.engine.search import DecodeRules, Hypothesis, LengthPenalty, max_source_len

ENGINE_INPUTS = "a CTranslate2 export (`mtpipe export`) or an mtpipe checkpoint"


# --------------------------------------------------------------------------------------------------------------------
# A loaded model
# --------------------------------------------------------------------------------------------------------------------


class Ct2Hypothesis(NamedTuple):
    """A finished translation: SentencePiece ``pieces`` and their ``ids`` (no EOS), and mtpipe's score
    ``log P(Y + EOS | X) / lp(|Y| + 1)``."""

    pieces: list[str]
    ids: list[int]
    score: float


@dataclass
class Ct2Model:
    """A loaded exported model: the ``ctranslate2.Translator`` and what decoding needs from the manifest."""

    path: Path
    translator: Any
    pieces: list[str]  # the vocabulary, id order
    ids: dict[str, int]
    max_positions: int
    vocab: dict[str, Any]  # the checkpoint's {"spm_sha256", "size"}: check it against a tokens artifact
    model_config: dict[str, Any] | None = None  # the exported model's config, as the manifest records it


def load_ct2(model_dir: Path, *, device: str = "cpu", compute_type: str = "default", threads: int = 0) -> Ct2Model:
    """Open an exported model directory (``threads``: CTranslate2 intra-op threads, 0 = its default)."""
    from mtpipe.engine.ct2_convert import require_ctranslate2

    ct2 = require_ctranslate2()
    model_dir = Path(model_dir)
    m = artifacts.read_manifest(model_dir, "export")
    if m.extra.get("format") != "ctranslate2":
        raise MtpipeError(f"{model_dir}: is a '{m.extra.get('format')}' export, not a CTranslate2 model")
    vocab_path = model_dir / m.extra.get("vocabulary", "shared_vocabulary.json")
    try:
        pieces = json.loads(vocab_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise MtpipeError(f"{vocab_path}: unreadable CTranslate2 vocabulary ({e})") from None
    if threads < 0:
        raise MtpipeError(f"threads: {threads} is not >= 0")
    try:
        translator = ct2.Translator(str(model_dir), device=device, compute_type=compute_type, intra_threads=threads)
    except (RuntimeError, ValueError) as e:
        raise MtpipeError(f"{model_dir}: CTranslate2 cannot load it ({str(e).splitlines()[0]})") from None
    meta = model_fields(model_dir, m)  # the exported checkpoint's fields, as the export records them
    return Ct2Model(model_dir, translator, pieces, {p: i for i, p in enumerate(pieces)},
                    int(m.extra["max_positions"]), dict(meta.vocab), meta.model_config)


# --------------------------------------------------------------------------------------------------------------------
# Translation under mtpipe's rules
# --------------------------------------------------------------------------------------------------------------------


def translate_under_rules(m: Ct2Model, sources: Sequence[Sequence[str | int]], rules: DecodeRules,
                          max_tokens: int) -> list[list[Ct2Hypothesis]]:
    """Translate sources (SentencePiece pieces or ids, no EOS, any order) on a loaded model with CTranslate2's beam
    search under mtpipe's ``rules``: search, re-score the hypotheses cut at the length limit, rank.

    Returns each source's ``nbest`` hypotheses, best first, in input order, scored with mtpipe's formula
    ``log P(Y + EOS | X) / lp(|Y| + 1)``, ``gnmt`` lp(n) = ((5 + n) / 6)^alpha or ``fairseq`` lp(n) = n^alpha
    (:class:`~mtpipe.engine.search.LengthPenalty`; the paper's section 6.1 decodes with beam 4, alpha 0.6, max length
    input + 50).

    How mtpipe's decode settings are honoured, and what differs (CTranslate2 4.x, ``src/decoding.cc``):

    * **Length penalty.** CTranslate2 has one formula: a finished hypothesis scores ``log P / n^length_penalty``
      (``log P`` including its EOS) where n counts the hypothesis' tokens *and* its EOS (checked on CTranslate2
      4.8.5: the score is the same with or without ``return_end_token``; this function sets it to see the EOS), so
      ``length_penalty = alpha`` is exactly mtpipe's ``fairseq`` penalty |Y|^alpha with |Y| counting EOS.
      mtpipe's default ``gnmt`` ((5 + |Y|) / 6)^alpha has no CTranslate2 equivalent; for it every finished
      hypothesis CTranslate2 returns (``beam`` of them) is re-scored with GNMT (log P = score * n^alpha) and
      re-ranked. The penalty only ranks *finished* hypotheses in both decoders, so the ranking is exact; what
      differs is the search below.
    * **Search.** CTranslate2 keeps ``beam`` live hypotheses, refilling from the top 2*beam candidates when some of
      the top ``beam`` end in EOS, and stops a sentence once ``round(beam * patience)`` hypotheses have finished
      (fairseq's rule; with alpha = 0, as soon as the best-scoring candidate is EOS). mtpipe lets finished
      hypotheses leave the beam and stops only when no live hypothesis can still beat the n-best finished score
      (tensor2tensor's bound). Greedy search (beam 1) is the same algorithm. At beam > 1, with ``patience`` 1 (the
      CTranslate2 and fairseq default), short low-probability hypotheses that end early can fill the quota before
      the best one finishes -- on very peaked models (e.g. a model that memorised its data) CTranslate2 then returns
      a worse translation than mtpipe; ``patience`` 2 waits for twice as many and closes that gap.
    * **Scores.** CTranslate2 masks PAD and BOS *before* its log-softmax, mtpipe *after* (so CTranslate2's token
      log-probabilities are renormalised over the other tokens): per token the two differ by
      ``-log(1 - P(PAD) - P(BOS))``, about 1e-5 for a trained model (PAD and BOS are never training targets). The
      rankings of tokens are the same.
    * **Max length.** mtpipe allows ``floor(max_len_a * S + max_len_b)`` tokens before EOS per sentence (S = source
      tokens without EOS, capped at max_positions - 1) and then forces EOS. CTranslate2 has one absolute
      ``max_decoding_length`` per call, so sentences are grouped by their limit L and each group decoded with
      ``max_decoding_length = L``: no output has more than L tokens, as in mtpipe. A hypothesis cut at L tokens
      without EOS is re-scored with CTranslate2's ``score_batch`` on Y + EOS (mtpipe's forced EOS), so its score is
      mtpipe's too; L = 0 gives the empty output scored log P(EOS | X). Sources longer than max_positions - 1 are
      truncated (``max_input_length``; EOS kept last), as mtpipe's decode truncates them.
    * PAD and BOS are never generated (``suppress_sequences``), as in mtpipe.
    * ``nbest`` <= ``beam``: CTranslate2 is asked for ``beam`` finished hypotheses, which are re-scored, sorted and
      cut to ``nbest``.

    ``max_tokens`` caps the source tokens per CTranslate2 batch.
    """
    pieces = _as_pieces(m, sources)
    common = dict(max_batch_size=max_tokens, batch_type="tokens", max_input_length=m.max_positions)
    raw, rescore = _search(m, pieces, rules, common)
    if rescore:
        # score_batch gives the log-probabilities of every target token and of the EOS it appends.
        scored = m.translator.score_batch([pieces[i] for i, _ in rescore], [raw[i][j][0] for i, j in rescore],
                                          **common)
        for (i, j), s in zip(rescore, scored):
            raw[i][j] = (raw[i][j][0], float(sum(s.log_probs)))
    return [_rank(m, r, rules) for r in raw]


def _as_pieces(m: Ct2Model, sources: Sequence[Sequence[str | int]]) -> list[list[str]]:
    """Sources as SentencePiece pieces, each cut to the source tokens that fit the model with their EOS."""
    limit_in = max_source_len(m.max_positions)
    pieces: list[list[str]] = []
    for n, s in enumerate(sources):
        if any(isinstance(t, Integral) and not 0 <= t < len(m.pieces) for t in s):
            raise MtpipeError(f"source {n}: token id out of the vocabulary (0..{len(m.pieces) - 1})")
        row = [m.pieces[int(t)] if isinstance(t, Integral) else str(t) for t in s]
        pieces.append(row[:limit_in])
    return pieces


Raw = list[list[tuple[list[str], "float | None"]]]  # per source: (pieces, log P(Y + EOS) or None: to re-score)


def _search(m: Ct2Model, pieces: list[list[str]], rules: DecodeRules,
            common: dict[str, Any]) -> tuple[Raw, list[tuple[int, int]]]:
    """CTranslate2's beam search, one call per output-length limit; returns every source's hypotheses with their
    log-probabilities, and the (source, index) of those cut at the limit, whose log P(Y + EOS) is still to come."""
    eos = m.pieces[EOS_ID]
    # CTranslate2's own score is log P / n^alpha, n counting the EOS: its fairseq penalty.
    ct2_penalty = LengthPenalty("fairseq", rules.penalty.alpha)
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(pieces):
        groups.setdefault(rules.max_output_len(len(p), m.max_positions), []).append(i)
    raw: Raw = [[] for _ in pieces]
    rescore: list[tuple[int, int]] = []
    for lim, idx in sorted(groups.items()):
        if lim == 0:
            for i in idx:  # nothing may precede EOS: the empty output
                rescore.append((i, len(raw[i])))
                raw[i].append(([], None))
            continue
        out = m.translator.translate_batch(
            [pieces[i] for i in idx], beam_size=rules.beam, patience=rules.patience, num_hypotheses=rules.beam,
            length_penalty=rules.penalty.alpha, max_decoding_length=lim, min_decoding_length=min(rules.min_len, lim),
            return_end_token=True, return_scores=True,
            suppress_sequences=[[m.pieces[PAD_ID]], [m.pieces[BOS_ID]]], **common)
        for i, r in zip(idx, out):
            for hyp, score in zip(r.hypotheses, r.scores):
                if hyp and hyp[-1] == eos:
                    raw[i].append((hyp[:-1], ct2_penalty.logprob(float(score), len(hyp))))
                else:  # cut at the length limit: mtpipe would force EOS here
                    rescore.append((i, len(raw[i])))
                    raw[i].append((list(hyp), None))
    return raw, rescore


def _rank(m: Ct2Model, hyps: list[tuple[list[str], float | None]], rules: DecodeRules) -> list[Ct2Hypothesis]:
    """One source's hypotheses scored by mtpipe's penalty, duplicates dropped, best first, cut to nbest."""
    best: dict[tuple[str, ...], Ct2Hypothesis] = {}
    for hyp, lp in hyps:
        assert lp is not None
        h = Ct2Hypothesis(list(hyp), [m.ids.get(p, UNK_ID) for p in hyp], rules.penalty.score(lp, len(hyp) + 1))
        if tuple(hyp) not in best or h.score > best[tuple(hyp)].score:
            best[tuple(hyp)] = h
    return sorted(best.values(), key=lambda h: -h.score)[: rules.nbest]


# --------------------------------------------------------------------------------------------------------------------
# The engine `mtpipe decode --engine ctranslate2` runs
# --------------------------------------------------------------------------------------------------------------------


def decode_source(path: Path) -> artifacts.Manifest:
    """The manifest of what ``mtpipe decode --engine ctranslate2 --checkpoint PATH`` names: a CTranslate2 export
    (kind ``export``, format ``ctranslate2``) or an mtpipe checkpoint; anything else fails with one line."""
    path = Path(path)
    try:
        m = artifacts.read_manifest(path)
    except MtpipeError as e:
        raise MtpipeError(f"{e}; --engine ctranslate2 needs {ENGINE_INPUTS}") from None
    if m.kind == "export" and m.extra.get("format") != "ctranslate2":
        raise MtpipeError(f"{path}: is a '{m.extra.get('format')}' export, not a CTranslate2 model; --engine "
                          f"ctranslate2 needs {ENGINE_INPUTS}")
    if m.kind not in ("export", "checkpoint"):
        raise MtpipeError(f"{path}: is a '{m.kind}' artifact; --engine ctranslate2 needs {ENGINE_INPUTS}")
    model_fields(path, m)  # validated: the checkpoint's fields, or the export's record of its checkpoint
    return m


def model_fields(path: Path, m: artifacts.Manifest) -> artifacts.CheckpointManifest:
    """The checkpoint fields of a :func:`decode_source`: the checkpoint's, or those the export records of it."""
    return artifacts.CheckpointManifest.of_artifact(m.kind, m.extra, Path(path) / artifacts.MANIFEST, m.format_version)


def source_vocab(path: Path, manifest: artifacts.Manifest, tokens: Path | None) -> tuple[Any, int, Path | None]:
    """``(SentencePiece model, checkpoint step, the bpe artifact used or None)`` of a :func:`decode_source`: the
    SentencePiece model of ``tokens``, else the export's or the checkpoint's own copy
    (:func:`mtpipe.engine.loading.vocab_source`), checked against the vocabulary the checkpoint was trained with."""
    meta = model_fields(path, manifest)
    own = artifact_spm(path, manifest)[0] if manifest.kind == "export" else artifacts.checkpoint_spm(path, manifest)
    spm_path, spm_sha, tokens = vocab_source(path, own, tokens)
    return load_vocab(path, meta.vocab, spm_path, spm_sha), meta.step, tokens


def open_for_decode(path: Path, manifest: artifacts.Manifest, tokens: Path | None, *, compute_type: str = "default",
                    threads: int = 0, device: str = "auto") -> Ct2Model:
    """A loaded CTranslate2 model for ``mtpipe decode --engine ctranslate2``: an export is opened as it is; a
    checkpoint (with the SentencePiece model of ``tokens``, else its own) is first exported with float32 weights to a
    temporary directory, which is removed once CTranslate2 has read it (the translator keeps its weights in memory),
    so nothing is left behind. ``compute_type`` may still quantise at load time (``int8``...; the choices are
    ``decode.ct2_compute_type``'s). ``device`` (``decode.device``) "auto": the first GPU CTranslate2 sees, else the
    CPU."""
    import dataclasses
    import tempfile

    from mtpipe.engine.ct2_convert import export_ctranslate2, require_ctranslate2

    gpus = require_ctranslate2().get_cuda_device_count()
    if device == "cuda" and gpus == 0:
        raise MtpipeError("decode.device=cuda but CTranslate2 sees no CUDA GPU")
    if device == "auto":
        device = "cuda" if gpus > 0 else "cpu"
    path = Path(path)
    if manifest.kind == "export":
        return load_ct2(path, device=device, compute_type=compute_type, threads=threads)
    with tempfile.TemporaryDirectory(prefix="mtpipe-ct2-") as tmp:
        export_ctranslate2(path, tokens, Path(tmp) / "model", summary=False)
        m = load_ct2(Path(tmp) / "model", device=device, compute_type=compute_type, threads=threads)
    return dataclasses.replace(m, path=path)


@dataclass
class Ct2Engine:
    """CTranslate2 as an :class:`~mtpipe.engine.protocol.Engine`. Whatever ``rules.stop`` says, CTranslate2 stops a
    sentence once ``round(beam x patience)`` hypotheses have finished (``finished``); :meth:`note` says so."""

    model: Ct2Model
    compute_type: str
    max_tokens: int
    compiled: bool = False  # CTranslate2 runs its own compiled code: nothing is built on first use

    @classmethod
    def open(cls, path: Path, manifest: artifacts.Manifest, tokens: Path | None, cfg: DecodeConfig) -> "Ct2Engine":
        from mtpipe import platform
        from mtpipe.console import info

        if manifest.kind == "checkpoint":
            info(f"exporting {path} to CTranslate2 (float32) for this run; `mtpipe export` does it once")
        model = open_for_decode(path, manifest, tokens, compute_type=cfg.ct2_compute_type,
                                threads=platform.torch_threads(cfg.threads), device=cfg.device)
        return cls(model, cfg.ct2_compute_type, cfg.max_tokens)

    @property
    def max_positions(self) -> int:
        return self.model.max_positions

    def describe(self) -> str:
        return f"{self.model.translator.device} (CTranslate2, compute type {self.compute_type})"

    def settings(self, rules: DecodeRules) -> str:
        return f"stop finished, patience {rules.patience:g}"

    def note(self, rules: DecodeRules) -> str | None:
        if rules.beam == 1:
            return None  # greedy search is the same algorithm
        return ("note: CTranslate2 stops a sentence once beam x patience hypotheses have finished (fairseq's rule, "
                "= --stop finished; mtpipe's default --stop bound stops when none can improve), so at beam > 1 "
                "outputs can differ from --engine mtpipe; "
                f"the {rules.penalty.kind} length penalty and the scores are mtpipe's"
                + (" (CTranslate2's own is |Y|^alpha: its finished hypotheses are re-ranked with GNMT)"
                   if rules.penalty.kind == "gnmt" else ""))

    def facts(self, rules: DecodeRules) -> dict[str, Any]:
        return {"device": self.describe(), "precision": f"CTranslate2 compute type {self.compute_type}",
                "search": self.settings(rules), "max_positions": self.max_positions,
                "model_config": self.model.model_config, "pruned": None,
                **({"note": note} if (note := self.note(rules)) else {})}

    def lane(self, continuous: bool = False) -> Lane:
        """Batch by batch: CTranslate2 decodes whole batches (continuous batching is mtpipe's engine's)."""
        from mtpipe.engine.lanes import BatchLane

        if continuous:
            raise MtpipeError("continuous batching needs decode.engine=mtpipe (ctranslate2 decodes batch by batch)")
        return BatchLane(self.translate)

    def warm_up(self, groups: Sequence[list[list[int]]], rules: DecodeRules, beams: Sequence[int] = (),
                continuous: bool = False) -> float:
        from mtpipe.engine.lanes import warm_lane

        return warm_lane(self.lane(continuous), groups, rules, beams)

    def close(self, wait: float = 30) -> None:
        """Nothing to release: the translator goes with the engine."""

    def translate(self, sources: Sequence[Sequence[int]], rules: DecodeRules,
                  on_done: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
        """The same inputs and outputs as mtpipe's engine: each source's ``nbest`` hypotheses in input order with
        mtpipe's scores; blank sources give the empty output.

        Sentences are sorted by length and handed over in blocks of about 4 x ``max_tokens`` source tokens: the
        progress bar moves, and each block still fills CTranslate2's ``max_tokens`` batches with sentences of
        similar lengths.
        """
        results, todo = blank_results(sources, on_done)
        todo.sort(key=lambda i: (len(sources[i]), i))
        for block in self._blocks(todo, sources):
            hyps = translate_under_rules(self.model, [sources[i] for i in block], rules, self.max_tokens)
            for i, hs in zip(block, hyps):
                # logprob back from mtpipe's score: score = log P(Y + EOS | X) / lp(|Y| + 1)
                results[i] = [Hypothesis(list(h.ids), h.score, rules.penalty.logprob(h.score, len(h.ids) + 1))
                              for h in hs]
            if on_done is not None:
                on_done(len(block))
        return results

    def _blocks(self, todo: list[int], sources: Sequence[Sequence[int]]) -> list[list[int]]:
        blocks: list[list[int]] = [[]]
        size = 0
        for i in todo:
            if blocks[-1] and size + len(sources[i]) + 1 > 4 * self.max_tokens:
                blocks.append([])
                size = 0
            blocks[-1].append(i)
            size += len(sources[i]) + 1
        return [b for b in blocks if b]


@dataclass
class Ct2Source(ModelSource):
    """How CTranslate2's engine opens (its entry in :mod:`mtpipe.registry`): a CTranslate2 export or a checkpoint
    (:func:`decode_source`) with its vocabulary (:func:`source_vocab`), then :meth:`Ct2Engine.open`, which converts
    a checkpoint on the fly (:func:`open_for_decode`)."""

    manifest: Any = field(default=None, repr=False)  # the export's or the checkpoint's manifest

    @classmethod
    def check(cls, cfg: DecodeConfig, checkpoint: Path, command: str) -> None:
        decode_source(checkpoint)

    @classmethod
    def locate(cls, cfg: DecodeConfig, checkpoint: Path, tokens: Path | None, command: str) -> "Ct2Source":
        manifest = decode_source(checkpoint)  # a CTranslate2 export or a checkpoint, else one error line
        sp, step, used = source_vocab(checkpoint, manifest, tokens)
        return cls(cfg, checkpoint, sp, step, used, manifest=manifest)

    def open(self, lone_graph: bool = False) -> Ct2Engine:
        return Ct2Engine.open(self.checkpoint, self.manifest, self.tokens, self.cfg)


__all__ = ["Ct2Engine", "Ct2Hypothesis", "Ct2Model", "Ct2Source", "ENGINE_INPUTS", "decode_source", "load_ct2",
           "open_for_decode", "source_vocab", "translate_under_rules"]
