"""Exact resume of ``mtpipe train``: what a checkpoint's ``trainer.pt`` holds beyond the weights, which checkpoint a
run resumes from, and whether it may.

``trainer.pt`` (:data:`TRAINER_STATE_VERSION` 1) is plain tensors, numbers, lists and dicts, so that
``torch.load(weights_only=True)`` reads it without unpickling code: the :class:`TrainState` keys, ``optimizer``
(Adam's moments and step count, so section 5.3's schedule continues), ``scaler`` (fp16's grad scaler, else empty),
``rng`` (every rank's torch CPU/CUDA RNG state, so dropout continues), ``world_size``, ``accum``, ``seed`` and
``version``. With the same world size and accumulation a resumed run equals the uninterrupted one (bitwise on CPU),
and so do its checkpoints, byte for byte: the one wall-clock figure a resume needs, the training time so far
(``train.max_time`` counts it across invocations), is kept beside them in the run directory's ``clock.json``
(:func:`write_clock`), not in a checkpoint, whose hashes would otherwise differ on every rerun that changed nothing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mtpipe import artifacts, writing

from mtpipe.training import distributed
from mtpipe.config import MODEL_PRESETS, TrainConfig, to_dict, with_model_defaults
from mtpipe.console import warn
from mtpipe.training.distributed import rank0_only
from mtpipe.errors import MtpipeError
from mtpipe.training.metrics import Window

if TYPE_CHECKING:
    from mtpipe.training.batches import TrainData

TRAINER_STATE_VERSION = 1

# train.stop_metric -> (the valid/* curve it reads, whether higher is better)
STOP_METRICS = {"valid_ppl": ("valid/ppl", False), "valid_bleu": ("valid/bleu", True)}


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
                  world_size: int, accum: int, seed: int) -> dict[str, Any]:
    """``trainer.pt``'s content: everything an exact resume needs besides the weights."""
    return {
        "version": TRAINER_STATE_VERSION, **state.to_dict(),
        "world_size": world_size, "accum": accum,
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else {},
        "rng": rngs,
        "seed": seed,
    }


def restore(ck: artifacts.Checkpoint, optimizer: torch.optim.Optimizer, scaler: Any, *, accum: int, seed: int,
            device: torch.device) -> TrainState:
    """Load ``ck``'s optimizer, grad scaler and this rank's RNG state; return its :class:`TrainState`.

    Another world size or accumulation than the checkpoint's cannot continue its dropout streams (they were drawn
    per rank and micro-batch): each rank then gets a fresh one, and the run goes on, but not bitwise."""
    ts = ck.trainer_state
    assert ts is not None
    optimizer.load_state_dict(ts["optimizer"])
    if scaler is not None and ts.get("scaler"):
        scaler.load_state_dict(ts["scaler"])
    state = TrainState.from_dict(ts)
    seconds = read_clock(ck.path.parent.parent, state.step)
    if seconds is not None:
        state.train_seconds = seconds
    elif "train_seconds" not in ts:
        warn(f"{ck.path.parent.parent / CLOCK_FILE}: no training time recorded for step {state.step}: train.max_time "
             "counts from 0 again (the checkpoint was moved from its run directory?)")
    rank, world, rngs = distributed.rank(), distributed.world_size(), ts["rng"]
    if len(rngs) == world and ts.get("accum") == accum:
        set_rng_state(rngs[rank], device)
    else:
        before, now = len(rngs) * int(ts.get("accum") or 0), world * accum
        if before == now:
            batch = f"the same global batch ({now} batches per update, train.tokens_per_update)"
        elif len(rngs) != world and before % world:
            batch = f"{now} batches per update instead of {before} (not a multiple of {world} processes)"
        else:
            batch = f"{now} batches per update instead of {before} (train.tokens_per_update or the batches changed)"
        warn(f"resuming {ck.path.name} on {world} process(es) x {accum} accumulation (it was written by "
             f"{len(rngs)} x {ts.get('accum')}): {batch}, from batch {state.position:,} of epoch {state.epoch + 1}; "
             "each rank's dropout stream starts afresh, so the run is not bitwise the uninterrupted one")
        torch.manual_seed(seed_for_rank(seed + state.step, rank))
    return state


def same_global_batch(ck: artifacts.Checkpoint, data: TrainData, world: int, tokens_per_update: int) -> TrainData:
    """``data`` for a resume of ``ck`` on ``world`` processes: another world size than the checkpoint's keeps its
    global batch, ``world * accum`` = the checkpoint's batches per update, by more (or less) accumulation
    (8 processes x 1 -> 4 x 2), so that every update takes the same batches of the epoch's order as the
    uninterrupted run would (rounded up to a multiple of ``world`` when it is not one: 8 -> 3 processes take 9).
    ``train.tokens_per_update`` alone could give another count (4096 tokens of 4096-token batches: 8 batches on 8
    processes but 4 on 4), so it is followed only when it (or the bucket's ``max_tokens``) changed since the
    checkpoint: then the new global batch is what was asked for. :func:`restore` warns about either."""
    import dataclasses
    import math

    from mtpipe.training.batches import accumulation

    ts = ck.trainer_state or {}
    ck_world, ck_accum = int(ts.get("world_size") or 0), int(ts.get("accum") or 0)
    if ck_world in (0, world) or ck_accum < 1:
        return data
    if accumulation(tokens_per_update, ck_world, data.max_tokens) != ck_accum:
        return data  # another global batch was asked for
    accum = math.ceil(ck_world * ck_accum / world)
    per_update = world * accum
    usable = len(data.train) // per_update * per_update
    if usable == 0:
        return data
    return dataclasses.replace(data, accum=accum, per_update=per_update, usable=usable)


@rank0_only
def write(out: Path, model: torch.nn.Module, model_config: dict[str, Any], vocab: dict[str, Any],
          trainer_state: dict[str, Any], cfg: TrainConfig, upstream: dict[str, Path], extra: dict[str, Any],
          spm: tuple[Path | None, Path | None] = (None, None), seconds: float = 0.0) -> None:
    """Write checkpoint ``out/checkpoints/step_{step:08d}`` (:func:`mtpipe.writing.write_checkpoint`: atomic, so a
    kill leaves the previous ones intact; ``spm``: the SentencePiece model and its vocab listing it carries), its
    training time so far (``seconds``) in ``out/clock.json`` first, record the best one in ``out/best.json``, and
    remove all but the last ``train.keep_last`` and the best (:func:`prunable`)."""
    step = int(trainer_state["step"])
    write_clock(out, {**read_clock_file(out), step: seconds})
    writing.write_checkpoint(
        artifacts.checkpoint_path(out, step), state_dict=model.state_dict(), model_config=model_config, vocab=vocab,
        step=step, trainer_state=trainer_state, params={"model": model_config, "train": to_dict(cfg)},
        upstream=upstream, extra=extra, spm=spm[0], spm_vocab=spm[1],
    )
    best = Best.from_dict(dict(trainer_state.get("best") or {}))
    if best.step >= 0:
        write_best(out, best)
    pruned = prunable(list_checkpoints(out), cfg.keep_last, protect={best.step})
    for _, old in pruned:
        shutil.rmtree(old, ignore_errors=True)
    if pruned:
        kept = {s for s, _ in list_checkpoints(out)}
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


# --------------------------------------------------------------------------------------------------------------------
# RNG streams
# --------------------------------------------------------------------------------------------------------------------


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's torch RNG states (CPU, and the device's on CUDA): dropout's (and LayerDrop's) draws."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_for_rank(seed: int, rank: int) -> int:
    """A distinct dropout stream per rank, derived from the seed (same masks on every rank would be correlated)."""
    return int(np.random.SeedSequence([seed, rank, 0x6D74]).generate_state(1, np.uint64)[0] >> 1)


# --------------------------------------------------------------------------------------------------------------------
# Which checkpoint, and whether it may be resumed
# --------------------------------------------------------------------------------------------------------------------


# Train keys whose change makes a resumed run differ from the run a fresh start with the new params would give.
# The others (when to stop, save, validate, log; threads, restarts) may change between invocations freely.
TRAJECTORY_KEYS = ("seed", "tokens_per_update", "lr_scale", "warmup", "adam_beta1", "adam_beta2", "adam_eps",
                   "clip_norm", "label_smoothing", "precision", "drophead_start", "drophead_end")


def changed_trajectory_keys(ck: artifacts.Checkpoint, cfg: TrainConfig) -> list[str]:
    """The :data:`TRAJECTORY_KEYS` whose value in ``cfg`` differs from the one the checkpoint was trained with."""
    before = (ck.manifest.params or {}).get("train") or {}
    now = to_dict(cfg)
    return [k for k in TRAJECTORY_KEYS if k in before and before[k] != now[k]]


def model_difference(before: dict[str, Any], now: dict[str, Any], given: dict[str, Any] | None = None) -> str | None:
    """How the model config ``now`` differs from a checkpoint's ``before`` (both resolved: preset values filled in,
    d_k/d_v derived), as the user would fix it; None when they are the same model.

    ``given``: the model keys the params and flags set (the unresolved section's non-null values). Those that differ
    are named first, as the keys to restore (``model.d_model=128 but the params give 256``); what they change in turn
    (d_k and d_v follow d_model / heads, a preset fills the keys left null) comes after, as their consequence.
    Without a given key among the differences (a key left null now takes the preset's or the derived value), the
    first differing key is named with where its new value comes from; ``given`` None (not known): the first
    differing key, derived ones last."""
    before, now = with_model_defaults(before), with_model_defaults(now)
    derived = ("d_k", "d_v")  # d_model / heads unless set
    differ = sorted((k for k in set(before) | set(now) if before.get(k) != now.get(k)),
                    key=lambda k: (k in derived, k))
    if not differ:
        return None
    known = given is not None
    given = {k: v for k, v in (given or {}).items() if v is not None}
    named = [k for k in differ if k in given] or differ[:1]
    text = (f"checkpoint has {' and '.join(f'model.{k}={before.get(k)!r}' for k in named)} but the params give "
            + (f"{now.get(named[0])!r}" if len(named) == 1
               else " and ".join(f"model.{k}={now.get(k)!r}" for k in named)))
    if known and named[0] not in given:  # a key left null: its value now comes from the preset or d_model / heads
        k, preset = named[0], now.get("preset")
        origin = ("d_model / heads" if k in derived else f"the {preset} preset's value"
                  if k in MODEL_PRESETS.get(preset, {}) else "the default")
        text += f" ({origin}: model.{k} is not set)"
    follows = [k for k in differ if k not in named and k not in given]
    if follows:
        text += (", which makes " + ", ".join(f"model.{k} {before.get(k)!r} -> {now.get(k)!r}" for k in follows))
    return text


def check_resumable(ck: artifacts.Checkpoint, model_config: dict[str, Any], vocab: dict[str, Any],
                    given: dict[str, Any] | None = None) -> None:
    """Refuse a checkpoint of another vocabulary or model shape, naming what differs: the model keys the params set
    (``given``, :func:`model_difference`), not the values derived from them."""
    if ck.vocab.get("spm_sha256") != vocab["spm_sha256"] or int(ck.vocab.get("size", -1)) != vocab["size"]:
        raise MtpipeError(
            f"{ck.path}: checkpoint was trained with another vocabulary (spm {str(ck.vocab.get('spm_sha256'))[:19]}, "
            f"size {ck.vocab.get('size')}) than --tokens gives (spm {vocab['spm_sha256'][:19]}, size {vocab['size']}); "
            f"use the bpe artifact it was trained on, train into another --out, or move {ck.path.parent} aside "
            "(mtpipe never deletes checkpoints)"
        )
    difference = model_difference(ck.model_config, model_config, given)
    if difference is not None:
        raise MtpipeError(
            f"{ck.path}: {difference}; a new model needs a fresh run: restore the model params, train into another "
            f"--out, or move {ck.path.parent} aside (mtpipe never deletes checkpoints)"
        )
    ts = ck.trainer_state
    if not isinstance(ts, dict) or ts.get("version") != TRAINER_STATE_VERSION:
        raise MtpipeError(f"{ck.path}: trainer.pt is not a resumable mtpipe trainer state (version "
                          f"{ts.get('version') if isinstance(ts, dict) else None}, expected {TRAINER_STATE_VERSION})")


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """``(step, dir)`` of the training checkpoints under ``out/checkpoints``, by step
    (:func:`mtpipe.artifacts.list_checkpoints`, the rule averaging uses too)."""
    return artifacts.list_checkpoints(out)


@rank0_only
def _latest_checkpoint(out: Path) -> str | None:
    ck_dir = out / "checkpoints"
    if ck_dir.is_dir():
        for d in ck_dir.iterdir():  # leftovers of a checkpoint write that was killed (see ArtifactWriter)
            if d.name.startswith(".step_") and (".tmp-" in d.name or ".old-" in d.name):
                shutil.rmtree(d, ignore_errors=True)
    found = list_checkpoints(out)
    return str(found[-1][1]) if found else None


def find_resume(out: Path, cfg: TrainConfig, model_config: dict[str, Any], vocab: dict[str, Any],
                device: torch.device, given: dict[str, Any] | None = None) -> artifacts.Checkpoint | None:
    """The checkpoint this run continues from, loaded with its trainer state, or None for a fresh start; ``given``:
    the model keys the params set (:func:`check_resumable`).

    Rank 0 picks the latest complete checkpoint (and removes half-written ones a kill left behind); every rank loads
    that one (the output directory must be shared between nodes)."""
    latest = distributed.broadcast_object(_latest_checkpoint(out))
    if latest is None:
        return None
    path = Path(latest)
    if not path.exists():
        raise MtpipeError(f"{path}: rank {distributed.rank()} cannot see rank 0's checkpoint: --out must be on a "
                          "filesystem shared by every node")
    ck = artifacts.load_checkpoint(path, trainer_state=True, device=str(device))
    check_resumable(ck, model_config, vocab, given)
    changed = changed_trajectory_keys(ck, cfg)
    if changed:
        before = ck.manifest.params["train"]
        warn(f"resuming {ck.path} with changed "
             + ", ".join(f"train.{k} ({before[k]!r} -> {getattr(cfg, k)!r})" for k in changed)
             + ": training continues from its step with the new values, which is not the run a fresh start "
             f"would give; for that, train into another --out or move {ck.path.parent} aside")
    return ck
