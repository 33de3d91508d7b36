"""mtpipe fetch: every source layout, every cleaning filter, streaming, and each bad input through the CLI."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mtpipe.stages import fetch

from mtpipe.stages import sources
from mtpipe.artifacts import read_manifest, read_table
from mtpipe.cli import app
from mtpipe.config import FetchConfig
from mtpipe.errors import MtpipeError

SPLITS = {"train": ["train"], "valid": ["validation", "val"], "test": ["test"]}


def cfg(source: Path | str, **kw) -> FetchConfig:
    return FetchConfig(source=str(source), splits=kw.pop("splits", SPLITS), **kw)


def write_lines(path: Path, lines: list[bytes | str]) -> None:
    data = b"".join((x.encode() if isinstance(x, str) else x) + b"\n" for x in lines)
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)


def parallel_dir(root: Path, splits: dict[str, tuple[list, list]], gz: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, (en, de) in splits.items():
        write_lines(root / f"{name}.en{'.gz' if gz else ''}", en)
        write_lines(root / f"{name}.de{'.gz' if gz else ''}", de)
    return root


def table(out: Path, split: str) -> dict:
    return read_table(out, f"{split}.parquet", "corpus").to_pydict()


def small_pairs(n: int = 40) -> tuple[list[str], list[str]]:
    return [f"the cat number {i} sits" for i in range(n)], [f"die Katze Nummer {i} sitzt" for i in range(n)]


# --------------------------------------------------------------------------------------------------------------------
# Real data, layouts, ids
# --------------------------------------------------------------------------------------------------------------------


def test_local_gz_corpus(small_corpus: Path, tmp_path: Path):
    out = tmp_path / "fetch"
    c = cfg(small_corpus, splits={"train": "train", "valid": ["validation", "val"], "test": ["test_2016_flickr"]})
    stats = fetch.fetch_corpus(c, out)
    m = read_manifest(out, "corpus")
    assert m.extra["source_splits"] == {"train": "train", "valid": "val", "test": "test_2016_flickr"}
    assert m.rows == {"train.parquet": stats["train"].rows_out, "valid.parquet": 100, "test.parquet": 100}
    assert m.params["fetch"]["source"] == str(small_corpus)
    assert m.extra["pairs_in"]["train"] - sum(m.extra["filters"].values()) == m.extra["pairs_out"]["train"]
    # Ids are line indices: each row is that line of the original files, normalised.
    with gzip.open(small_corpus / "train.en.gz", "rt", encoding="utf-8") as f:
        en = f.read().split("\n")
    t = table(out, "train")
    assert t["id"] == sorted(set(t["id"]))
    for i, s in zip(t["id"], t["src"]):
        assert s == unicodedata.normalize("NFC", en[i]).strip()
    assert table(out, "valid")["id"] == list(range(100))


def test_cleaning_filters_each_counted(tmp_path: Path):
    en = [
        "a good pair",                    # 0 kept
        b"bad \xff utf8",                 # 1 invalid_utf8
        "   ",                            # 2 empty (after stripping)
        "one",                            # 3 too_short (min_len 2)
        " ".join(["w"] * 11),             # 4 too_long (max_len 10)
        "a b",                            # 5 ratio: 2 vs 10 words > 3
        "a good pair",                    # 6 duplicate of 0
        "  Cafe\u0301 time \r",           # 7 kept, NFC + stripped (CR too)
        "a b c",                          # 8 kept: ratio exactly 3 is allowed (Moses uses >)
        "a good pair",                    # 9 kept: same source, other target
    ]
    de = ["ein gutes Paar", "ok text", "x", "zwei worte", "kurz genug hier", " ".join(["v"] * 10), "ein gutes Paar",
          "Kaffee Zeit", " ".join(["v"] * 9), "ein anderes Paar"]
    src = parallel_dir(tmp_path / "src", {"train": (en, de), "val": (["Cafe\u0301  ", b"\xfe x"], ["", "y"]),
                                          "test": (["t"], ["t"])})
    out = tmp_path / "out"
    stats = fetch.fetch_corpus(cfg(src, min_len=2, max_len=10, max_ratio=3.0), out)
    f = stats["train"].filters
    assert f == {"invalid_utf8": 1, "malformed": 0, "empty": 1, "too_short": 1, "too_long": 1, "ratio": 1,
                 "duplicate": 1}
    assert "train.en.gz line 2" in stats["train"].samples["invalid_utf8"]
    t = table(out, "train")
    assert t["id"] == [0, 7, 8, 9]
    assert t["src"][1] == "Caf\u00e9 time"
    # valid is normalised but never filtered: the empty side and the bad bytes stay (as U+FFFD).
    v = table(out, "valid")
    assert v["src"] == ["Caf\u00e9", "\ufffd x"] and v["tgt"] == ["", "y"]
    m = read_manifest(out, "corpus")
    assert m.extra["filters"] == f


def test_streaming_chunks_do_not_change_the_result(tmp_path: Path, monkeypatch):
    en, de = small_pairs(300)
    en[10], en[77] = en[4], "\ufeffbom is not at file start"
    de[10] = de[4]  # a duplicate pair in another batch once batches hold 7 rows
    src = parallel_dir(tmp_path / "src", {"train": (en, de), "val": (en[:9], de[:9]), "test": (en[:3], de[:3])})
    fetch.fetch_corpus(cfg(src), tmp_path / "a")
    monkeypatch.setattr(sources, "BATCH_ROWS", 7)
    monkeypatch.setattr(sources, "READ_CHUNK", 61)  # lines straddle chunk boundaries
    fetch.fetch_corpus(cfg(src), tmp_path / "b")
    for split in ("train", "valid", "test"):
        assert table(tmp_path / "a", split) == table(tmp_path / "b", split)
    t = table(tmp_path / "b", "train")
    assert len(t["id"]) == 299 and 10 not in t["id"]  # the duplicate across batches is still found


def test_bom_and_missing_final_newline(tmp_path: Path):
    root = tmp_path / "src"
    root.mkdir()
    (root / "train.en").write_bytes(b"\xef\xbb\xbfhello there\nsecond line")
    (root / "train.de").write_bytes(b"hallo da\r\nzweite Zeile\r\n")
    for s in ("val", "test"):
        write_lines(root / f"{s}.en", ["x"])
        write_lines(root / f"{s}.de", ["y"])
    fetch.fetch_corpus(cfg(root), tmp_path / "out")
    t = table(tmp_path / "out", "train")
    assert t["src"] == ["hello there", "second line"] and t["tgt"] == ["hallo da", "zweite Zeile"]


def _layout_dirs(tmp_path: Path, en: list[str], de: list[str]) -> dict[str, Path]:
    """The same corpus in every local layout fetch reads."""
    data = {"train": (en, de), "validation": (en[:5], de[:5]), "test": (en[:4], de[:4])}
    dirs = {"text": parallel_dir(tmp_path / "text", data, gz=False)}
    tsv = tmp_path / "tsv"
    tsv.mkdir()
    for s, (a, b) in data.items():  # de-en order: fetch swaps the columns back
        write_lines(tsv / f"{s}.de-en.tsv.gz" if s == "train" else tsv / f"{s}.tsv", [
            (f"{y}\t{x}" if s == "train" else f"{x}\t{y}") for x, y in zip(a, b)])
    dirs["tsv"] = tsv
    cols, struct = tmp_path / "parquet_cols", tmp_path / "parquet_struct"
    cols.mkdir()
    struct.mkdir()
    for s, (a, b) in data.items():
        if s == "train":  # Hub-style shards
            pq.write_table(pa.table({"en": a[:7], "de": b[:7]}), cols / "train-00000-of-00002.parquet")
            pq.write_table(pa.table({"en": a[7:], "de": b[7:]}), cols / "train-00001-of-00002.parquet")
        else:
            pq.write_table(pa.table({"de": b, "en": a, "extra": [1] * len(a)}), cols / f"{s}.parquet")
        tr = pa.array([{"de": y, "en": x} for x, y in zip(a, b)])
        pq.write_table(pa.table({"translation": tr}), struct / f"{s}.parquet")
    dirs["parquet_cols"], dirs["parquet_struct"] = cols, struct
    return dirs


def test_every_local_layout_gives_the_same_corpus(tmp_path: Path):
    en, de = small_pairs(20)
    en[3] = " padded \u00a0"
    results = {}
    for name, d in _layout_dirs(tmp_path, en, de).items():
        out = tmp_path / f"out_{name}"
        fetch.fetch_corpus(cfg(d), out)
        results[name] = {s: table(out, s) for s in ("train", "valid", "test")}
    first = results.pop("text")
    assert first["train"]["src"][3] == "padded"
    for name, r in results.items():
        assert r == first, name


def test_tsv_malformed_lines_dropped_from_train_rejected_in_valid(tmp_path: Path):
    root = tmp_path / "src"
    root.mkdir()
    write_lines(root / "train.tsv", ["a b\tc d", "no tab here", "x\ty\tz", "e f\tg h"])
    write_lines(root / "val.tsv", ["a\tb"])
    write_lines(root / "test.tsv", ["a\tb"])
    stats = fetch.fetch_corpus(cfg(root), tmp_path / "out")
    assert stats["train"].filters["malformed"] == 2
    assert table(tmp_path / "out", "train")["id"] == [0, 3]
    write_lines(root / "val.tsv", ["a\tb", "only one column"])
    with pytest.raises(MtpipeError, match=r"val.tsv: line 2: expected exactly one tab"):
        fetch.fetch_corpus(cfg(root), tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


# --------------------------------------------------------------------------------------------------------------------
# The datasets code path, offline
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    return datasets


def test_datasets_save_to_disk_and_local_parquet_dataset(tmp_path: Path, hf_cache):
    datasets = hf_cache
    en, de = small_pairs(30)
    en.append(en[0])
    de.append(de[0])  # a duplicate: the datasets path is cleaned like any other
    splits = {"train": (en, de), "validation": (en[:6], de[:6]), "test": (en[:5], de[:5])}
    dd = datasets.DatasetDict({s: datasets.Dataset.from_dict({"translation": [{"en": x, "de": y}
                                                                                for x, y in zip(a, b)]})
                               for s, (a, b) in splits.items()})
    saved = tmp_path / "saved"
    dd.save_to_disk(str(saved))
    pqdir = tmp_path / "pqds"  # a local Parquet dataset in Multi30k's column style, read by load_dataset
    pqdir.mkdir()
    for s, (a, b) in splits.items():
        pq.write_table(pa.table({"en": a, "de": b}), pqdir / f"{s}.parquet")
    ref = parallel_dir(tmp_path / "text", splits)
    fetch.fetch_corpus(cfg(ref), tmp_path / "ref")
    for i, source in enumerate([saved, f"hf:{saved}", f"hf:{pqdir}"]):
        out = tmp_path / f"out{i}"
        stats = fetch.fetch_corpus(cfg(source), out)
        assert stats["train"].filters["duplicate"] == 1
        for s in ("train", "valid", "test"):
            assert table(out, s) == table(tmp_path / "ref", s), (source, s)
    assert read_manifest(tmp_path / "out2", "corpus").extra["source_splits"]["valid"] == "validation"


def test_datasets_missing_language_is_named(tmp_path: Path, hf_cache):
    datasets = hf_cache
    dd = datasets.DatasetDict({s: datasets.Dataset.from_dict({"translation": [{"en": "a", "fr": "b"}]})
                               for s in ("train", "validation", "test")})
    dd.save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(MtpipeError, match=r"no language 'de' \(translation fields: en, fr\)"):
        fetch.fetch_corpus(cfg(tmp_path / "saved"), tmp_path / "out")


# --------------------------------------------------------------------------------------------------------------------
# Deduplication set
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grow_slice", [1 << 20, 7])  # 7: the old table moved a few slots at a time
def test_seen_hashes_matches_a_python_set(grow_slice: int, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(fetch.SeenHashes, "GROW_SLICE", grow_slice)
    rng = np.random.default_rng(0)
    seen, ref = fetch.SeenHashes(capacity=16), set()  # tiny start: many grow steps and collisions
    for _ in range(30):
        # Few distinct values, with duplicates inside each batch and across batches; 0 and 1 collide on purpose
        # (0 is the empty-slot marker and is stored as 1).
        h = rng.integers(0, 3000, size=500).astype(np.uint64)
        h = h * np.uint64(0x9E3779B97F4A7C15)
        new = seen.add(h)
        want = np.zeros(len(h), bool)
        for i, x in enumerate(h.tolist()):
            x = x or 1
            if x not in ref:
                ref.add(x)
                want[i] = True
        assert (new == want).all()
    assert len(seen) == len(ref)
    assert len(seen.table) * fetch.SeenHashes.MAX_LOAD >= len(ref)


def test_pair_hashes_separate_fields():
    a = fetch.pair_hashes(pa.array(["ab", "a", "ab"]), pa.array(["c", "bc", "c"]))
    assert a[0] != a[1] and a[0] == a[2]


# --------------------------------------------------------------------------------------------------------------------
# Bad input, through the CLI: exit 1, one line naming the file and the problem, nothing written
# --------------------------------------------------------------------------------------------------------------------


def cli_error(tmp_path: Path, *args: str, env: dict | None = None) -> str:
    out = tmp_path / "artifacts" / "fetch"
    res = CliRunner().invoke(app, ["fetch", "--params", str(tmp_path / "none.yaml"), "--out", str(out), *args],
                             env=env)
    assert res.exit_code == 1, res.output
    lines = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, res.output
    assert not out.exists()
    if out.parent.exists():
        assert not list(out.parent.glob(".fetch*"))  # no temporary directory left behind
    return lines[0]


@pytest.fixture(autouse=True)
def _no_params_file(tmp_path: Path):
    (tmp_path / "none.yaml").write_text("{}\n")


SPLIT_ARGS = ["--splits", json.dumps(SPLITS)]


def test_bad_line_counts(tmp_path: Path):
    en, de = small_pairs(10)
    src = parallel_dir(tmp_path / "src", {"train": (en, de[:9]), "val": (en, de), "test": (en, de)})
    msg = cli_error(tmp_path, "--source", str(src), *SPLIT_ARGS)
    assert f"{src}/train.en.gz has 10 lines but {src}/train.de.gz has 9" in msg


def test_missing_split(tmp_path: Path):
    en, de = small_pairs(10)
    src = parallel_dir(tmp_path / "src", {"train": (en, de), "dev": (en, de), "test": (en, de)})
    msg = cli_error(tmp_path, "--source", str(src), *SPLIT_ARGS)
    assert f"{src}: no split for 'valid' (tried: valid, validation, val; found: dev, test, train)" in msg


def test_missing_language(tmp_path: Path):
    en, de = small_pairs(10)
    src = parallel_dir(tmp_path / "src", {"train": (en, de), "val": (en, de), "test": (en, de)})
    msg = cli_error(tmp_path, "--source", str(src), *SPLIT_ARGS, "--tgt-lang", "fr")
    assert f"{src}/train.fr[.gz]: not found" in msg and "has no language 'fr' (it has: de, en)" in msg
    pqd = tmp_path / "pq"
    pqd.mkdir()
    for s in ("train", "val", "test"):
        pq.write_table(pa.table({"en": en, "fr": de}), pqd / f"{s}.parquet")
    msg = cli_error(tmp_path, "--source", str(pqd), *SPLIT_ARGS)
    assert f"{pqd}/train.parquet: split 'train' has no language 'de' (columns: en, fr" in msg


def test_unreachable_hf_dataset_fails_fast(tmp_path: Path):
    t0 = time.perf_counter()
    msg = cli_error(tmp_path, "--source", "hf:nonexistent/xyz",
                    env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert time.perf_counter() - t0 < 30
    assert "hf:nonexistent/xyz: cannot load the Hugging Face dataset" in msg
    assert "set fetch.source to a local directory" in msg


def test_unreachable_hub_without_offline_env_fails_fast(tmp_path: Path):
    """As a user runs it: no HF_*_OFFLINE set, the Hub unreachable (a closed local port stands in for it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "proxy" not in k.lower()}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))  # port 9 (discard): refused
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "mtpipe", "fetch", "--params", str(tmp_path / "none.yaml"),
                          "--source", "hf:nonexistent/xyz", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert time.perf_counter() - t0 < 20, "must not sit in the Hub client's retry loop"
    assert res.returncode == 1
    errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "127.0.0.1:9 unreachable" in errors[0] and "no cached copy" in errors[0]
    assert not (tmp_path / "out").exists()


def test_empty_after_cleaning(tmp_path: Path):
    src = parallel_dir(tmp_path / "src", {"train": (["a", "b"], ["", "c d e f"]), "val": (["x"], ["y"]),
                                          "test": (["x"], ["y"])})
    msg = cli_error(tmp_path, "--source", str(src), *SPLIT_ARGS, "--max-ratio", "2")
    assert f"{src}/train.en.gz + train.de.gz: split 'train' is empty after cleaning (2 pairs in; dropped: " \
           "empty 1, ratio 1)" in msg


def test_no_such_source(tmp_path: Path):
    msg = cli_error(tmp_path, "--source", str(tmp_path / "nope"))
    assert "nope: no such directory" in msg


def test_the_output_split_name_itself_is_tried_first(tmp_path: Path):
    """A corpus whose files already use mtpipe's split names (valid.{en,de}) needs no fetch.splits entry: the output
    split's own name wins over the aliases (here both valid.* and val.* exist), through the CLI as a user runs it;
    an entry that names it keeps its own order."""
    en, de = small_pairs(30)
    src = parallel_dir(tmp_path / "src", {"train": (en, de), "valid": (en[:5], de[:5]), "val": (en[:7], de[:7]),
                                          "test": (en[:3], de[:3])})
    (tmp_path / "none.yaml").write_text("", encoding="utf-8")
    for splits, want, rows in ((SPLITS, "valid", 5), ({**SPLITS, "valid": ["val", "valid"]}, "val", 7)):
        out = tmp_path / f"out_{want}"
        res = CliRunner().invoke(app, ["fetch", "--params", str(tmp_path / "none.yaml"), "--source", str(src),
                                       "--splits", json.dumps(splits), "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert read_manifest(out).extra["source_splits"] == {"train": "train", "valid": want, "test": "test"}
        assert read_manifest(out).rows["valid.parquet"] == rows


# --------------------------------------------------------------------------------------------------------------------
# Slices, corpus artifacts as sources, synthetic sides (hypotheses), tags, several train sources
# --------------------------------------------------------------------------------------------------------------------


def hypotheses_artifact(out: Path, ids: list[int], texts: list[str], split: str | None = "train") -> Path:
    """A hypotheses artifact as `mtpipe decode --out` writes it (rows in any order: decode sorts by length)."""
    from mtpipe.writing import ArtifactWriter

    with ArtifactWriter(out, "hypotheses", {}) as w:
        w.write_table(f"{split or 'input'}.parquet", pa.table({
            "id": ids, "hypothesis": texts, "tokens": [[5]] * len(ids), "score": [0.0] * len(ids),
            "nbest": [[]] * len(ids), "nbest_scores": [[]] * len(ids)}))
        w.extra["split"] = split
    return out


def test_train_slice_through_the_cli_keeps_line_ids(tmp_path: Path):
    en, de = small_pairs(30)
    src = parallel_dir(tmp_path / "src", {"train": (en, de), "val": (en[:5], de[:5]), "test": (en[:3], de[:3])})
    for sl, want in (("3:7", [3, 4, 5, 6]), ("27:", [27, 28, 29]), (":2", [0, 1])):
        out = tmp_path / f"out{want[0]}"
        res = CliRunner().invoke(app, ["fetch", "--params", str(tmp_path / "none.yaml"), "--source", str(src),
                                       *SPLIT_ARGS, "--train-slice", sl, "--out", str(out)])
        assert res.exit_code == 0, res.output
        t = table(out, "train")
        assert t["id"] == want and t["src"] == [en[i] for i in want]
        assert len(table(out, "valid")["id"]) == 5  # valid and test are never sliced
    assert "need 0 <= START < END" in cli_error(tmp_path, "--source", str(src), *SPLIT_ARGS, "--train-slice", "7:3")


def test_a_corpus_artifact_is_a_source_in_either_direction(tmp_path: Path):
    en, de = small_pairs(20)
    src = parallel_dir(tmp_path / "src", {"train": (en, de), "val": (en[:5], de[:5]), "test": (en[:3], de[:3])})
    fetch.fetch_corpus(cfg(src), tmp_path / "corpus")
    fetch.fetch_corpus(cfg(tmp_path / "corpus", src_lang="de", tgt_lang="en", train_slice="10:"), tmp_path / "rev")
    t = table(tmp_path / "rev", "train")
    assert t["id"] == list(range(10, 20)) and t["src"] == de[10:] and t["tgt"] == en[10:]
    assert table(tmp_path / "rev", "test")["src"] == de[:3]
    msg = cli_error(tmp_path, "--source", str(tmp_path / "corpus"), "--tgt-lang", "fr")
    assert "a corpus artifact of en-de, not of en-fr" in msg


def test_synthetic_sides_tags_and_several_train_sources(tmp_path: Path):
    """Back-translation as the example builds it: half A of a corpus, plus half B's target side with a reverse
    model's translations (a hypotheses artifact, rows in decode's order) as its source side, tagged."""
    en, de = small_pairs(20)
    src = parallel_dir(tmp_path / "src", {"train": (en, de), "val": (en[:5], de[:5]), "test": (en[:3], de[:3])})
    fetch.fetch_corpus(cfg(src), tmp_path / "corpus")
    fetch.fetch_corpus(cfg(tmp_path / "corpus", src_lang="de", tgt_lang="en", train_slice="10:"), tmp_path / "mono")
    ids = [19, 12, 10, 11, 13, 14, 16, 17, 18, 15]  # every id of B, in another order
    hyps = hypotheses_artifact(tmp_path / "bt", ids, [f"synthetic {i}" for i in ids])
    out = tmp_path / "out"
    c = cfg(tmp_path / "corpus", train_slice=":10",
            add_train=[{"source": str(tmp_path / "mono"), "hypotheses": str(hyps), "tag": "<BT>"}])
    fetch.fetch_corpus(c, out)
    t = table(out, "train")
    assert t["src"][:10] == en[:10] and t["tgt"][:10] == de[:10]  # A as it was
    # B: the German side real, the English side the translations matched by id, tagged; ids follow A's rows
    b = dict(zip(t["id"][10:], zip(t["src"][10:], t["tgt"][10:])))
    assert b == {10 + i: (f"<BT> synthetic {10 + i}", de[10 + i]) for i in range(10)}
    m = read_manifest(out, "corpus")
    assert [s["pairs_out"] for s in m.extra["train_sources"]] == [10, 10]
    assert m.extra["train_sources"][1]["first_id"] == 10 and "hypotheses_1" in m.upstream
    assert table(out, "test")["src"] == en[:3]  # valid and test: fetch.source's, untagged

    # Distillation: the source's own target side replaced (no tag), and a missing translation named.
    fetch.fetch_corpus(cfg(tmp_path / "mono", src_lang="de", tgt_lang="en", hypotheses=str(hyps)), tmp_path / "kd")
    assert table(tmp_path / "kd", "train")["tgt"] == [f"synthetic {i}" for i in range(10, 20)]
    short = hypotheses_artifact(tmp_path / "short", ids[1:], ["x"] * 9)
    with pytest.raises(MtpipeError, match=r"short: has no translation of id 19 of .*mono/train.parquet"):
        fetch.fetch_corpus(cfg(tmp_path / "mono", src_lang="de", tgt_lang="en", hypotheses=str(short)),
                           tmp_path / "bad")
    test_split = hypotheses_artifact(tmp_path / "test_hyps", [0], ["x"], split="test")
    with pytest.raises(MtpipeError, match=r"translates split 'test', not a corpus's train split"):
        fetch.fetch_corpus(cfg(tmp_path / "corpus", hypotheses=str(test_split)), tmp_path / "bad")
    with pytest.raises(MtpipeError, match=r"src: hypotheses replace a side of a corpus artifact"):
        fetch.fetch_corpus(cfg(src, hypotheses=str(hyps)), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_add_train_entries_are_validated(tmp_path: Path):
    msg = cli_error(tmp_path, "--source", str(tmp_path), "--add-train", '[{"source": "x", "slice": "1:2"}]')
    assert "fetch.add_train[0]: unknown key 'slice'" in msg
    msg = cli_error(tmp_path, "--source", str(tmp_path), "--add-train", '[{"source": "x", "train_slice": "a:b"}]')
    assert "fetch.add_train[0].train_slice = 'a:b': expected START:END" in msg
