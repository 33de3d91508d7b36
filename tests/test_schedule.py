"""Budget-aware training: ``train.schedule=linear`` (warm-up, then a straight line to zero where the budget ends)
and ``train.save_every_progress`` (checkpoints spaced over the budget), with exact resume."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mtpipe import artifacts
from tests.test_train import make_artifacts, mcfg, tcfg, tsv


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_artifacts(tmp_path_factory.mktemp("data"))


def test_linear_schedule_is_the_lower_of_the_warmup_line_and_the_decay_line() -> None:
    from mtpipe.training.update import learning_rate, linear_learning_rate

    d, w = 512, 4000
    peak = learning_rate(w, d, w)
    # Early in a long budget it is the paper's warm-up, exactly.
    for step in (1, 10, 1000):
        assert linear_learning_rate(step, step / 1e6, d, w) == pytest.approx(learning_rate(step, d, w), rel=1e-12)
    # After the warm-up it falls linearly with the budget spent, from the paper's peak to zero.
    assert linear_learning_rate(10 * w, 0.5, d, w) == pytest.approx(peak / 2, rel=1e-12)
    assert linear_learning_rate(10 * w, 0.75, d, w) == pytest.approx(peak / 4, rel=1e-12)
    assert linear_learning_rate(10 * w, 1.0, d, w) == 0.0
    # A warm-up that is a large part of the budget: the lines cross below the peak, no jump anywhere.
    total = 2 * w
    lrs = [linear_learning_rate(s, (s - 1) / total, d, w, scale=3.0) for s in range(1, total + 1)]
    top = max(range(total), key=lambda i: lrs[i])
    assert lrs[top] < 3.0 * peak and all(a <= b for a, b in zip(lrs[:top], lrs[1:top + 1]))
    assert all(a >= b for a, b in zip(lrs[top:], lrs[top + 1:]))
    assert max(abs(a - b) for a, b in zip(lrs, lrs[1:])) <= 3.0 * peak / w * 1.01  # steps no larger than warm-up's
    assert lrs[-1] == pytest.approx(3.0 * peak / total, rel=1e-9)  # the last update's rate is nearly zero


def test_linear_schedule_by_steps_logs_its_rate_and_checkpoints_by_progress(data: tuple[Path, Path],
                                                                            tmp_path: Path) -> None:
    from mtpipe.artifacts import list_checkpoints
    from mtpipe.training.train import train_model
    from mtpipe.training.update import linear_learning_rate

    out = tmp_path / "out"
    cfg = tcfg(max_steps=12, warmup=4, schedule="linear", save_every_steps=0, save_every_progress=0.25)
    s = train_model(mcfg(), cfg, *data, out)
    assert s["steps"] == 12
    assert [st for st, _ in list_checkpoints(out)] == [3, 6, 9, 12]  # every quarter of the budget
    d = artifacts.load_checkpoint(out / "checkpoints" / "step_00000012").model_config["d_model"]
    logged = tsv(out, "train/lr")
    assert [st for st, _ in logged] == list(range(1, 13))
    for step, lr in logged:  # update k runs at the budget spent before it, (k - 1) / 12
        assert float(lr) == pytest.approx(linear_learning_rate(step, (step - 1) / 12, d, 4, 2.0), rel=1e-9)


def test_linear_schedule_resumes_exactly(data: tuple[Path, Path], tmp_path: Path) -> None:
    """A run resumed from its step-6 checkpoint ends with the same weights, bit for bit, as one that never
    stopped: the schedule's state (steps and training seconds) travels in the checkpoint."""
    from mtpipe.training.train import train_model

    cfg = tcfg(max_steps=12, warmup=4, schedule="linear", save_every_steps=0, save_every_progress=0.25)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train_model(mcfg(), cfg, *data, whole)
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / "step_00000006", cut / "checkpoints" / "step_00000006")
    s = train_model(mcfg(), cfg, *data, cut)
    assert s["resumed_from"].endswith("step_00000006") and s["updates_this_run"] == 6
    a = artifacts.load_checkpoint(whole / "checkpoints" / "step_00000012").state_dict
    b = artifacts.load_checkpoint(cut / "checkpoints" / "step_00000012").state_dict
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert tsv(cut, "train/lr") == tsv(whole, "train/lr")[6:]  # the same rates after the resume


def test_linear_schedule_by_time_decays_to_near_zero_at_the_time_budget(data: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    """With only ``max_time`` as the budget, the rate follows the clock: it peaks, falls steadily, and the last
    updates run at a small fraction of the peak when the guard stops training."""
    from mtpipe.training.train import train_model

    out = tmp_path / "out"
    cfg = tcfg(max_steps=0, max_time=0.05, warmup=2, schedule="linear", save_every_steps=0, valid_every_steps=0)
    s = train_model(mcfg(), cfg, *data, out)
    assert s["stopped_by"] == "max_time" and s["steps"] >= 20
    lrs = [float(v) for _, v in tsv(out, "train/lr")]
    top = lrs.index(max(lrs))
    assert all(a >= b for a, b in zip(lrs[top:], lrs[top + 1:]))  # time only moves forward
    assert lrs[-1] <= 0.2 * lrs[top]


def test_unknown_schedule_is_refused() -> None:
    with pytest.raises(Exception, match="schedule"):
        tcfg(schedule="cosine")
