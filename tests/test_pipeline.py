"""The whole DVC pipeline: `dvc repro` in a fresh git + DVC repository on a tiny corpus.

The repository gets the project's own dvc.yaml, stages/ and mtpipe/ sources (dvc.yaml lists the modules as deps),
and the committed params.yaml with only the sizes shrunk, so a broken quickstart params.yaml or dvc.yaml fails here.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from conftest import REPO
from mtpipe import artifacts

STAGES = ["fetch", "bpe", "bucket", "train", "average", "decode", "score"]


def tiny_params(corpus: Path) -> dict:
    """The committed params.yaml, pointed at a local corpus and shrunk to run in seconds."""
    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    params["fetch"]["source"] = str(corpus)
    params["bpe"].update(vocab_size=400)
    params["bucket"].update(max_tokens=512)
    params["model"] = dict(preset="tiny", encoder_layers=1, decoder_layers=1, d_model=32, d_ff=64, heads=2)
    params["train"].update(max_steps=8, max_epochs=0, max_time=0, warmup=4, tokens_per_update=512, threads=1,
                           save_every_steps=2, save_every_minutes=0, valid_every_steps=4, log_every_steps=2, nproc="1")
    params["average"].update(last=2)
    params["decode"].update(beam=2, threads=1)
    return params


def environment() -> dict[str, str]:
    env = dict(os.environ)
    # The stages call `mtpipe` and `python`: the ones of the environment running the tests.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1")
    return env


def run(repo: Path, *args: str, check: bool = True) -> str:
    p = subprocess.run(list(args), cwd=repo, env=environment(), capture_output=True, text=True)
    out = p.stdout + p.stderr
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {p.returncode}:\n{out[-4000:]}")
    return out


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", output)


DVC = [sys.executable, "-m", "dvc"]


def make_repo(repo: Path, params: dict) -> Path:
    """A git + DVC repository with the project's dvc.yaml, stages/, mtpipe/ and ``params``."""
    repo.mkdir(parents=True)
    shutil.copy(REPO / "dvc.yaml", repo / "dvc.yaml")
    shutil.copy(REPO / ".gitignore", repo / ".gitignore")
    shutil.copytree(REPO / "stages", repo / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "mtpipe", repo / "mtpipe", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    run(repo, "git", "init", "-q")
    run(repo, *DVC, "init", "-q")
    run(repo, *DVC, "config", "core.analytics", "false")
    return repo


def test_dvc_repro_runs_the_seven_stages_then_only_what_changed(tmp_path: Path, small_corpus: Path) -> None:
    repo = make_repo(tmp_path / "repo", tiny_params(small_corpus))
    dvc = DVC

    out = run(repo, *dvc, "repro")
    assert ran_stages(out) == STAGES
    metrics = json.loads((repo / "metrics" / "score.json").read_text(encoding="utf-8"))
    assert 0.0 <= metrics["bleu"] <= 100.0 and "chrf" in metrics and "ter" in metrics
    assert "up to date" in run(repo, *dvc, "status")
    shown = run(repo, *dvc, "metrics", "show")
    assert "bleu" in shown and "valid.ppl" in shown  # score.json and the training run's last logged values
    run(repo, *dvc, "plots", "show", "-o", "plots")  # the training curves, rendered to HTML
    html = (repo / "plots" / "index.html").read_text(encoding="utf-8")
    for curve in ("train_loss", "train_lr", "train_tgt_tokens_per_s", "valid_ppl"):
        assert f"metrics_{curve}_tsv" in html, curve

    # A second repro does nothing.
    assert ran_stages(run(repo, *dvc, "repro")) == []

    # An experiment on a decode knob re-runs decode and score only.
    run(repo, "git", "add", "-A")
    run(repo, "git", "commit", "-qm", "pipeline")
    out = run(repo, *dvc, "exp", "run", "-S", "decode.beam=1")
    assert ran_stages(out) == ["decode", "score"]
    # dvc exp show compares the runs: each row has its own metrics (uncached metrics live in git, not ignored).
    rows = list(csv.DictReader(io.StringIO(run(repo, *dvc, "exp", "show", "--csv"))))
    assert {r["decode.beam"] for r in rows} >= {"1", "2"}
    assert all(r["bleu"] not in ("", "!") and r["valid.ppl"] not in ("", "!") for r in rows), rows


def test_dvc_repro_after_an_interruption_resumes_training_bitwise(tmp_path: Path, small_corpus: Path) -> None:
    """Ctrl-C during `dvc repro`'s training, then `dvc repro` again: training resumes from its last checkpoint (DVC
    must not delete the checkpoints, `persist`), keeps every earlier one, and ends with the weights and loss curve of
    an uninterrupted run, bit for bit."""
    from safetensors.torch import load_file

    params = tiny_params(small_corpus)
    params["train"].update(max_steps=200, save_every_steps=10, keep_last=30, valid_every_steps=50, log_every_steps=10)
    whole = make_repo(tmp_path / "whole", params)
    cut = make_repo(tmp_path / "cut", params)
    run(whole, *DVC, "repro")

    ck_dir = cut / "artifacts" / "train" / "checkpoints"
    # Ctrl-C as a terminal delivers it: SIGINT at its default disposition in DVC and so in the training process. A
    # test run started in the background (`make test &`) inherits SIGINT ignored, and an ignored SIGINT stays ignored
    # across exec, so without this the interruption would not interrupt.
    p = subprocess.Popen([*DVC, "repro"], cwd=cut, env=environment(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not (ck_dir / "step_00000020").exists():
            assert p.poll() is None and time.monotonic() < deadline, "training never reached step 20"
            time.sleep(0.01)
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C: DVC and the training process both get it
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    kept = {d.name: artifacts.manifest_hash(d) for d in ck_dir.iterdir() if not d.name.startswith(".")}
    assert "step_00000200" not in kept, "training finished before the interruption: nothing was tested"

    out = run(cut, *DVC, "repro")
    assert ran_stages(out) == ["train", "average", "decode", "score"]
    assert "resuming from" in out
    for name, h in kept.items():  # the checkpoints from before the interruption are the same files
        assert artifacts.manifest_hash(ck_dir / name) == h, name
    for name in ("step_00000200", "step_00000100"):
        a = load_file(str(ck_dir / name / "model.safetensors"))
        b = load_file(str(whole / "artifacts/train/checkpoints" / name / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    curve = Path("artifacts/train/live/plots/metrics/train/loss.tsv")
    assert (cut / curve).read_text() == (whole / curve).read_text()  # no row lost, none twice
    assert json.loads((cut / "metrics/score.json").read_text())["bleu"] == \
        json.loads((whole / "metrics/score.json").read_text())["bleu"]
