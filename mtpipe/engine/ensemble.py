"""The ensemble engine (``decode.ensemble``, ``mtpipe decode --checkpoint A --checkpoint B``): several models
decoded as one, their output distributions averaged at every step.

Why: models trained from different seeds make different errors, and averaging their next-token probabilities is
the cheapest reliable gain over the best single model (the paper's big models average checkpoints of one run,
section 6.1; ensembles of runs are what fairseq's ``--path a.pt:b.pt``, Marian's ``--models``, OpenNMT and Sockeye
decode). As fairseq and OpenNMT do, the step's log-probability of token y is the log of the models' mean
probability::

    log p(y) = log( (1/n) sum_i p_i(y) ) = logsumexp_i(log p_i(y)) - log n

computed as ``m + log(mean_i exp(log p_i(y) - m))`` with ``m`` the largest of the ``log p_i(y)``
(:func:`average_log_probs`): the same value, and an ensemble of a model with itself gives the model's own
log-probabilities exactly (``exp(0) = 1``), so it decodes exactly what the model alone decodes.

Each model keeps its own encoder output and incremental decoder cache (:class:`EnsembleState`); the search sees one
step function (:meth:`Ensemble.step`), so beam search, greedy search and sampling work on an ensemble unchanged. The
models must share their vocabulary (checked when they are located, :meth:`EnsembleSource.locate`); their
shapes may differ. Each is prepared at the decoding precision (:func:`mtpipe.engine.variants.prepare`) and runs the
eager step: decode.compile and decode.prune are refused for an ensemble (:class:`mtpipe.config.DecodeConfig`), and
decode.cuda_graphs does not apply.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from mtpipe.config import DecodeConfig, to_dict
from mtpipe.engine.protocol import Lane
from mtpipe.engine.search import DecodeRules
from mtpipe.engine.translate import MtpipeEngine, MtpipeSource, open_device
from mtpipe.errors import MtpipeError


def average_log_probs(members: Sequence[Tensor]) -> Tensor:
    """The log of the members' mean probability, elementwise (module docstring): ``n x [R, V]`` -> ``[R, V]``. A
    token every member rules out (-inf) stays -inf."""
    if len(members) == 1:
        return members[0]
    stacked = torch.stack(list(members))  # [n, R, V]
    top = stacked.amax(dim=0)  # [R, V]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # -inf everywhere: exp() below gives 0
    return top + (stacked - top).exp().mean(dim=0).log()


@dataclass
class EnsembleState:
    """Each member's decoding state (:class:`mtpipe.engine.cache.DecoderState`), reordered together."""

    members: list[Any]

    def select(self, index: Tensor, beams: int | None = None) -> "EnsembleState":
        return EnsembleState([s.select(index, beams) for s in self.members])

    def admit(self, fresh: "EnsembleState") -> "EnsembleState":
        return EnsembleState([s.admit(f) for s, f in zip(self.members, fresh.members)])


class Ensemble:
    """Prepared models (:class:`mtpipe.engine.variants.Prepared`) that decode as one: what the search and
    :func:`mtpipe.engine.translate.search_batches` drive, as they drive a single prepared model."""

    def __init__(self, members: Sequence[Any]) -> None:
        if not members:
            raise MtpipeError("an ensemble needs at least one model")
        starts = {m.start_id for m in members}
        if len(starts) > 1:
            raise MtpipeError(f"decode.ensemble: the models start decoding with different tokens ({sorted(starts)}: "
                              "model.decoder_start differs)")
        self.members = list(members)
        self.start_id = members[0].start_id
        positions = min(m.cfg.max_positions for m in members)
        # Sources and outputs are cut to the positions every member has.
        self.cfg = dataclasses.replace(members[0].cfg, max_positions=positions)

    def encode(self, src: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Each member's encoder output and source mask."""
        memories, masks = zip(*(m.encode(src) for m in self.members))
        return list(memories), list(masks)

    def start(self, memories: list[Tensor], masks: list[Tensor]) -> EnsembleState:
        return EnsembleState([m.start(x, k) for m, x, k in zip(self.members, memories, masks)])

    def step(self, tokens: Tensor, state: EnsembleState, lazy: bool = False) -> tuple[Any, EnsembleState]:
        """Every member's step on its own state; the averaged log-probabilities ``[R, V]`` (``lazy``: a function
        of ``(lo, hi)`` making rows ``lo:hi`` of them from each member's rows, as
        :meth:`mtpipe.engine.variants.Prepared.step` does)."""
        outs, states = zip(*(m.step(tokens, s, lazy=True) for m, s in zip(self.members, state.members)))

        def log_probs(lo: int, hi: int) -> Tensor:
            return average_log_probs([out(lo, hi) for out in outs])  # n x [hi-lo, V] -> [hi-lo, V]

        return (log_probs if lazy else log_probs(0, tokens.size(0))), EnsembleState(list(states))

    def settings(self) -> contextlib.AbstractContextManager:
        """Nothing to enter: the members run the eager step."""
        return contextlib.nullcontext()


@dataclass
class EnsembleEngine(MtpipeEngine):
    """mtpipe's search on an :class:`Ensemble`, as an :class:`~mtpipe.engine.protocol.Engine`: batch by batch
    (:meth:`MtpipeEngine.translate`); a server's continuous lane takes one model."""

    @classmethod
    def open_models(cls, models: Sequence[Any], cfg: DecodeConfig) -> "EnsembleEngine":
        """``models`` moved to the decoding device (a GPU when there is one) and each prepared at
        ``decode.precision``."""
        from mtpipe.engine.variants import prepare

        device = open_device(cfg)
        members = [prepare(m.to(device), cfg.precision, device) for m in models]
        return cls(Ensemble(members), device, cfg.precision, cfg.max_tokens, cfg.threads)

    def settings(self, rules: DecodeRules) -> str:
        return f"ensemble of {len(self.prepared.members)} models, " + super().settings(rules)

    def facts(self, rules: DecodeRules) -> dict[str, Any]:
        return {**super().facts(rules), "ensemble": [to_dict(m.cfg) for m in self.prepared.members]}

    def lane(self, continuous: bool = False) -> Lane:
        if continuous:
            raise MtpipeError("decode.ensemble: an ensemble decodes batch by batch (serve.batching=continuous takes "
                              "one model)")
        return super().lane(continuous)


@dataclass
class EnsembleSource(MtpipeSource):
    """How the ensemble engine opens (its entry in :mod:`mtpipe.registry`, picked by ``decode.ensemble``): the first
    checkpoint as mtpipe's engine opens it, each further one as well (:func:`locate_member`), then
    :meth:`EnsembleEngine.open_models` on all of them."""

    members: list[Any] = field(default_factory=list, repr=False)  # the other models' ModelAndVocab, in order

    @classmethod
    def locate(cls, cfg: DecodeConfig, checkpoint: Path, tokens: Path | None, command: str) -> "EnsembleSource":
        first = MtpipeSource.locate(cfg, checkpoint, tokens, command)
        members = [locate_member(Path(p), tokens, first.loaded, command) for p in cfg.ensemble]
        return cls(cfg, first.checkpoint, first.sp, first.step, first.tokens, loaded=first.loaded, members=members)

    def open(self, lone_graph: bool = False) -> EnsembleEngine:
        return EnsembleEngine.open_models([self.loaded.model, *(m.model for m in self.members)], self.cfg)

    @property
    def upstream(self) -> dict[str, Path]:
        """The lineage a hypotheses manifest records: the models as checkpoint, checkpoint_2, ..."""
        return {"checkpoint": self.checkpoint,
                **{f"checkpoint_{i}": m.checkpoint for i, m in enumerate(self.members, start=2)},
                **({"tokens": self.tokens} if self.tokens is not None else {})}

    def facts(self, engine: Any) -> dict[str, Any]:
        return {**super().facts(engine), "ensemble_checkpoints": [str(m.checkpoint) for m in self.members]}


def locate_member(checkpoint: Path, tokens: Path | None, first: Any, command: str) -> Any:
    """A model of ``decode.ensemble`` (:class:`mtpipe.engine.loading.ModelAndVocab`), opened as the first
    (``first``) is and checked against it: an ensemble's models share one vocabulary, whose ids their distributions
    are averaged over (one line naming the checkpoint otherwise)."""
    from mtpipe.engine.loading import bare_sha, open_checkpoint

    member = open_checkpoint(checkpoint, tokens, command)
    mine, theirs = bare_sha(member.ck.vocab.get("spm_sha256")), bare_sha(first.ck.vocab.get("spm_sha256"))
    if mine != theirs:
        raise MtpipeError(f"{checkpoint}: trained with another vocabulary than {first.checkpoint} (SentencePiece "
                          f"sha256 {mine[:12]}... vs {theirs[:12]}...): an ensemble's models must share one")
    return member


__all__ = ["Ensemble", "EnsembleEngine", "EnsembleSource", "EnsembleState", "average_log_probs", "locate_member"]
