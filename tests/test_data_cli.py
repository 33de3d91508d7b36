"""The data stages end to end through the CLI, as a user runs them: fetch -> bpe -> bucket with default paths."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.compute as pc
from typer.testing import CliRunner

from mtpipe.artifacts import manifest_hash, read_manifest, read_table
from mtpipe.cli import app

REPO = Path(__file__).resolve().parents[1]


def test_fetch_bpe_bucket_with_params_yaml(small_corpus: Path, tmp_path: Path, monkeypatch):
    work = tmp_path / "project"
    work.mkdir()
    shutil.copy(REPO / "params.yaml", work / "params.yaml")
    monkeypatch.chdir(work)
    run = CliRunner().invoke
    r = run(app, ["fetch", "--source", str(small_corpus)])
    assert r.exit_code == 0, r.output
    assert "pairs out" in r.output  # the summary table
    r = run(app, ["bpe", "--vocab-size", "600"])
    assert r.exit_code == 0, r.output
    assert "unk rate" in r.output
    r = run(app, ["bucket", "--max-tokens", "1024"])
    assert r.exit_code == 0, r.output
    assert "padding ratio" in r.output

    fetch_dir, bpe_dir, bucket_dir = work / "artifacts/fetch", work / "artifacts/bpe", work / "artifacts/bucket"
    corpus = read_manifest(fetch_dir, "corpus")
    tokens = read_manifest(bpe_dir, "tokens")
    batches = read_manifest(bucket_dir, "batches")
    # Lineage: each manifest holds the hash of the one upstream.
    assert tokens.upstream == {"corpus": manifest_hash(fetch_dir)}
    assert batches.upstream == {"tokens": manifest_hash(bpe_dir)}
    # params.yaml values, with the flags on top.
    assert corpus.params["fetch"]["splits"]["valid"] == ["validation", "val"]
    assert corpus.extra["source_splits"] == {"train": "train", "valid": "val", "test": "test_2016_flickr"}
    assert tokens.params["bpe"]["vocab_size"] == 600 and batches.params["bucket"]["max_tokens"] == 1024
    assert sorted(corpus.files) == ["test.parquet", "train.parquet", "valid.parquet"]
    assert sorted(tokens.files) == ["spm.model", "spm.vocab", "test.parquet", "train.parquet", "valid.parquet"]
    assert sorted(batches.files) == ["train.arrow", "train.parquet", "valid.parquet"]
    assert corpus.rows["valid.parquet"] == tokens.rows["valid.parquet"] == 100
    # Every train id of the tokens split is in exactly one batch (no pair is longer than max_len here).
    ids = read_table(bpe_dir, "train.parquet", "tokens", columns=["id"]).column("id")
    batched = pc.list_flatten(read_table(bucket_dir, "train.parquet", "batches").column("ids"))
    assert len(batched) == len(ids)
    assert sorted(batched.to_pylist()) == sorted(ids.to_pylist())

    # Re-running a stage with the same inputs reproduces its artifact byte for byte.
    before = dict(tokens.files)
    r = run(app, ["bpe", "--vocab-size", "600"])
    assert r.exit_code == 0, r.output
    assert read_manifest(bpe_dir).files == before


def test_default_source_offline_is_a_clear_error(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    r = CliRunner().invoke(app, ["fetch"], env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert r.exit_code == 1
    assert "error: fetch.source hf:bentrevett/multi30k: cannot load the Hugging Face dataset" in r.output
    assert not (tmp_path / "artifacts" / "fetch").exists()
