"""Artifact manifests: validation on read, atomic writes, lineage."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from mtpipe import artifacts, writing
from mtpipe.errors import MtpipeError


def _corpus(n: int = 3) -> pa.Table:
    return pa.table({"id": list(range(n)), "src": ["a"] * n, "tgt": ["b"] * n})


def test_roundtrip_and_lineage(tmp_path: Path):
    up = tmp_path / "up"
    with writing.ArtifactWriter(up, "corpus", {"fetch": {"x": 1}}) as w:
        w.write_table("train.parquet", _corpus())
    with writing.ArtifactWriter(tmp_path / "down", "corpus", upstream={"corpus": up}) as w:
        w.write_table("train.parquet", _corpus(5))
    m = artifacts.read_manifest(tmp_path / "down", "corpus")
    assert m.rows == {"train.parquet": 5}
    assert m.upstream["corpus"] == artifacts.manifest_hash(up)
    assert artifacts.read_manifest(up).params == {"fetch": {"x": 1}}
    assert artifacts.read_table(up, "train.parquet", "corpus").num_rows == 3
    assert artifacts.splits_of(up, "corpus") == ["train"]


def test_failed_write_leaves_nothing_and_keeps_old(tmp_path: Path):
    out = tmp_path / "a"
    with writing.ArtifactWriter(out, "corpus") as w:
        w.write_table("train.parquet", _corpus())
    with pytest.raises(RuntimeError):
        with writing.ArtifactWriter(out, "corpus") as w:
            w.write_table("train.parquet", _corpus(10))
            raise RuntimeError("killed")
    assert artifacts.read_table(out, "train.parquet", "corpus").num_rows == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temp dirs left


def test_wrong_kind_version_schema_and_tamper_are_refused(tmp_path: Path):
    out = tmp_path / "a"
    with writing.ArtifactWriter(out, "corpus") as w:
        w.write_table("train.parquet", _corpus())
    with pytest.raises(MtpipeError, match="expected 'tokens'"):
        artifacts.read_manifest(out, "tokens")
    m = json.loads((out / "manifest.json").read_text())
    m["format_version"] = 0
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(MtpipeError, match="format version 0"):
        artifacts.read_manifest(out, "corpus")
    m["format_version"] = 1
    (out / "manifest.json").write_text(json.dumps(m))
    # A tokens-kind read of a corpus-schema file, relabelled: the schema check catches it.
    m["kind"] = "tokens"
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(MtpipeError, match="wrong schema"):
        artifacts.open_parquet(out, "train.parquet", "tokens")
    with open(out / "train.parquet", "ab") as f:
        f.write(b"x")
    with pytest.raises(MtpipeError, match="does not match"):
        artifacts.verify_file(out, "train.parquet")
    with pytest.raises(MtpipeError, match="not an mtpipe artifact"):
        artifacts.read_manifest(tmp_path)
    with pytest.raises(MtpipeError, match="not found"):
        artifacts.read_manifest(tmp_path / "nope")


def test_checkpoint_roundtrip_without_pickle(tmp_path: Path):
    import torch

    sd = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    ts = {"step": 7, "rng": torch.get_rng_state(), "nested": {"a": [1, 2]}}
    writing.write_checkpoint(tmp_path / "ck", state_dict=sd, model_config={"d_model": 4}, vocab={"size": 10},
                               step=7, trainer_state=ts)
    ck = artifacts.load_checkpoint(tmp_path / "ck", trainer_state=True)
    assert ck.step == 7 and ck.model_config == {"d_model": 4} and ck.vocab == {"size": 10}
    assert torch.equal(ck.state_dict["w"], sd["w"]) and ck.state_dict["b"].dtype == torch.bfloat16
    assert torch.equal(ck.trainer_state["rng"], ts["rng"]) and ck.trainer_state["nested"] == {"a": [1, 2]}


def test_atomic_write_text(tmp_path: Path):
    p = tmp_path / "m" / "x.json"
    writing.atomic_write_text(p, "{}")
    assert p.read_text() == "{}" and [q.name for q in p.parent.iterdir()] == ["x.json"]


def test_checkpoint_format_1_is_still_read_and_a_newer_one_refused(tmp_path: Path):
    import torch

    writing.write_checkpoint(tmp_path / "ck", state_dict={"w": torch.ones(2)}, model_config={}, vocab={"size": 2},
                             step=3)
    path = tmp_path / "ck" / "manifest.json"
    m = json.loads(path.read_text())
    assert m["format_version"] == 2 and "spm_model" not in m["extra"]
    m["format_version"] = 1
    path.write_text(json.dumps(m))
    ck = artifacts.load_checkpoint(tmp_path / "ck")
    assert ck.step == 3 and ck.spm is None
    m["format_version"] = 3
    path.write_text(json.dumps(m))
    with pytest.raises(MtpipeError, match="format version 3, .* reads versions 1, 2"):
        artifacts.read_manifest(tmp_path / "ck")
