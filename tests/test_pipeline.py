"""The whole DVC pipeline (issue 5): `dvc repro` in a fresh git + DVC repository on a tiny corpus.

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
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import REPO

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


def run(repo: Path, *args: str, check: bool = True) -> str:
    env = dict(os.environ)
    # The stages call `mtpipe` and `python`: the ones of the environment running the tests.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@example.com", DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1")
    p = subprocess.run(list(args), cwd=repo, env=env, capture_output=True, text=True)
    out = p.stdout + p.stderr
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {p.returncode}:\n{out[-4000:]}")
    return out


def ran_stages(output: str) -> list[str]:
    return re.findall(r"Running stage '(\w+)'", output)


def test_dvc_repro_runs_the_seven_stages_then_only_what_changed(tmp_path: Path, multi30k_small: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(REPO / "dvc.yaml", repo / "dvc.yaml")
    shutil.copy(REPO / ".gitignore", repo / ".gitignore")
    shutil.copytree(REPO / "stages", repo / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "mtpipe", repo / "mtpipe", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "params.yaml").write_text(yaml.safe_dump(tiny_params(multi30k_small), sort_keys=False), encoding="utf-8")
    dvc = [sys.executable, "-m", "dvc"]
    run(repo, "git", "init", "-q")
    run(repo, *dvc, "init", "-q")
    run(repo, *dvc, "config", "core.analytics", "false")

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
