"""`mtpipe train`: schedule, loss, batching, precision, checkpoints and exact resume, distributed equivalence.

The tiny artifacts and the multi-process runs' helpers are :mod:`testkit.runs`'s (shared with bench/): the task is
learnable (the target is the source reversed with every id shifted), so a tiny model can overfit it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mtpipe import artifacts
from mtpipe.config import ModelConfig, TrainConfig
from mtpipe.errors import MtpipeError
from mtpipe.training import checkpoints
from testkit.runs import (
    REPO,
    RESUME_TRAIN,
    SPM,
    TINY,
    VOCAB,
    assert_same_run,
    descendants,
    kill_tree,
    make_artifacts,
    run_env,
    tsv,
    wait_for,
    weights,
    write_params,
)


def tcfg(**kw) -> TrainConfig:
    """Test training settings: fp32 (bitwise comparisons), 1 thread, checkpoints by steps only, log every step."""
    base = dict(max_steps=12, warmup=10, lr_scale=2.0, precision="fp32", threads=1, save_every_minutes=0.0,
                save_every_steps=4, keep_last=20, valid_every_steps=6, log_every_steps=1, tokens_per_update=96)
    return TrainConfig(**{**base, **kw})


def mcfg(**kw) -> ModelConfig:
    return ModelConfig(**{**TINY, **kw})


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_artifacts(tmp_path_factory.mktemp("data"))


# --------------------------------------------------------------------------------------------------------------------
# Pure functions: schedule, loss, batch size, batch order, collation
# --------------------------------------------------------------------------------------------------------------------


def test_learning_rate_schedule_is_section_5_3() -> None:
    from mtpipe.training.update import learning_rate

    d, w = 512, 4000
    assert learning_rate(1, d, w) == pytest.approx(d**-0.5 * 1 * w**-1.5, rel=1e-12)
    assert learning_rate(w, d, w) == pytest.approx(d**-0.5 * w**-0.5, rel=1e-12)  # the peak: both terms meet
    assert learning_rate(4 * w, d, w) == pytest.approx(d**-0.5 * (4 * w) ** -0.5, rel=1e-12)
    assert learning_rate(4 * w, d, w) == pytest.approx(learning_rate(w, d, w) / 2, rel=1e-12)  # 1/sqrt decay
    lrs = [learning_rate(s, d, w) for s in range(1, 3 * w)]
    assert max(range(len(lrs)), key=lrs.__getitem__) + 1 == w  # linear warm-up, then decay
    assert learning_rate(100, d, w, scale=2.0) == pytest.approx(2 * learning_rate(100, d, w), rel=1e-12)


def _smoothed(logits: torch.Tensor, target: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The training loss of ``logits`` themselves: the projection by an identity matrix (V = D)."""
    from mtpipe.training.loss import projected_label_smoothed_nll

    return projected_label_smoothed_nll(logits, torch.eye(logits.size(-1), dtype=logits.dtype), None, target, eps)


def test_label_smoothing_is_the_textbook_cross_entropy() -> None:
    """Szegedy et al.'s q'(k) = (1 - eps) [k = y] + eps / V: the loss is H(q', p), computed here by hand."""
    # V = 2, p = (1/4, 3/4), target 1, eps = 0.2: q' = (0.1, 0.9).
    logits = torch.tensor([[0.0, math.log(3.0)]])
    loss, nll = _smoothed(logits, torch.tensor([1]), 0.2)
    assert loss.item() == pytest.approx(-(0.1 * math.log(0.25) + 0.9 * math.log(0.75)), rel=1e-6)
    assert nll.item() == pytest.approx(-math.log(0.75), rel=1e-6)
    # A uniform prediction costs log V whatever eps is (q' sums to 1).
    loss, _ = _smoothed(torch.zeros(3, 7), torch.tensor([0, 3, 6]), 0.1)
    assert loss.item() == pytest.approx(3 * math.log(7), rel=1e-6)
    # Random case against the explicit distribution, and against torch's own label_smoothing (same convention).
    g = torch.Generator().manual_seed(0)
    logits, target, eps = torch.randn(5, 11, generator=g), torch.randint(0, 11, (5,), generator=g), 0.1
    q = torch.full((5, 11), eps / 11).scatter_add_(1, target[:, None], torch.full((5, 1), 1 - eps))
    want = -(q * torch.log_softmax(logits.double(), -1)).sum()
    loss, nll = _smoothed(logits, target, eps)
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert loss.item() == pytest.approx(F.cross_entropy(logits, target, label_smoothing=eps, reduction="sum").item(),
                                        rel=1e-6)
    assert nll.item() == pytest.approx(F.cross_entropy(logits, target, reduction="sum").item(), rel=1e-6)
    # bf16 states: the loss is still computed in float32.
    loss16, _ = _smoothed(logits.bfloat16(), target, eps)
    assert loss16.dtype == torch.float32


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_blockwise_loss_equals_autograd_of_the_formula(eps: float, bias: bool, precision: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss made a block of rows at a time, its gradient computed in the forward pass, equals the textbook
    formula on the whole logits differentiated by autograd: loss, NLL, and the gradients of the states, the
    projection matrix and its bias, with several blocks and a short last one (bf16: under CPU autocast, as training
    runs it, against autograd of the same products under autocast). Without gradients it gives the same values."""
    import mtpipe.training.loss as ml
    from testkit.oracles import reference_label_smoothed_nll

    n, vocab, d = 300, 13, 6
    monkeypatch.setitem(ml._BLOCK_BYTES, "cpu", 4 * vocab * ml._ROW_MULTIPLE)  # blocks of 128 rows: 128, 128, 44
    g = torch.Generator().manual_seed(1)
    h0, w0 = torch.randn(n, d, generator=g), torch.randn(vocab, d, generator=g)
    b0 = torch.randn(vocab, generator=g) if bias else None
    target = torch.randint(0, vocab, (n,), generator=g)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    results = []
    for blockwise in (True, False):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        b = b0.clone().requires_grad_(True) if b0 is not None else None
        with autocast:
            if blockwise:
                loss, nll = ml.projected_label_smoothed_nll(h, w, b, target, eps)
            else:
                loss, nll = reference_label_smoothed_nll(F.linear(h, w, b), target, eps)
        (0.7 * loss).backward()
        results.append((loss.detach(), nll.detach(), h.grad, w.grad, None if b is None else b.grad))
    tol = 2e-2 if precision == "bf16" else 1e-5
    for got, want in zip(*results):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, atol=tol * max(1.0, want.abs().max().item()), rtol=tol)
    with torch.no_grad(), autocast:
        loss, nll = ml.projected_label_smoothed_nll(h0, w0, b0, target, eps)
    torch.testing.assert_close((loss, nll), results[0][:2])


def test_blockwise_loss_reports_the_nll_without_a_gradient() -> None:
    """Only the smoothed loss is trained on: the NLL it also returns carries no gradient."""
    from mtpipe.training.loss import projected_label_smoothed_nll

    h = torch.randn(4, 3, requires_grad=True)
    loss, nll = projected_label_smoothed_nll(h, torch.randn(5, 3), None, torch.tensor([0, 1, 2, 3]), 0.1)
    assert loss.requires_grad and not nll.requires_grad


def test_accumulation_keeps_the_global_batch() -> None:
    from mtpipe.training.batches import accumulation

    assert accumulation(25000, 1, 4096) == 7
    assert accumulation(25000, 8, 4096) == 1
    assert accumulation(25000, 2, 4096) == 4
    assert accumulation(100, 4, 4096) == 1
    for world in (1, 2, 3, 8):
        a = accumulation(25000, world, 3000)
        assert world * a * 3000 >= 25000 > world * (a - 1) * 3000


def test_ranks_take_disjoint_batches_and_epochs_reshuffle() -> None:
    from mtpipe.training.batches import epoch_order, rank_batches

    n, world, accum = 23, 2, 3
    order = epoch_order(n, seed=5, epoch=0)
    assert sorted(order) == list(range(n))
    np.testing.assert_array_equal(order, epoch_order(n, seed=5, epoch=0))  # recomputable: nothing to store
    assert not np.array_equal(order, epoch_order(n, seed=5, epoch=1))
    assert not np.array_equal(order, epoch_order(n, seed=6, epoch=0))
    seen: list[int] = []
    for pos in range(0, n - world * accum + 1, world * accum):
        parts = [rank_batches(order, pos, world, accum, r) for r in range(world)]
        assert all(len(p) == accum for p in parts)
        assert not set(parts[0]) & set(parts[1])
        # 2 ranks x 1 batch and 1 rank x 2 batches make the same update.
        assert set(rank_batches(order, pos, 1, 2, 0)) == set(rank_batches(order, pos, 2, 1, 0)) | set(
            rank_batches(order, pos, 2, 1, 1))
        seen += [int(b) for p in parts for b in p]
    assert len(seen) == len(set(seen)) == 18


def test_collate_layout() -> None:
    from mtpipe.training.batches import TokenSplit, collate

    split = TokenSplit("t", src=np.array([5, 6, 7], np.int32), src_off=np.array([0, 2, 3]),
                       tgt=np.array([8, 9, 10, 11], np.int32), tgt_off=np.array([0, 1, 4]), ids=np.array([0, 1]))
    src, tgt_in, tgt_out = collate(split, np.array([1, 0]))
    E, B, P = artifacts.EOS_ID, artifacts.BOS_ID, artifacts.PAD_ID
    assert src.tolist() == [[7, E, P], [5, 6, E]]
    assert tgt_in.tolist() == [[B, 9, 10, 11], [B, 8, P, P]]
    assert tgt_out.tolist() == [[9, 10, 11, E], [8, E, P, P]]
    assert src.dtype == tgt_in.dtype == torch.int64


def test_batches_map_ids_and_count_tokens(tmp_path: Path) -> None:
    """Batch ids are values of the tokens' id column (not row numbers); token counts match the bucket's."""
    from mtpipe.training.batches import load_batches, load_split

    tokens, batches = make_artifacts(tmp_path, n_train=40, id_base=1000)
    split = load_split(tokens, "train")
    table = load_batches(batches, "train", split)
    want = artifacts.read_table(batches, "train.parquet", "batches")
    np.testing.assert_array_equal(table.tgt_tokens, want.column("tgt_tokens").to_pylist())
    np.testing.assert_array_equal(table.src_width, want.column("src_len").to_pylist())
    assert sorted(table.rows.tolist()) == list(range(40))


# --------------------------------------------------------------------------------------------------------------------
# Training in this process (world size 1)
# --------------------------------------------------------------------------------------------------------------------


def test_tiny_model_overfits_a_fewpairs(tmp_path: Path) -> None:
    from mtpipe.training.train import train_model

    tokens, batches = make_artifacts(tmp_path, n_train=8, n_valid=8, max_tokens=96)
    cfg = tcfg(max_steps=150, warmup=30, lr_scale=1.0, label_smoothing=0.0, tokens_per_update=1, save_every_steps=0,
               valid_every_steps=0, log_every_steps=10)
    s = train_model(mcfg(dropout=0.0, d_model=64, d_ff=128), cfg, tokens, batches, tmp_path / "out")
    assert s["steps"] == 150
    assert s["train_loss"] < 0.05, s  # nll per target token (no smoothing): the 8 pairs are memorised


@pytest.fixture(scope="module")
def ws1_run(data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 updates of 2 accumulated batches, checkpoints every 4 (2 kept), validation every 6."""
    from mtpipe.training.train import train_model

    out = tmp_path_factory.mktemp("ws1") / "out"
    train_model(mcfg(), tcfg(keep_last=2), *data, out)
    return out


def test_outputs_checkpoints_and_metrics(ws1_run: Path) -> None:
    from mtpipe.model.transformer import build_model
    from mtpipe.training.update import learning_rate

    out = ws1_run
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000008", "step_00000012"]  # keep_last
    ck = artifacts.load_checkpoint(out / "checkpoints" / "step_00000012", trainer_state=True)
    assert ck.step == 12 and ck.vocab == {"spm_sha256": SPM, "size": VOCAB}
    ts = torch.load(out / "checkpoints" / "step_00000012" / "trainer.pt", weights_only=True)  # no pickle needed
    assert ts["step"] == 12 and len(ts["rng"]) == 1 and ts["accum"] == 2
    model = build_model(ck.model_config, ck.vocab["size"])
    model.load_state_dict(ck.state_dict)  # the checkpoint alone rebuilds the model
    summary = json.loads((out / "train.json").read_text())
    assert summary["steps"] == 12 and summary["stopped_by"] == "max_steps" and summary["accumulation"] == 2
    assert summary["valid_ppl"] == pytest.approx(math.exp(summary["valid_nll"]))
    # dvclive curves: one train row per update, validation at 6 and 12, the schedule's lr.
    assert [s for s, _ in tsv(out, "train/loss")] == list(range(1, 13))
    assert [s for s, _ in tsv(out, "valid/ppl")] == [6, 12]
    d = ck.model_config["d_model"]
    for step, lr in tsv(out, "train/lr"):
        assert float(lr) == pytest.approx(learning_rate(step, d, 10, 2.0), rel=1e-9)
    assert all(float(v) > 0 for _, v in tsv(out, "train/tgt_tokens_per_s"))
    assert json.loads((out / "live" / "metrics.json").read_text())["step"] == 12
    assert not (out / "live" / "dvc.yaml").exists() and not (out / "dvc.yaml").exists()


def test_finished_run_restarted_does_nothing_more(ws1_run: Path, data: tuple[Path, Path]) -> None:
    from mtpipe.training.train import train_model

    before = tsv(ws1_run, "train/loss")
    s = train_model(mcfg(), tcfg(keep_last=2), *data, ws1_run)
    assert s["steps"] == 12 and s["updates_this_run"] == 0 and s["resumed_from"].endswith("step_00000012")
    assert tsv(ws1_run, "train/loss") == before


def test_resume_repairs_metric_files_a_kill_cut_short(ws1_run: Path, data: tuple[Path, Path],
                                                      tmp_path: Path) -> None:
    """A kill while rank 0 writes its metrics leaves a half row in a curve and an empty metrics.json (dvclive writes
    both in place): the resume drops the half row and rows after the checkpoint, and rebuilds the summary."""
    import shutil

    from mtpipe.training.train import train_model

    out = tmp_path / "out"
    shutil.copytree(ws1_run, out)
    shutil.rmtree(out / "checkpoints" / "step_00000012")  # killed between step 12's metrics and its checkpoint
    with open(out / "live" / "plots" / "metrics" / "train" / "loss.tsv", "a") as f:
        f.write("13\t4.2")  # no newline: cut short
    (out / "live" / "metrics.json").write_text("{\n    \"train\": {")
    (out / "live" / ".metrics.json.tmp-x1y2").write_text("{")
    s = train_model(mcfg(), tcfg(keep_last=2), *data, out)
    assert s["resumed_from"].endswith("step_00000008") and s["updates_this_run"] == 4
    assert tsv(out, "train/loss") == tsv(ws1_run, "train/loss")  # rewound to 8, then the same 4 updates again
    summary = json.loads((out / "live" / "metrics.json").read_text())
    assert summary["step"] == 12 and summary["valid"]["ppl"] == pytest.approx(s["valid_ppl"])
    assert not [p.name for p in (out / "live").iterdir() if p.name.startswith(".")]  # no temp files left


def test_checkpoint_of_another_vocabulary_or_model_is_refused(ws1_run: Path, data: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    import shutil

    from mtpipe.training.train import train_model

    out = tmp_path / "out"
    shutil.copytree(ws1_run, out)
    other_tokens, other_batches = make_artifacts(tmp_path / "other", spm="sha256:" + "cd" * 32)
    with pytest.raises(MtpipeError, match="another vocabulary"):
        train_model(mcfg(), tcfg(max_steps=20), other_tokens, other_batches, out)
    with pytest.raises(MtpipeError, match="model.d_ff=64 but the params give 96"):
        train_model(mcfg(d_ff=96), tcfg(max_steps=20), *data, out)


def test_a_model_refused_on_resume_is_named_by_the_keys_the_user_changed(ws1_run: Path, data: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    """Another d_model also changes d_k and d_v (d_model / heads): the refusal names d_model, the key given, and
    the derived ones only as its consequence; a key the params no longer set is named with where its value now
    comes from (the preset). From the command line too, where the flag is what the user changed."""
    import shutil

    from mtpipe.training.train import train_model

    out = tmp_path / "out"
    shutil.copytree(ws1_run, out)
    with pytest.raises(MtpipeError) as e:
        train_model(mcfg(d_model=64), tcfg(max_steps=20), *data, out)
    assert str(e.value).startswith(f"{out / 'checkpoints'}/step_")
    assert (": checkpoint has model.d_model=32 but the params give 64, which makes model.d_k 16 -> 32, model.d_v "
            "16 -> 32; a new model needs a fresh run") in str(e.value)
    with pytest.raises(MtpipeError, match=r"checkpoint has model.d_model=32 and model.heads=2 but the params give "
                                          r"model.d_model=64 and model.heads=4;"):
        train_model(mcfg(d_model=64, heads=4), tcfg(max_steps=20), *data, out)
    unset = {k: v for k, v in TINY.items() if k != "d_model"}  # the tiny preset's d_model is 64
    with pytest.raises(MtpipeError, match=r"checkpoint has model.d_model=32 but the params give 64 \(the tiny "
                                          r"preset's value: model.d_model is not set\), which makes model.d_k"):
        train_model(ModelConfig(**unset), tcfg(max_steps=20), *data, out)
    import dataclasses

    from typer.testing import CliRunner

    from mtpipe.cli import app

    train = {k: v for k, v in dataclasses.asdict(tcfg(max_steps=20)).items() if v is not None}
    params = write_params(tmp_path / "params.yaml", TINY, {**train, "nproc": "1"})
    r = CliRunner().invoke(app, ["train", "--params", str(params), "--tokens", str(data[0]), "--batches",
                                 str(data[1]), "--out", str(out), "--d-model", "48"])
    assert r.exit_code == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]  # (the fixture's spm warns)
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    assert ("checkpoint has model.d_model=32 but the params give 48, which makes model.d_k 16 -> 24, model.d_v 16 "
            "-> 24") in errors[0]


def test_nonfinite_loss_skips_the_update_then_stops(data: tuple[Path, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import mtpipe.training.train as mt
    import mtpipe.training.update as mu

    real = mu.projected_label_smoothed_nll
    calls = {"n": 0, "bad": set()}

    def flaky(h, weight, bias, target, eps):
        calls["n"] += 1
        loss, nll = real(h, weight, bias, target, eps)
        if calls["n"] in calls["bad"]:
            loss = loss * float("nan")
        return loss, nll

    monkeypatch.setattr(mu, "projected_label_smoothed_nll", flaky)
    calls["bad"] = {3}  # the first micro-batch of update 2 (2 micro-batches per update)
    s = mt.train_model(mcfg(), tcfg(max_steps=4, valid_every_steps=0, save_every_steps=0), *data, tmp_path / "a")
    assert s["steps"] == 4  # the skipped update does not count
    assert "non-finite loss" in capsys.readouterr().err
    calls["n"], calls["bad"] = 0, set(range(1, 100))
    with pytest.raises(MtpipeError, match="diverged: 3 updates in a row"):
        mt.train_model(mcfg(), tcfg(max_steps=10, max_bad_steps=3), *data, tmp_path / "b")
    assert not (tmp_path / "b" / "checkpoints").exists()


def test_fp16_overflow_every_update_stops_at_the_cap_naming_the_scale_and_the_checkpoint(
        data: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # fp16's path on the CPU: the real grad scaler (a CPU one; fp16 itself needs a GPU) in Updater.finish, and an
    # overflowed gradient with a finite loss injected after each backward. A few overflows are skipped and training
    # goes on (each halves the scale); train.max_overflow_steps of them in a row end the run in one line naming the
    # loss scale and the last good checkpoint, which is left as it was.
    import mtpipe.training.train as mt
    import mtpipe.training.update as mu

    real_init, real_backward = mu.Updater.__init__, mu.Updater.backward
    overflow = {"updates": set()}

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)

    def backward(self, batch, scale, sync):
        sums = real_backward(self, batch, scale, sync)
        if getattr(self, "update", 0) in overflow["updates"]:
            self.params[0].grad.view(-1)[0] = float("inf")  # the loss stays finite
        return sums

    def finish(self, lr, loss):
        self.update = getattr(self, "update", 0) + 1  # which update the next backward belongs to
        return real_finish(self, lr, loss)

    real_finish = mu.Updater.finish
    monkeypatch.setattr(mu.Updater, "__init__", init)
    monkeypatch.setattr(mu.Updater, "backward", backward)
    monkeypatch.setattr(mu.Updater, "finish", finish)
    overflow["updates"] = {1, 2}  # the 2nd and 3rd updates (counted from 0): skipped, then training goes on
    s = mt.train_model(mcfg(), tcfg(max_steps=4, save_every_steps=2, valid_every_steps=0, max_overflow_steps=3),
                       *data, tmp_path / "run")
    assert s["steps"] == 4 and s["fp16_overflows"] == 2
    ck = artifacts.checkpoint_path(tmp_path / "run", 4)
    before = {p: p.read_bytes() for p in sorted((tmp_path / "run" / "checkpoints").rglob("*")) if p.is_file()}

    overflow["updates"] = set(range(100))  # from now on every update overflows
    with pytest.raises(MtpipeError) as e:
        mt.train_model(mcfg(), tcfg(max_steps=12, save_every_steps=2, valid_every_steps=0, max_overflow_steps=3),
                       *data, tmp_path / "run")
    line = str(e.value)
    assert "\n" not in line and "3 fp16 updates in a row had inf/nan gradients with a finite loss" in line
    assert "loss scale is now 2048;" in line  # 2^16 halved by the first run's 2 (its checkpoint's) and these 3
    assert f"last good checkpoint: {ck} (step 4)" in line
    after = {p: p.read_bytes() for p in sorted((tmp_path / "run" / "checkpoints").rglob("*")) if p.is_file()}
    assert after == before


def test_out_of_memory_names_the_batch_and_the_fix(data: tuple[Path, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import mtpipe.training.train as mt
    import mtpipe.training.update as mu

    def oom(self, *args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(mu.LossModule, "forward", oom)
    with pytest.raises(MtpipeError, match=r"out of memory .* sentences.*--max-tokens 24"):
        mt.train_model(mcfg(), tcfg(), *data, tmp_path / "out")


@pytest.mark.parametrize("kw, match", [
    (dict(precision="fp16"), "fp16 needs a CUDA GPU"),
    (dict(precision="int8"), "not one of"),
    (dict(max_steps=0, max_epochs=0, max_time=0.0), "at least one stopping criterion"),
    (dict(warmup=0), "warmup"),
    (dict(tokens_per_update=96 * 100), "fewer than one update"),
])
def test_bad_settings_are_clear_errors(data: tuple[Path, Path], tmp_path: Path, kw: dict, match: str) -> None:
    from mtpipe.training.train import train_model

    with pytest.raises(MtpipeError, match=match):
        train_model(mcfg(), tcfg(**kw), *data, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sequences_longer_than_the_model_allows(tmp_path: Path) -> None:
    """Too-long train batches are a clear error up front; a too-long valid pair is left out of validation."""
    from mtpipe.training.train import train_model

    tokens, batches = make_artifacts(tmp_path, long_valid=30, max_tokens=64)
    with pytest.raises(MtpipeError, match="max_positions=8; lower bucket.max_len"):
        train_model(mcfg(max_positions=8), tcfg(), tokens, batches, tmp_path / "a")
    s = train_model(mcfg(max_positions=20), tcfg(max_steps=2), tokens, batches, tmp_path / "b")
    assert math.isfinite(s["valid_loss"])


def test_batches_of_another_bpe_artifact_are_refused(data: tuple[Path, Path], tmp_path: Path) -> None:
    from mtpipe.training.train import train_model

    other_tokens, _ = make_artifacts(tmp_path, seed=3)
    with pytest.raises(MtpipeError, match="another bpe artifact"):
        train_model(mcfg(), tcfg(), other_tokens, data[1], tmp_path / "out")


def test_resume_warns_of_changed_batches_only_when_they_changed(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """A bucket re-run that only adds train.arrow (an artifact of an older mtpipe, rebuilt) is the same batches: no
    warning; batches packed otherwise are named."""
    from mtpipe.training.train import train_model

    old = make_artifacts(tmp_path / "old", arrow=False)
    train_model(mcfg(), tcfg(max_steps=4), *old, tmp_path / "run")
    capsys.readouterr()
    same = make_artifacts(tmp_path / "same", arrow=True)
    assert train_model(mcfg(), tcfg(max_steps=6), *same, tmp_path / "run")["resumed_from"]
    assert "batches changed" not in capsys.readouterr().err
    other = make_artifacts(tmp_path / "other", max_tokens=40)
    assert train_model(mcfg(), tcfg(max_steps=8), *other, tmp_path / "run")["resumed_from"]
    assert "the batches changed since step_00000006" in " ".join(capsys.readouterr().err.split())


def test_bf16_autocast_and_epoch_stop(data: tuple[Path, Path], tmp_path: Path) -> None:
    """bf16 autocast trains (weights stay float32); max_epochs stops at an epoch boundary."""
    from mtpipe.training.train import train_model

    s = train_model(mcfg(), tcfg(precision="bf16", max_steps=0, max_epochs=2, valid_every_steps=0), *data,
                    tmp_path / "o")
    assert s["stopped_by"] == "max_epochs" and s["epochs"] == 2.0 and s["precision"] == "bf16"
    assert math.isfinite(s["train_loss"]) and math.isfinite(s["valid_loss"])
    ck = artifacts.load_checkpoint(Path(s["checkpoints"][-1]))
    assert all(t.dtype == torch.float32 for t in ck.state_dict.values())


def test_training_forward_passes_choose_their_attention_kernels(data: tuple[Path, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every training and validation forward runs under :func:`mtpipe.model.ops.attention_kernels` for the run's
    device (on a GPU: no cuDNN attention, which sets itself up anew for each of the buckets' shapes; what the
    context switches is checked in test_decode), and the loss itself is computed inside it."""
    import contextlib

    from mtpipe.training import train, update, validation

    entered: list[str] = []
    inside = [False]

    @contextlib.contextmanager
    def recording(device: torch.device):
        entered.append(device.type)
        inside[0] = True
        try:
            yield
        finally:
            inside[0] = False

    calls = {"in": 0, "out": 0}
    forward = update.LossModule.forward

    def checked(self, *args, **kw):
        calls["in" if inside[0] else "out"] += 1
        return forward(self, *args, **kw)

    monkeypatch.setattr(update, "attention_kernels", recording)  # training forwards
    monkeypatch.setattr(validation, "attention_kernels", recording)  # validation forwards
    monkeypatch.setattr(update.LossModule, "forward", checked)
    s = train.train_model(mcfg(), tcfg(max_steps=3, valid_every_steps=2), *data, tmp_path / "o")
    assert s["steps"] == 3 and math.isfinite(s["valid_loss"])
    assert calls["out"] == 0 and calls["in"] == len(entered) > 3 and set(entered) == {"cpu"}


def test_no_dvc_side_effects_inside_a_git_checkout(data: tuple[Path, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """dvclive alone would `dvc init` (and `git add`) a git checkout that has no DVC repository: training must
    leave the repository untouched and create no experiment."""
    from mtpipe.training.train import train_model

    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.chdir(repo)
    train_model(mcfg(), tcfg(max_steps=2, valid_every_steps=0), *data, repo / "out")
    assert not (repo / ".dvc").exists() and not (repo / "dvc.yaml").exists()
    staged = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
    assert staged.splitlines() == ["?? out/"]


def test_time_limits_stop_and_checkpoint(data: tuple[Path, Path], tmp_path: Path) -> None:
    """max_time (minutes of training) stops the run; save_every_minutes writes checkpoints on rank 0's clock."""
    from mtpipe.artifacts import list_checkpoints
    from mtpipe.training.train import train_model

    s = train_model(mcfg(), tcfg(max_steps=0, max_time=0.02, save_every_steps=0, save_every_minutes=0.0002,
                         valid_every_steps=0), *data, tmp_path / "out")
    assert s["stopped_by"] == "max_time" and s["steps"] >= 1 and s["train_minutes"] >= 0.02
    steps = [st for st, _ in list_checkpoints(tmp_path / "out")]
    assert len(steps) >= 2 and steps[-1] == s["steps"]


def test_the_training_time_resumes_from_the_run_clock_not_the_checkpoint(data: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    """Wall time stays out of the checkpoints (their bytes depend on the weights and state alone) and in the run's
    clock.json, one entry per kept checkpoint; a resumed run's train.max_time counts the time before it from there,
    and a checkpoint moved away from its clock resumes with the time counted from 0 and a warning."""
    from mtpipe.artifacts import list_checkpoints
    from mtpipe.training.train import train_model

    out = tmp_path / "out"
    s = train_model(mcfg(), tcfg(max_steps=4, save_every_steps=1, keep_last=2, valid_every_steps=0), *data, out)
    clock = checkpoints.read_clock_file(out)
    assert sorted(clock) == [st for st, _ in list_checkpoints(out)] == [3, 4]  # pruned checkpoints' entries gone
    assert 0 < clock[4] <= s["train_minutes"] * 60 + 0.06  # train_minutes is rounded to 0.001 min
    ts = torch.load(artifacts.checkpoint_path(out, 4) / artifacts.TRAINER_STATE, weights_only=True)
    assert "train_seconds" not in ts
    train_model(mcfg(), tcfg(max_steps=5, save_every_steps=1, keep_last=2, valid_every_steps=0), *data, out)
    assert checkpoints.read_clock_file(out)[5] > clock[4]  # the time before the resume counted
    (out / checkpoints.CLOCK_FILE).write_text("{}")
    with pytest.raises(MtpipeError, match=r"clock.json: not a training clock"):
        train_model(mcfg(), tcfg(max_steps=6, valid_every_steps=0), *data, out)
    (out / checkpoints.CLOCK_FILE).unlink()
    s = train_model(mcfg(), tcfg(max_steps=6, save_every_steps=1, valid_every_steps=0), *data, out)
    assert s["steps"] == 6 and s["train_minutes"] * 60 < clock[4] + 60  # counted from 0 again (not an error)


def test_max_time_is_the_plan_under_the_linear_schedule(data: tuple[Path, Path], tmp_path: Path) -> None:
    """With train.schedule=linear, max_time is the budget the rate decays over: a run it ends did what was planned
    (no loud guard note), while under the paper's schedule it is a guard that cut max_epochs' plan short."""
    from mtpipe.training.train import train_model

    for schedule, cut_short in (("linear", False), ("inverse_sqrt", True)):
        s = train_model(mcfg(), tcfg(max_steps=0, max_epochs=10_000, max_time=0.01, schedule=schedule,
                                     save_every_steps=0, valid_every_steps=0), *data, tmp_path / schedule)
        assert s["stopped_by"] == "max_time" and s["schedule"] == schedule
        assert s["stopped_early"] is cut_short and (s["stop_note"] is not None) is cut_short


def test_precision_auto() -> None:
    from mtpipe import platform

    cpu = torch.device("cpu")
    assert platform.training_precision("auto", cpu) == ("bf16" if platform.cpu().native_bf16 else "fp32")
    assert platform.training_precision("fp32", cpu) == "fp32"
    for native in (True, False):  # asked as on a CPU with native bf16 and on one without
        flags = frozenset({"avx512_bf16"} if native else ())
        with platform.assume_cpu(capability="AVX512", isa_limit="", flags=flags):
            assert platform.training_precision("auto", cpu) == ("bf16" if native else "fp32")
    with pytest.raises(MtpipeError, match="train.precision=fp16 needs a CUDA GPU"):
        platform.training_precision("fp16", cpu)


def test_precision_auto_honours_an_isa_restriction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX2 emulation of a CPU without native bf16 (and a user's own restriction) trains in fp32."""
    from mtpipe import platform

    bf16_cpu = dict(capability="AVX512", isa_limit="", flags=frozenset({"avx512_bf16", "avx512f"}))
    with platform.assume_cpu(**bf16_cpu) as cpu:
        assert cpu.native_bf16 and platform.training_precision("auto", torch.device("cpu")) == "bf16"
    for restricted in (dict(isa_limit="AVX2"), dict(isa_limit="avx512_core_vnni"), dict(capability="AVX2")):
        with platform.assume_cpu(**{**bf16_cpu, **restricted}) as cpu:
            assert not cpu.native_bf16 and platform.training_precision("auto", torch.device("cpu")) == "fp32"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # what the probe reads
    assert platform.CPU.probe().isa_limit == "AVX2" and not platform.CPU.probe().native_bf16
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    # ATEN_CPU_CAPABILITY is read when torch starts: a fresh interpreter.
    code = ("import torch; from mtpipe import platform; "
            "print(torch.backends.cpu.get_cpu_capability(), platform.cpu().native_bf16, platform.cpu().restriction)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["AVX2", "False", "avx2"]


def test_an_isa_restriction_gets_its_own_compile_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch.compile's code cached without ATEN_CPU_CAPABILITY decoded garbage when reused under it: a restricted
    process compiles into a cache of its own, unless the user chose the cache directory."""
    from mtpipe import platform
    from mtpipe.engine.runtime import separate_compile_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with platform.assume_cpu(restriction=""):
        assert separate_compile_cache() is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    with platform.assume_cpu(restriction="avx2"):  # ATEN_CPU_CAPABILITY=AVX2, as torch started with
        path = separate_compile_cache()
        assert path is not None and Path(path).name == "capability-avx2"
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == path
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        assert separate_compile_cache() is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


# --------------------------------------------------------------------------------------------------------------------
# The launcher
# --------------------------------------------------------------------------------------------------------------------


def test_launcher_builds_the_torchrun_command() -> None:
    from mtpipe.config import ModelConfig, TrainConfig
    from mtpipe.training.launch import launch_command, resolve_nproc, torchrun_command

    if not torch.cuda.is_available():
        assert resolve_nproc("auto") == 1
    assert resolve_nproc("3") == 3
    for bad in ("0", "two"):
        with pytest.raises(MtpipeError, match="train.nproc"):
            resolve_nproc(bad)
    paths = {"tokens": Path("t"), "batches": Path("b"), "out": Path("x")}
    model, train = ModelConfig(preset="tiny", dropout=0.2), TrainConfig(nproc="2", max_restarts=1, compile=False)
    cmd = launch_command(model, train, paths, env={})
    assert cmd is not None and cmd[1:3] == ["-m", "torch.distributed.run"] and "--standalone" in cmd
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--max-restarts") + 1] == "1"
    worker = cmd[cmd.index("mtpipe") + 1:]
    assert worker[:7] == ["train", "--tokens", "t", "--batches", "b", "--out", "x"]
    # The workers get every resolved value as a flag, and not the launcher's own flags.
    assert worker[worker.index("--preset") + 1] == "tiny" and worker[worker.index("--dropout") + 1] == "0.2"
    assert "--no-compile" in worker and "--nproc" not in worker and "--max-restarts" not in worker
    # train.threads 0: the machine's cores are shared among the workers (torchrun alone would give each one thread);
    # an explicit train.threads or OMP_NUM_THREADS is left as it is.
    from mtpipe import platform

    assert worker[worker.index("--threads") + 1] == str(max(1, platform.cpu_count() // 2))
    explicit = launch_command(model, TrainConfig(nproc="2", threads=3), paths, env={})
    assert explicit is not None and explicit[explicit.index("--threads") + 1] == "3"
    omp = launch_command(model, train, paths, env={"OMP_NUM_THREADS": "5"})
    assert omp is not None and omp[omp.index("--threads") + 1] == "0"
    # One process, or a worker torchrun started: train here.
    assert launch_command(model, TrainConfig(nproc="1"), paths, env={}) is None
    assert launch_command(model, train, paths, env={"LOCAL_RANK": "0"}) is None
    assert launch_command(model, TrainConfig(nproc="1"), paths, env={"MTPIPE_MAX_RESTARTS": "2"}) is not None
    multi = torchrun_command(8, [], env={"MTPIPE_NNODES": "2", "MTPIPE_NODE_RANK": "1",
                                         "MTPIPE_RDZV_ENDPOINT": "node0:29400"})
    assert "--standalone" not in multi
    assert multi[multi.index("--nnodes") + 1] == "2" and multi[multi.index("--node-rank") + 1] == "1"
    assert multi[multi.index("--rdzv-endpoint") + 1] == "node0:29400"
    with pytest.raises(MtpipeError, match="MTPIPE_RDZV_ENDPOINT"):
        torchrun_command(8, [], env={"MTPIPE_NNODES": "2"})


# --------------------------------------------------------------------------------------------------------------------
# Separate processes: SIGKILL and resume, torchrun at world size 2
# --------------------------------------------------------------------------------------------------------------------

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc to find workers")


def _command(params: Path, data: tuple[Path, Path], out: Path, launcher: bool) -> list[str]:
    head = [sys.executable, str(REPO / "stages" / "train.py")] if launcher else [sys.executable, "-m", "mtpipe",
                                                                                "train"]
    return head + ["--params", str(params), "--tokens", str(data[0]), "--batches", str(data[1]), "--out", str(out)]


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=run_env(), cwd=log.parent).returncode
    if rc != 0:  # the first failing rank's own traceback, not only torchrun's summary of it
        text = log.read_text()
        rank0 = [ln for ln in text.splitlines() if ln.startswith("[rank0]")]
        raise AssertionError("\n".join(rank0[-40:]) + "\n...\n" + text[-3000:])


def _worker(proc: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun worker ``rank`` under a launch."""
    for pid in descendants(proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    raise AssertionError(f"no worker of rank {rank} found")


@needs_proc
def test_sigkill_and_rerun_continues_bitwise_at_world_size_1(data: tuple[Path, Path], tmp_path: Path) -> None:
    """Kill -9 after a checkpoint, run the same command again: the loss curve equals the uninterrupted run's."""
    # dropout 0.1: the RNG state matters. The reference runs `mtpipe train`; the killed run goes through the stage
    # launcher, which runs one process in-process (the same code path).
    params = write_params(tmp_path / "params.yaml", TINY, {**RESUME_TRAIN, "nproc": 1})
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    _run(_command(params, data, ref, launcher=False), tmp_path / "ref.log")
    log = tmp_path / "killed.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(_command(params, data, killed, launcher=True), stdout=f, stderr=subprocess.STDOUT,
                                env=run_env(), cwd=tmp_path)
    try:
        wait_for(killed / "checkpoints" / "step_00000006", proc, log)
    finally:
        kill_tree(proc, killed)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "checkpoints" / "step_00000016").exists()
    _run(_command(params, data, killed, launcher=True), tmp_path / "resumed.log")
    assert "resuming from" in (tmp_path / "resumed.log").read_text()
    assert_same_run(ref, killed, 16)


@pytest.fixture(scope="module")
def ws2_ref(data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An uninterrupted 2-process torchrun run (gloo) through the stage launcher; returns (params, out)."""
    root = tmp_path_factory.mktemp("ws2")
    params = write_params(root / "params.yaml", TINY, {**RESUME_TRAIN, "nproc": 2})
    _run(_command(params, data, root / "ref", launcher=True), root / "ref.log")
    return params, root / "ref"


@pytest.mark.slow
@needs_proc
def test_world_size_2_equals_world_size_1_with_twice_the_accumulation(data: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """2 processes x 1 batch and 1 process x 2 batches make the same updates: same parameters after N updates."""
    from mtpipe.training.train import train_model

    train = {**RESUME_TRAIN, "max_steps": 8, "save_every_steps": 0, "valid_every_steps": 0}
    params = write_params(tmp_path / "params.yaml", {**TINY, "dropout": 0.0}, {**train, "nproc": 2})
    _run(_command(params, data, tmp_path / "ws2", launcher=True), tmp_path / "ws2.log")
    s1 = train_model(mcfg(dropout=0.0), TrainConfig(**train), *data, tmp_path / "ws1")
    s2 = json.loads((tmp_path / "ws2" / "train.json").read_text())
    assert (s1["processes"], s1["accumulation"], s2["processes"], s2["accumulation"]) == (1, 2, 2, 1)
    w1, w2 = weights(tmp_path / "ws1" / "checkpoints" / "step_00000008"), weights(
        tmp_path / "ws2" / "checkpoints" / "step_00000008")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6, msg=k)
    losses1, losses2 = tsv(tmp_path / "ws1", "train/loss"), tsv(tmp_path / "ws2", "train/loss")
    assert [s for s, _ in losses2] == list(range(1, 9))
    for (_, a), (_, b) in zip(losses1, losses2):
        assert float(a) == pytest.approx(float(b), rel=1e-5)
    # Not trivially equal: 8 updates moved the weights well away from the shared initialisation.
    from mtpipe.model.transformer import Transformer

    torch.manual_seed(TrainConfig(**train).seed)  # the trainer seeds the initialisation with train.seed
    init = Transformer(mcfg(dropout=0.0), VOCAB).state_dict()
    assert max((w1[k] - init[k]).abs().max().item() for k in w1) > 1e-2


@pytest.mark.slow
@needs_proc
def test_bf16_gradient_allreduce_trains_alike_in_half_the_bytes(data: tuple[Path, Path], tmp_path: Path) -> None:
    """train.grad_allreduce=bf16 at world size 2: DDP's bf16 hook is what sums the gradients (the weights are not the
    fp32 run's), and the run follows the fp32 one closely (the effect on quality, at this scale)."""
    from mtpipe.training.train import train_model

    train = {**RESUME_TRAIN, "max_steps": 8, "save_every_steps": 0, "valid_every_steps": 0}
    params = write_params(tmp_path / "params.yaml", {**TINY, "dropout": 0.0},
                          {**train, "nproc": 2, "grad_allreduce": "bf16"})
    _run(_command(params, data, tmp_path / "bf16", launcher=True), tmp_path / "bf16.log")
    train_model(mcfg(dropout=0.0), TrainConfig(**train), *data, tmp_path / "fp32")
    w32, w16 = (weights(tmp_path / run / "checkpoints" / "step_00000008") for run in ("fp32", "bf16"))
    assert max((w32[k] - w16[k]).abs().max().item() for k in w32) > 1e-5  # not the fp32 sums
    for (_, a), (_, b) in zip(tsv(tmp_path / "fp32", "train/loss"), tsv(tmp_path / "bf16", "train/loss")):
        assert float(b) == pytest.approx(float(a), rel=2e-2)


@pytest.mark.slow
@needs_proc
def test_sigkill_and_worker_crash_resume_bitwise_at_world_size_2(ws2_ref: tuple[Path, Path],
                                                                  data: tuple[Path, Path], tmp_path: Path) -> None:
    """Under torchrun --max-restarts 1: a SIGKILLed worker makes torchrun restart the group, which resumes from the
    last checkpoint; then the whole launch is SIGKILLed and the same command run again. The loss curve still equals
    the uninterrupted 2-process run's, bitwise."""
    params, ref = ws2_ref
    out, log = tmp_path / "out", tmp_path / "run.log"
    cmd = _command(params, data, out, launcher=True) + ["--max-restarts", "1"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=run_env(), cwd=tmp_path)
    try:
        wait_for(out / "checkpoints" / "step_00000003", proc, log)
        os.kill(_worker(proc, 1), signal.SIGKILL)  # a crashed worker: torchrun restarts both, they resume
        wait_for(out / "checkpoints" / "step_00000009", proc, log)
    finally:
        kill_tree(proc, out)  # now the whole launch dies (or a failed test leaves nothing running)
    assert not (out / "checkpoints" / "step_00000016").exists()
    _run(cmd, tmp_path / "rerun.log")
    assert "resuming from" in (tmp_path / "rerun.log").read_text()
    assert_same_run(ref, out, 16)
    ts = torch.load(out / "checkpoints" / "step_00000016" / "trainer.pt", weights_only=True)
    assert len(ts["rng"]) == 2 and not torch.equal(ts["rng"][0]["torch"], ts["rng"][1]["torch"])


@pytest.mark.slow
@needs_proc
def test_a_killed_worker_ends_in_one_line_that_resumes_the_run_at_world_size_2(
        ws2_ref: tuple[Path, Path], data: tuple[Path, Path], tmp_path: Path) -> None:
    """Without restarts, a SIGKILLed worker ends the launch with a non-zero status and one line: the rank, its
    signal, the last checkpoint on disk and the command that resumes; torchrun's report (ChildFailedError, the
    surviving ranks' tracebacks) goes to the run's train.log, not the console. Running the printed command resumes
    the run, which then equals the uninterrupted one, bitwise."""
    import shlex
    import shutil

    params, ref = ws2_ref
    out = tmp_path / "out"
    cmd = _command(params, data, out, launcher=False)  # python -m mtpipe train ...; nproc 2 from params.yaml
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err, open(tmp_path / "stdout.txt", "w") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=err, env=run_env(), cwd=tmp_path)
    try:
        wait_for(out / "checkpoints" / "step_00000003", proc, err_path)
        os.kill(_worker(proc, 1), signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        kill_tree(proc, out)
    assert proc.returncode == 1
    stderr = err_path.read_text()
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    for noise in ("Traceback", "ChildFailedError", "[rank", "FAILED", "Root Cause"):
        assert noise not in stderr, stderr
    step, last = artifacts.list_checkpoints(out)[-1]
    assert step < 16
    head, rerun = errors[0].split("; to resume, run: ")
    assert head == ("error: training failed: rank 1 was killed by signal SIGKILL (9); last checkpoint: "
                    f"{last} (step {step})")
    rerun, report = rerun.split("; torchrun's report and the tracebacks: ")
    assert report == str(out / "train.log")
    log = (out / "train.log").read_text()
    assert "Root Cause (first observed failure)" in log and "exitcode  : -9" in log and "training failed: rank 1" in log
    # The command is this launch's own, word for word, with a program the shell finds.
    words = shlex.split(rerun)
    assert words[1:] == cmd[1:]
    assert os.path.samefile(shutil.which(words[0]) or words[0], sys.executable)
    _run(words, tmp_path / "rerun.log")
    assert f"resuming from {last}" in (tmp_path / "rerun.log").read_text()
    assert_same_run(ref, out, 16)


@pytest.mark.slow
@needs_proc
def test_a_refusal_in_the_workers_is_their_one_line_at_world_size_2(ws2_ref: tuple[Path, Path],
                                                                    data: tuple[Path, Path], tmp_path: Path) -> None:
    """An error every worker reports as bad input (here: a resume with another d_model) is printed once, as one
    process prints it, with no resume advice and no torchrun report."""
    import shutil

    params, ref = ws2_ref
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    r = subprocess.run(_command(params, data, out, launcher=False) + ["--d-model", "48"], capture_output=True,
                       text=True, env=run_env(), cwd=tmp_path)
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr
    assert errors[0].startswith(f"error: {out / 'checkpoints' / 'step_00000016'}: checkpoint has model.d_model=32 "
                                "but the params give 48, which makes model.d_k 16 -> 24")
    assert "to resume" not in errors[0]


class _Failure:
    """A stand-in for torchrun's ProcessFailure (what root_failure and failure_summary read)."""

    def __init__(self, exitcode: int, timestamp: int = 100, message: object = "") -> None:
        self.exitcode, self.timestamp, self.message = exitcode, timestamp, message


def _recorded(kind: str, message: str, at: float, code: int = 1) -> dict:
    return {"message": message, "extraInfo": {"py_callstack": "Traceback ...", "timestamp": str(int(at)),
                                              "mtpipe": {"kind": kind, "message": message, "exit_code": code,
                                                         "time": at}}}


def test_the_root_failure_is_the_killed_process_else_the_first_recorded_error(tmp_path: Path) -> None:
    from mtpipe.training.failures import failure_summary, root_failure

    lost_peer = _recorded("exception", "RuntimeError: Connection reset by peer", 100.9)
    killed = {0: _Failure(1, 100, lost_peer), 1: _Failure(-9, 101), 2: _Failure(-15, 100)}
    assert root_failure(killed)[0] == 1  # the one killed from outside, though rank 0's error is "earlier"
    bug = _recorded("exception", "ValueError: bad thing", 100.2)
    assert root_failure({0: _Failure(1, 100, lost_peer), 1: _Failure(1, 100, bug)})[0] == 1  # same second: by time
    assert root_failure({0: _Failure(-15, 100), 1: _Failure(3, 99)})[0] == 1  # torchrun's rule, earliest
    line, code = failure_summary({0: _Failure(1, 100, lost_peer), 1: _Failure(1, 100, bug)}, tmp_path / "none",
                                 "mtpipe train --out x", tmp_path / "train.log")
    assert code == 1 and line == ("training failed: rank 1 failed (exit status 1): ValueError: bad thing; last "
                                  "checkpoint: none yet (a rerun starts from step 0); to resume, run: mtpipe train "
                                  f"--out x; torchrun's report and the tracebacks: {tmp_path / 'train.log'}")
    refused = _recorded("mtpipe", "x/step_00000004: checkpoint has model.d_model=32 but ...", 100.1, code=1)
    assert failure_summary({0: _Failure(1, 100, refused), 1: _Failure(-15, 100)}, tmp_path, "mtpipe train",
                           None) == ("x/step_00000004: checkpoint has model.d_model=32 but ...", 1)


def test_a_workers_error_is_recorded_where_torchrun_reads_it(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from mtpipe.training.failures import REPORTS_ENV, recorded_error
    from mtpipe.training.launch import worker_errors

    path = tmp_path / "attempt_0" / "1" / "error.json"
    env = {"TORCHELASTIC_ERROR_FILE": str(path), REPORTS_ENV: "1"}
    for error, kind, message, code in [(ValueError("bad\nthing"), "exception", "ValueError: bad", 1),
                                       (MtpipeError("train.x: bad"), "mtpipe", "train.x: bad", 1),
                                       (KeyboardInterrupt(), "interrupted", "interrupted", 130)]:
        with pytest.raises(SystemExit) as e:
            with worker_errors(env):
                raise error
        assert e.value.code == code
        failure = ProcessFailure(local_rank=1, pid=1, exitcode=code, error_file=str(path))
        assert recorded_error(failure)["kind"] == kind and recorded_error(failure)["message"] == message
        assert "Traceback" in failure.message["extraInfo"]["py_callstack"]  # the traceback, for the report
    # Not a worker of mtpipe's launcher: errors pass through as usual.
    with pytest.raises(ValueError):
        with worker_errors({"TORCHELASTIC_ERROR_FILE": str(path)}):
            raise ValueError("plain")


def test_the_resume_command_is_the_launch_command() -> None:
    from mtpipe.training.failures import rerun_command

    main = str(REPO / "mtpipe" / "__main__.py")
    assert rerun_command([main, "train", "--out", "my run"]).endswith(" -m mtpipe train --out 'my run'")
    assert rerun_command(["stages/train.py", "--nproc", "2"]).endswith(" stages/train.py --nproc 2")
    assert rerun_command(["/nowhere/bin/mtpipe", "train"]) == "/nowhere/bin/mtpipe train"  # not on PATH: as given
