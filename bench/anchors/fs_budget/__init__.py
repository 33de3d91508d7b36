"""mtpipe's budgeted ``linear`` learning-rate schedule as a fairseq 0.12 scheduler, for the quality comparison.

``fairseq-train --user-dir bench/anchors/fs_budget --lr-scheduler budget_linear --lr P --warmup-updates W
--budget-hours H --stop-time-hours H`` (or ``--budget-updates N --max-update N``) runs
``mtpipe.training.update.linear_learning_rate`` in fairseq: update ``n`` (from 1) at
``P * max(0, min(n / W, 1 - progress))``,
``progress`` the larger share spent of the time budget (from the scheduler's construction, right after fairseq
starts its own stop clock) and of the update budget. So the decay reaches 0 as fairseq's budget runs out, whatever
its speed meanwhile, as mtpipe's does. The rule needs no fairseq; the scheduler is registered where fairseq is
installed (the anchors' venv-fs38, Python 3.8). ``python -m bench.anchors.fs_budget --self-check`` checks it.
"""

import time

try:  # present in the anchors' venv (fairseq 0.12.2), where fairseq-train imports this module
    import fairseq
except ImportError:
    fairseq = None


def budget_linear_rate(update: int, seconds: float, peak: float, warmup: int, budget_seconds: float = 0.0,
                       max_updates: float = 0.0) -> float:
    """The rate of ``update`` (counted from 1) after ``seconds`` of training: ``peak * max(0, min(update / warmup,
    1 - progress))``, ``progress`` the larger of ``seconds / budget_seconds`` and ``(update - 1) / max_updates``
    (the budget spent before the update; a zero budget is no budget), capped at 1."""
    parts = [0.0]
    if budget_seconds > 0:
        parts.append(seconds / budget_seconds)
    if max_updates > 0:
        parts.append((update - 1) / max_updates)
    progress = min(1.0, max(parts))
    return peak * max(0.0, min(update / warmup, 1.0 - progress))


if fairseq is not None:
    from dataclasses import dataclass, field
    from typing import List

    from fairseq.dataclass import FairseqDataclass
    from fairseq.optim.lr_scheduler import FairseqLRScheduler, register_lr_scheduler
    from omegaconf import II

    @dataclass
    class BudgetLinearConfig(FairseqDataclass):
        warmup_updates: int = field(default=4000, metadata={"help": "updates of linear warm-up to --lr"})
        budget_hours: float = field(default=0.0, metadata={
            "help": "the time budget the rate decays over (give --stop-time-hours the same); 0: none"})
        budget_updates: float = field(default=0.0, metadata={
            "help": "the update budget the rate decays over (give --max-update the same); 0: none"})
        lr: List[float] = II("optimization.lr")

    @register_lr_scheduler("budget_linear", dataclass=BudgetLinearConfig)
    class BudgetLinearSchedule(FairseqLRScheduler):
        """:func:`budget_linear_rate` per update; the seconds spent are kept in the state dict, so a resumed run
        goes on where it stopped (as fairseq's own stop clock does)."""

        def __init__(self, cfg: BudgetLinearConfig, optimizer):
            super().__init__(cfg, optimizer)
            if len(cfg.lr) > 1:
                raise ValueError("budget_linear takes one --lr (the peak)")
            if cfg.warmup_updates < 1:
                raise ValueError("budget_linear needs --warmup-updates >= 1")
            self.peak = float(cfg.lr[0])
            self.start = time.time()
            self.optimizer.set_lr(self.rate(1))

        def seconds(self) -> float:
            return time.time() - self.start

        def rate(self, update: int) -> float:
            budget = float(self.cfg.budget_hours or 0.0) * 3600.0
            return budget_linear_rate(update, self.seconds(), self.peak, self.cfg.warmup_updates, budget,
                                      float(self.cfg.budget_updates or 0.0))

        def step_update(self, num_updates):
            """After update ``num_updates``: the rate of the next one."""
            self.optimizer.set_lr(self.rate(num_updates + 1))
            return self.optimizer.get_lr()

        def state_dict(self):
            return {**super().state_dict(), "seconds": self.seconds()}

        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            self.start = time.time() - float(state_dict.get("seconds", 0.0))
