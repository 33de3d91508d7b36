"""The decoding engines, one entry each: the one place that names them and says what each one refuses, can do, and
how it opens.

An entry (:class:`EngineEntry`) declares an engine's name (a value of ``decode.engine``, or, for the ensemble engine,
the ``decode`` key whose models it decodes together), its config check (the ``decode`` settings it refuses, run
whenever a ``decode`` section is built: :meth:`mtpipe.config.DecodeConfig.check`), what it can do besides
translating a file (a server's continuous batching, sampling) and how it opens: the dotted path of its
:class:`mtpipe.engine.protocol.ModelSource`, which locates a model and its vocabulary, checks them, and opens the
engine on them. Only :mod:`mtpipe.engine.opening` imports that path, when a command opens a model, so that this
module, which the settings read, stays in the foundation layer below the engine.

Adding an engine: write its module under ``mtpipe/engine/`` (its :class:`~mtpipe.engine.protocol.Engine` and the
``ModelSource`` that opens it) and add its entry to :data:`ENGINES`. ``decode.engine``'s choices, the settings'
checks, and the opening of every command that translates (``mtpipe decode``, ``mtpipe serve`` and their decoding
processes) follow from the entry. Light (no torch): the CLI reads it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mtpipe.errors import MtpipeError

# The decode key that picks an entry when it is its ``name`` (the others are picked by a key of their own being set).
BY_ENGINE = "engine"


def check_ctranslate2(cfg: Any) -> None:
    """What CTranslate2 leaves to mtpipe's engine: the precision (it has ``decode.ct2_compute_type``), pruning on the
    fly, and mtpipe's compiled step (it runs its own compiled code)."""
    if cfg.precision != "fp32":
        raise MtpipeError(f"decode.precision: {cfg.precision} applies to engine mtpipe; with engine ctranslate2 set "
                          "decode.ct2_compute_type (e.g. bfloat16, int8)")
    if cfg.prune:
        raise MtpipeError("decode.prune: not available with engine ctranslate2; write a pruned checkpoint with "
                          "`mtpipe average --prune` and decode (or export) that")
    if cfg.compile != "off":
        raise MtpipeError("decode.compile: applies to engine mtpipe (CTranslate2 runs its own compiled code)")


def check_ensemble(cfg: Any) -> None:
    """An ensemble: a list of checkpoint paths, decoded by mtpipe's eager step, unpruned."""
    if not all(isinstance(p, str) and p for p in cfg.ensemble):
        raise MtpipeError(f"decode.ensemble: {cfg.ensemble!r} is not a list of checkpoint paths")
    for key, value, only in (("engine", cfg.engine, "mtpipe"), ("compile", cfg.compile, "off"),
                             ("prune", cfg.prune, "")):
        if value != only:
            raise MtpipeError(f"decode.ensemble: an ensemble is decoded by engine mtpipe's eager step, unpruned: "
                              f"not with decode.{key} = {value!r}")


@dataclass(frozen=True)
class EngineEntry:
    """One engine: see the module docstring."""

    name: str
    # "module:Class": its mtpipe.engine.protocol.ModelSource, imported by mtpipe.engine.opening alone
    opens: str
    # the decode section (mtpipe.config.DecodeConfig) -> an MtpipeError for a setting this engine refuses
    check: Callable[[Any], None] | None = None
    continuous: bool = False  # serve.batching=continuous: requests join the running batch between decoder steps
    samples: bool = False  # decode.sampling_topk != 0
    # the decode key that picks it: BY_ENGINE (decode.engine = name), or a key of its own, picking it when set
    picked_by: str = BY_ENGINE


ENGINES: dict[str, EngineEntry] = {e.name: e for e in (
    EngineEntry("mtpipe", "mtpipe.engine.translate:MtpipeSource", continuous=True, samples=True),
    EngineEntry("ctranslate2", "mtpipe.engine.ct2:Ct2Source", check=check_ctranslate2),
    EngineEntry("ensemble", "mtpipe.engine.ensemble:EnsembleSource", check=check_ensemble, samples=True,
                picked_by="ensemble"),
)}

# decode.engine's values: the engines it picks by name (mtpipe.config.DecodeConfig.engine's choices).
ENGINE_NAMES: tuple[str, ...] = tuple(name for name, e in ENGINES.items() if e.picked_by == BY_ENGINE)


def named(cfg: Any) -> EngineEntry:
    """The engine ``decode.engine`` names (the decode section ``cfg``)."""
    try:
        return ENGINES[cfg.engine]
    except KeyError:
        raise MtpipeError(f"decode.engine = {cfg.engine!r} is not one of {', '.join(ENGINE_NAMES)}") from None


def chosen(cfg: Any) -> EngineEntry:
    """The engine that decodes under the decode section ``cfg``: one picked by a key of its own that is set (the
    ensemble engine: ``decode.ensemble`` lists more models), else the one ``decode.engine`` names."""
    picked = [e for e in ENGINES.values() if e.picked_by != BY_ENGINE and getattr(cfg, e.picked_by)]
    return picked[0] if picked else named(cfg)


def check(cfg: Any) -> None:
    """The engines' rules on the decode section ``cfg``: the check of the engine ``decode.engine`` names, then of
    the engine that decodes when another is picked (an ensemble of that engine's models), and sampling only by an
    engine that samples."""
    for entry in dict.fromkeys((named(cfg), chosen(cfg))):
        if entry.check is not None:
            entry.check(cfg)
    if cfg.sampling_topk != 0 and not chosen(cfg).samples:
        able = " or ".join(n for n in ENGINE_NAMES if ENGINES[n].samples)
        raise MtpipeError(f"decode.sampling_topk: sampling is engine {able}'s; engine {cfg.engine} searches")


def check_batching(cfg: Any, batching: str) -> None:
    """``serve.batching`` against the engine ``decode.engine`` (the decode section ``cfg``) names: continuous
    batching needs an engine that takes requests between decoder steps."""
    if batching == "continuous" and not named(cfg).continuous:
        able = " or ".join(n for n in ENGINE_NAMES if ENGINES[n].continuous)
        raise MtpipeError(f"serve.batching=continuous needs decode.engine={able} ({cfg.engine} decodes batch by "
                          "batch)")


__all__ = ["BY_ENGINE", "ENGINES", "ENGINE_NAMES", "EngineEntry", "check", "check_batching", "check_ctranslate2",
           "check_ensemble", "chosen", "named"]
