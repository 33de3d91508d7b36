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

Train's sources
---------------
Train may be built from several sources (``fetch.add_train`` after ``fetch.source``), each cut to the rows
``train_slice`` names, its target side perhaps replaced by a hypotheses artifact's translations (``hypotheses``:
back-translation, distillation) and its source sentences perhaps tagged (``tag``), all cleaned together (one set of
duplicates). A row's id is its row in its source, plus, for an added source, where the rows before it ended, so ids
stay unique and traceable; the manifest lists each source (``train_sources``). Valid and test are fetch.source's.

The corpus is streamed in Arrow record batches, vectorised with ``pyarrow.compute``; duplicate detection keeps one
64-bit XXH3 hash per kept pair in a numpy open-addressing table, so a 4.5M-pair corpus (WMT14 en-de) runs in a few
hundred MB. Row ids are the 0-based line (row) index in the source split, so a pair can always be traced back.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mtpipe import console
from mtpipe.artifacts import CORPUS_SCHEMA, read_manifest, read_table
from mtpipe.config import FetchConfig, to_dict, train_slice
from mtpipe.errors import MtpipeError
from mtpipe.reading import from_numpy, to_numpy
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
    """Normalises every split and filters train; one instance per source of a split, which share ``stats`` and
    ``seen`` (train's sources are deduplicated together). A row's id is ``id_offset`` + its row in its source; ``tag``
    goes before every kept source sentence."""

    def __init__(self, cfg: FetchConfig, split: str, reader: SplitReader, seen: Optional[SeenHashes],
                 stats: Optional[SplitStats] = None, id_offset: int = 0, tag: str = ""):
        self.cfg, self.split, self.reader, self.seen = cfg, split, reader, seen
        self.train = split == "train"
        self.stats = stats if stats is not None else SplitStats()
        self.id_offset, self.tag = id_offset, tag

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
        ids = np.arange(start, start + n, dtype=np.int64) + self.id_offset
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
        if self.tag:  # after the filters: they judge the sentence, not the tag
            src = pc.binary_join_element_wise(pa.scalar(self.tag), src, " ")
        return pa.RecordBatch.from_arrays([from_numpy(ids), src, tgt], schema=CORPUS_SCHEMA)


# --------------------------------------------------------------------------------------------------------------------
# Train's sources: fetch.source's train split, then fetch.add_train's; each sliced, its target side perhaps replaced
# --------------------------------------------------------------------------------------------------------------------


def train_parts(cfg: FetchConfig) -> list[dict[str, Any]]:
    """fetch.source's train settings, then each fetch.add_train entry's, with the same keys."""
    own = {"source": cfg.source, "train_slice": cfg.train_slice, "hypotheses": cfg.hypotheses, "tag": cfg.tag}
    return [own, *({"train_slice": "", "hypotheses": None, "tag": "", **e} for e in cfg.add_train)]


class Hypotheses:
    """A hypotheses artifact of a corpus artifact's train split: its translations, looked up by the corpus's ids.

    Why: back-translation (Sennrich et al. 2016) and sequence-level distillation (Kim and Rush 2016) train on a
    corpus whose one side another model wrote; the decode that wrote it kept the corpus's ids, so the pairs are
    rebuilt exactly, whatever order or subset the decode ran on."""

    def __init__(self, path: Path):
        self.path = path
        m = read_manifest(path, "hypotheses")
        if m.extra.get("split") != "train":
            what = f"split '{m.extra['split']}'" if m.extra.get("split") else "--input text"
            raise MtpipeError(f"{path}: translates {what}, not a corpus's train split (decode.split: train)")
        t = read_table(path, "train.parquet", "hypotheses", columns=["id", "hypothesis"])
        ids = to_numpy(t.column("id").combine_chunks())
        order = np.argsort(ids, kind="stable")
        self.ids, self.text = ids[order], t.column("hypothesis").combine_chunks().take(from_numpy(order))

    def lookup(self, ids: pa.Array, where: str) -> pa.Array:
        want = to_numpy(ids)
        pos = np.minimum(np.searchsorted(self.ids, want), max(len(self.ids) - 1, 0))
        found = self.ids[pos] == want if len(self.ids) else np.zeros(len(want), bool)
        if not found.all():
            raise MtpipeError(f"{self.path}: has no translation of id {int(want[~found][0])} of {where} (decode the "
                              "train split of that corpus's bpe artifact)")
        return self.text.take(from_numpy(pos))


def train_rows(reader: SplitReader, part: dict[str, Any], hyps: Optional[Hypotheses]) -> Iterator[tuple[Batch, int]]:
    """``(batch, first row)`` of the rows ``part["train_slice"]`` keeps, the target side replaced by ``hyps``."""
    first, last = train_slice(part["train_slice"], "train_slice")
    start = 0
    for batch in reader.batches():
        n = len(batch.tgt)
        lo, hi = max(first - start, 0), n if last is None else min(last - start, n)
        if hi > lo:
            if (lo, hi) != (0, n):
                batch = Batch(*(a.slice(lo, hi - lo) if isinstance(a, pa.Array) else a for a in batch))
            if hyps is not None:
                side = hyps.lookup(batch.ids, reader.where)
                batch = batch._replace(**{"src" if reader.swapped else "tgt": side})
            yield batch, start + lo
        start += n
        if last is not None and start >= last:
            return


# --------------------------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------------------------


def fetch_corpus(cfg: FetchConfig, out: Path, *, force: bool = False) -> dict[str, SplitStats]:
    """Read ``cfg.source``, clean train, write the ``corpus`` artifact to ``out``; returns per-split statistics."""
    out = Path(out)
    parts = train_parts(cfg)
    hyp_dirs = {i: Path(p["hypotheses"]) for i, p in enumerate(parts) if p["hypotheses"]}
    prepare_output(out, "corpus", inputs=[*(local_source(p["source"]) for p in parts), *hyp_dirs.values()],
                   force=force)
    source = open_source(cfg)
    mapping = resolve_splits(cfg, source)
    # Every source opened first: a missing language or split fails before anything is written.
    readers = {split: [source.open(name)] for split, name in mapping.items()}
    readers["train"] += [_train_reader(cfg, p["source"]) for p in parts[1:]]
    for i in hyp_dirs:
        if readers["train"][i].swapped is None:
            raise MtpipeError(f"{parts[i]['source']}: hypotheses replace a side of a corpus artifact (mtpipe fetch "
                              "--out) whose train split was decoded; this source is not one")
    hyps = {i: Hypotheses(d) for i, d in hyp_dirs.items()}
    stats: dict[str, SplitStats] = {}
    given: dict[str, list[dict[str, Any]]] = {}  # per split, what each of its sources gave
    upstream = {f"hypotheses_{i}": d for i, d in hyp_dirs.items()}
    with ArtifactWriter(out, "corpus", {"fetch": to_dict(cfg)}, upstream=upstream, force=force) as w, \
            console.progress() as bar:
        for split, split_readers in readers.items():
            writer = w.parquet_writer(f"{split}.parquet")
            try:
                s = stats[split] = SplitStats()
                given[split] = _write_split(cfg, split, split_readers, parts, hyps, s, writer, bar)
            finally:
                writer.close()
            w.rows[f"{split}.parquet"] = s.rows_out
            _check_split(split, s, split_readers[0])
        w.extra.update({
            "source": cfg.source,
            "src_lang": cfg.src_lang,
            "tgt_lang": cfg.tgt_lang,
            "source_splits": mapping,
            "source_files": {split: {p.name: p.stat().st_size for r in rs for p in r.files}
                             for split, rs in readers.items() if any(r.files for r in rs)},
            "train_sources": given["train"],
            "normalisation": "NFC, leading/trailing whitespace stripped",
            "pairs_in": {k: s.rows_in for k, s in stats.items()},
            "pairs_out": {k: s.rows_out for k, s in stats.items()},
            "filters": stats["train"].filters,
            "filter_samples": stats["train"].samples,
        })
    _summary(cfg, mapping, stats, out)
    return stats


def _train_reader(cfg: FetchConfig, source: str) -> SplitReader:
    """The train split of one fetch.add_train source."""
    more = replace(cfg, source=source, splits={"train": cfg.splits["train"]})
    opened = open_source(more)
    return opened.open(resolve_splits(more, opened)["train"])


def _write_split(cfg: FetchConfig, split: str, readers: list[SplitReader], parts: list[dict[str, Any]],
                 hyps: dict[int, Hypotheses], s: SplitStats, writer: Any, bar: Any) -> list[dict[str, Any]]:
    """One split's sources cleaned into ``writer``, counted in ``s``; what each of train's sources gave."""
    seen = SeenHashes() if cfg.dedup and split == "train" else None
    offset, sources_out = 0, []
    for i, reader in enumerate(readers):
        part = parts[i] if split == "train" else {"train_slice": "", "tag": ""}
        cleaner = Cleaner(cfg, split, reader, seen, s, offset, part["tag"])
        task = bar.add_task(f"{split} ({reader.unit})" + (f" + {part['source']}" if i else ""), total=reader.total)
        before, end = (s.rows_in, s.rows_out), 0
        for batch, start in train_rows(reader, part, hyps.get(i) if split == "train" else None):
            writer.write_batch(cleaner(batch, start))
            end = start + len(batch.tgt)
            bar.update(task, completed=min(batch.position, reader.total))
        bar.update(task, completed=reader.total)
        sources_out.append({**part, "first_id": offset, "pairs_in": s.rows_in - before[0],
                            "pairs_out": s.rows_out - before[1]})
        offset += end
    return sources_out


def _check_split(split: str, s: SplitStats, reader: SplitReader) -> None:
    """An empty split is an error; replaced bytes in valid or test a warning."""
    if s.rows_out == 0:
        what = "after cleaning" if split == "train" and s.rows_in else "(no lines)"
        kept = ", ".join(f"{k} {v:,}" for k, v in s.filters.items() if v)
        raise MtpipeError(f"{reader.where}: split '{split}' is empty {what}"
                          + (f" ({s.rows_in:,} pairs in; dropped: {kept})" if kept else ""))
    if s.replaced_utf8:
        console.warn(f"{reader.where}: {s.replaced_utf8:,} lines of {split} are not valid UTF-8 (first: "
                     f"{s.samples['invalid_utf8']}); kept with U+FFFD since {split} is never filtered")


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

