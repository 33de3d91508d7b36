"""A checkpoint as a model, with its SentencePiece model: what ``decode``, ``export``, ``serve`` and ``attention``
load, each through :func:`open_checkpoint` (``decode`` and ``serve`` by their engine's
:class:`~mtpipe.engine.protocol.ModelSource`, :mod:`mtpipe.engine.opening`; ``export`` and CTranslate2's conversion by
:func:`mtpipe.engine.ct2_convert.load_source`).

A checkpoint records the vocabulary it was trained with (``vocab``: the sha256 of the SentencePiece model and its
size); decoding or exporting it with another SentencePiece model would map ids to the wrong pieces without any error,
so both are checked here, once, each failure one :class:`~mtpipe.errors.MtpipeError` line.

Which SentencePiece model (:func:`vocab_source`): that of ``--tokens`` when it is given; else the copy the checkpoint
carries (format 2, :func:`mtpipe.artifacts.checkpoint_spm`), so that a checkpoint decodes outside its project; else,
for a checkpoint without one, the project's bpe artifact (``artifacts/bpe``) when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpipe import artifacts
from mtpipe.artifacts import bare_sha
from mtpipe.errors import MtpipeError

SPM_MODEL = "spm.model"  # the SentencePiece model's name in a bpe artifact and in an export


@dataclass
class ModelAndVocab:
    """A checkpoint rebuilt as a model (eval mode), with the SentencePiece model it was trained with."""

    checkpoint: Path
    ck: artifacts.Checkpoint
    model: Any  # mtpipe.model.transformer.Transformer
    sp: Any  # sentencepiece.SentencePieceProcessor
    spm_path: Path
    tokens: Path | None = None  # the bpe artifact the SentencePiece model came from; None: the checkpoint's own


def artifact_spm(directory: Path, manifest: artifacts.Manifest) -> tuple[Path, str]:
    """``(path, bare sha256)`` of the ``spm.model`` an artifact (a bpe artifact, or an export) lists, its hash
    verified."""
    return artifacts.verify_file(directory, SPM_MODEL, manifest), bare_sha(manifest.files[SPM_MODEL])


def load_vocab(checkpoint: Path, vocab: dict[str, Any], spm_path: Path, spm_sha: str) -> Any:
    """The SentencePiece model at ``spm_path`` (sha256 ``spm_sha``), after checking that it is the one the checkpoint
    (its ``vocab`` record) was trained with: the same hash and the same number of pieces."""
    import sentencepiece as spm

    got = bare_sha(vocab.get("spm_sha256"))
    if got != spm_sha:
        raise MtpipeError(f"{checkpoint}: trained with another SentencePiece model than {spm_path} "
                          f"(checkpoint vocab sha256 {got[:12]}..., spm.model {spm_sha[:12]}...)")
    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    if int(vocab.get("size", -1)) != sp.get_piece_size():
        raise MtpipeError(f"{checkpoint}: vocabulary size {vocab.get('size')} does not match {spm_path} "
                          f"({sp.get_piece_size()} pieces)")
    return sp


def build_checkpoint_model(ck: artifacts.Checkpoint) -> Any:
    """The checkpoint's Transformer with its weights, in eval mode."""
    from mtpipe.model.transformer import build_model

    try:
        model = build_model(ck.model_config, int(ck.vocab["size"]))
        model.load_state_dict(ck.state_dict)
    except (TypeError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MtpipeError(f"{ck.path}: weights do not fit the checkpoint's model config ({first})") from None
    return model.eval()


def vocab_source(checkpoint: Path, own_spm: Path | None, tokens: Path | None) -> tuple[Path, str, Path | None]:
    """``(spm.model, its bare sha256, the bpe artifact it is from or None)`` for a checkpoint (or an export) whose
    own SentencePiece model is ``own_spm`` (None: it carries none), as the module docstring orders them."""
    from mtpipe.params import PATHS

    if tokens is None:
        if own_spm is not None:
            return own_spm, bare_sha(artifacts.file_hash(own_spm)), None
        if Path(PATHS["bpe"]).is_dir():
            tokens = Path(PATHS["bpe"])
        else:
            raise MtpipeError(f"{checkpoint}: carries no SentencePiece model (written before checkpoints carried "
                              "one) and no --tokens was given: pass --tokens, the bpe artifact it was trained with")
    tokens = Path(tokens)
    spm_path, spm_sha = artifact_spm(tokens, artifacts.read_manifest(tokens, "tokens"))
    return spm_path, spm_sha, tokens


def refuse_export(checkpoint: Path, command: str) -> None:
    """An ``mtpipe export`` directory is CTranslate2's model, not mtpipe's: one line saying how to use it."""
    if (checkpoint / artifacts.MANIFEST).is_file() and artifacts.read_manifest(checkpoint).kind == "export":
        raise MtpipeError(f"{checkpoint}: is an `mtpipe export` model; {command} it with --engine ctranslate2 (or "
                          "give the checkpoint it was exported from)")


def open_checkpoint(checkpoint: Path, tokens: Path | None = None, command: str | None = None) -> ModelAndVocab:
    """The one way a command opens a checkpoint's model: ``checkpoint`` (an mtpipe checkpoint artifact) and its
    SentencePiece model (:func:`load_model_and_vocab`). ``command``: a command that also decodes exports with
    another engine (decode, serve), named in the one line that refuses an export; None: an export fails as any
    artifact that is not a checkpoint does."""
    checkpoint = Path(checkpoint)
    if command is not None:
        refuse_export(checkpoint, command)
    return load_model_and_vocab(checkpoint, tokens)


def load_model_and_vocab(checkpoint: Path, tokens: Path | None = None) -> ModelAndVocab:
    """Load ``checkpoint`` (an mtpipe checkpoint artifact, nothing else) and its SentencePiece model (that of the bpe
    artifact ``tokens``, else its own: :func:`vocab_source`), check that they belong together, and rebuild the
    model."""
    checkpoint = Path(checkpoint)
    ck = artifacts.load_checkpoint(checkpoint)
    spm_path, spm_sha, tokens = vocab_source(checkpoint, ck.spm, tokens)
    sp = load_vocab(checkpoint, ck.vocab, spm_path, spm_sha)
    return ModelAndVocab(checkpoint, ck, build_checkpoint_model(ck), sp, spm_path, tokens)


__all__ = ["ModelAndVocab", "SPM_MODEL", "artifact_spm", "bare_sha", "build_checkpoint_model", "load_model_and_vocab",
           "load_vocab", "open_checkpoint", "refuse_export", "vocab_source"]
