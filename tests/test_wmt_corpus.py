"""testkit/wmt_corpus.py, the synthetic WMT14-shaped corpus bench/wmt_data.py measures the data stages on: its
statistics (length shape, correlated sides, a Zipf vocabulary with a tail of rare types), determinism, and that fetch
reads both of its forms (gzip text files, a saved ``datasets`` directory) to the same corpus.

A smaller type inventory than the bench's (building 12M spellings takes seconds); the sampler is the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mtpipe.artifacts import read_table
from mtpipe.config import FetchConfig
from mtpipe.stages import fetch
from testkit import wmt_corpus as wc

TYPES = 300_000
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vocabs() -> dict[str, wc.Vocabulary]:
    return {lang: wc.vocabulary(lang, 7, types=TYPES) for lang in wc.LANGS}


def lines(sl: tuple[np.ndarray, np.ndarray]) -> list[str]:
    return sl[0].tobytes().decode().splitlines()


def test_spellings_are_distinct_with_numbers_and_punctuation(vocabs: dict[str, wc.Vocabulary]) -> None:
    for lang, v in vocabs.items():
        spelled = [v.blob[v.off[i]:v.off[i + 1]].tobytes().decode() for i in range(len(v.off) - 1)]
        assert all(s.endswith(" ") and " " not in s[:-1] for s in spelled)
        assert len(spelled) == TYPES + len(wc.PUNCT) and len(set(spelled)) > 0.999 * len(spelled), lang
        assert spelled[-2:] == [", ", ". "] and spelled[123] == "4 "  # 123 = 29 * 4 + 7: the number 4
        assert len(spelled[TYPES - 1]) > len(spelled[0])  # rarer types are longer
    assert any(ch in "äöüß" for ch in vocabs["de"].blob[:5000].tobytes().decode(errors="ignore"))


def test_lengths_words_and_determinism(vocabs: dict[str, wc.Vocabulary]) -> None:
    rng = np.random.default_rng(0)
    src, tgt = wc.lengths(rng, 200_000)
    assert 26 < src.mean() < 28 and 21 <= np.median(src) <= 24 and src.min() >= 1 and src.max() == 250
    assert np.corrcoef(src, tgt)[0, 1] > 0.9 and 0.9 < tgt.mean() / src.mean() < 1.0
    ranks = wc.words(np.random.default_rng(1), 2_000_000, TYPES)
    counts = np.bincount(ranks, minlength=TYPES)
    assert ranks.min() >= 0 and ranks.max() < TYPES
    assert 0.15 < counts[:10].sum() / len(ranks) < 0.3  # a Zipf head: the 10 commonest types ~1/4 of the words
    seen = np.count_nonzero(counts)
    assert seen > 20_000 and np.count_nonzero(counts == 1) / seen > 0.3  # a tail of rare types, many seen once
    a = next(wc.slices("train", 1000, 3, vocabs))
    b = next(wc.slices("train", 1000, 3, vocabs))
    assert all(np.array_equal(a[lang][0], b[lang][0]) for lang in wc.LANGS)
    en = lines(a["en"])
    assert len(en) == len(lines(a["de"])) == 1000 and all(en)
    assert sum(x.endswith(" .") for x in en) > 700 and any(" , " in x for x in en)


def test_fetch_reads_both_forms_alike(tmp_path: Path, vocabs: dict[str, wc.Vocabulary]) -> None:
    wc.write_local(tmp_path / "local", 2000, 5, vocabs)
    wc.write_datasets(tmp_path / "hf", 2000, 5, vocabs, shard_pairs=wc.SLICE)
    splits = {"train": ["train"], "valid": ["valid", "validation"], "test": ["test"]}
    tables = {}
    for form in ("local", "hf"):
        stats = fetch.fetch_corpus(FetchConfig(source=str(tmp_path / form), splits=splits), tmp_path / f"out-{form}")
        assert stats["train"].rows_in == 2000 and stats["test"].rows_out == 3003
        tables[form] = read_table(tmp_path / f"out-{form}", "train.parquet", "corpus")
    assert tables["local"].equals(tables["hf"])
    first = next(wc.slices("train", 2000, 5, vocabs))
    assert tables["local"].column("src")[0].as_py() == lines(first["en"])[0]


def test_the_bench_runs_the_stages_and_writes_results(tmp_path: Path) -> None:
    """bench/wmt_data.py end to end at a toy size (the CLI stages as subprocesses, the memory sampler, the results
    file written after each stage); the loader and restart stages are bench/train_data.py's and test_train's."""
    results = tmp_path / "wmt_data.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "wmt_data.py"), "--pairs", "2000", "--types", "50000",
                          "--vocab", "500", "--stages", "gen,fetch,bpe,bucket", "--form", "both", "--out",
                          str(tmp_path / "work"), "--results", str(results)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    stages = json.loads(results.read_text())["figures"]["stages"]
    assert set(stages) == {"gen", "fetch", "bpe", "bucket"}
    assert stages["fetch"]["local"]["pairs_out"] == stages["fetch"]["datasets"]["pairs_out"]
    assert stages["fetch"]["local"]["pairs_out"]["train"] == 2000
    assert stages["bpe"]["training"]["sentences"] == 4000 and stages["bpe"]["encoding"]["seconds"] >= 0
    for r in (stages["fetch"]["local"], stages["bpe"], stages["bucket"]):
        assert r["peak_rss_mb"] > 20 and 0 < r["peak_pss_mb"] <= r["peak_rss_mb"] and r["seconds"] > 0
