"""``mtpipe train``'s update as a plain function, for the training benchmarks (``bench/train_throughput.py``,
``bench/anchors``): the very :class:`mtpipe.training.update.Updater` that training runs, so that a benchmark times
exactly what training does, without the loop around it (data order, logging, validation, checkpoints)."""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from mtpipe import platform
from mtpipe.config import TrainConfig
from mtpipe.training.plan import TrainBatch, loss_positions
from mtpipe.training.update import Updater, learning_rate


def make_train_step(model: nn.Module, cfg: TrainConfig) -> Callable[[Tensor, Tensor, Tensor], float]:
    """A one-process training update ``step(src, tgt_in, tgt_out) -> loss per target token`` with the schedule
    (section 5.3), precision and optimizer of ``cfg``: one micro-batch per update, its gradient scaled by its real
    target tokens as ``mtpipe train`` scales an update's."""
    device = next(model.parameters()).device
    platform.set_threads(cfg.threads)
    updater = Updater(model, cfg, device, platform.training_precision(cfg.precision, device))
    d_model = model.cfg.d_model
    count = [0]

    def step(src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> float:
        pos, gold = loss_positions(tgt_out.cpu())  # the loss's real target positions, found on the host
        ntok = len(pos)
        sums = updater.backward(TrainBatch(src, tgt_in, pos, gold).to(device), scale=1.0 / ntok, sync=True)
        count[0] += 1
        updater.finish(learning_rate(count[0], d_model, cfg.warmup, cfg.lr_scale), sums[0])
        return float(sums[0]) / ntok

    return step
