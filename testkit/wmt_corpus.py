"""A synthetic parallel corpus shaped like WMT14 en-de, for bench/wmt_data.py and its test: sentence lengths,
vocabulary richness, digits and punctuation, written as local gzip text or a saved ``datasets`` directory.

The data stages' cost depends on the shape of the text, not on its meaning: how many words a line has (fetch's
filters, bpe's encoding, bucket's lengths) and how many distinct words there are (SentencePiece's training memory and
time grow with the types it counts). So the shape is WMT14's and the words are nonsense:

* Lengths: a log-normal number of words per source sentence, mean about 27 and median about 23, clipped to 1-250
  (WMT14 en-de's train split has a long tail up to the 250 words fetch keeps); the target's count is the source's
  times a log-normal ratio (German runs a few percent shorter in words), so the two sides correlate as a translation's
  do.
* Words: 90 % from a Zipf (s = 1) head of 20,000 common types, 10 % from a steeper Zipf tail (s = 1.8) over ranks up
  to 12 million: about 1.1 million types per side in 4.5M pairs, half of them hapaxes, 3.3 million in 36M pairs (a
  real corpus's types grow so, by Heaps' law); 37,000 BPE pieces encode a sentence in about 30 of them. Types are
  spelled from syllables (each side its own inventory; German's has umlauts and ß), longer as they get rarer; 1 rank
  in 29 is a number; commas and sentence-final periods are tokens of their own.
* Deterministic from a seed and the slice index, generated in slices of :data:`SLICE` pairs with numpy (word ids
  drawn in bulk, spelled by gathering bytes from a vocabulary table), so memory stays bounded at any size.
"""

from __future__ import annotations

import gzip
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SLICE = 65536  # pairs per generated slice
HEAD, TYPES = 20_000, 12_000_000  # head types; rank bound of the tail
TAIL_SHARE, TAIL_S = 0.10, 1.8
MU, SIGMA, MAX_WORDS = np.log(27.0) - 0.6**2 / 2, 0.6, 250  # log-normal: mean 27 words, clipped to 250
SPLITS = {"train": 0, "valid": 3000, "test": 3003}  # pairs; train's is the caller's
HF_SPLITS = {"train": "train", "valid": "validation", "test": "test"}  # the names wmt/wmt14 uses
LANGS = ("en", "de")
_SOUNDS = {
    "en": (["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z", "st",
            "th", "ch", "sh", "br", "tr", "pl", "gr", "cr", "fl"],
           ["a", "e", "i", "o", "u", "ea", "ou", "ai", "ee", "oo", "y"], ["", "n", "r", "s", "t", "l", "nd", "ng", "st",
                                                                          "ck"]),
    "de": (["", "b", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "w", "z", "sch", "st", "sp",
            "kr", "br", "tr", "pf", "gr", "fl", "kl"],
           ["a", "e", "i", "o", "u", "ä", "ö", "ü", "ei", "au", "ie", "eu"], ["", "n", "r", "s", "t", "l", "ch", "ng",
                                                                              "ß", "nd", "tz", "rt", "cht"]),
}
PUNCT = [",", "."]


@dataclass
class Vocabulary:
    """One side's types as a byte table: type ``i`` is ``blob[off[i]:off[i + 1]]``, a trailing space included.
    Ranks ``0..TYPES-1`` are words and numbers; ``TYPES`` is the comma, ``TYPES + 1`` the period."""

    blob: np.ndarray  # uint8 [bytes]
    off: np.ndarray  # int64 [types + 1]


def gather(blob: np.ndarray, off: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The entries ``ids`` of a byte table, concatenated: ``(bytes uint8, offsets int64 [len(ids) + 1])``."""
    lens = off[ids + 1] - off[ids]
    out_off = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(lens, out=out_off[1:])
    idx = np.repeat(off[ids] - out_off[:-1], lens) + np.arange(out_off[-1])
    return blob[idx], out_off


def _table(pieces: list[str]) -> tuple[np.ndarray, np.ndarray]:
    data = [p.encode() for p in pieces]
    off = np.zeros(len(data) + 1, np.int64)
    np.cumsum([len(d) for d in data], out=off[1:])
    return np.frombuffer(b"".join(data), np.uint8), off


def vocabulary(lang: str, seed: int, types: int = TYPES, chunk: int = 1 << 20) -> Vocabulary:
    """``lang``'s spellings: a rank's syllable count grows with its rank (1 below 100, 2 below :data:`HEAD`, 3 below
    2M, else 4); its index within the band, scrambled (times a prime, modulo the band's size), written in the base
    ``b = ceil(size ** (1 / k))`` gives one syllable per digit, position ``i`` using its own seeded choice of ``b`` of
    the S syllables: rare words share syllables without sharing whole prefixes, and all but a few in 10,000 types
    are spelled differently (two syllable sequences can make one string: "a" + "ban" and "ab" + "an"). Ranks
    ``r % 29 == 7`` (from 100 on) are the number ``r // 29``."""
    onsets, vowels, codas = _SOUNDS[lang]
    syllables = [o + v + c for o in onsets for v in vowels for c in codas]
    s = len(syllables)
    rng = np.random.default_rng([seed, LANGS.index(lang)])
    perms = np.stack([rng.permutation(s) for _ in range(4)])  # [4, S]
    sblob, soff = _table(syllables + list("0123456789") + [" "])
    digit0, space = s, s + 10
    bands = np.array([0, 100, HEAD, 2_000_000])
    blobs, lens = [], []
    for lo in range(0, types, chunk):
        r = np.arange(lo, min(types, lo + chunk), dtype=np.int64)
        k = np.searchsorted(bands, r, side="right")  # syllables, 1..4
        size = np.diff(np.r_[bands, types])[k - 1]
        j = ((r - bands[k - 1]) * 1_000_003) % size  # 1_000_003 is prime: a permutation of the band
        base = np.ceil(size ** (1.0 / k)).astype(np.int64)
        number = (r >= 100) & (r % 29 == 7)
        value = r // 29
        digits = np.where(number, np.floor(np.log10(np.maximum(value, 1))).astype(np.int64) + 1, k)
        pieces = np.full((len(r), 9), -1, np.int64)  # [ranks, at most 8 pieces + the space]
        for i in range(8):
            syl = perms[i % 4][(j // base**i) % base] if i < 4 else np.zeros_like(j)
            dig = digit0 + (value // 10 ** np.maximum(digits - 1 - i, 0)) % 10
            pieces[:, i] = np.where(i < digits, np.where(number, dig, syl), -1)
        pieces[np.arange(len(r)), digits] = space
        flat = pieces[pieces >= 0]  # row-major: each rank's pieces in order
        blobs.append(gather(sblob, soff, flat)[0])
        lens.append(np.where(pieces >= 0, soff[pieces + 1] - soff[pieces], 0).sum(1))
    pblob, poff = _table([p + " " for p in PUNCT])
    blob = np.concatenate([*blobs, pblob])
    off = np.zeros(types + len(PUNCT) + 1, np.int64)
    np.cumsum(np.concatenate([*lens, np.diff(poff)]), out=off[1:])
    return Vocabulary(blob, off)


def lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Words per sentence of ``n`` pairs: ``(src [n], tgt [n])`` int64, each in 1..250."""
    src = np.clip(np.rint(rng.lognormal(MU, SIGMA, n)), 1, MAX_WORDS).astype(np.int64)
    tgt = np.clip(np.rint(src * rng.lognormal(-0.04, 0.2, n)), 1, MAX_WORDS).astype(np.int64)
    return src, tgt


def words(rng: np.random.Generator, n: int, types: int = TYPES) -> np.ndarray:
    """``n`` word ranks: the Zipf head (s = 1 over :data:`HEAD` types, by its continuous inverse CDF) or, with
    probability :data:`TAIL_SHARE`, the Zipf tail (s = 1.8 from rank ``HEAD`` on; the 0.6 % of it beyond ``types``
    wraps around into the tail)."""
    u = rng.random(n)
    head = np.exp(u * np.log(HEAD + 1.0)) - 1.0  # x^-1 on [1, HEAD + 1), shifted to 0
    a, b = HEAD ** (1 - TAIL_S), types ** (1 - TAIL_S)
    tail = (a + (b - a) * rng.random(n)) ** (1 / (1 - TAIL_S))
    tail = HEAD + (tail.astype(np.int64) - HEAD) % (types - HEAD)
    return np.where(rng.random(n) < TAIL_SHARE, tail, head.astype(np.int64))


def side_text(rng: np.random.Generator, vocab: Vocabulary, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The lines of one side, ``counts[i]`` words each: ``(bytes with a newline after each line, line offsets)``.
    4 % of the words become commas and 85 % of the lines of 3+ words end with a period."""
    types = len(vocab.off) - 1 - len(PUNCT)
    ids = words(rng, int(counts.sum()), types)
    ids[rng.random(len(ids)) < 0.04] = types  # comma
    ends = np.cumsum(counts) - 1
    period = (counts >= 3) & (rng.random(len(counts)) < 0.85)
    ids[ends[period]] = types + 1
    data, woff = gather(vocab.blob, vocab.off, ids)
    data[woff[ends + 1] - 1] = ord("\n")  # each line's last space
    return data, woff[np.r_[0, ends + 1]]


def slices(split: str, pairs: int, seed: int, vocabs: dict[str, Vocabulary]) -> Iterator[dict[str, tuple]]:
    """The split's pairs in slices: per language, ``(bytes, line offsets)``; slice ``k`` depends on (seed, split,
    k) alone."""
    for k, start in enumerate(range(0, pairs, SLICE)):
        rng = np.random.default_rng([seed, list(SPLITS).index(split), k])
        n_src, n_tgt = lengths(rng, min(SLICE, pairs - start))
        yield {lang: side_text(rng, vocabs[lang], n) for lang, n in zip(LANGS, (n_src, n_tgt))}


def split_sizes(pairs: int) -> dict[str, int]:
    return {**SPLITS, "train": pairs}


def write_local(out: Path, pairs: int, seed: int, vocabs: dict[str, Vocabulary], level: int = 1) -> None:
    """``{split}.{en,de}.gz`` under ``out`` (fetch's parallel-files layout); each side compressed in its own thread
    (zlib releases the GIL). Written to ``*.tmp`` names, renamed when complete."""
    out.mkdir(parents=True, exist_ok=True)
    for split, n in split_sizes(pairs).items():
        files = {lang: gzip.open(out / f"{split}.{lang}.gz.tmp", "wb", compresslevel=level) for lang in LANGS}
        for sl in slices(split, n, seed, vocabs):
            threads = [threading.Thread(target=files[lang].write, args=(sl[lang][0].tobytes(),)) for lang in LANGS]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for lang, f in files.items():
            f.close()
            (out / f"{split}.{lang}.gz.tmp").rename(out / f"{split}.{lang}.gz")


def _strings(data: np.ndarray, off: np.ndarray) -> pa.Array:
    arr = pa.Array.from_buffers(pa.large_string(), len(off) - 1, [None, pa.py_buffer(off), pa.py_buffer(data)])
    return pc.utf8_rtrim(arr, characters="\n").cast(pa.string())


def write_datasets(out: Path, pairs: int, seed: int, vocabs: dict[str, Vocabulary], shard_pairs: int = 1 << 20) -> None:
    """A saved ``datasets`` DatasetDict like ``wmt/wmt14``'s (train / validation / test, one ``translation`` column
    of the Translation feature): each split's Arrow shards (``data-0000k-of-0000n.arrow``, what ``save_to_disk``
    writes) streamed slice by slice, then its ``state.json`` and ``dataset_info.json``."""
    import datasets

    features = datasets.Features({"translation": datasets.Translation(languages=list(LANGS))})
    schema = features.arrow_schema
    struct = schema.field("translation").type
    for split, n in split_sizes(pairs).items():
        d = out / HF_SPLITS[split]
        d.mkdir(parents=True, exist_ok=True)
        shards = max(1, -(-n // shard_pairs))
        names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
        writer, done = None, 0
        for sl in slices(split, n, seed, vocabs):
            if done % shard_pairs == 0:
                if writer is not None:
                    writer.close()
                writer = pa.ipc.new_stream(str(d / names[done // shard_pairs]), schema)
            cols = {lang: _strings(*sl[lang]) for lang in LANGS}
            col = pa.StructArray.from_arrays([cols[f.name] for f in struct], fields=list(struct))
            writer.write_batch(pa.RecordBatch.from_arrays([col], schema=schema))
            done += len(col)
        assert writer is not None
        writer.close()
        state = {"_data_files": [{"filename": x} for x in names], "_fingerprint": f"synthetic-{seed}-{split}-{n}",
                 "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
                 "_split": None}
        (d / "state.json").write_text(json.dumps(state, indent=2))
        info = {"citation": "", "description": "synthetic WMT14-shaped corpus", "features": features.to_dict(),
                "homepage": "", "license": ""}
        (d / "dataset_info.json").write_text(json.dumps(info, indent=2))
    (out / "dataset_dict.json").write_text(json.dumps({"splits": list(HF_SPLITS.values())}))
