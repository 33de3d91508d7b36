"""mtpipe bpe: joint SentencePiece training, multi-threaded encoding, --spm-model, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
from typer.testing import CliRunner

from mtpipe.stages import bpe

from mtpipe.stages import fetch
from mtpipe.artifacts import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    file_hash,
    manifest_hash,
    read_manifest,
    read_table,
)
from mtpipe.cli import app
from mtpipe.config import BpeConfig, FetchConfig
from mtpipe.errors import MtpipeError
from mtpipe.writing import ArtifactWriter

VOCAB = 500


@pytest.fixture
def corpus(small_corpus: Path, tmp_path: Path) -> Path:
    out = tmp_path / "fetch"
    fetch.fetch_corpus(FetchConfig(source=str(small_corpus), splits={"train": "train", "valid": "val",
                                                              "test": "test_2016_flickr"}), out)
    return out


def tokens_of(out: Path, split: str) -> pa.Table:
    return read_table(out, f"{split}.parquet", "tokens")


def test_train_and_encode(corpus: Path, tmp_path: Path):
    out = tmp_path / "bpe"
    stats = bpe.tokenize_corpus(BpeConfig(vocab_size=VOCAB, threads=2), corpus, out)
    m = read_manifest(out, "tokens")
    assert m.upstream == {"corpus": manifest_hash(corpus)}
    assert m.extra["spm_sha256"] == file_hash(out / "spm.model") == m.files["spm.model"]
    assert m.extra["vocab_size"] == VOCAB and "spm.vocab" in m.files
    assert m.extra["sample_sentences"] == 2 * read_manifest(corpus).rows["train.parquet"]
    assert m.params["bpe"]["vocab_size"] == VOCAB
    sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert len((out / "spm.vocab").read_text(encoding="utf-8").splitlines()) == VOCAB
    for split in ("train", "valid", "test"):
        text = read_table(corpus, f"{split}.parquet", "corpus").to_pydict()
        tok = tokens_of(out, split).to_pydict()
        assert tok["id"] == text["id"]
        assert m.rows[f"{split}.parquet"] == len(tok["id"]) == stats[split].pairs
        flat = np.concatenate([np.asarray(x, np.int64) for x in tok["src"] + tok["tgt"]])
        # No pad/bos/eos is stored (the model and the batching add EOS); unk only for characters train lacks.
        assert not np.isin(flat, [PAD_ID, BOS_ID, EOS_ID]).any() and flat.max() < VOCAB
        assert (flat == UNK_ID).sum() == round(m.extra["unk_rate"][split] * len(flat))
        assert m.extra["tokens"][split] == {"src": sum(map(len, tok["src"])), "tgt": sum(map(len, tok["tgt"]))}
        # Decoding gives back the text (SentencePiece's NFKC may change a rare character: allow 1%).
        same = sum(sp.decode(ids) == s for ids, s in zip(tok["src"] + tok["tgt"], text["src"] + text["tgt"]))
        assert same >= 0.99 * 2 * len(tok["id"])
    assert 0.5 < m.extra["vocab_coverage"] <= 1.0
    assert m.extra["unk_rate"]["train"] == 0.0  # character_coverage 1.0: every train character is in the vocab


def test_bpe_dropout_copies_follow_train_with_distinct_ids_and_the_same_text(corpus: Path, tmp_path: Path):
    plain, drop = tmp_path / "plain", tmp_path / "drop"
    bpe.tokenize_corpus(BpeConfig(vocab_size=VOCAB, threads=2), corpus, plain)
    cfg = BpeConfig(vocab_size=VOCAB, threads=2, dropout=0.1, dropout_copies=3)
    bpe.tokenize_corpus(cfg, corpus, drop)
    assert file_hash(plain / "spm.model") == file_hash(drop / "spm.model")  # the vocabulary does not change
    base, copies = tokens_of(plain, "train").to_pydict(), tokens_of(drop, "train").to_pydict()
    n, stride = len(base["id"]), max(base["id"]) + 1
    assert len(copies["id"]) == 4 * n and read_manifest(drop).extra["train_encodings"] == 4
    # The usual encoding first, unchanged; then each copy with ids offset by a multiple of (largest id + 1).
    assert {k: v[:n] for k, v in copies.items()} == base
    for k in range(1, 4):
        assert copies["id"][k * n:(k + 1) * n] == [i + k * stride for i in base["id"]]
    assert len(set(copies["id"])) == 4 * n
    sp = spm.SentencePieceProcessor(model_file=str(drop / "spm.model"))
    for side in ("src", "tgt"):
        rows = copies[side]
        # Every sample spells the same sentence in (on average) more, smaller pieces; samples differ from each other.
        assert all(sp.decode(rows[k * n + i]) == sp.decode(rows[i]) for k in range(1, 4) for i in range(n))
        assert sum(map(len, rows[n:2 * n])) > 1.05 * sum(map(len, rows[:n]))
        assert rows[n:2 * n] != rows[2 * n:3 * n]
    for split in ("valid", "test"):  # never sampled
        assert tokens_of(drop, split).to_pydict() == tokens_of(plain, split).to_pydict()
    # Reproducible: the same seed gives the same samples, byte for byte (another seed does not).
    again = tmp_path / "again"
    bpe.tokenize_corpus(cfg, corpus, again)
    assert tokens_of(again, "train").to_pydict() == copies
    other = tmp_path / "other"
    bpe.tokenize_corpus(BpeConfig(vocab_size=VOCAB, threads=2, dropout=0.1, dropout_copies=3, seed=2), corpus, other)
    assert tokens_of(other, "train").to_pydict()["src"][n:] != copies["src"][n:]
    # The bucket stage batches every copy's rows, each once, and training reads them by id.
    from mtpipe.stages import bucket
    from mtpipe.training.batches import load_train_data
    from mtpipe.config import BucketConfig

    bucket.bucket_tokens(BucketConfig(max_tokens=512, multiple_of=1), drop, tmp_path / "batches")
    batched = read_table(tmp_path / "batches", "train.parquet", "batches").column("ids").to_pylist()
    assert sorted(i for b in batched for i in b) == sorted(copies["id"])
    assert load_train_data(drop, tmp_path / "batches", 512, 1).usable == len(batched)


@pytest.mark.parametrize("kw", [dict(dropout=0.1), dict(dropout_copies=2)])
def test_bpe_dropout_needs_a_probability_and_copies(corpus: Path, tmp_path: Path, kw: dict):
    with pytest.raises(MtpipeError, match="bpe.dropout"):
        bpe.tokenize_corpus(BpeConfig(vocab_size=VOCAB, **kw), corpus, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_spm_model_reuse_and_threads_give_identical_tokens(corpus: Path, tmp_path: Path):
    a = tmp_path / "a"
    bpe.tokenize_corpus(BpeConfig(vocab_size=VOCAB, threads=2), corpus, a)
    b = tmp_path / "b"
    bpe.tokenize_corpus(BpeConfig(vocab_size=VOCAB, threads=1), corpus, b, spm_model=a / "spm.model")
    ma, mb = read_manifest(a), read_manifest(b)
    assert mb.extra["spm_sha256"] == ma.extra["spm_sha256"]
    assert mb.extra["spm_model_source"] == str(a / "spm.model")
    for split in ("train", "valid", "test"):
        assert tokens_of(a, split).equals(tokens_of(b, split))
    # The regenerated vocab lists the same pieces in the same order.
    pieces = lambda p: [line.split("\t")[0] for line in p.read_text(encoding="utf-8").splitlines()]  # noqa: E731
    assert pieces(b / "spm.vocab") == pieces(a / "spm.vocab")


def test_sample_cap_is_seeded(corpus: Path, tmp_path: Path):
    def sample(seed: int) -> list[str]:
        counter = [0]
        out = list(bpe.training_sentences(corpus, BpeConfig(sample_sentences=300, seed=seed), counter))
        assert counter[0] == len(out) == 300
        return out

    a, b, c = sample(1), sample(1), sample(2)
    assert a == b and a != c
    text = read_table(corpus, "train.parquet", "corpus").to_pydict()
    assert set(a) <= set(text["src"]) | set(text["tgt"])
    assert set(a) & set(text["src"]) and set(a) & set(text["tgt"])  # both sides are sampled
    everything = list(bpe.training_sentences(corpus, BpeConfig(sample_sentences=10**9), [0]))
    assert sorted(everything) == sorted(text["src"] + text["tgt"])
    out = tmp_path / "capped"
    bpe.tokenize_corpus(BpeConfig(vocab_size=300, sample_sentences=300), corpus, out)
    assert read_manifest(out).extra["sample_sentences"] == 300


def test_training_is_reproducible(corpus: Path, tmp_path: Path):
    bpe.tokenize_corpus(BpeConfig(vocab_size=VOCAB, threads=2), corpus, tmp_path / "a")
    bpe.tokenize_corpus(BpeConfig(vocab_size=VOCAB, threads=2), corpus, tmp_path / "b")
    assert read_manifest(tmp_path / "a").files == read_manifest(tmp_path / "b").files


def test_encode_is_flat_and_matches_sentencepiece(corpus: Path, tmp_path: Path):
    out = tmp_path / "bpe"
    bpe.tokenize_corpus(BpeConfig(vocab_size=VOCAB), corpus, out)
    sp = bpe.load_spm(out / "spm.model")
    src = ["Ein Hund rennt.", "", "A dog runs  fast ."]
    tgt = ["x", "Zwei Männer", ""]
    # encode_split's call: both sides in one multi-threaded encode, split back by to_arrow (no BOS/EOS)
    s, t, s_flat, t_flat = bpe.to_arrow(sp.encode(src + tgt, out_type=int, num_threads=2), len(src))
    assert s.type == t.type == pa.list_(pa.int32())
    assert s.to_pylist() == [sp.encode(x) for x in src] and t.to_pylist() == [sp.encode(x) for x in tgt]
    assert s_flat.tolist() == [i for x in src for i in sp.encode(x)]
    assert t_flat.tolist() == [i for x in tgt for i in sp.encode(x)]


def test_foreign_special_ids_are_refused(tmp_path: Path):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"word{i} other{i % 7}" for i in range(200)), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "m"), vocab_size=60,
                                   model_type="bpe", minloglevel=2)  # default ids: unk 0, bos 1, eos 2, no pad
    with pytest.raises(MtpipeError, match=r"m.model: special ids .* differ from mtpipe's"):
        bpe.load_spm(tmp_path / "m.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(MtpipeError, match="junk.model: not a SentencePiece model"):
        bpe.load_spm(tmp_path / "junk.model")


# --------------------------------------------------------------------------------------------------------------------
# Bad input through the CLI: exit 1, one line naming the file, nothing written
# --------------------------------------------------------------------------------------------------------------------


def cli_error(tmp_path: Path, corpus: Path, *args: str) -> str:
    out = tmp_path / "out" / "bpe"
    none = tmp_path / "none.yaml"
    none.write_text("{}\n")
    res = CliRunner().invoke(app, ["bpe", "--params", str(none), "--corpus", str(corpus), "--out", str(out), *args])
    assert res.exit_code == 1, res.output
    lines = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, res.output
    assert not out.exists()
    if out.parent.exists():
        assert not list(out.parent.glob(".bpe*"))
    return lines[0]


def test_vocab_too_large_is_explained(tmp_path: Path):
    root = tmp_path / "tiny"
    root.mkdir()
    for s in ("train", "val", "test"):
        (root / f"{s}.en").write_text("\n".join(f"a small cat {i}" for i in range(20)) + "\n")
        (root / f"{s}.de").write_text("\n".join(f"eine kleine Katze {i}" for i in range(20)) + "\n")
    corpus = tmp_path / "fetch"
    fetch.fetch_corpus(FetchConfig(source=str(root), splits={"train": "train", "valid": "val", "test": "test"}), corpus)
    msg = cli_error(tmp_path, corpus, "--vocab-size", "5000")
    assert f"bpe.vocab_size=5000 is larger than the 40 training sentences of {corpus}/train.parquet support" in msg
    limit = int(msg.split("--vocab-size ")[1].split()[0])
    assert 30 < limit < 5000
    # The suggested maximum works.
    res = CliRunner().invoke(app, ["bpe", "--params", str(tmp_path / "none.yaml"), "--corpus", str(corpus), "--out",
                                   str(tmp_path / "ok"), "--vocab-size", str(limit)])
    assert res.exit_code == 0, res.output


def test_old_format_and_wrong_schema_corpus(corpus: Path, tmp_path: Path):
    m = json.loads((corpus / "manifest.json").read_text())
    m["format_version"] = 0
    (corpus / "manifest.json").write_text(json.dumps(m))
    msg = cli_error(tmp_path, corpus, "--vocab-size", str(VOCAB))
    assert f"{corpus}: 'corpus' format version 0" in msg and "re-run the stage" in msg
    # A corpus artifact whose train.parquet has the wrong column types (valid manifest and hashes).
    bad = tmp_path / "bad"
    with ArtifactWriter(bad, "corpus") as w:
        pq.write_table(pa.table({"id": [0, 1], "src": [b"a", b"b"], "tgt": ["x", "y"]}), w.path("train.parquet"))
    msg = cli_error(tmp_path, bad, "--vocab-size", str(VOCAB))
    assert f"{bad}/train.parquet: wrong schema, column 'src' is binary, expected string" in msg
    # Not a corpus at all: a tokens artifact given as --corpus.
    toks = tmp_path / "toks"
    with ArtifactWriter(toks, "tokens") as w:
        w.write_table("train.parquet", pa.table({"id": [0], "src": [[5]], "tgt": [[6]]}))
    assert f"{toks}: is a 'tokens' artifact, expected 'corpus'" in cli_error(tmp_path, toks)
    assert "artifact not found" in cli_error(tmp_path, tmp_path / "missing")


def test_missing_spm_model(corpus: Path, tmp_path: Path):
    msg = cli_error(tmp_path, corpus, "--spm-model", str(tmp_path / "nope.model"))
    assert "nope.model: SentencePiece model not found" in msg
