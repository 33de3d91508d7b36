"""The train data loader: train.arrow memory-mapped (the batches of the Parquet loader, views of the mapped file), its
hash checked once and remembered, a changed file caught at the next start, an older bucket artifact still read."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from mtpipe import artifacts, reading, writing

from mtpipe.stages import bucket
from mtpipe.training.batches import MappedSplit, collate, load_batches, load_split, load_train_data
from mtpipe.config import BucketConfig
from mtpipe.errors import MtpipeError

SPM = "sha256:" + "ab" * 32


def tokens_artifact(out: Path, n: int, seed: int = 0) -> Path:
    """A tokens artifact of ``n`` random pairs (some empty, ids not row positions) and a small valid split."""
    rng = np.random.default_rng(seed)

    def side(k: int) -> pa.Array:
        return pa.array([rng.integers(4, 60, int(rng.integers(0, 24))).tolist() for _ in range(k)],
                        pa.list_(pa.int32()))

    with writing.ArtifactWriter(out, "tokens", {"bpe": {"vocab_size": 64}}) as w:
        for split, k in (("train", n), ("valid", 20)):
            w.write_table(f"{split}.parquet", pa.table({"id": np.arange(k, dtype=np.int64) * 5 + 7,
                                                        "src": side(k), "tgt": side(k)}))
        w.path("spm.model").write_bytes(b"not a real sentencepiece model")
        w.extra.update(spm_sha256=SPM, vocab_size=64)
    return out


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A verification cache of this test's own, and no racy-file margin (the artifacts here are seconds old)."""
    monkeypatch.setenv("MTPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(reading, "RACY_NS", 0)
    return tmp_path / "cache"


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The bucket stage's artifact of 1,500 pairs, train.arrow in record batches of about 200 pairs."""
    monkeypatch.setattr(bucket, "ARROW_CHUNK_PAIRS", 200)
    tokens = tokens_artifact(tmp_path / "bpe", 1500)
    bucket.bucket_tokens(BucketConfig(max_tokens=160, max_len=20, multiple_of=4), tokens, tmp_path / "bucket")
    return tokens, tmp_path / "bucket"


def hash_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files artifacts.file_hash hashes from now on."""
    calls: list[str] = []
    real = artifacts.file_hash

    def counting(path: Path, *a, **kw) -> str:
        calls.append(Path(path).name)
        return real(path, *a, **kw)

    monkeypatch.setattr(artifacts, "file_hash", counting)
    return calls


def assert_same_batches(a, b) -> None:
    """Two loaders' train data give the same batch table and the same collated tensors for every batch."""
    assert len(a.train) == len(b.train)
    for f in ("src_tokens", "tgt_tokens", "src_width", "tgt_width"):
        x, y = getattr(a.train, f), getattr(b.train, f)
        assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y), f
    for i in range(len(a.train)):
        for x, y in zip(collate(a.train_tokens, a.train.batch(i), 2), collate(b.train_tokens, b.train.batch(i), 2)):
            assert x.dtype == y.dtype and torch.equal(x, y), i


def test_mapped_batches_equal_the_parquet_loaders(data: tuple[Path, Path], cache: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    tokens, batches = data
    mapped = load_train_data(tokens, batches, 320, 1)
    assert isinstance(mapped.train_tokens, MappedSplit) and len(mapped.train_tokens.chunks) > 3
    assert "train.arrow" in artifacts.read_manifest(batches).files

    class Old:  # what load_train_data read before train.arrow: both artifacts' train.parquet
        train_tokens = load_split(tokens, "train")
        train = load_batches(batches, "train", train_tokens)

    assert_same_batches(mapped, Old)
    # the ids are those of train.parquet, batch after batch
    ids = artifacts.read_table(batches, "train.parquet", "batches").column("ids").to_pylist()
    for i in (0, len(ids) // 2, len(ids) - 1):
        chunk, rows = mapped.train_tokens.locate(mapped.train.batch(i))
        assert chunk.ids[rows].tolist() == ids[i]
    # A bucket artifact without train.arrow (an older mtpipe's) is read the old way, with a warning.
    old = tmp_path / "old"
    m = json.loads((batches / "manifest.json").read_text())
    old.mkdir()
    for name in ("train.parquet", "valid.parquet"):
        (old / name).write_bytes((batches / name).read_bytes())
    del m["files"]["train.arrow"], m["rows"]["train.arrow"]
    (old / "manifest.json").write_text(json.dumps(m))
    capsys.readouterr()
    parquet = load_train_data(tokens, old, 320, 1)
    assert "has no train.arrow (made by an older mtpipe)" in capsys.readouterr().err.replace("\n", " ")
    assert not isinstance(parquet.train_tokens, MappedSplit)
    assert_same_batches(mapped, parquet)
    assert (mapped.accum, mapped.per_update, mapped.usable) == (parquet.accum, parquet.per_update, parquet.usable)


def test_the_train_data_are_views_of_the_mapped_file(data: tuple[Path, Path], cache: Path) -> None:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("optional: /proc/self/maps (Linux) shows which file a memory address maps")
    tokens, batches = data
    split = load_train_data(tokens, batches, 320, 1).train_tokens
    assert isinstance(split, MappedSplit)
    target = str((batches / "train.arrow").resolve())
    regions = []
    for line in maps.read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == target:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            regions.append((lo, hi))
    assert regions, "train.arrow is not mapped"
    for chunk in split.chunks:
        for arr in (chunk.src, chunk.src_off, chunk.tgt, chunk.tgt_off, chunk.ids):
            assert not arr.flags.owndata and not arr.flags.writeable
            lo = arr.__array_interface__["data"][0]
            assert any(a <= lo and lo + arr.nbytes <= b for a, b in regions)


def test_the_hash_is_checked_once_then_remembered(data: tuple[Path, Path], cache: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, batches = data
    calls = hash_calls(monkeypatch)
    load_train_data(tokens, batches, 320, 1)
    assert calls.count("train.arrow") == 1
    record = reading.verification_record(batches / "train.arrow")
    assert record.is_relative_to(cache)
    rec = json.loads(record.read_text())
    assert rec["sha256"] == artifacts.read_manifest(batches).files["train.arrow"]
    calls.clear()
    for _ in range(2):
        load_train_data(tokens, batches, 320, 1)
    assert "train.arrow" not in calls  # a restart checks the stat key only
    assert not [p for p in batches.iterdir() if p.name not in ("manifest.json", "train.parquet", "valid.parquet",
                                                                "train.arrow")]  # nothing written into the artifact


def test_a_file_changed_in_place_is_caught_at_the_next_start(data: tuple[Path, Path], cache: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, batches = data
    load_train_data(tokens, batches, 320, 1)
    path = batches / "train.arrow"
    st = os.stat(path)
    time.sleep(0.05)  # past the filesystem clock's tick of the check (RACY_NS is 0 here)
    with open(path, "r+b") as f:  # same size, the mtime put back: the ctime still moves
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size
    calls = hash_calls(monkeypatch)
    with pytest.raises(MtpipeError) as e:
        load_train_data(tokens, batches, 320, 1)
    assert calls.count("train.arrow") == 1
    assert str(e.value) == f"{path}: content does not match its manifest hash (modified or truncated)"


def test_a_file_checked_within_the_clock_tick_is_not_remembered(data: tuple[Path, Path], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(reading, "RACY_NS", 3600 * 10**9)  # every file here is younger than an hour
    tokens, batches = data
    calls = hash_calls(monkeypatch)
    load_train_data(tokens, batches, 320, 1)
    load_train_data(tokens, batches, 320, 1)
    assert calls.count("train.arrow") == 2
    assert not reading.verification_record(batches / "train.arrow").exists()


def test_an_unwritable_cache_costs_a_warning_only(data: tuple[Path, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MTPIPE_CACHE_DIR", str(tmp_path / "file" / "cache"))  # below a file: cannot be made
    monkeypatch.setattr(reading, "RACY_NS", 0)
    tokens, batches = data
    assert len(load_train_data(tokens, batches, 320, 1).train) > 0
    assert "the next start hashes it again" in capsys.readouterr().err.replace("\n", " ")


def test_a_compressed_train_arrow_is_a_one_line_error(tmp_path: Path, cache: Path) -> None:
    tokens = tokens_artifact(tmp_path / "bpe", 50)
    bucket.bucket_tokens(BucketConfig(max_tokens=160, max_len=20, multiple_of=1), tokens, tmp_path / "bucket")
    bad = tmp_path / "bad"
    table = pa.ipc.open_file(pa.memory_map(str(tmp_path / "bucket" / "train.arrow"))).read_all()
    with writing.ArtifactWriter(bad, "batches", {"bucket": {"max_tokens": 160}}, upstream={"tokens": tokens}) as w:
        w.path("train.parquet").write_bytes((tmp_path / "bucket" / "train.parquet").read_bytes())
        with pa.ipc.new_file(str(w.path("train.arrow")), table.schema,
                             options=pa.ipc.IpcWriteOptions(compression="zstd")) as f:
            f.write_table(table)
    with pytest.raises(MtpipeError, match=r"train.arrow: record batch 0 is not stored as plain buffers") as e:
        load_train_data(tokens, bad, 320, 1)
    assert "\n" not in str(e.value) and str(bad / "train.arrow") in str(e.value)
    with writing.ArtifactWriter(bad, "batches", {"bucket": {"max_tokens": 160}}, upstream={"tokens": tokens}) as w:
        w.path("train.arrow").write_bytes((tmp_path / "bucket" / "train.parquet").read_bytes())
    with pytest.raises(MtpipeError, match=r"train.arrow: not a readable Arrow IPC file"):
        load_train_data(tokens, bad, 320, 1)


def test_training_is_bitwise_the_same_from_train_arrow_and_from_parquet(tmp_path: Path, cache: Path) -> None:
    from test_train import mcfg, tcfg
    from testkit.runs import make_artifacts, weights

    from mtpipe.training import train

    runs = {}
    for arrow in (True, False):
        tokens, batches = make_artifacts(tmp_path / f"data_{arrow}", arrow=arrow)
        assert ("train.arrow" in artifacts.read_manifest(batches).files) == arrow
        train.train_model(mcfg(), tcfg(max_steps=4, save_every_steps=4, valid_every_steps=0), tokens, batches,
                          tmp_path / f"run_{arrow}")
        runs[arrow] = weights(artifacts.checkpoint_path(tmp_path / f"run_{arrow}", 4))
    assert runs[True].keys() == runs[False].keys()
    assert all(torch.equal(runs[True][k], runs[False][k]) for k in runs[True])
