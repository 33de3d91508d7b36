"""What ends training and how far along it is: ``train.max_steps``, ``max_epochs`` and ``max_time`` (whichever runs
out first), early stopping's patience, and the checkpoints the clock schedules.

Decisions that depend on a clock are made on rank 0's (:meth:`Budget.rank0_clock`) and handed to every rank in the
update's all-reduce, so that ranks whose clocks differ still save, stop and set the learning rate alike at the same
update. ``train.max_time`` counts the training time of every invocation of a run (``clock.json``,
:mod:`mtpipe.training.checkpoints`).
"""

from __future__ import annotations

import math
import time

from mtpipe.config import TrainConfig
from mtpipe.training import metrics
from mtpipe.training.batches import TrainData
from mtpipe.training.state import TrainState


class Budget:
    """The run's budget as one process sees it: the plan (``max_steps``, ``max_epochs``, ``max_time``), the budget
    spent, and this invocation's clocks (monotonic seconds, restarted when the loop starts: :meth:`start`)."""

    def __init__(self, cfg: TrainConfig, data: TrainData, state: TrainState, rank: int):
        self.cfg, self.data, self.state, self.rank = cfg, data, state, rank
        # The update count DropHead's schedule ends at (and the progress bar's total): max_steps, else what
        # max_epochs amount to; 0 when only max_time limits the run.
        self.total_steps = cfg.max_steps or cfg.max_epochs * data.usable // data.per_update
        self.loop_start = self.last_save_time = time.monotonic()
        self.seconds_before = 0.0  # training seconds of the invocations before this one
        self.last_progress = 0.0  # rank 0: the budget progress after the last update (save_every_progress)

    def start(self) -> float:
        """The loop starts: restart this invocation's clocks; returns the start time."""
        self.loop_start = self.last_save_time = time.monotonic()
        self.seconds_before = self.state.train_seconds
        self.last_progress = self.progress(self.seconds_before)
        return self.loop_start

    def seconds(self) -> float:
        """Training seconds so far, this invocation's and the earlier ones'."""
        return self.seconds_before + time.monotonic() - self.loop_start

    def progress(self, seconds: float, step: int | None = None) -> float:
        """The fraction of the budget spent after ``seconds`` of training and ``step`` updates (default: those
        applied): the largest of the fractions of ``max_steps``, ``max_epochs`` and ``max_time`` used (whichever runs
        out first ends training), in [0, 1]."""
        cfg, st = self.cfg, self.state
        parts = [0.0]
        if cfg.max_steps:
            parts.append((st.step if step is None else step) / cfg.max_steps)
        if cfg.max_epochs:
            parts.append((st.epoch + st.position / self.data.usable) / cfg.max_epochs)
        if cfg.max_time:
            parts.append(seconds / (60 * cfg.max_time))
        return min(1.0, max(parts))

    def rank0_clock(self) -> tuple[bool, bool, float]:
        """``(save_due, time_up, seconds)`` by rank 0's clock (others say False, False, 0): the update's all-reduce
        hands rank 0's decision and training seconds to every rank, so that ranks whose clocks differ still save,
        stop and set the learning rate (:meth:`progress` of those seconds) alike at the same update."""
        if self.rank != 0:
            return False, False, 0.0
        now, cfg = time.monotonic(), self.cfg
        seconds = self.seconds_before + now - self.loop_start
        save_due = cfg.save_every_minutes > 0 and now - self.last_save_time >= 60 * cfg.save_every_minutes
        if cfg.save_every_progress > 0:
            # A checkpoint once this update takes progress across a multiple of save_every_progress (counting the
            # update itself, so max_steps=100 and 0.05 save at steps 5, 10, ...).
            after, every = self.progress(seconds, self.state.step + 1), cfg.save_every_progress
            save_due = save_due or math.floor(after / every + 1e-9) > math.floor(self.last_progress / every + 1e-9)
            self.last_progress = after
        time_up = cfg.max_time > 0 and seconds >= 60 * cfg.max_time
        return save_due, time_up, seconds

    def bar_fields(self, start_step: int) -> dict[str, float | None]:
        """The progress bar's time left and fill. Time left (:func:`mtpipe.training.metrics.remaining_seconds`): the
        sooner of the step plan's end, at this invocation's pace so far, and train.max_time's (rich alone would
        ignore the time limit). Fill: the budget spent (:meth:`progress`), so that a run train.max_time ends fills
        its bar as its minutes pass rather than stopping at a fraction of its epoch cap's updates."""
        elapsed = time.monotonic() - self.loop_start
        eta = metrics.remaining_seconds(self.state.step, self.total_steps, self.state.step - start_step, elapsed,
                                        self.seconds_before + elapsed, self.cfg.max_time)
        return {"eta_seconds": eta, "fraction": self.progress(self.seconds_before + elapsed)}

    def stop_reason(self, time_up: bool) -> str:
        """Why training stops now (``""``: it goes on)."""
        cfg, st = self.cfg, self.state
        if cfg.max_steps and st.step >= cfg.max_steps:
            return "max_steps"
        if cfg.max_epochs and st.epoch >= cfg.max_epochs:
            return "max_epochs"
        if cfg.patience and st.best.metric == cfg.stop_metric and st.best.bad >= cfg.patience:
            return "patience"
        return "max_time" if time_up else ""

    def save_due(self, clock_says: bool) -> bool:
        """Whether this update's checkpoint is due: by the clock (``clock_says``) or by ``train.save_every_steps``."""
        every = self.cfg.save_every_steps
        return clock_says or bool(every and self.state.step % every == 0)

    def planned_updates(self) -> int:
        """The updates max_steps and max_epochs plan for (the sooner of the two; 0: neither is set)."""
        cfg, d = self.cfg, self.data
        plans = [n for n in (cfg.max_steps, cfg.max_epochs * d.usable // d.per_update) if n > 0]
        return min(plans) if plans else 0
