"""The update loop keeps the device busy: no host synchronisation inside an update, results read one update late,
batches made ahead in the trainer's own order.

On a GPU a read of a device value (``.item()``, ``float(t)``, ``.tolist()``, a boolean-mask selection, ``nonzero``)
makes the host wait until the device has caught up, and the device then idles until the host queues more work.
These tests count such reads on the CPU, where they cost nothing but are made by the same code: every aten op the
loop runs goes through a dispatch mode that notes the reads, and the values of tensors computed by the loop read on
the host are caught by wrapping ``Tensor.tolist`` / ``numpy`` / ``item``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtpipe.artifacts import PAD_ID
from mtpipe.config import ModelConfig, TrainConfig
from mtpipe.training import trainer as trainer_mod
from mtpipe.training.batches import epoch_order, load_train_data, rank_batches
from mtpipe.training.plan import UpdatePlan, loss_positions
from testkit.runs import TINY, make_artifacts, weights

aten = torch.ops.aten
# Ops whose result size or value the host must know: on CUDA each one waits for the device.
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
           aten.unique_consecutive.default, aten._unique2.default, aten.repeat_interleave.Tensor}


class SyncCounter(TorchDispatchMode):
    """Notes in ``log`` every syncing op and every host read of a tensor the loop computed."""

    def __init__(self, log: list[str]):
        super().__init__()
        self.log, self.made = log, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING or (func is aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1])):
            self.log.append(f"sync:{func}")
        out = func(*args, **kwargs)
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in inputs:
                self.made[t.untyped_storage().data_ptr()] = t  # kept alive: its address is not reused by host data
        return out


def tcfg(**kw) -> TrainConfig:
    base = dict(max_steps=9, warmup=4, precision="fp32", threads=1, save_every_minutes=0.0, save_every_steps=0,
                valid_every_steps=0, log_every_steps=3, tokens_per_update=96)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_artifacts(tmp_path_factory.mktemp("data"))


def traced_run(data: tuple[Path, Path], out: Path, monkeypatch: pytest.MonkeyPatch, **kw) -> list[str]:
    """Train, noting in a log the loop's phases (begin / end / read of each update) and every sync inside them."""
    from mtpipe.training.train import train_model

    log: list[str] = []
    counter = SyncCounter(log)
    T = trainer_mod.Trainer
    for name in ("_begin", "_end", "_read"):
        orig = getattr(T, name)

        def phase(self, *a, _orig=orig, _name=name, **k):
            log.append(f"{_name}>")
            try:
                return _orig(self, *a, **k)
            finally:
                log.append(f"{_name}<")
        monkeypatch.setattr(T, name, phase)
    for name in ("tolist", "numpy", "item"):
        orig = getattr(torch.Tensor, name)

        def read(self, *a, _orig=orig, _name=name, **k):
            if self.untyped_storage().data_ptr() in counter.made:
                log.append(f"sync:{_name}")
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, read)
    loop = T.train_loop

    def traced_loop(self):
        with counter:
            return loop(self)
    monkeypatch.setattr(T, "train_loop", traced_loop)
    summary = train_model(ModelConfig(**TINY), tcfg(**kw), *data, out)
    assert summary["steps"] == kw.get("max_steps", 9)
    return log


def phases(log: list[str]) -> list[tuple[str, int]]:
    """``(phase, syncs inside it)`` in order."""
    out, depth = [], None
    for e in log:
        if e.endswith(">"):
            depth = [e[:-1], 0]
        elif e.endswith("<"):
            out.append(tuple(depth))
            depth = None
        elif depth is not None:
            depth[1] += 1
        else:
            raise AssertionError(f"a host read outside an update's phases: {e}")
    return out


def test_an_update_reads_nothing_from_the_device_and_is_read_one_update_later(data, tmp_path, monkeypatch):
    log = traced_run(data, tmp_path / "o", monkeypatch)
    ph = phases(log)
    assert not [n for n, s in ph if n in ("_begin", "_end") and s], f"syncs inside an update: {log}"
    assert all(s == 1 for n, s in ph if n == "_read")  # one read of a few numbers per update, nothing else
    names = [n for n, _ in ph]
    # update j + 1 is begun before update j is read, except before the last update (max_steps: nothing to begin)
    assert names[:5] == ["_begin", "_end", "_begin", "_read", "_end"]
    assert names.count("_read") == names.count("_end") == 9 and names.count("_begin") == 9
    assert names[-3:] == ["_read", "_end", "_read"]


def test_the_old_boolean_selection_would_be_caught(monkeypatch):
    """The counter sees what the loss used to do (a boolean mask on device values)."""
    log: list[str] = []
    with SyncCounter(log):
        h, t = torch.randn(2, 3, 4), torch.tensor([[5, 6, 0], [7, 0, 0]])
        _ = h[t != 0]
        _ = float(h.sum())
    assert len(log) == 2 and all(e.startswith("sync:") for e in log)


def test_a_run_with_time_and_clock_stops_and_checkpoints_equal_the_plain_run(data, tmp_path, monkeypatch):
    """A stop decided on the clock (after the next update was begun) drops that update and puts the RNG back: the
    checkpoint then resumes to the same weights as a run that never stopped."""
    from mtpipe.training.train import train_model

    ref = train_model(ModelConfig(**TINY), tcfg(max_steps=8), *data, tmp_path / "ref")
    calls = {"n": 0}
    clock = trainer_mod.Budget.rank0_clock

    def stop_at_5(self):
        save, up, seconds = clock(self)
        calls["n"] += 1
        return save, calls["n"] == 5, seconds  # update 5's flags: time is up (read once update 6 was begun)
    monkeypatch.setattr(trainer_mod.Budget, "rank0_clock", stop_at_5)
    first = train_model(ModelConfig(**TINY), tcfg(max_steps=8, max_time=60), *data, tmp_path / "cut")
    assert first["steps"] == 5 and first["stopped_by"] == "max_time"
    monkeypatch.setattr(trainer_mod.Budget, "rank0_clock", clock)
    again = train_model(ModelConfig(**TINY), tcfg(max_steps=8), *data, tmp_path / "cut")
    assert again["steps"] == 8 and again["resumed_from"]
    a, b = weights(Path(ref["checkpoints"][-1])), weights(Path(again["checkpoints"][-1]))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_producer_walks_the_trainers_order_across_epochs(data):
    tokens, batches = data
    d = load_train_data(tokens, batches, 96, 2)  # 2 ranks: each takes every other batch of an update
    for rank in (0, 1):
        inline = UpdatePlan(d, seed=3, epoch=1, position=d.per_update, rank=rank, world=2, start_id=1)
        with UpdatePlan(d, seed=3, epoch=1, position=d.per_update, rank=rank, world=2, start_id=1,
                        prefetch=2) as ahead:
            walk = [next(ahead) for _ in range(3 * d.usable // d.per_update)]  # three epochs' worth
        epoch, position = 1, d.per_update
        for got, same in zip(walk, (next(inline) for _ in walk)):
            order = epoch_order(len(d.train), 3, epoch)
            want = [int(b) for b in rank_batches(order, position, 2, d.accum, rank)]
            assert (got.epoch, got.position) == (epoch, position) == (same.epoch, same.position)
            assert [b for b, _ in got.batches] == want == [b for b, _ in same.batches]
            for (_, x), (_, y) in zip(got.batches, same.batches):
                assert all(torch.equal(u, v) for u, v in zip(x, y))
            position += d.per_update
            if position + d.per_update > d.usable:
                epoch, position = epoch + 1, 0
        assert len({p.epoch for p in walk}) >= 3


def test_the_producer_hands_on_its_error_and_stops_when_closed(data):
    tokens, batches = data
    d = load_train_data(tokens, batches, 96, 1)
    d.train_tokens = None  # collating now fails inside the thread
    with UpdatePlan(d, seed=1, epoch=0, position=0, rank=0, world=1, start_id=1, prefetch=2) as plan:
        with pytest.raises(AttributeError):
            next(plan)
    plan = UpdatePlan(load_train_data(tokens, batches, 96, 1), seed=1, epoch=0, position=0, rank=0, world=1,
                      start_id=1, prefetch=1)
    next(plan)
    plan.close()
    assert not any(t.name == "mtpipe-batches" and t.is_alive() for t in threading.enumerate())


def test_loss_positions_are_the_non_pad_targets():
    tgt_out = torch.tensor([[5, 6, 3], [7, 3, PAD_ID]])  # [B, T]
    pos, gold = loss_positions(tgt_out)
    assert pos.tolist() == [0, 1, 2, 3, 4] and gold.tolist() == [5, 6, 3, 7, 3]
    assert torch.equal(gold, tgt_out[tgt_out != PAD_ID])
    assert np.array_equal(pos.numpy(), np.flatnonzero(tgt_out.numpy().reshape(-1) != PAD_ID))


def test_a_trainer_for_updates_makes_the_updates_of_mtpipe_train(data, tmp_path):
    """What a benchmark of the update times (``Trainer.for_updates`` / ``updates``, bench/gpu_paper.py) is ``mtpipe
    train``'s run: the same weights after 6 updates made in two calls, and after 3 more from a checkpoint's state."""
    from mtpipe import artifacts
    from mtpipe.training import resume
    from mtpipe.training.train import train_model

    cfg = tcfg(max_steps=6, save_every_steps=3, keep_last=5)
    ref = train_model(ModelConfig(**TINY), cfg, *data, tmp_path / "ref")
    d = load_train_data(*data, cfg.tokens_per_update, 1)
    t = trainer_mod.Trainer.for_updates(ModelConfig(**TINY), cfg, d, torch.device("cpu"))
    assert len(t.updates(4)) == 4 * d.per_update and len(t.updates(2)) == 2 * d.per_update
    assert t.state.step == 6
    last = weights(Path(ref["checkpoints"][-1]))
    assert all(torch.equal(last[k], v) for k, v in t.model.state_dict().items())

    ck = artifacts.load_checkpoint(artifacts.checkpoint_path(tmp_path / "ref", 3), trainer_state=True)
    t = trainer_mod.Trainer.for_updates(ModelConfig(**TINY), cfg, d, torch.device("cpu"), state_dict=ck.state_dict)
    t.use_batches(d, resume.restore(ck, t.updater.optimizer, t.updater.scaler, accum=d.accum, seed=cfg.seed,
                                    device=t.device))
    t.updates(3, go_on=lambda: t.state.step < 6)
    t.close_updates()
    assert t.state.step == 6 and all(torch.equal(last[k], v) for k, v in t.model.state_dict().items())
