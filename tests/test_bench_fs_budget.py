"""The quality benchmark gives fairseq mtpipe's budgeted ``linear`` schedule (``bench/fs_budget``, a fairseq
``--user-dir`` scheduler): the same rate as ``mtpipe.train.linear_learning_rate`` at every update and every share of
the budget, so fairseq's decay ends with its own time budget however fast it runs. fairseq is not installed here:
the scheduler class is exercised against a stand-in of the three fairseq names it uses."""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_plugin(monkeypatch: pytest.MonkeyPatch, with_fairseq: bool) -> types.ModuleType:
    """``bench/fs_budget`` imported afresh, with a stand-in ``fairseq`` (registry, base classes) or none."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.delitem(sys.modules, "fs_budget", raising=False)
    if with_fairseq:
        registry: dict[str, tuple[type, type]] = {}

        class FairseqLRScheduler:
            def __init__(self, cfg, optimizer):
                self.cfg, self.optimizer, self.best = cfg, optimizer, None

            def state_dict(self):
                return {"best": self.best}

            def load_state_dict(self, state_dict):
                self.best = state_dict["best"]

        def register_lr_scheduler(name, dataclass=None):
            def wrap(cls):
                registry[name] = (cls, dataclass)
                return cls
            return wrap

        root = types.ModuleType("fairseq")
        root.registry = registry  # type: ignore[attr-defined]
        dc = types.ModuleType("fairseq.dataclass")
        dc.FairseqDataclass = type("FairseqDataclass", (), {})  # type: ignore[attr-defined]
        optim = types.ModuleType("fairseq.optim")
        lrs = types.ModuleType("fairseq.optim.lr_scheduler")
        lrs.FairseqLRScheduler = FairseqLRScheduler  # type: ignore[attr-defined]
        lrs.register_lr_scheduler = register_lr_scheduler  # type: ignore[attr-defined]
        for name, mod in (("fairseq", root), ("fairseq.dataclass", dc), ("fairseq.optim", optim),
                          ("fairseq.optim.lr_scheduler", lrs)):
            monkeypatch.setitem(sys.modules, name, mod)
    else:
        monkeypatch.setitem(sys.modules, "fairseq", None)  # import fairseq -> ImportError
    return importlib.import_module("fs_budget")


def test_the_rate_is_mtpipes_linear_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    from mtpipe.train import linear_learning_rate

    plugin = load_plugin(monkeypatch, with_fairseq=False)
    assert not hasattr(plugin, "BudgetLinearSchedule")  # no fairseq: only the rule
    d, w, scale = 128, 1000, 1.79
    peak = scale * d**-0.5 * w**-0.5
    budget = 37 * 60.0
    for update in (1, 10, 500, 1000, 1500, 3000, 4438):
        for seconds in (0.0, 60.0, 555.0, 1800.0, budget, budget + 5):
            ours = plugin.budget_linear_rate(update, seconds, peak, w, budget_seconds=budget)
            assert ours == pytest.approx(linear_learning_rate(update, min(1.0, seconds / budget), d, w, scale),
                                         rel=1e-12, abs=1e-15)
    # An update budget (equal updates): update k runs at the share spent before it, (k - 1) / N, as mtpipe's does.
    n = 2000
    for update in range(1, n + 1, 37):
        assert plugin.budget_linear_rate(update, 1e9, peak, w, max_updates=n) == pytest.approx(
            linear_learning_rate(update, (update - 1) / n, d, w, scale), rel=1e-12, abs=1e-15)
    assert plugin.budget_linear_rate(5000, budget, peak, w, budget_seconds=budget) == 0.0  # the budget is spent


def test_the_scheduler_follows_the_clock_and_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = load_plugin(monkeypatch, with_fairseq=True)
    cls, config = sys.modules["fairseq"].registry["budget_linear"]
    assert cls is plugin.BudgetLinearSchedule and config is plugin.BudgetLinearConfig

    @dataclass
    class Cfg:  # the parsed BudgetLinearConfig, as fairseq hands it over
        warmup_updates: int = 10
        budget_hours: float = 0.01  # 36 s
        budget_updates: float = 0.0
        lr: tuple = (0.005,)

    class Optimizer:
        lr = None

        def set_lr(self, lr):
            self.lr = lr

        def get_lr(self):
            return self.lr

    clock = [1000.0]
    monkeypatch.setattr(plugin.time, "time", lambda: clock[0])
    opt = Optimizer()
    sched = cls(Cfg(), opt)
    assert opt.lr == pytest.approx(0.005 / 10)  # the first update's rate, set before it runs
    rates = []
    for update in range(1, 101):
        clock[0] += 0.36  # 100 updates fill the 36 s budget
        rates.append(sched.step_update(update))  # the rate of the next update
        assert rates[-1] == pytest.approx(plugin.budget_linear_rate(update + 1, 0.36 * update, 0.005, 10, 36.0))
    assert rates[8] == pytest.approx(0.005 * (1 - 0.09))  # update 10: the warm-up line meets the decay line
    assert rates[-1] == pytest.approx(0.0, abs=1e-12)  # the budget is spent: the decay has reached 0
    # A resumed run keeps its clock: 18 s spent, restored in a new process at another wall-clock time.
    state = {"best": None, "seconds": 18.0}
    clock[0] = 5e6
    resumed = cls(Cfg(), Optimizer())
    resumed.load_state_dict(state)
    assert resumed.step_update(50) == pytest.approx(0.005 * 0.5)
    with pytest.raises(ValueError, match="one --lr"):
        cls(Cfg(lr=(0.1, 0.2)), Optimizer())


def test_the_quality_bench_hands_fairseq_the_budgeted_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    anchors = importlib.import_module("anchors")
    mc = {"encoder_layers": 4, "decoder_layers": 4, "d_model": 128, "d_ff": 256, "heads": 4, "dropout": 0.2,
          "attention_dropout": 0.0, "relu_dropout": 0.0, "norm_position": "pre"}
    tc = {"lr_scale": 1.79, "warmup": 1000, "label_smoothing": 0.1, "schedule": "linear"}
    _, flags = anchors.fairseq_settings("run", mc, tc, every=139)
    flags = [str(f) for f in flags]
    opt = dict(zip(flags, flags[1:]))
    assert opt["--lr-scheduler"] == "budget_linear" and Path(opt["--user-dir"]) == BENCH / "fs_budget"
    assert float(opt["--lr"]) == pytest.approx(1.79 * 128**-0.5 * 1000**-0.5, rel=1e-5)  # the paper's peak
    assert opt["--warmup-updates"] == "1000" and "--encoder-normalize-before" in flags
    _, flags = anchors.fairseq_settings("run", mc, {**tc, "schedule": "inverse_sqrt"}, every=139)
    assert "--lr-scheduler" not in flags  # fs_train.sh's own inverse square root
    with pytest.raises(SystemExit, match="no fairseq counterpart"):
        anchors.fairseq_settings("run", mc, {**tc, "schedule": "cosine"}, every=139)
