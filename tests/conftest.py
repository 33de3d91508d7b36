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


def train_spm(prefix: Path, lines: list[str], vocab_size: int):
    """A tiny BPE SentencePiece model ``prefix.model`` with mtpipe's special ids, trained on ``lines``; returns its
    processor."""
    import sentencepiece as spm

    from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID, UNK_ID

    text = prefix.with_suffix(".txt")
    text.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(prefix), vocab_size=vocab_size,
                                   model_type="bpe", pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                                   hard_vocab_limit=False, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


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
