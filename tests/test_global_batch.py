"""The global batch (section 5.1: ~25000 tokens per update, ``train.tokens_per_update``) on any number of processes:
the layout's arithmetic, the sentences the processes share, and real runs (torchrun, gloo on CPU) of 1, 2, 3, 4 and 8
processes from the same params."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_train import _command, _run, needs_proc

from mtpipe.errors import MtpipeError
from mtpipe.training.batches import (
    GLOBAL_BATCH_TOLERANCE,
    BatchTable,
    TrainData,
    epoch_order,
    layout_for,
    load_train_data,
    rank_batches,
    rank_rows,
    update_layout,
)
from testkit.runs import RESUME_TRAIN, TINY, make_artifacts, tsv, write_params

WORLDS = (1, 2, 3, 4, 8)


@pytest.mark.parametrize("tokens, max_tokens", [(25000, 3200), (25000, 4096), (4096, 4096), (960, 48), (1008, 48),
                                                (100, 4096), (48 * 20, 48)])
def test_the_global_batch_is_within_the_tolerance_on_any_world_size(tokens: int, max_tokens: int) -> None:
    """Batches per update on 1..64 processes: within 10 % of one process's count, which covers tokens_per_update
    with whole batches; where today's whole batches per process are within it, they are kept (8 GPUs x 1 = 1 x 8)."""
    one = update_layout(tokens, 1, max_tokens)
    assert one.per_update == max(1, math.ceil(tokens / max_tokens)) and not one.split
    for world in range(1, 65):
        lay = update_layout(tokens, world, max_tokens)
        assert one.per_update <= lay.per_update <= one.per_update * (1 + GLOBAL_BATCH_TOLERANCE)
        whole = world * max(1, math.ceil(tokens / (world * max_tokens)))
        if whole <= one.per_update * (1 + GLOBAL_BATCH_TOLERANCE):
            assert lay == (whole, whole // world, False)  # the arithmetic of whole batches, unchanged
        else:
            assert lay.split and lay.per_update == one.per_update
    # The recipes' 3200-token batches: 8 on 1, 2, 4, 8 and 16 GPUs (not 16 batches on 16 GPUs).
    assert [update_layout(25000, w, 3200).per_update for w in (1, 2, 3, 4, 8, 12, 16, 24)] == [8] * 8


def table(sizes: list[int]) -> BatchTable:
    zeros = np.zeros(len(sizes), np.int64)
    return BatchTable(rows=None, off=np.concatenate([[0], np.cumsum(sizes)]), src_tokens=zeros, tgt_tokens=zeros,
                      src_width=zeros, tgt_width=zeros)


@pytest.mark.parametrize("per_update, world", [(8, 16), (8, 3), (8, 12), (7, 8), (5, 2), (8, 4), (1, 8)])
def test_processes_share_every_sentence_of_the_update_once(per_update: int, world: int) -> None:
    """Every sentence of the update's batches goes to exactly one process, in parts that are contiguous runs of one
    batch; every process gets a share of about per_update / world batches and at most ``accum`` parts."""
    rng = np.random.default_rng(per_update * 100 + world)
    sizes = rng.integers(world, 40, 30).tolist()
    lay = layout_for(per_update, world)
    data = TrainData(vocab={}, max_tokens=48, train_tokens=None, train=table(sizes), valid_tokens=None,  # type: ignore
                     valid=None, accum=0, per_update=0, usable=0).with_layout(lay, world, "batches")
    order = epoch_order(len(sizes), seed=1, epoch=0)
    for position in range(0, data.usable, per_update):
        group = order[position : position + per_update]
        shares = [rank_rows(data, order, position, world, r) for r in range(world)]
        got = np.sort(np.concatenate([rows for share in shares for _, rows in share]))
        want = np.sort(np.concatenate([data.train.batch(int(b)) for b in group]))
        np.testing.assert_array_equal(got, want)  # each sentence once
        for share in shares:
            assert 1 <= len(share) <= lay.accum
            for b, rows in share:
                batch = data.train.batch(b)
                assert len(rows) and b in group and np.array_equal(rows, np.arange(rows[0], rows[-1] + 1))
                assert batch[0] <= rows[0] and rows[-1] <= batch[-1]
            mine = sum(len(rows) / len(data.train.batch(b)) for b, rows in share)  # in batches
            assert abs(mine - per_update / world) <= per_update / world * 0.5 + 2 / world
        if not lay.split:  # whole batches: exactly the ranks' every-world-th batches
            assert [[b for b, _ in s] for s in shares] == [
                rank_batches(order, position, world, lay.accum, r).tolist() for r in range(world)]


def test_batches_too_small_to_share_are_refused_naming_the_keys() -> None:
    data = TrainData(vocab={}, max_tokens=48, train_tokens=None, train=table([9, 1, 9]),  # type: ignore
                     valid_tokens=None, valid=None, accum=0, per_update=0, usable=0)
    with pytest.raises(MtpipeError, match=r"batch 1 holds 1 sentence\(s\).*train.tokens_per_update to a multiple of "
                                          r"8 x bucket.max_tokens \(384\), or change bucket.max_tokens or train.nproc"):
        data.with_layout(layout_for(1, 8), 8, "batches")


def test_the_layout_reaches_the_train_data(tmp_path: Path) -> None:
    tokens, batches = make_artifacts(tmp_path)
    for world in WORLDS:
        d = load_train_data(tokens, batches, 4 * 48, world)
        assert (d.per_update, d.split) == (4, world in (3, 8)) and d.usable == len(d.train) // 4 * 4


def run_on(world: int, data: tuple[Path, Path], where: Path) -> tuple[dict, list[float]]:
    """A run of ``world`` processes (torchrun, gloo) of the same params: 4 batches of <= 48 tokens per update, 3
    updates, dropout 0; returns its train.json and its loss curve, after checking the log's global batch lines."""
    train = {**RESUME_TRAIN, "tokens_per_update": 4 * 48, "max_steps": 3, "save_every_steps": 0,
             "valid_every_steps": 0}
    params = write_params(where / f"params-{world}.yaml", {**TINY, "dropout": 0.0}, {**train, "nproc": world})
    out = where / f"ws{world}"
    _run(_command(params, data, out, launcher=True), where / f"ws{world}.log")
    log = (out / "train.log").read_text()
    assert (f"global batch: 4 batches of <= 48 tokens per update (<= 192 padded tokens per side; "
            f"train.tokens_per_update 192), on {world} process(es)") in log
    assert "tokens per update (the mean of the first 3 updates of this run; train.tokens_per_update 192)" in log
    return json.loads((out / "train.json").read_text()), [float(v) for _, v in tsv(out, "train/loss")]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[Path, Path], dict, list[float]]:
    where = tmp_path_factory.mktemp("global-batch")
    data = make_artifacts(where / "data")  # 14 batches of <= 48 tokens
    return (data, *run_on(1, data, where))


@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize("world", WORLDS)
def test_any_world_size_trains_the_global_batch_of_one_process(one_process, world: int, tmp_path: Path) -> None:
    """The same params on 1, 2, 3, 4 and 8 processes: the target tokens per update that train.json (and the log)
    record agree with one process's within 10 % -- here exactly, since every world size takes the same 4 batches
    (3 processes share them in thirds, 8 take half a batch each) -- and (dropout 0) so does the loss of every
    update."""
    data, ref, ref_loss = one_process
    summary, loss = (ref, ref_loss) if world == 1 else run_on(world, data, tmp_path)
    gb, want = summary["global_batch"], ref["global_batch"]["tgt_tokens_per_update"]
    assert gb["measured_updates"] == 3 and gb["batches_per_update"] == summary["batches_per_update"] == 4
    assert abs(gb["tgt_tokens_per_update"] - want) <= GLOBAL_BATCH_TOLERANCE * want
    assert gb["tgt_tokens_per_update"] <= gb["max_tokens_per_update"] == 192
    assert len(loss) == 3 and loss[0] != loss[-1]
    assert loss == pytest.approx(ref_loss, rel=1e-5)  # the same updates, up to the order of the sums
