"""Shared fixtures. Tests run offline, on CPU, in a few minutes on 2 cores."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MULTI30K = Path(os.environ.get("MTPIPE_MULTI30K", REPO.parent / "shared" / "data" / "multi30k"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def have_multi30k() -> bool:
    return (MULTI30K / "train.en.gz").exists()


needs_multi30k = pytest.mark.skipif(not have_multi30k(), reason=f"Multi30k not found at {MULTI30K}")


@pytest.fixture
def multi30k_small(tmp_path: Path) -> Path:
    """A local {split}.{lang}.gz corpus: the first 2,000 train pairs, 100 val, 100 test of the real Multi30k."""
    if not have_multi30k():
        pytest.skip(f"Multi30k not found at {MULTI30K}")
    out = tmp_path / "corpus"
    out.mkdir()
    for split, n in (("train", 2000), ("val", 100), ("test_2016_flickr", 100)):
        for lang in ("en", "de"):
            with gzip.open(MULTI30K / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = [next(f) for _ in range(n)]
            with gzip.open(out / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.writelines(lines)
    return out
