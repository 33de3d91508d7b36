"""The batches of the coming updates, ready before the update needs them (:class:`UpdatePlan`).

Why: on a GPU an update's kernels run while Python prepares the next one; if the next batches were collated, padded
and pinned only when the update starts, the GPU would wait for numpy. So a background thread walks the same batch
order as the trainer's state (:func:`mtpipe.training.batches.epoch_order`, ``per_update`` batches an update from the
epoch's position on, rank r its share of them: :func:`~mtpipe.training.batches.rank_rows`) and hands
over whole updates whose micro-batches are already collated into :class:`TrainBatch` es in pinned memory; the
update copies them to the device with ``non_blocking`` copies. The walk depends on ``(train.seed, epoch, position)``
alone, never on what an update did, so the thread can run ahead and a resumed run walks on from its checkpoint's
position: the order (and exact resume) is the one the trainer had without the thread.

On a CPU the batches are collated in line (``prefetch=0``): the thread would take a core from the update's own
threads for work that is a small share of a CPU update.

The loss's real target positions (section 5.4's loss is over real tokens only) are found here, on the host, as flat
indices (:func:`loss_positions`): selecting them on the device with a boolean mask would make the GPU report how
many there are before the update can go on, a synchronisation in the middle of every micro-batch.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, NamedTuple

import numpy as np
import torch
from torch import Tensor

from mtpipe.artifacts import PAD_ID
from mtpipe.training.batches import TokenSplit, MappedSplit, TrainData, collate, epoch_order, rank_rows


class TrainBatch(NamedTuple):
    """One micro-batch as the update takes it: ``src [B, S]``, ``tgt_in [B, T]`` (:func:`collate`), and the loss's
    targets: ``pos [N]`` the flat indices into ``[B * T]`` of the real (non-pad) target positions, ``gold [N]`` the
    target ids there (``tgt_out`` at ``pos``)."""

    src: Tensor
    tgt_in: Tensor
    pos: Tensor
    gold: Tensor

    def to(self, device: torch.device) -> TrainBatch:
        """On ``device``: pinned host tensors are copied without blocking the host (CUDA); a no-op on CPU."""
        if device.type == "cpu":
            return self
        return TrainBatch(*(t.to(device, non_blocking=True) for t in self))

    def pinned(self) -> TrainBatch:
        return TrainBatch(*(t.pin_memory() for t in self))


def loss_positions(tgt_out: Tensor) -> tuple[Tensor, Tensor]:
    """``(pos, gold)``: the flat indices of ``tgt_out``'s non-pad entries (``[B, T]`` row-major) and their ids."""
    flat = tgt_out.reshape(-1)  # [B * T]
    pos = torch.from_numpy(np.flatnonzero(flat.numpy() != PAD_ID))  # [N] int64
    return pos, flat[pos]


def train_batch(split: TokenSplit | MappedSplit, rows: np.ndarray, start: int) -> TrainBatch:
    """The micro-batch of the sentences ``rows``, on the host."""
    src, tgt_in, tgt_out = collate(split, rows, start)
    return TrainBatch(src, tgt_in, *loss_positions(tgt_out))


class Planned(NamedTuple):
    """One update of the walk: where it starts, its real tokens (all ranks) and this rank's micro-batches."""

    epoch: int
    position: int
    tgt_tokens: int  # real target tokens of the update's batches, all ranks (the loss's divisor)
    src_tokens: int
    batches: list[tuple[int, TrainBatch]]  # (batch index, micro-batch) of this rank, in accumulation order


class UpdatePlan:
    """The updates from ``(epoch, position)`` on, for one rank; with ``prefetch > 0`` made by a background thread
    up to ``prefetch`` updates ahead (pinned when ``pin``). Iterate it; :meth:`close` (or ``with``) stops the
    thread."""

    def __init__(self, data: TrainData, seed: int, epoch: int, position: int, rank: int, world: int, start_id: int,
                 prefetch: int = 0, pin: bool = False):
        self.data, self.seed, self.rank, self.world, self.start_id, self.pin = data, seed, rank, world, start_id, pin
        self._walk = self._updates(epoch, position)
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        if prefetch > 0:
            self._queue = queue.Queue(maxsize=prefetch)
            self._thread = threading.Thread(target=self._produce, name="mtpipe-batches", daemon=True)
            self._thread.start()

    def _updates(self, epoch: int, position: int) -> Iterator[Planned]:
        d = self.data
        order = epoch_order(len(d.train), self.seed, epoch)
        while True:
            group = order[position : position + d.per_update]
            batches = []
            for b, rows in rank_rows(d, order, position, self.world, self.rank):
                tb = train_batch(d.train_tokens, rows, self.start_id)
                batches.append((b, tb.pinned() if self.pin else tb))
            yield Planned(epoch, position, int(d.train.tgt_tokens[group].sum()), int(d.train.src_tokens[group].sum()),
                          batches)
            position += d.per_update  # the trainer's own walk (Trainer._account): the next epoch when too few remain
            if position + d.per_update > d.usable:
                epoch, position = epoch + 1, 0
                order = epoch_order(len(d.train), self.seed, epoch)

    def _produce(self) -> None:
        try:
            for item in self._walk:
                if not self._put(item):
                    return
        except BaseException as e:  # handed to the consumer, which raises it where the update would have used it
            self._put(e)

    def _put(self, item: object) -> bool:
        """Queue ``item`` once there is room; False when the plan was closed meanwhile."""
        assert self._queue is not None
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> UpdatePlan:
        return self

    def __next__(self) -> Planned:
        if self._queue is None:
            return next(self._walk)
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._queue is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> UpdatePlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
