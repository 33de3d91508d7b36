"""The data part: fairseq-preprocess (binarising the encoded text, ``--joined-dictionary --workers 2``) against
``mtpipe bpe --spm-model`` (encoding the raw text: fairseq's side was given it done) + ``mtpipe bucket``, wall seconds
and peak memory, at Multi30k size and ``--data-pairs`` (train repeated). Ratio = fairseq seconds / mtpipe seconds."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path
from typing import Any

from bench.anchors.common import DATA, Env, say, sh, write_params

M30K_TRAIN = 29000


def corpus_dir(e: Env, pairs: int) -> Path:
    """Raw text (mtpipe's input) and SentencePiece pieces (fairseq's) of Multi30k with train repeated to ``pairs``
    lines; made once under the work dir."""
    d = e.work / "data" / str(pairs)
    if (d / ".done").exists():
        return d
    say(f"data: writing the {pairs:,}-pair corpus (raw for mtpipe, spm pieces for fairseq) to {d}")
    shutil.rmtree(d, ignore_errors=True)
    (d / "raw").mkdir(parents=True)
    (d / "spm").mkdir()
    for lang in ("en", "de"):
        for split in ("val", "test_2016_flickr"):
            shutil.copy(DATA / f"{split}.{lang}.gz", d / "raw" / f"{split}.{lang}.gz")
            shutil.copy(e.a / "data" / "spm" / f"{split}.{lang}", d / "spm" / f"{split}.{lang}")
        for src, dst in ((DATA / f"train.{lang}.gz", d / "raw" / f"train.{lang}.gz"),
                         (e.a / "data" / "spm" / f"train.{lang}", d / "spm" / f"train.{lang}")):
            opener = gzip.open if src.suffix == ".gz" else open
            with opener(src, "rt", encoding="utf-8") as f:
                lines = f.read().splitlines(keepends=True)
            with opener(dst, "wt", encoding="utf-8", **({"compresslevel": 1} if opener is gzip.open else {})) as f:
                for start in range(0, pairs, len(lines)):
                    f.writelines(lines[: min(len(lines), pairs - start)])
    (d / ".done").write_text(str(pairs))
    return d


def data_round(e: Env, pairs: int, r: int) -> dict[str, Any]:
    d = corpus_dir(e, pairs)
    if not (d / "fetch" / "manifest.json").exists():  # untimed: mtpipe's counterpart of having text files
        write_params(d)
        sh(e.mtpipe("fetch", "--source", "raw", "--out", "fetch"), e.logs / f"setup_fetch_{pairs}.log", e.env, d)
    tag, fs_peak, mt_peak = e.logs / f"r{r}_data_{pairs}", [], []
    shutil.rmtree(d / "fs-bin", ignore_errors=True)
    fs = sh([e.a / "venv-fs38" / "bin" / "fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
             "--trainpref", d / "spm" / "train", "--validpref", d / "spm" / "val", "--testpref",
             d / "spm" / "test_2016_flickr", "--destdir", d / "fs-bin", "--joined-dictionary", "--workers", 2],
            Path(f"{tag}_fairseq_preprocess.log"), e.env, peak=fs_peak)
    shutil.rmtree(d / "fs-bin", ignore_errors=True)
    bpe = sh(e.mtpipe("bpe", "--corpus", "fetch", "--spm-model", e.spm, "--out", "bpe_t"),
             Path(f"{tag}_mtpipe_bpe.log"), e.env, d, peak=mt_peak)
    bucket = sh(e.mtpipe("bucket", "--tokens", "bpe_t", "--out", "bucket_t"), Path(f"{tag}_mtpipe_bucket.log"),
                e.env, d, peak=mt_peak)
    return {"fairseq-preprocess": {"value": fs, "seconds": fs, "peak_rss_bytes": max(fs_peak)},
            "mtpipe bpe+bucket": {"value": bpe + bucket, "seconds": bpe + bucket, "bpe_s": bpe, "bucket_s": bucket,
                                  "peak_rss_bytes": max(mt_peak)}}
