"""mtpipe bucket: token-budget packing properties, the artifact, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from mtpipe.stages import bucket
from mtpipe.artifacts import manifest_hash, read_manifest, read_table
from mtpipe.cli import app
from mtpipe.config import BucketConfig
from mtpipe.errors import MtpipeError
from mtpipe.writing import ArtifactWriter


def tokens_artifact(out: Path, splits: dict[str, tuple[list[int], list[int]]], id_offset: int = 1000) -> Path:
    """A tokens artifact whose pairs have the given token counts (ids deliberately not row positions)."""
    with ArtifactWriter(out, "tokens") as w:
        for split, (s, t) in splits.items():
            w.write_table(f"{split}.parquet", pa.table({
                "id": np.arange(len(s), dtype=np.int64) * 3 + id_offset,
                "src": pa.array([[7] * n for n in s], pa.list_(pa.int32())),
                "tgt": pa.array([[9] * n for n in t], pa.list_(pa.int32())),
            }))
    return out


def check_packing(src: np.ndarray, tgt: np.ndarray, bounds: np.ndarray, max_tokens: int, m: int) -> None:
    """Every pair once, in order; within budget on both sides; counts a multiple of m or forced below it; greedy."""
    n = len(src)
    assert bounds[0] == 0 and bounds[-1] == n and (np.diff(bounds) > 0).all()
    for a, b in zip(bounds[:-1], bounds[1:]):
        size = b - a
        assert size * src[a:b].max() <= max_tokens and size * tgt[a:b].max() <= max_tokens
        fits = lambda k: k * src[a:a + k].max() <= max_tokens and k * tgt[a:a + k].max() <= max_tokens  # noqa: E731
        if size % m:
            assert size < m
            # Fewer than m only when m would not fit, or at the very end.
            assert b == n or not fits(size + 1)
        if b < n:
            # Greedy: the next multiple (or the next pair, below m) would not fit.
            nxt = size + (m if size >= m else 1)
            assert a + nxt > n or not fits(nxt)


@pytest.mark.parametrize("seed", range(6))
def test_pack_properties(seed: int):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    max_tokens = int(rng.choice([64, 300, 1000, 4096]))
    m = int(rng.choice([1, 3, 8]))
    src = rng.integers(1, min(max_tokens, 120) + 1, n)
    tgt = np.clip(src + rng.integers(-20, 40, n), 1, max_tokens)
    order = bucket.length_order(src, tgt)
    s, t = src[order], tgt[order]
    assert (np.diff(s) >= 0).all()
    check_packing(s, t, bucket.pack(s, t, max_tokens, m), max_tokens, m)


def test_length_order_is_stable():
    src = np.array([3, 1, 3, 1, 2])
    tgt = np.array([5, 2, 5, 1, 9])
    assert bucket.length_order(src, tgt).tolist() == [3, 1, 4, 0, 2]


def test_forced_small_batches():
    # 5 positions per pair, 12 tokens: only 2 fit, fewer than multiple_of = 8 -> batches of 2 rather than overflow.
    src = np.full(5, 5)
    assert bucket.pack(src, src, 12, 8).tolist() == [0, 2, 4, 5]


def test_run_drops_long_train_keeps_long_valid(tmp_path: Path):
    rng = np.random.default_rng(0)
    s = rng.integers(0, 40, 500).tolist()
    t = rng.integers(0, 40, 500).tolist()
    s[10], t[20] = 60, 70  # longer than max_len = 50 positions
    toks = tokens_artifact(tmp_path / "tok", {"train": (s, t), "valid": ([3, 80, 4], [2, 3, 90])})
    cfg = BucketConfig(max_tokens=400, max_len=50, multiple_of=4)
    stats = bucket.bucket_tokens(cfg, toks, tmp_path / "b")
    assert stats["train"].dropped == 2 and stats["train"].pairs == 498
    man = read_manifest(tmp_path / "b", "batches")
    assert man.upstream == {"tokens": manifest_hash(toks)}
    assert man.extra["dropped_too_long"] == 2 and man.params["bucket"]["max_tokens"] == 400
    tr = read_table(tmp_path / "b", "train.parquet", "batches").to_pydict()
    ids = [i for b in tr["ids"] for i in b]
    want = {1000 + 3 * k for k in range(500)} - {1000 + 30, 1000 + 60}
    assert len(ids) == len(set(ids)) == 498 and set(ids) == want  # every kept id exactly once
    row = {1000 + 3 * k: k for k in range(500)}
    for b in range(len(tr["batch"])):
        ls = [s[row[i]] + 1 for i in tr["ids"][b]]  # + EOS
        lt = [t[row[i]] + 1 for i in tr["ids"][b]]
        assert tr["src_len"][b] == max(ls) and tr["tgt_len"][b] == max(lt)
        assert tr["src_tokens"][b] == sum(ls) and tr["tgt_tokens"][b] == sum(lt)
        assert len(ls) * max(ls) <= 400 and len(lt) * max(lt) <= 400
        assert len(ls) % 4 == 0 or len(ls) < 4
    assert tr["batch"] == list(range(len(tr["batch"])))
    va = read_table(tmp_path / "b", "valid.parquet", "batches").to_pydict()
    assert sorted(i for b in va["ids"] for i in b) == [1000, 1003, 1006]
    assert [1003] in va["ids"] and [1006] in va["ids"]  # each over-long valid pair alone
    # Deterministic: the same input gives a byte-identical artifact.
    bucket.bucket_tokens(cfg, toks, tmp_path / "b2")
    assert read_manifest(tmp_path / "b2").files == man.files


def test_padding_ratio_reported(tmp_path: Path):
    toks = tokens_artifact(tmp_path / "tok", {"train": ([4, 4, 4, 4], [1, 1, 1, 9])})
    stats = bucket.bucket_tokens(BucketConfig(max_tokens=100, max_len=20, multiple_of=1), toks, tmp_path / "b")
    # One batch: src 4 x 5 positions, no padding; tgt 4 x 10 padded, 2 + 2 + 2 + 10 real.
    assert stats["train"].batches == 1
    assert stats["train"].padding == pytest.approx(1 - (20 + 16) / (20 + 40))
    assert read_manifest(tmp_path / "b").extra["padding_ratio"]["train"] == pytest.approx(0.4)


# --------------------------------------------------------------------------------------------------------------------
# Bad input through the CLI
# --------------------------------------------------------------------------------------------------------------------


def cli_error(tmp_path: Path, tokens: Path, *args: str) -> str:
    out = tmp_path / "out" / "bucket"
    none = tmp_path / "none.yaml"
    none.write_text("{}\n")
    res = CliRunner().invoke(app, ["bucket", "--params", str(none), "--tokens", str(tokens), "--out", str(out),
                                   *args])
    assert res.exit_code == 1, res.output
    lines = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, res.output
    assert not out.exists()
    if out.parent.exists():
        assert not list(out.parent.glob(".bucket*"))
    return lines[0]


def test_max_tokens_below_max_len(tmp_path: Path):
    toks = tokens_artifact(tmp_path / "tok", {"train": ([3], [3])})
    msg = cli_error(tmp_path, toks, "--max-tokens", "100", "--max-len", "256")
    assert "bucket.max_tokens=100 is smaller than bucket.max_len=256" in msg and "--max-tokens to at least 256" in msg


def test_old_format_wrong_schema_wrong_kind(tmp_path: Path):
    toks = tokens_artifact(tmp_path / "tok", {"train": ([3], [3])})
    m = json.loads((toks / "manifest.json").read_text())
    m["format_version"] = 0
    (toks / "manifest.json").write_text(json.dumps(m))
    assert f"{toks}: 'tokens' format version 0" in cli_error(tmp_path, toks)
    bad = tmp_path / "bad"
    with ArtifactWriter(bad, "corpus") as w:  # text where token ids belong, relabelled as a tokens artifact
        w.write_table("train.parquet", pa.table({"id": [0], "src": ["a"], "tgt": ["b"]}))
    m = json.loads((bad / "manifest.json").read_text())
    m["kind"] = "tokens"
    (bad / "manifest.json").write_text(json.dumps(m))
    assert f"{bad}/train.parquet: wrong schema, column 'src' is string, expected list<item: int32>" in \
        cli_error(tmp_path, bad)
    m["kind"] = "corpus"
    (bad / "manifest.json").write_text(json.dumps(m))
    assert f"{bad}: is a 'corpus' artifact, expected 'tokens'" in cli_error(tmp_path, bad)


def test_everything_too_long(tmp_path: Path):
    toks = tokens_artifact(tmp_path / "tok", {"train": ([30, 40], [3, 3])})
    with pytest.raises(MtpipeError, match=r"train.parquet: every pair is longer than bucket.max_len=20"):
        bucket.bucket_tokens(BucketConfig(max_tokens=100, max_len=20), toks, tmp_path / "b")
    assert not (tmp_path / "b").exists()
