"""Exact resume of ``mtpipe train``: which checkpoint a run resumes from, whether it may, and the trainer state it
continues (:mod:`mtpipe.training.state`).

The same command on the same ``OUT`` continues from the latest checkpoint; with the same world size and
accumulation the run equals the uninterrupted one (bitwise on CPU), and so do its checkpoints, byte for byte.
Another world size keeps the global batch (:func:`same_global_batch`) but not the dropout streams (:func:`restore`).
A checkpoint of another vocabulary or model shape is refused, naming the key the user changed
(:func:`check_resumable`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mtpipe import artifacts
from mtpipe.config import MODEL_PRESETS, TrainConfig, to_dict, with_model_defaults
from mtpipe.console import warn
from mtpipe.errors import MtpipeError
from mtpipe.training import distributed
from mtpipe.training.checkpoints import CLOCK_FILE, latest_checkpoint, read_clock
from mtpipe.training.state import TRAINER_STATE_VERSION, TrainState, seed_for_rank, set_rng_state

if TYPE_CHECKING:
    from mtpipe.training.batches import TrainData


def restore(ck: artifacts.Checkpoint, optimizer: torch.optim.Optimizer, scaler: Any, *, accum: int, seed: int,
            device: torch.device, per_update: int | None = None) -> TrainState:
    """Load ``ck``'s optimizer, grad scaler and this rank's RNG state; return its :class:`TrainState`.

    Another world size, accumulation or batches per update than the checkpoint's cannot continue its dropout streams
    (they were drawn per rank and micro-batch): each rank then gets a fresh one, and the run goes on, but not
    bitwise. ``per_update``: this run's batches per update (default ``world_size * accum``)."""
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
    before = int(ts.get("batches_per_update") or len(rngs) * int(ts.get("accum") or 0))
    now = per_update if per_update is not None else world * accum
    if len(rngs) == world and ts.get("accum") == accum and before == now:
        set_rng_state(rngs[rank], device)
    else:
        if before == now:
            batch = f"the same global batch ({now} batches per update, train.tokens_per_update)"
        else:
            batch = f"{now} batches per update instead of {before} (train.tokens_per_update or the batches changed)"
        warn(f"resuming {ck.path.name} on {world} process(es) x {accum} accumulation (it was written by "
             f"{len(rngs)} x {ts.get('accum')}): {batch}, from batch {state.position:,} of epoch {state.epoch + 1}; "
             "each rank's dropout stream starts afresh, so the run is not bitwise the uninterrupted one")
        torch.manual_seed(seed_for_rank(seed + state.step, rank))
    return state


def same_global_batch(ck: artifacts.Checkpoint, data: TrainData, world: int, tokens_per_update: int) -> TrainData:
    """``data`` for a resume of ``ck`` on ``world`` processes: another world size than the checkpoint's keeps its
    global batch, the checkpoint's batches per update, by more (or less) accumulation (8 processes x 1 -> 4 x 2) or,
    when ``world`` does not divide them, by sharing their sentences (8 batches on 3 or 16 processes:
    :func:`~mtpipe.training.batches.layout_for`), so that every update takes the same batches of the epoch's order
    as the uninterrupted run would. The params could give another count (within 10 %; or, for a checkpoint of an
    older mtpipe, whose count grew with the world size, even on the same world size), so they are followed only when
    ``train.tokens_per_update`` (or the bucket's ``max_tokens``) changed since the checkpoint: then the new global
    batch is what was asked for.
    :func:`restore` warns about either."""
    from mtpipe.training.batches import accumulation, layout_for, update_layout

    ts = ck.trainer_state or {}
    ck_world, ck_accum = int(ts.get("world_size") or 0), int(ts.get("accum") or 0)
    if ck_world < 1 or ck_accum < 1:
        return data
    if "batches_per_update" in ts:
        ck_per = int(ts["batches_per_update"])
        asked = update_layout(tokens_per_update, ck_world, data.max_tokens).per_update
    else:  # written by an older mtpipe: whole batches, its count of them
        ck_per = ck_world * ck_accum
        asked = ck_world * accumulation(tokens_per_update, ck_world, data.max_tokens)
    if asked != ck_per or (ck_world == world and ck_per == data.per_update) or len(data.train) < ck_per:
        return data  # another global batch was asked for, or the params' is the checkpoint's
    return data.with_layout(layout_for(ck_per, world), world, ck.path)


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


def find_resume(out: Path, cfg: TrainConfig, model_config: dict[str, Any], vocab: dict[str, Any],
                device: torch.device, given: dict[str, Any] | None = None) -> artifacts.Checkpoint | None:
    """The checkpoint this run continues from, loaded with its trainer state, or None for a fresh start; ``given``:
    the model keys the params set (:func:`check_resumable`).

    Rank 0 picks the latest complete checkpoint (and removes half-written ones a kill left behind); every rank loads
    that one (the output directory must be shared between nodes)."""
    latest = distributed.broadcast_object(latest_checkpoint(out))
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


def batches_changed(ck: artifacts.Checkpoint, batches_id: str, batches: Path) -> bool:
    """Whether the train batches differ from those ``ck`` was trained on: by their identity
    (:attr:`mtpipe.training.batches.TrainData.batches_id`) where the checkpoint records it, else (a checkpoint of
    an older mtpipe) by the bucket artifact's manifest."""
    recorded = ck.meta.train_batches
    if recorded:
        return recorded != batches_id
    return ck.manifest.upstream.get("batches") not in (None, artifacts.manifest_hash(batches))
