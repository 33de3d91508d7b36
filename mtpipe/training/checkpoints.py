"""Training's checkpoints: written by rank 0 alone, kept (the last ``train.keep_last`` and the best), and the files
beside them in the run directory.

``OUT/checkpoints/step_{step:08d}`` (:func:`mtpipe.writing.write_checkpoint`: atomic, so that a kill leaves the
previous ones intact) holds the weights, ``trainer.pt`` (:mod:`mtpipe.training.state`), the SentencePiece model
(so that it decodes without the bpe artifact) and, in its manifest, the validation at its step (``mtpipe average
--select best`` ranks by it). Beside them: ``clock.json`` (each checkpoint's training time so far: the one
wall-clock figure a resume needs, kept out of the checkpoints, whose hashes would otherwise differ on every rerun
that changed nothing) and ``best.json`` (the best checkpoint by ``train.stop_metric``).

Writing is a collective (:meth:`Checkpointer.save`: every rank contributes its RNG state); the files are rank 0's
side effects, behind :func:`mtpipe.training.distributed.rank0_only`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtpipe import artifacts, writing
from mtpipe.config import TrainConfig, to_dict
from mtpipe.console import warn
from mtpipe.errors import MtpipeError
from mtpipe.training import distributed
from mtpipe.training.distributed import rank0_only
from mtpipe.training.state import Best, TrainState, rng_state, trainer_state


@rank0_only
def write(out: Path, model: torch.nn.Module, meta: artifacts.CheckpointManifest, trainer_state: dict[str, Any],
          cfg: TrainConfig, upstream: dict[str, Path], spm: tuple[Path | None, Path | None] = (None, None),
          seconds: float = 0.0) -> None:
    """Write checkpoint ``out/checkpoints/step_{meta.step:08d}`` (:func:`mtpipe.writing.write_checkpoint`: atomic, so
    a kill leaves the previous ones intact; ``meta``: its manifest's fields; ``spm``: the SentencePiece model and its
    vocab listing it carries), its training time so far (``seconds``) in ``out/clock.json`` first, record the best
    one in ``out/best.json``, and remove all but the last ``train.keep_last`` and the best (:func:`prunable`)."""
    step = meta.step
    write_clock(out, {**read_clock_file(out), step: seconds})
    writing.write_checkpoint(
        artifacts.checkpoint_path(out, step), state_dict=model.state_dict(), meta=meta, trainer_state=trainer_state,
        params={"model": meta.model_config, "train": to_dict(cfg)}, upstream=upstream, spm=spm[0], spm_vocab=spm[1],
    )
    best = Best.from_dict(dict(trainer_state.get("best") or {}))
    if best.step >= 0:
        write_best(out, best)
    pruned = prunable(artifacts.list_checkpoints(out), cfg.keep_last, protect={best.step})
    for _, old in pruned:
        shutil.rmtree(old, ignore_errors=True)
    if pruned:
        kept = {s for s, _ in artifacts.list_checkpoints(out)}
        write_clock(out, {s: v for s, v in read_clock_file(out).items() if s in kept})

BEST_FILE = "best.json"  # in the run directory: the best checkpoint by train.stop_metric

CLOCK_FILE = "clock.json"  # in the run directory: each checkpoint's training time so far


def write_clock(out: Path, seconds: dict[int, float]) -> None:
    """``out/clock.json``: each checkpoint's training time so far, by step. :func:`write` records a checkpoint's
    before writing it (so that every checkpoint has its entry) and drops those of the checkpoints it prunes."""
    import json

    record = {str(s): round(float(v), 3) for s, v in sorted(seconds.items())}
    writing.atomic_write_text(out / CLOCK_FILE, json.dumps({"train_seconds": record}, indent=1) + "\n")


def read_clock_file(out: Path) -> dict[int, float]:
    """``out/clock.json``'s step -> training seconds ({} when absent; a damaged file is an error naming it)."""
    import json

    path = Path(out) / CLOCK_FILE
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))["train_seconds"]
        return {int(s): float(v) for s, v in record.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MtpipeError(f"{path}: not a training clock written by mtpipe train ({e}); move it aside to resume "
                          "with train.max_time counted from 0") from None


def read_clock(out: Path, step: int) -> float | None:
    """The training time recorded for checkpoint ``step`` in ``out/clock.json``, or None."""
    return read_clock_file(out).get(step)


def prunable(found: list[tuple[int, Path]], keep_last: int, protect: set[int]) -> list[tuple[int, Path]]:
    """The checkpoints (``found`` sorted by step) that ``train.keep_last`` lets go: all but the newest ``keep_last``,
    never one at a ``protect``ed step (the best checkpoint survives however many newer ones follow it)."""
    return [(s, d) for s, d in found[: max(len(found) - keep_last, 0)] if s not in protect]


def write_best(out: Path, best: Best) -> None:
    """``out/best.json``: which checkpoint is the best by ``train.stop_metric``, and the early-stopping count."""
    import json

    record = {"metric": best.metric, "value": best.value, "step": best.step,
              "checkpoint": str(artifacts.checkpoint_path(".", best.step)),
              "validations_without_improvement": best.bad}
    writing.atomic_write_text(out / BEST_FILE, json.dumps(record, indent=2) + "\n")


@rank0_only
def latest_checkpoint(out: Path) -> str | None:
    """The latest complete checkpoint under ``out`` (rank 0; the half-written ones a kill left behind are removed
    first), or None."""
    ck_dir = out / "checkpoints"
    if ck_dir.is_dir():
        for d in ck_dir.iterdir():  # leftovers of a checkpoint write that was killed (see ArtifactWriter)
            if d.name.startswith(".step_") and (".tmp-" in d.name or ".old-" in d.name):
                shutil.rmtree(d, ignore_errors=True)
    found = artifacts.list_checkpoints(out)
    return str(found[-1][1]) if found else None


def spm_files(tokens: Path, vocab: dict[str, Any]) -> tuple[Path | None, Path | None]:
    """(spm.model, spm.vocab) of the bpe artifact ``tokens``, which every checkpoint carries so that it decodes
    without the artifact; (None, None) when its spm.model is not the model its manifest's spm_sha256 names (the bpe
    stage never writes such an artifact)."""
    from mtpipe.engine.loading import SPM_MODEL

    m = artifacts.read_manifest(tokens, "tokens")
    spm = artifacts.verify_file(tokens, SPM_MODEL, m)
    if artifacts.bare_sha(m.files[SPM_MODEL]) != artifacts.bare_sha(vocab["spm_sha256"]):
        warn(f"{spm}: is not the SentencePiece model its manifest's spm_sha256 names; the checkpoints will not "
             "carry it (decode them with --tokens)")
        return None, None
    vocab_file = artifacts.CHECKPOINT_SPM_VOCAB
    return spm, artifacts.verify_file(tokens, vocab_file, m) if vocab_file in m.files else None


def valid_at_step(state: TrainState) -> dict[str, float]:
    """The validation metrics measured at the current step (``{}``: none), recorded in its checkpoint's manifest
    so that ``mtpipe average --select best`` can rank checkpoints."""
    out: dict[str, float] = {}
    if state.last_valid_step == state.step:
        out.update(state.last_valid)
    if state.last_bleu_step == state.step and state.last_bleu is not None:
        out["valid/bleu"] = state.last_bleu
    return out


@dataclass
class Checkpointer:
    """What every checkpoint of one run records besides the trainer state: where it goes, the model, its inputs and
    settings. ``spm``: :func:`spm_files` on rank 0 (the only rank that writes)."""

    out: Path
    model: torch.nn.Module
    model_config: dict[str, Any]
    cfg: TrainConfig
    tokens: Path
    batches: Path
    world: int
    precision: str
    device: torch.device
    decode: dict[str, Any]  # the decode settings each checkpoint records (RECORDED_DECODE)
    spm: tuple[Path | None, Path | None]
    batches_id: str = ""  # TrainData.batches_id: what a resume compares to tell whether the batches changed
    lineage: dict[str, Any] | None = None  # a fine-tune's parent (mtpipe.training.finetune), recorded in each one

    def save(self, state: TrainState, optimizer: torch.optim.Optimizer, scaler: Any, vocab: dict[str, Any],
             accum: int, rng: dict[str, Any] | None = None, per_update: int | None = None) -> None:
        """Checkpoint at the current step (a collective: every rank contributes its RNG state, ``rng`` or else the
        current one; rank 0 writes)."""
        rngs = distributed.all_gather_object(rng if rng is not None else rng_state(self.device))
        if distributed.is_rank0():
            ts = trainer_state(state, optimizer, scaler, rngs, self.world, accum, self.cfg.seed, per_update)
            meta = artifacts.CheckpointManifest(
                model_config=self.model_config, vocab=vocab, step=int(ts["step"]), epoch=state.epoch,
                world_size=self.world, precision=self.precision, valid=valid_at_step(state), decode=self.decode,
                train_batches=self.batches_id, finetuned_from=self.lineage)
            write(self.out, self.model, meta, ts, self.cfg, upstream={"tokens": self.tokens, "batches": self.batches},
                  spm=self.spm, seconds=state.train_seconds)
