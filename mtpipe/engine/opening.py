"""Opening a model to translate with, the one way every command that translates opens one: ``mtpipe decode``,
``mtpipe serve`` and their decoding processes (:mod:`mtpipe.engine.workers`), so that a sentence is read, translated
and written the same way by each. The engine is the one :mod:`mtpipe.registry` picks for the ``decode`` section
(``decode.engine``, or the ensemble engine for ``decode.ensemble``); its entry names the
:class:`~mtpipe.engine.protocol.ModelSource` that opens it, which is imported here and nowhere else:

* :func:`locate`: the model (a checkpoint, or with ``decode.engine=ctranslate2`` also an ``mtpipe export``
  directory) checked, with its vocabulary (:func:`mtpipe.engine.loading.vocab_source`), before any slow work;
  :meth:`~mtpipe.engine.protocol.ModelSource.open` then starts the engine. A checkpoint's model is opened by
  :func:`mtpipe.engine.loading.open_checkpoint`, as ``mtpipe export``, ``mtpipe attention`` and CTranslate2's
  conversion open it. :func:`check_source`: what ``mtpipe serve`` checks before its port opens.
* :func:`warm_up`: what a process decodes before its real work (a server's requests, stdin's lines, a file's
  batches), chosen here once.
* :func:`clean_line` (how a line of raw text is cleaned before it is encoded), :func:`encode_lines` (how it is
  encoded: a line without a letter or a digit is not translated) and :func:`detokenise` (pieces -> one line of
  text).
* :func:`open_model`: an :class:`OpenModel`, the engine with what a server needs besides (its vocabulary, the facts
  ``/info`` shows, the warm-up), which a server's process can also rebuild without weights from a worker
  process's :meth:`~OpenModel.description`.
"""

from __future__ import annotations

import importlib
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mtpipe import registry
from mtpipe.config import DecodeConfig
from mtpipe.engine.protocol import Engine, Lane, ModelSource
from mtpipe.engine.search import DecodeRules
from mtpipe.errors import MtpipeError

# What a process decodes before its first real input (a server's warm-up, stdin with decode.compile): one sentence,
# then several of different lengths; any vocabulary encodes them (SentencePiece falls back to pieces).
WARM_UP_TEXTS = ("Warm up.", "Warm up a batch.", "Of sentences of several lengths, together.", "One more.")
# The work a process warms up for (warm_up's ``work``): a server's requests, stdin's lines, a file's or split's batches.
REQUESTS, LINES, BATCHES = "requests", "lines", "batches"


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


def source_class(cfg: DecodeConfig) -> type[ModelSource]:
    """The :class:`~mtpipe.engine.protocol.ModelSource` of the engine that decodes under ``cfg``
    (:func:`mtpipe.registry.chosen`), imported from the dotted path its entry names."""
    module, _, name = registry.chosen(cfg).opens.partition(":")
    return getattr(importlib.import_module(module), name)


def check_source(cfg: DecodeConfig, checkpoint: Path, command: str = "serve") -> None:
    """What can be checked of the model without loading it: that it is there and is what the engine reads (a
    missing or wrong checkpoint fails with one line, before a server listens)."""
    source_class(cfg).check(cfg, Path(checkpoint), command)


def locate(cfg: DecodeConfig, checkpoint: Path, tokens: Path | None, command: str = "decode") -> ModelSource:
    """The model and its SentencePiece model, located and checked by the engine's
    :meth:`~mtpipe.engine.protocol.ModelSource.locate`: that of ``tokens``, else the checkpoint's (or export's) own
    (:func:`mtpipe.engine.loading.vocab_source`), checked against the vocabulary it was trained with. ``command``
    names what refuses an export for engine mtpipe."""
    return source_class(cfg).locate(cfg, Path(checkpoint), Path(tokens) if tokens is not None else None, command)


def warm_up(engine: Engine, rules: DecodeRules, work: str, *, sp: Any = None,
            sources: Sequence[list[int]] = (), beams: Sequence[int] = (), continuous: bool = False) -> float | None:
    """What a process decodes before its real work (:meth:`mtpipe.engine.protocol.Engine.warm_up`: the first
    decodings pay for kernel selection and, with ``decode.compile``, for building the compiled step, whose graphs
    differ by the number of sentences and the beam), chosen by the ``work`` ahead; the seconds it took, or None
    where there is nothing to warm up:

    * :data:`REQUESTS` (a server, in its own process or in each worker process): always, so that no request pays:
      :data:`WARM_UP_TEXTS` encoded with ``sp``, one sentence, then the others together, at ``rules.beam`` and at
      each of ``beams``, through a ``continuous`` lane when the server batches so;
    * :data:`LINES` (stdin): with a compiled step only, all of :data:`WARM_UP_TEXTS`, then one alone (lines come
      one at a time, and a lone sentence has a graph of its own);
    * :data:`BATCHES` (a file or a split): with a compiled step only, the work's own first ``sources``, several,
      then one alone, which runs in the same graph as two copies of itself, outside the timed decoding.
    """
    if work == BATCHES:
        return engine.warm_up([list(sources[:8]), list(sources[:1])], rules) if engine.compiled and sources else None
    texts = [sp.encode(t, out_type=int)[: engine.max_positions - 1] for t in WARM_UP_TEXTS]
    if work == REQUESTS:
        return engine.warm_up([texts[:1], texts[1:]], rules, beams, continuous)
    return engine.warm_up([texts, texts[:1]], rules) if engine.compiled else None


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
        """The engine warmed up for a server's requests (:func:`warm_up`), at ``rules.beam`` and each of ``beams``."""
        if self.engine is None:
            raise MtpipeError("this process holds no copy of the model (serve.workers > 1)")
        seconds = warm_up(self.engine, rules, REQUESTS, sp=self.sp, beams=beams, continuous=continuous)
        assert seconds is not None, "a server always warms up"
        return seconds

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


__all__ = ["BATCHES", "LINES", "ModelSource", "OpenModel", "REQUESTS", "WARM_UP_TEXTS", "check_source", "clean_line",
           "detokenise", "encode_lines", "has_words", "locate", "open_model", "source_class", "warm_up"]
