"""Opening a model to translate with: a checkpoint (or, with ``decode.engine=ctranslate2``, also an ``mtpipe export``
directory) and its SentencePiece model, as the engine ``decode.engine`` names. ``mtpipe decode``, ``mtpipe serve``
and their decoding processes (:mod:`mtpipe.engine.workers`) all open it here, so that a sentence is read, translated
and written the same way by each:

* :func:`locate`: the model checked, with its vocabulary (:func:`mtpipe.engine.loading.vocab_source`), before any
  slow work; :meth:`ModelSource.open` then starts the engine (:class:`~mtpipe.engine.translate.MtpipeEngine`,
  :class:`~mtpipe.engine.ct2.Ct2Engine`, or for ``decode.ensemble`` :class:`~mtpipe.engine.ensemble.EnsembleEngine`,
  each further model located by :func:`locate_member`).
* :func:`clean_line` (how a line of raw text is cleaned before it is encoded), :func:`encode_lines` (how it is
  encoded: a line without a letter or a digit is not translated) and :func:`detokenise` (pieces -> one line of
  text).
* :func:`open_model`: an :class:`OpenModel`, the engine with what a server needs besides (its vocabulary, the facts
  ``/info`` shows, the warm-up), which a server's process can also rebuild without weights from a worker
  process's :meth:`~OpenModel.description`.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from mtpipe import artifacts
from mtpipe.config import DecodeConfig
from mtpipe.engine.protocol import Engine, Lane
from mtpipe.engine.search import DecodeRules
from mtpipe.errors import MtpipeError

# What a process decodes before its first real input (a server's warm-up, stdin with decode.compile): one sentence,
# then several of different lengths; any vocabulary encodes them (SentencePiece falls back to pieces).
WARM_UP_TEXTS = ("Warm up.", "Warm up a batch.", "Of sentences of several lengths, together.", "One more.")


def clean_line(text: str) -> str:
    """A line of raw text as it is translated: NFC-normalised and stripped, as ``fetch`` cleans text (a trailing
    ``\\r`` included)."""
    return unicodedata.normalize("NFC", text).strip()


def has_words(text: str) -> bool:
    """Whether ``text`` holds a letter or a digit (Unicode categories L and N): something to translate."""
    return any(unicodedata.category(c)[0] in "LN" for c in text)


def encode_lines(sp: Any, lines: Sequence[str]) -> list[list[int]]:
    """Cleaned lines (:func:`clean_line`) as source token ids, the one place where ``mtpipe decode`` and ``mtpipe
    serve`` encode raw text. A line without a letter or a digit (only punctuation, symbols, emoji, control or
    invisible characters such as NUL, zero-width spaces or direction marks) is the empty source, translated as a
    blank line is: the empty output at score 0, not decoded (:func:`mtpipe.engine.protocol.blank_results`). Such a
    line has nothing to translate, and SentencePiece gives it as ``<unk>`` or a stray piece, from which the model
    invents a sentence."""
    worded = [i for i, line in enumerate(lines) if has_words(line)]
    sources: list[list[int]] = [[] for _ in lines]
    for i, ids in zip(worded, sp.encode([lines[i] for i in worded], out_type=int)):
        sources[i] = ids
    return sources


def detokenise(sp: Any, hyp_tokens: list[list[int]]) -> list[str]:
    """Hypotheses as text, one line each no matter what the model emits."""
    return [s.replace("\r", " ").replace("\n", " ") for s in sp.decode(hyp_tokens)]


def refuse_export(checkpoint: Path, command: str) -> None:
    """An ``mtpipe export`` directory is CTranslate2's model, not mtpipe's: one line saying how to use it."""
    if (checkpoint / artifacts.MANIFEST).is_file() and artifacts.read_manifest(checkpoint).kind == "export":
        raise MtpipeError(f"{checkpoint}: is an `mtpipe export` model; {command} it with --engine ctranslate2 (or "
                          "give the checkpoint it was exported from)")


@dataclass
class ModelSource:
    """A checkpoint (or, with engine ctranslate2, an export) with its vocabulary checked; :meth:`open` starts the
    engine, the slow part, once the sources have been read and checked."""

    cfg: DecodeConfig
    checkpoint: Path
    sp: Any  # the SentencePiece model (sentencepiece.SentencePieceProcessor)
    step: int  # the checkpoint's training step
    tokens: Path | None  # the bpe artifact the vocabulary came from; None: the model's own
    manifest: Any = field(default=None, repr=False)  # engine ctranslate2: the export's or checkpoint's manifest
    loaded: Any = field(default=None, repr=False)  # engine mtpipe: the mtpipe.engine.loading.ModelAndVocab
    # decode.ensemble: the other models (mtpipe.engine.loading.ModelAndVocab), decoded with this one
    ensemble: list[Any] = field(default_factory=list, repr=False)

    @property
    def upstream(self) -> dict[str, Path]:
        """The lineage a hypotheses manifest records (an ensemble's models: checkpoint, checkpoint_2, ...)."""
        return {"checkpoint": self.checkpoint,
                **{f"checkpoint_{i}": m.checkpoint for i, m in enumerate(self.ensemble, start=2)},
                **({"tokens": self.tokens} if self.tokens is not None else {})}

    def open(self, lone_graph: bool = False) -> Engine:
        """The engine (``lone_graph``: see :meth:`mtpipe.engine.translate.MtpipeEngine.open`)."""
        if self.cfg.engine == "ctranslate2":
            from mtpipe.engine.ct2 import Ct2Engine

            return Ct2Engine.open(self.checkpoint, self.manifest, self.tokens, self.cfg)
        if self.ensemble:
            from mtpipe.engine.ensemble import EnsembleEngine

            return EnsembleEngine.open_models([self.loaded.model, *(m.model for m in self.ensemble)], self.cfg)
        from mtpipe.engine.translate import MtpipeEngine

        return MtpipeEngine.open(self.loaded.model, self.cfg, lone_graph=lone_graph)

    def facts(self, engine: Engine) -> dict[str, Any]:
        """What a server's ``/info`` shows and a decoding process reports: the model, its engine's facts under the
        decode section's rules."""
        model = (artifacts.manifest_hash(self.checkpoint)
                 if (self.checkpoint / artifacts.MANIFEST).is_file() else None)
        return {"checkpoint": str(self.checkpoint), "model": model, "step": self.step, "engine": self.cfg.engine,
                "vocab_size": self.sp.get_piece_size(), **engine.facts(DecodeRules.from_config(self.cfg)),
                **({"ensemble_checkpoints": [str(m.checkpoint) for m in self.ensemble]} if self.ensemble else {})}


def locate(cfg: DecodeConfig, checkpoint: Path, tokens: Path | None, command: str = "decode") -> ModelSource:
    """The model and its SentencePiece model: that of ``tokens``, else the checkpoint's (or export's) own
    (:func:`mtpipe.engine.loading.vocab_source`), checked against the vocabulary it was trained with. ``command``
    names what refuses an export for engine mtpipe."""
    checkpoint = Path(checkpoint)
    tokens = Path(tokens) if tokens is not None else None
    if cfg.engine == "ctranslate2":
        from mtpipe.engine import ct2

        manifest = ct2.decode_source(checkpoint)  # a CTranslate2 export or a checkpoint, else one error line
        sp, step, used = ct2.source_vocab(checkpoint, manifest, tokens)
        return ModelSource(cfg, checkpoint, sp, step, used, manifest=manifest)
    from mtpipe.engine.loading import load_model_and_vocab

    refuse_export(checkpoint, command)
    loaded = load_model_and_vocab(checkpoint, tokens)
    others = [locate_member(Path(p), tokens, loaded, command) for p in cfg.ensemble]
    return ModelSource(cfg, checkpoint, loaded.sp, loaded.ck.step, loaded.tokens, loaded=loaded, ensemble=others)


def locate_member(checkpoint: Path, tokens: Path | None, first: Any, command: str) -> Any:
    """A model of ``decode.ensemble`` (:class:`mtpipe.engine.loading.ModelAndVocab`), checked as :func:`locate`
    checks the first (``first``) and against it: an ensemble's models share one vocabulary, whose ids their
    distributions are averaged over (one line naming the checkpoint otherwise)."""
    from mtpipe.engine.loading import bare_sha, load_model_and_vocab

    refuse_export(checkpoint, command)
    member = load_model_and_vocab(checkpoint, tokens)
    mine, theirs = bare_sha(member.ck.vocab.get("spm_sha256")), bare_sha(first.ck.vocab.get("spm_sha256"))
    if mine != theirs:
        raise MtpipeError(f"{checkpoint}: trained with another vocabulary than {first.checkpoint} (SentencePiece "
                          f"sha256 {mine[:12]}... vs {theirs[:12]}...): an ensemble's models must share one")
    return member


@dataclass
class OpenModel:
    """A model opened to serve: its engine (None where the weights live in worker processes only), the
    SentencePiece model, and what ``/info`` shows."""

    engine: Engine | None
    sp: Any  # sentencepiece.SentencePieceProcessor
    max_positions: int
    info: dict[str, Any]

    def lane(self, continuous: bool = False) -> Lane:
        """A lane over the engine (:meth:`mtpipe.engine.protocol.Engine.lane`)."""
        if self.engine is None:
            raise MtpipeError("this process holds no copy of the model (serve.workers > 1)")
        return self.engine.lane(continuous)

    def detokenise(self, tokens: list[list[int]]) -> list[str]:
        """Pieces -> text as ``mtpipe decode`` writes it (:func:`detokenise`)."""
        return detokenise(self.sp, tokens)

    def warm_up(self, rules: DecodeRules, beams: Sequence[int] = (), continuous: bool = False) -> float:
        """The engine's warm-up (:meth:`mtpipe.engine.protocol.Engine.warm_up`) on :data:`WARM_UP_TEXTS`: one
        sentence, then the others together, at ``rules.beam`` and at each of ``beams``."""
        if self.engine is None:
            raise MtpipeError("this process holds no copy of the model (serve.workers > 1)")
        texts = [self.sp.encode(t, out_type=int)[: self.max_positions - 1] for t in WARM_UP_TEXTS]
        return self.engine.warm_up([texts[:1], texts[1:]], rules, beams, continuous)

    def description(self) -> dict[str, Any]:
        """What a server process needs of a model that its worker processes run: the vocabulary (the SentencePiece
        model's bytes), the positions, the ``/info`` facts (:meth:`described` rebuilds it)."""
        return {"spm": self.sp.serialized_model_proto(), "max_positions": self.max_positions, "info": self.info}

    @classmethod
    def described(cls, description: dict[str, Any]) -> "OpenModel":
        """The model as :meth:`description` describes it, without its weights: encoding and detokenising only
        (with ``serve.workers`` > 1 the weights live in the worker processes alone)."""
        import sentencepiece as spm

        return cls(None, spm.SentencePieceProcessor(model_proto=description["spm"]),
                   int(description["max_positions"]), dict(description["info"]))


def open_model(cfg: DecodeConfig, checkpoint: Path, tokens: Path | None, command: str = "serve") -> OpenModel:
    """The checkpoint (or export) and its vocabulary (that of ``tokens``, None: the model's own), located
    (:func:`locate`) and its engine opened. Requests often come one sentence at a time: with ``decode.compile`` a
    lone sentence gets a graph of its own, built in the warm-up."""
    source = locate(cfg, checkpoint, tokens, command)
    engine = source.open(lone_graph=True)
    return OpenModel(engine, source.sp, engine.max_positions, source.facts(engine))


__all__ = ["ModelSource", "OpenModel", "WARM_UP_TEXTS", "clean_line", "detokenise", "encode_lines", "has_words",
           "locate", "locate_member", "open_model", "refuse_export"]
