"""``mtpipe fetch``: a parallel corpus -> a ``corpus`` artifact ({train,valid,test}.parquet: id, src, tgt).

Where a corpus can come from (``fetch.source``) is :mod:`mtpipe.stages.sources`.

Cleaning
--------
Every split is Unicode-NFC normalised and stripped of leading/trailing whitespace. Valid and test are never filtered
(scores must be computed on the official sets; an undecodable byte there becomes U+FFFD with a warning). Train pairs
are dropped by the first of these filters that applies, and every filter is counted:

1. ``invalid_utf8``: either side is not valid UTF-8 (the first line number is reported);
2. ``malformed``: a TSV line without exactly one tab;
3. ``empty``: either side is empty after stripping;
4. ``too_short`` / ``too_long``: a side has fewer than ``min_len`` or more than ``max_len`` whitespace words;
5. ``ratio``: one side has more than ``max_ratio`` times the other's words (Moses ``clean-corpus-n.perl``);
6. ``duplicate``: the exact (src, tgt) pair was seen before (``dedup``).

The corpus is streamed in Arrow record batches, vectorised with ``pyarrow.compute``; duplicate detection keeps one
64-bit XXH3 hash per kept pair in a numpy open-addressing table, so a 4.5M-pair corpus (WMT14 en-de) runs in a few
hundred MB. Row ids are the 0-based line (row) index in the source split, so a pair can always be traced back.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mtpipe import console
from mtpipe.artifacts import CORPUS_SCHEMA, from_numpy, to_numpy
from mtpipe.config import FetchConfig, to_dict
from mtpipe.errors import MtpipeError
from mtpipe.stages.sources import Batch, SplitReader, local_source, open_source, resolve_splits
from mtpipe.writing import ArtifactWriter, prepare_output

FILTERS = ("invalid_utf8", "malformed", "empty", "too_short", "too_long", "ratio", "duplicate")


# --------------------------------------------------------------------------------------------------------------------
# Cleaning
# --------------------------------------------------------------------------------------------------------------------


class SeenHashes:
    """A set of 64-bit hashes in a numpy open-addressing table (linear probing, load <= 0.7).

    8 bytes per slot: about 12 bytes per distinct pair on average (16-24 while the table doubles), versus ~70 for a
    Python set of ints: deduplicating tens of millions of pairs fits in well under a GB. Inserts are vectorised over
    a whole batch. Two different pairs share a 64-bit hash with probability about n^2 / 2^65 (5e-7 for 4.5M pairs):
    one pair wrongly dropped.
    """

    MAX_LOAD = 0.7
    GROW_SLICE = 1 << 20

    def __init__(self, capacity: int = 1 << 16):
        self.table = np.zeros(capacity, np.uint64)
        self.size = 0

    def add(self, h: np.ndarray) -> np.ndarray:
        """Insert a batch of hashes; True where a hash is new (its first occurrence, in the batch and ever)."""
        h = np.where(h == 0, np.uint64(1), h).astype(np.uint64)  # 0 marks an empty slot
        uniq, first = np.unique(h, return_index=True)
        while (self.size + len(uniq)) > self.MAX_LOAD * len(self.table):
            self._grow()
        new = np.zeros(len(h), bool)
        new[first[self._insert(uniq)]] = True
        return new

    def __len__(self) -> int:
        return self.size

    def _insert(self, keys: np.ndarray) -> np.ndarray:
        """Insert distinct keys; True where a key was absent."""
        table, mask = self.table, np.uint64(len(self.table) - 1)
        inserted = np.zeros(len(keys), bool)
        pending = np.arange(len(keys))
        pos = (keys & mask).astype(np.int64)  # XXH3 output is uniform: its low bits are a fine slot index
        while pending.size:
            k, p = keys[pending], pos[pending]
            slot = table[p]
            done = slot == k  # already present: a duplicate
            empty = np.flatnonzero(slot == 0)
            if empty.size:
                # Several keys may claim one empty slot; the write that lands wins, the others probe on.
                table[p[empty]] = k[empty]
                won = empty[table[p[empty]] == k[empty]]
                inserted[pending[won]] = True
                done[won] = True
                self.size += len(won)
            pending = pending[~done]
            pos[pending] = (pos[pending] + 1) & int(mask)
        return inserted

    def _grow(self) -> None:
        """Double the table, moving the keys a slice of the old table at a time: the probing's temporaries (a few
        arrays the size of the keys moved) stay small, so the peak is the two tables, not several times more."""
        old, self.table = self.table, np.zeros(len(self.table) * 2, np.uint64)
        self.size = 0
        for i in range(0, len(old), self.GROW_SLICE):
            part = old[i : i + self.GROW_SLICE]
            self._insert(part[part != 0])


def pair_hashes(src: pa.Array, tgt: pa.Array) -> np.ndarray:
    """64-bit XXH3 of each (src, tgt) pair. The source's byte length is part of the key, so no separator choice can
    make two different pairs look alike. (XXH3 is ~20x faster here than hashlib's BLAKE2b and as well mixed.)"""
    import xxhash

    key = pc.binary_join_element_wise(pc.cast(pc.binary_length(src), pa.string()), src, tgt, "\x00")
    keys = pc.cast(key, pa.binary()).to_pylist()
    return np.fromiter(map(xxhash.xxh3_64_intdigest, keys), dtype=np.uint64, count=len(keys))


def _decode(arr: pa.Array) -> tuple[pa.Array, Optional[np.ndarray]]:
    """``binary`` -> ``string``; invalid UTF-8 becomes U+FFFD and is flagged (None when the batch is all valid)."""
    try:
        out = arr.cast(pa.string())
        return (out.fill_null("") if out.null_count else out), None
    except pa.ArrowInvalid:
        if not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):
            raise
    # Rare slow path: find the bad lines one by one (only for a batch that has one).
    bad = np.zeros(len(arr), bool)
    out = []
    for i, v in enumerate(arr.to_pylist()):
        try:
            out.append(v.decode("utf-8") if v is not None else "")
        except UnicodeDecodeError:
            bad[i] = True
            out.append(v.decode("utf-8", "replace"))
    return pa.array(out, pa.string()), bad


def normalise(arr: pa.Array) -> pa.Array:
    """Unicode NFC and leading/trailing whitespace removed (applied to every split).

    Only non-ASCII lines can change under NFC, and CPython's normaliser returns an already-normalised string as is
    after a quick check, which is ~10x faster than Arrow's ``utf8_normalize`` on every line; Arrow builds the result.
    """
    non_ascii = pc.invert(pc.string_is_ascii(arr))
    if non_ascii.true_count:
        idx = pc.indices_nonzero(non_ascii)
        texts = arr.take(idx).to_pylist()
        normal = [unicodedata.normalize("NFC", t) for t in texts]
        changed = [i for i, (a, b) in enumerate(zip(texts, normal)) if a is not b]
        if changed:
            mask = np.zeros(len(arr), bool)
            mask[to_numpy(idx)[changed]] = True
            arr = pc.replace_with_mask(arr, pa.array(mask), pa.array([normal[i] for i in changed], pa.string()))
    return pc.utf8_trim_whitespace(arr)


def word_counts(arr: pa.Array) -> np.ndarray:
    """Whitespace-separated words per line (0 for an empty line), as Moses counts them."""
    n = to_numpy(pc.list_value_length(pc.utf8_split_whitespace(arr)))
    return np.where(to_numpy(pc.binary_length(arr)) == 0, 0, n)


@dataclass
class SplitStats:
    rows_in: int = 0
    rows_out: int = 0
    filters: dict[str, int] = field(default_factory=lambda: {f: 0 for f in FILTERS})
    samples: dict[str, str] = field(default_factory=dict)  # filter -> "file line N" of its first occurrence
    replaced_utf8: int = 0  # valid/test: lines with undecodable bytes kept with U+FFFD


class Cleaner:
    """Normalises every split and filters train; one instance per split."""

    def __init__(self, cfg: FetchConfig, split: str, reader: SplitReader, seen: Optional[SeenHashes]):
        self.cfg, self.split, self.reader, self.seen = cfg, split, reader, seen
        self.train = split == "train"
        self.stats = SplitStats()

    def _drop(self, name: str, mask: np.ndarray, alive: np.ndarray, start: int, side: str = "") -> None:
        hit = mask & alive
        n = int(hit.sum())
        if n:
            self.stats.filters[name] += n
            if name not in self.stats.samples:
                self.stats.samples[name] = f"{side or self.reader.where} line {start + int(np.argmax(hit)) + 1}"
            alive &= ~hit

    def __call__(self, batch: Batch, start: int) -> pa.RecordBatch:
        """Normalise (every split) and filter (train) one batch whose first row has index ``start``."""
        n = len(batch.tgt)
        self.stats.rows_in += n
        malformed = to_numpy(batch.malformed) if batch.malformed is not None else None
        alive = np.ones(n, bool)
        src, bad_src = _decode(batch.src)
        tgt, bad_tgt = _decode(batch.tgt)
        files = self.reader.files
        if not self.train:
            if malformed is not None and malformed.any():
                line = start + int(np.argmax(malformed)) + 1
                raise MtpipeError(f"{self.reader.where}: line {line}: expected exactly one tab (src<TAB>tgt); "
                                  f"{self.split} is never filtered, so fix the file")
            for bad in (bad_src, bad_tgt):
                if bad is not None:
                    self.stats.replaced_utf8 += int(bad.sum())
                    self.stats.samples.setdefault("invalid_utf8", f"line {start + int(np.argmax(bad)) + 1}")
        else:
            if malformed is not None:
                self._drop("malformed", malformed, alive, start)
            for bad, f in ((bad_src, files[:1]), (bad_tgt, files[1:] or files[:1])):
                if bad is not None:
                    self._drop("invalid_utf8", bad, alive, start, str(f[0]) if f else "")
        src, tgt = normalise(src), normalise(tgt)
        ids = np.arange(start, start + n, dtype=np.int64)
        if self.train:
            c = self.cfg
            ws, wt = word_counts(src), word_counts(tgt)
            self._drop("empty", (ws == 0) | (wt == 0), alive, start)
            self._drop("too_short", (ws < c.min_len) | (wt < c.min_len), alive, start)
            self._drop("too_long", (ws > c.max_len) | (wt > c.max_len), alive, start)
            # Moses clean-corpus-n: drop when e/f > ratio or f/e > ratio (both counts are >= 1 here).
            self._drop("ratio", (ws > c.max_ratio * wt) | (wt > c.max_ratio * ws), alive, start)
            if self.seen is not None and alive.any():
                idx = np.flatnonzero(alive)
                keep_src, keep_tgt = src.take(from_numpy(idx)), tgt.take(from_numpy(idx))
                dup = np.zeros(n, bool)
                dup[idx] = ~self.seen.add(pair_hashes(keep_src, keep_tgt))
                self._drop("duplicate", dup, alive, start)
            if not alive.all():
                idx = from_numpy(np.flatnonzero(alive))
                src, tgt, ids = src.take(idx), tgt.take(idx), ids[alive]
        self.stats.rows_out += len(ids)
        return pa.RecordBatch.from_arrays([from_numpy(ids), src, tgt], schema=CORPUS_SCHEMA)


# --------------------------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------------------------


def fetch_corpus(cfg: FetchConfig, out: Path, *, force: bool = False) -> dict[str, SplitStats]:
    """Read ``cfg.source``, clean train, write the ``corpus`` artifact to ``out``; returns per-split statistics."""
    out = Path(out)
    prepare_output(out, "corpus", inputs=[local_source(cfg.source)], force=force)
    source = open_source(cfg)
    mapping = resolve_splits(cfg, source)
    readers = {split: source.open(name) for split, name in mapping.items()}  # fails early on a missing language
    stats: dict[str, SplitStats] = {}
    with ArtifactWriter(out, "corpus", {"fetch": to_dict(cfg)}, force=force) as w, console.progress() as bar:
        for split, reader in readers.items():
            cleaner = Cleaner(cfg, split, reader, SeenHashes() if cfg.dedup and split == "train" else None)
            task = bar.add_task(f"{split} ({reader.unit})", total=reader.total)
            writer = w.parquet_writer(f"{split}.parquet")
            try:
                start = 0
                for batch in reader.batches():
                    writer.write_batch(cleaner(batch, start))
                    start += len(batch.tgt)
                    bar.update(task, completed=min(batch.position, reader.total))
            finally:
                writer.close()
            bar.update(task, completed=reader.total)
            s = stats[split] = cleaner.stats
            w.rows[f"{split}.parquet"] = s.rows_out
            if s.rows_out == 0:
                what = "after cleaning" if split == "train" and s.rows_in else "(no lines)"
                kept = ", ".join(f"{k} {v:,}" for k, v in s.filters.items() if v)
                raise MtpipeError(f"{reader.where}: split '{split}' is empty {what}"
                                  + (f" ({s.rows_in:,} pairs in; dropped: {kept})" if kept else ""))
            if s.replaced_utf8:
                console.warn(f"{reader.where}: {s.replaced_utf8:,} lines of {split} are not valid UTF-8 (first: "
                             f"{s.samples['invalid_utf8']}); kept with U+FFFD since {split} is never filtered")
        w.extra.update({
            "source": cfg.source,
            "src_lang": cfg.src_lang,
            "tgt_lang": cfg.tgt_lang,
            "source_splits": mapping,
            "source_files": {split: {p.name: p.stat().st_size for p in r.files} for split, r in readers.items()
                             if r.files},
            "normalisation": "NFC, leading/trailing whitespace stripped",
            "pairs_in": {k: s.rows_in for k, s in stats.items()},
            "pairs_out": {k: s.rows_out for k, s in stats.items()},
            "filters": stats["train"].filters,
            "filter_samples": stats["train"].samples,
        })
    _summary(cfg, mapping, stats, out)
    return stats


def _summary(cfg: FetchConfig, mapping: dict[str, str], stats: dict[str, SplitStats], out: Path) -> None:
    splits = list(stats)
    rows: list[list[Any]] = [["source split", *[mapping[s] for s in splits]],
                             ["pairs in", *[stats[s].rows_in for s in splits]]]
    for f in FILTERS:
        if f == "malformed" and not stats["train"].filters[f]:
            continue  # only TSV sources can have malformed lines
        rows.append([f"  - {f}", *[stats[s].filters[f] if s == "train" else "" for s in splits]])
    rows.append(["pairs out", *[stats[s].rows_out for s in splits]])
    console.table(f"fetch: {cfg.source} ({cfg.src_lang}-{cfg.tgt_lang}) -> {out}", ["", *splits], rows)
    for name, where in stats["train"].samples.items():
        if name in ("invalid_utf8", "malformed"):
            console.warn(f"train: {stats['train'].filters[name]:,} pairs dropped as {name} (first: {where})")

