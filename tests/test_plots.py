"""`mtpipe plots`: a run's dvclive curves, as :mod:`mtpipe.training.metrics` writes them, become PNG charts and a page that
opens offline (no http, no script, only the PNGs beside it); a run without metrics fails in one line with nothing
written; the default output inside the run leaves it a run that training resumes from."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpipe import artifacts, writing
from mtpipe.cli import app
from mtpipe.training.metrics import Metrics, Window
from mtpipe.stages.plots import charts_for, read_run, read_tsv

PNG = b"\x89PNG\r\n\x1a\n"


def fake_run(run: Path, steps: int = 6, bleu: bool = True) -> Path:
    """A run directory whose ``live/`` is written by the trainer's own writer (:class:`mtpipe.training.metrics.Metrics`):
    train points every update, valid loss/ppl (and BLEU) every other one."""
    metrics = Metrics()
    metrics.open(run, None)
    for step in range(1, steps + 1):
        w = Window()
        w.add(loss=40.0 / step, nll=30.0 / step, tokens=10, grad_norm=1.0 + step)
        metrics.log(step, w.values(lr=1e-4 * step, tgt_per_s=100.0 + step, src_per_s=90.0, epoch=step / 3))
        if step % 2 == 0:
            valid = {"valid/loss": 3.5 / step, "valid/nll": 3.0 / step, "valid/ppl": math.exp(3.0 / step)}
            metrics.log(step, {**valid, **({"valid/bleu": 5.0 * step} if bleu else {})})
    metrics.close()
    (run / "checkpoints").mkdir()
    return run


def invoke(*args: str):
    return CliRunner().invoke(app, ["plots", *args])


def test_cli_draws_the_curves_into_the_run_and_a_page_of_local_files_only(tmp_path):
    run = fake_run(tmp_path / "train")
    r = invoke("--run", str(run))
    assert r.exit_code == 0, r.output
    out = run / "plots"  # the default: inside the run
    m = artifacts.read_manifest(out, "plots")
    pngs = {p.name for p in out.glob("*.png")}
    assert {"loss.png", "ppl.png", "lr.png", "bleu.png", "throughput.png"} <= pngs
    for name in pngs:
        assert (out / name).read_bytes()[:8] == PNG and artifacts.verify_file(out, name, m)
    page = (out / "index.html").read_text(encoding="utf-8")
    assert not re.search(r"https?:", page, re.I) and "<script" not in page.lower()
    refs = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', page)
    assert set(refs) == pngs and all((out / ref).is_file() and "/" not in ref for ref in refs)
    writing.check_run_dir(run)  # a run directory with its plots is still one that `mtpipe train` resumes
    r = invoke("--run", str(run))  # its own output is replaced
    assert r.exit_code == 0, r.output
    assert not [p for p in run.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_loss_chart_has_train_and_valid_and_every_logged_series_is_drawn(tmp_path):
    run = fake_run(tmp_path / "train", bleu=False)
    series = read_run(run)
    assert series["train/loss"] == ([1, 2, 3, 4, 5, 6], pytest.approx([4.0 / s for s in range(1, 7)]))
    assert series["valid/loss"][0] == [2, 4, 6]
    charts = charts_for({**series, "valid/chrf": ([2], [50.0])})
    by_file = {c.file: c for c in charts}
    assert by_file["loss.png"].series == ("train/loss", "valid/loss")
    assert "bleu.png" not in by_file  # no valid BLEU logged: no empty chart
    drawn = {s for c in charts for s in c.series}
    assert set(series) | {"valid/chrf"} <= drawn  # every logged curve somewhere, unknown ones on charts of their own
    assert by_file["other-chrf.png"].series == ("valid/chrf",)


def test_read_tsv_ignores_a_timestamp_column_and_a_row_cut_short(tmp_path):
    path = tmp_path / "loss.tsv"
    path.write_text("timestamp\tstep\tloss\n1\t10\t2.5\n2\t20\t2.0\n3\t3", encoding="utf-8")
    assert read_tsv(path) == ([10, 20], [2.5, 2.0])


@pytest.mark.parametrize("make", ["empty", "missing", "checkpoints only"])
def test_a_run_without_metrics_is_one_line_and_writes_nothing(tmp_path, make):
    run = tmp_path / "train"
    if make != "missing":
        run.mkdir()
    if make == "checkpoints only":
        (run / "checkpoints").mkdir()
    out = tmp_path / "pictures"
    r = invoke("--run", str(run), "--out", str(out))
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {run}: ") and "run directory" in lines[0], r.output
    assert not out.exists() and not (run / "plots").exists()


def test_output_over_what_it_reads_or_not_its_own_is_refused(tmp_path):
    run = fake_run(tmp_path / "train")
    r = invoke("--run", str(run), "--out", str(run / "live" / "pics"))
    assert r.exit_code == 1 and "is inside the input" in r.output
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("keep", encoding="utf-8")
    r = invoke("--run", str(run), "--out", str(notes))
    assert r.exit_code == 1 and "not an mtpipe artifact" in r.output
    assert [p.name for p in notes.iterdir()] == ["mine.txt"]
