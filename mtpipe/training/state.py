"""What a checkpoint's ``trainer.pt`` holds beyond the weights, and the RNG streams it continues.

``trainer.pt`` (:data:`TRAINER_STATE_VERSION` 1) is plain tensors, numbers, lists and dicts, so that
``torch.load(weights_only=True)`` reads it without unpickling code: the :class:`TrainState` keys, ``optimizer``
(Adam's moments and step count, so section 5.3's schedule continues), ``scaler`` (fp16's grad scaler, else empty),
``rng`` (every rank's torch CPU/CUDA RNG state, so dropout continues), ``world_size``, ``accum``,
``batches_per_update``, ``seed`` and ``version`` (:func:`trainer_state`). With the same world size and batches per
update a resumed run equals the uninterrupted one (bitwise on CPU; :mod:`mtpipe.training.resume`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mtpipe.artifacts import STOP_METRICS
from mtpipe.training.metrics import Window

TRAINER_STATE_VERSION = 1


def improves(metric: str, value: float, best: float | None) -> bool:
    """Whether ``value`` of ``train.stop_metric`` beats ``best`` (``None``: nothing measured yet); strictly, so a
    plateau counts against the patience."""
    higher = STOP_METRICS[metric][1]
    return best is None or (value > best if higher else value < best)


@dataclass
class Best:
    """Early stopping's record (part of ``trainer.pt``, so a resume in the middle of a patience count continues it):
    the best scheduled validation of ``train.stop_metric`` so far, its step (whose checkpoint is never pruned), and
    the validations since then that did not improve on it."""

    metric: str = ""  # the train.stop_metric the record is about ("": none yet)
    value: float | None = None
    step: int = -1
    bad: int = 0  # validations in a row without improvement

    def update(self, metric: str, value: float, step: int) -> bool:
        """Book one validation; True when it improved on the best (it is the new best). A record about another
        metric (train.stop_metric changed between invocations) starts over."""
        if metric != self.metric:
            self.metric, self.value, self.step, self.bad = metric, None, -1, 0
        if improves(metric, value, self.value):
            self.value, self.step, self.bad = float(value), step, 0
            return True
        self.bad += 1
        return False

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value, "step": self.step, "bad": self.bad}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Best:
        value = d.get("value")
        return cls(metric=str(d.get("metric", "")), value=None if value is None else float(value),
                   step=int(d.get("step", -1)), bad=int(d.get("bad", 0)))


@dataclass
class TrainState:
    """Where training stands: the part of ``trainer.pt`` that the trainer itself advances, update by update."""

    step: int = 0  # updates applied (skipped and fp16-overflowed ones not counted): the schedule's step (5.3)
    epoch: int = 0  # epochs completed
    position: int = 0  # batches of this epoch's order consumed (all ranks together)
    bad_steps: int = 0  # updates skipped in a row for a non-finite loss or gradient norm
    overflows: int = 0  # fp16 updates the grad scaler skipped (it lowered its scale, as designed)
    train_seconds: float = 0.0  # training time of every invocation so far (train.max_time counts it; clock.json)
    tgt_seen: int = 0  # real target tokens of the applied updates
    src_seen: int = 0
    window: Window = field(default_factory=Window)  # sums since the last logged point: that point resumes exact
    last_valid_step: int = -1  # the step of the last validation (-1: none yet)
    last_valid: dict[str, float] = field(default_factory=dict)  # its valid/* values
    last_bleu_step: int = -1  # the step of the last validation BLEU (-1: none yet)
    last_bleu: float | None = None  # its valid/bleu
    best: Best = field(default_factory=lambda: Best())  # early stopping: the best validation so far

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers and dicts, under the keys every version-1 ``trainer.pt`` has (``train_seconds`` aside: wall
        time, kept in the run directory's ``clock.json``)."""
        return {
            "step": self.step, "epoch": self.epoch, "position": self.position,
            "bad_steps": self.bad_steps, "overflows": self.overflows,
            "tgt_seen": self.tgt_seen, "src_seen": self.src_seen,
            "window": self.window.to_dict(),
            "last_valid_step": self.last_valid_step, "last_valid": dict(self.last_valid),
            "last_bleu_step": self.last_bleu_step, "last_bleu": self.last_bleu, "best": self.best.to_dict(),
        }

    @classmethod
    def from_dict(cls, ts: dict[str, Any]) -> TrainState:
        """The state of a loaded ``trainer.pt`` (its other keys are ignored here)."""
        return cls(
            step=int(ts["step"]), epoch=int(ts["epoch"]), position=int(ts["position"]),
            bad_steps=int(ts["bad_steps"]), overflows=int(ts["overflows"]),
            # Checkpoints written before clock.json carry their training time here.
            train_seconds=float(ts.get("train_seconds", 0.0)), tgt_seen=int(ts["tgt_seen"]),
            src_seen=int(ts["src_seen"]),
            window=Window.from_dict(dict(ts["window"])),
            last_valid_step=int(ts["last_valid_step"]), last_valid=dict(ts["last_valid"]),
            # Checkpoints written before validation BLEU and early stopping existed lack these keys.
            last_bleu_step=int(ts.get("last_bleu_step", -1)),
            last_bleu=None if ts.get("last_bleu") is None else float(ts["last_bleu"]),
            best=Best.from_dict(dict(ts.get("best") or {})),
        )


def trainer_state(state: TrainState, optimizer: torch.optim.Optimizer, scaler: Any, rngs: list[dict[str, Any]],
                  world_size: int, accum: int, seed: int, per_update: int | None = None) -> dict[str, Any]:
    """``trainer.pt``'s content: everything an exact resume needs besides the weights (``per_update``: the batches
    per update, ``world_size * accum`` unless the processes shared them)."""
    return {
        "version": TRAINER_STATE_VERSION, **state.to_dict(),
        "world_size": world_size, "accum": accum,
        "batches_per_update": per_update if per_update is not None else world_size * accum,
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "rng": rngs,
        "seed": seed,
    }


# --------------------------------------------------------------------------------------------------------------------
# RNG streams
# --------------------------------------------------------------------------------------------------------------------


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's torch RNG states (CPU, and the device's on CUDA): dropout's (and LayerDrop's) draws."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Put back what :func:`rng_state` took."""
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_for_rank(seed: int, rank: int) -> int:
    """A distinct dropout stream per rank, derived from the seed (same masks on every rank would be correlated)."""
    return int(np.random.SeedSequence([seed, rank, 0x6D74]).generate_state(1, np.uint64)[0] >> 1)
