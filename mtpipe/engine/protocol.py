"""What every decoding engine offers its callers (:class:`Engine`), what a server's worker drives (:class:`Lane`), and
how an engine opens (:class:`ModelSource`, which each engine's entry in :mod:`mtpipe.registry` names).

Three engines satisfy :class:`Engine`: mtpipe's own beam search (:class:`mtpipe.engine.translate.MtpipeEngine`),
CTranslate2 (:class:`mtpipe.engine.ct2.Ct2Engine`) and a pool of decoding processes running either
(:class:`mtpipe.engine.workers.DecodePool`). ``mtpipe decode`` and ``mtpipe serve`` see only this protocol, so the
same sentence translates the same way through each command: the rules are :class:`~mtpipe.engine.search.DecodeRules`
(the paper's section 6.1), a blank source gives the empty output with score 0 (:func:`blank_results`, so a blank
line stays blank), and each engine says where its search differs from the rules (:meth:`Engine.note`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from mtpipe import artifacts
from mtpipe.config import DecodeConfig
from mtpipe.engine.search import DecodeRules, Hypothesis


def empty_output() -> list[Hypothesis]:
    """The translation of a blank source: the empty output with score 0, not decoded."""
    return [Hypothesis([], 0.0, 0.0)]


def blank_results(sources: Sequence[Sequence[int]],
                  on_done: Callable[[int], None] | None = None) -> tuple[list[list[Hypothesis]], list[int]]:
    """``(results, todo)``: every blank source already answered with the empty output at score 0 (a blank input line
    is not decoded: it gives a blank output line), the others' places empty and their indices in ``todo``;
    ``on_done`` told of the blank ones at once."""
    results: list[list[Hypothesis]] = [empty_output() if not s else [] for s in sources]
    todo = [i for i, s in enumerate(sources) if s]
    if on_done is not None and len(todo) < len(sources):
        on_done(len(sources) - len(todo))
    return results, todo


class Lane(Protocol):
    """What a server's worker drives: requests in (:meth:`add`), finished requests out (:meth:`poll`).
    ``continuous``: it takes new requests while it decodes (else only when it is idle)."""

    continuous: bool

    def add(self, key: int, sources: list[list[int]], rules: Any) -> None:
        """Take request ``key``: its sources (token ids, no EOS), decoded under ``rules``."""
        ...

    def busy(self) -> bool:
        """Whether requests are still being decoded."""
        ...

    def cancel(self, keys: Sequence[int]) -> None:
        """Forget requests ``keys`` (their clients have gone): what is not yet decoded of them is dropped, and they
        are never reported by :meth:`poll`."""
        ...

    def poll(self) -> list[tuple[int, Any]]:
        """Work a little (a decoder step, a batch, or a few milliseconds' wait): the requests finished meanwhile,
        each ``(key, result)``; a failed request's result is an exception."""
        ...

    def decoding(self) -> contextlib.AbstractContextManager:
        """What the thread that drives the lane enters once around its polls (``decode.compile``'s settings),
        rather than every poll entering it again."""
        ...


class Engine(Protocol):
    """A decoder of token-id sources under :class:`~mtpipe.engine.search.DecodeRules`."""

    max_positions: int  # the model's positions: sources are cut to max_positions - 1 tokens, outputs capped
    # whether its first decodings build code (decode.compile): a caller that times its work warms it up first
    compiled: bool

    def describe(self) -> str:
        """Where it runs (the log line and the hypotheses manifest's ``device``)."""
        ...

    def settings(self, rules: DecodeRules) -> str:
        """How it searches under ``rules``, for the log line."""
        ...

    def note(self, rules: DecodeRules) -> str | None:
        """Where its search differs from ``rules`` (logged before decoding), or None."""
        ...

    def facts(self, rules: DecodeRules) -> dict[str, Any]:
        """What a server's ``/info`` and a pool of processes report of it: ``device``, ``precision``, ``search``,
        ``max_positions``, ``model_config`` (the model that runs), ``pruned`` (decode.prune's kept layers or
        None), and ``note`` when there is one."""
        ...

    def translate(self, sources: Sequence[Sequence[int]], rules: DecodeRules,
                  on_done: Callable[[int], None] | None = None) -> list[list[Hypothesis]]:
        """Each source's ``rules.nbest`` hypotheses, best first, in input order; an empty source gives the empty
        output with score 0 (a blank line stays blank). ``on_done(n)`` as n sentences finish."""
        ...

    def lane(self, continuous: bool = False) -> Lane:
        """A lane over this engine for a server's worker: batch by batch, or ``continuous`` (sentences join the
        running search between decoder steps; mtpipe's engine only)."""
        ...

    def warm_up(self, groups: Sequence[list[list[int]]], rules: DecodeRules, beams: Sequence[int] = (),
                continuous: bool = False) -> float:
        """Decode each group of sources before the real work, at ``rules.beam`` and then each of ``beams``
        (through a ``continuous`` lane: also the last group joining a sentence that is decoding); the seconds it
        took. The first decodings of a process pay for kernel selection and, with ``decode.compile``, for
        building the compiled step, whose graphs differ by the number of sentences, the beam and the masks of rows
        that joined later: no timed decode and no request should."""
        ...

    def close(self, wait: float = 30) -> None:
        """Release what it holds (a pool's processes: ``wait`` seconds for them, 0: at once)."""
        ...


@dataclass
class ModelSource:
    """A model located and checked with its vocabulary, its engine not opened yet: each engine's own subclass (the
    ``opens`` of its :class:`mtpipe.registry.EngineEntry`) says how, and :mod:`mtpipe.engine.opening` alone picks
    and calls it. :meth:`locate` reads and checks everything a bad input could break (one
    :class:`~mtpipe.errors.MtpipeError` line each) before :meth:`open`, the slow part, starts the engine."""

    cfg: DecodeConfig
    checkpoint: Path
    sp: Any  # the SentencePiece model (sentencepiece.SentencePieceProcessor)
    step: int  # the checkpoint's training step
    tokens: Path | None  # the bpe artifact the vocabulary came from; None: the model's own

    @classmethod
    def check(cls, cfg: DecodeConfig, checkpoint: Path, command: str) -> None:
        """What can be checked of ``checkpoint`` without loading it (``mtpipe serve``, before its port opens): that
        it is there and is what this engine reads. ``command`` names what refuses it."""
        raise NotImplementedError

    @classmethod
    def locate(cls, cfg: DecodeConfig, checkpoint: Path, tokens: Path | None, command: str) -> "ModelSource":
        """The model at ``checkpoint`` and its SentencePiece model (that of the bpe artifact ``tokens``, else the
        model's own: :func:`mtpipe.engine.loading.vocab_source`), checked against the vocabulary it was trained
        with."""
        raise NotImplementedError

    def open(self, lone_graph: bool = False) -> Engine:
        """The engine (``lone_graph``: see :meth:`mtpipe.engine.translate.MtpipeEngine.open`)."""
        raise NotImplementedError

    @property
    def upstream(self) -> dict[str, Path]:
        """The lineage a hypotheses manifest records."""
        return {"checkpoint": self.checkpoint, **({"tokens": self.tokens} if self.tokens is not None else {})}

    def facts(self, engine: Engine) -> dict[str, Any]:
        """What a server's ``/info`` shows and a decoding process reports: the model, its engine's facts under the
        decode section's rules."""
        model = (artifacts.manifest_hash(self.checkpoint)
                 if (self.checkpoint / artifacts.MANIFEST).is_file() else None)
        return {"checkpoint": str(self.checkpoint), "model": model, "step": self.step, "engine": self.cfg.engine,
                "vocab_size": self.sp.get_piece_size(), **engine.facts(DecodeRules.from_config(self.cfg))}


__all__ = ["Engine", "Lane", "ModelSource", "blank_results", "empty_output"]
