"""``mtpipe bucket``: token-based batches (paper section 5.1).

"Sentence pairs were batched together by approximate sequence length. Each training batch contained a set of sentence
pairs containing approximately 25000 source tokens and 25000 target tokens." This stage fixes that batching once, as
data: the train stage shuffles the batch order per epoch and accumulates batches up to its ``tokens_per_update``.

* Lengths are positions the model sees: token count + 1 for EOS, on both sides (the decoder input is BOS + target,
  the same length). They come from the Arrow list offsets, vectorised; the token values are never touched.
* Train pairs with a side longer than ``max_len`` positions are dropped and counted (they could not be embedded or
  would dominate memory); valid pairs are never dropped: an over-long one gets a batch of its own, with a warning.
* Pairs are sorted by (source length, target length) with a stable sort, so ties keep the tokens split's order and the
  result is deterministic. Batches are packed greedily along that order: a batch grows while
  ``n_sentences * longest_length`` stays within ``max_tokens`` on each side (the padded token count one process
  allocates), then is cut back to a multiple of ``multiple_of`` sentences (tensor-core friendly shapes). The only
  batches that are not a multiple are those smaller than ``multiple_of``: where ``max_tokens`` cannot hold
  ``multiple_of`` sentences of that length (fewer sentences rather than exceeding the budget), and the tail of the
  sorted order.
* Output: a ``batches`` artifact with ``{train,valid}.parquet`` in ``BATCHES_SCHEMA``. ``ids`` holds values of the
  tokens split's ``id`` column (the corpus line index), not row positions; every kept train id is in exactly one
  batch.
* And ``train.arrow`` (``BATCH_TOKENS_SCHEMA``, :func:`write_batch_tokens`): the train batches again with their
  sentences' token ids, batch after batch, as an uncompressed Arrow IPC file that training memory-maps (one copy in
  the page cache for every process of a node, instead of the whole tokens split read into each). With bounded
  memory: while the lengths are read, the token ids go to a scratch file in the artifact's temporary directory, from
  which each record batch (whole batches, about :data:`ARROW_CHUNK_PAIRS` pairs) is gathered.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mtpipe import console
from mtpipe.artifacts import (
    BATCH_TOKENS_SCHEMA,
    BATCHES_SCHEMA,
    TRAIN_ARROW,
    open_parquet,
    read_manifest,
    splits_of,
)
from mtpipe.config import BucketConfig, to_dict
from mtpipe.errors import MtpipeError
from mtpipe.reading import from_numpy, to_numpy
from mtpipe.writing import ArtifactWriter, prepare_output

SPLITS = ("train", "valid")


def read_lengths(tokens: Path, split: str, bar: Any,
                 spill: tuple[BinaryIO, BinaryIO] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, src_len, tgt_len)`` of a tokens split; lengths include EOS. Streams the file in batches; lengths come
    from the list offsets (``list_value_length``), so no token is ever touched in Python. ``spill``: two binary files
    that get the source and the target token ids, flat int32, row after row (for :func:`write_batch_tokens`)."""
    pf = open_parquet(tokens, f"{split}.parquet", "tokens")
    n = pf.metadata.num_rows
    ids = np.empty(n, np.int64)
    src = np.empty(n, np.int32)
    tgt = np.empty(n, np.int32)
    task = bar.add_task(f"read {split} (pairs)", total=n)
    i = 0
    for b in pf.iter_batches(batch_size=65536, columns=["id", "src", "tgt"]):
        k = b.num_rows
        ids[i:i + k] = to_numpy(b.column(0))
        src[i:i + k] = to_numpy(pc.list_value_length(b.column(1))) + 1
        tgt[i:i + k] = to_numpy(pc.list_value_length(b.column(2))) + 1
        if spill is not None:
            for f, col in zip(spill, (b.column(1), b.column(2))):
                np.ascontiguousarray(to_numpy(col.flatten()), dtype=np.int32).tofile(f)
        i += k
        bar.update(task, completed=i)
    return ids, src, tgt


def length_order(src: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """Indices sorting by (src_len, tgt_len); stable, so equal pairs keep their input order."""
    key = (src.astype(np.int64) << 32) | tgt.astype(np.int64)
    return np.argsort(key, kind="stable")


def pack(src: np.ndarray, tgt: np.ndarray, max_tokens: int, multiple_of: int) -> np.ndarray:
    """Batch boundaries over pairs already sorted by source length: ``bounds[b]:bounds[b + 1]`` is batch ``b``.

    Greedy: each batch takes the longest prefix of the remaining pairs whose padded size ``n * max(len)`` fits
    ``max_tokens`` on both sides, then rounds its count down to a multiple of ``multiple_of`` when it has at least
    that many. Each pair must fit alone (``max(src, tgt) <= max_tokens``).
    """
    n = len(src)
    bounds = [0]
    i = 0
    while i < n:
        # Sources are sorted, and a running maximum only grows: no batch from i can hold more than this.
        k = min(n - i, max_tokens // max(int(src[i]), int(tgt[i])))
        m = np.arange(1, k + 1, dtype=np.int64)
        fits = (m * src[i:i + k] <= max_tokens) & (m * np.maximum.accumulate(tgt[i:i + k]) <= max_tokens)
        size = k if fits[-1] else int(np.argmin(fits))  # fits is True then False: both products are monotone
        if size >= multiple_of:
            size -= size % multiple_of
        i += size
        bounds.append(i)
    return np.asarray(bounds, np.int64)


@dataclass
class SplitBatches:
    pairs_in: int
    dropped: int
    batches: int
    pairs: int
    src_tokens: int
    tgt_tokens: int
    src_padded: int
    tgt_padded: int
    min_size: int
    max_size: int

    @property
    def padding(self) -> float:
        """Share of the padded positions (both sides) that are padding."""
        padded = self.src_padded + self.tgt_padded
        return 1.0 - (self.src_tokens + self.tgt_tokens) / padded if padded else 0.0


def batch_table(ids: np.ndarray, src: np.ndarray, tgt: np.ndarray, bounds: np.ndarray) -> pa.Table:
    """The BATCHES_SCHEMA table of batches ``bounds`` over the (sorted) pairs, all vectorised."""
    starts = bounds[:-1]
    if len(starts) == 0:
        return BATCHES_SCHEMA.empty_table()
    return pa.Table.from_arrays(
        [
            from_numpy(np.arange(len(starts), dtype=np.int64)),
            pa.ListArray.from_arrays(from_numpy(bounds.astype(np.int32)), from_numpy(ids.astype(np.int64))),
            from_numpy(np.add.reduceat(src.astype(np.int64), starts)),
            from_numpy(np.add.reduceat(tgt.astype(np.int64), starts)),
            from_numpy(np.maximum.reduceat(src, starts).astype(np.int32)),
            from_numpy(np.maximum.reduceat(tgt, starts).astype(np.int32)),
        ],
        schema=BATCHES_SCHEMA,
    )


def make_batches(cfg: BucketConfig, split: str, ids: np.ndarray, src: np.ndarray, tgt: np.ndarray,
                 where: str) -> tuple[pa.Table, SplitBatches, np.ndarray, np.ndarray]:
    """Drop (train) or isolate (valid) over-long pairs, sort, pack. Returns the table, its statistics, and the
    batches as ``order`` (the input rows, batch after batch) and ``bounds`` (batch ``b`` is
    ``order[bounds[b]:bounds[b + 1]]``)."""
    n = len(ids)
    long = (src > cfg.max_len) | (tgt > cfg.max_len)
    dropped = 0
    if long.any():
        if split == "train":
            dropped = int(long.sum())
        else:
            console.warn(f"{where}: {int(long.sum()):,} {split} pairs are longer than bucket.max_len={cfg.max_len} "
                         "positions; each gets a batch of its own (valid is never filtered)")
    ok = ~long
    order = np.flatnonzero(ok)[length_order(src[ok], tgt[ok])]
    bounds = pack(src[order], tgt[order], cfg.max_tokens, cfg.multiple_of)
    if split != "train" and long.any():
        extra = np.flatnonzero(long)
        order = np.concatenate([order, extra])
        bounds = np.concatenate([bounds, bounds[-1] + np.arange(1, len(extra) + 1)])
    s_ids, s_src, s_tgt = ids[order], src[order], tgt[order]
    table = batch_table(s_ids, s_src, s_tgt, bounds)
    sizes = np.diff(bounds)
    sl = to_numpy(table.column("src_len")).astype(np.int64)
    tl = to_numpy(table.column("tgt_len")).astype(np.int64)
    stats = SplitBatches(
        pairs_in=n, dropped=dropped, batches=len(sizes), pairs=int(sizes.sum()),
        src_tokens=int(s_src.sum()), tgt_tokens=int(s_tgt.sum()),
        src_padded=int((sizes * sl).sum()), tgt_padded=int((sizes * tl).sum()),
        min_size=int(sizes.min()) if len(sizes) else 0, max_size=int(sizes.max()) if len(sizes) else 0,
    )
    return table, stats, order, bounds


# --------------------------------------------------------------------------------------------------------------------
# train.arrow: the batches with their token ids, for training to memory-map
# --------------------------------------------------------------------------------------------------------------------

ARROW_CHUNK_PAIRS = 1 << 17  # pairs per record batch of train.arrow (whole batches: at least one, more from there)


@dataclass
class FlatSide:
    """One side of a tokens split as flat arrays (in memory or memory-mapped): the token ids of row ``r`` are
    ``values[off[r]:off[r + 1]]``."""

    values: np.ndarray  # int32 [tokens]
    off: np.ndarray  # int64 [rows + 1]

    @classmethod
    def from_lengths(cls, values: np.ndarray, lengths: np.ndarray, where: str = "tokens") -> "FlatSide":
        """The flat ``values`` of rows of ``lengths`` ids each; ``where`` names their file in an error."""
        off = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=off[1:])
        if off[-1] != len(values):
            raise MtpipeError(f"{where}: {len(values)} token ids where the lengths add up to {int(off[-1])}")
        return cls(values, off)

    def gather(self, rows: np.ndarray) -> pa.ListArray:
        """The rows ``rows``, in that order, as a list<int32> array (vectorised: one fancy index of every id)."""
        starts = self.off[rows]
        lens = self.off[rows + 1] - starts
        off = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        if off[-1] >= 2**31:
            raise MtpipeError(f"{TRAIN_ARROW}: a record batch would hold {int(off[-1]):,} token ids, more than "
                              "list<int32> offsets address; lower bucket.max_len")
        idx = np.repeat(starts - off[:-1], lens) + np.arange(off[-1], dtype=np.int64)
        values = np.ascontiguousarray(self.values[idx], dtype=np.int32)
        return pa.ListArray.from_arrays(from_numpy(off.astype(np.int32)), from_numpy(values))


def chunk_bounds(bounds: np.ndarray, pairs: int | None = None) -> list[tuple[int, int]]:
    """``(first, end)`` batch ranges of train.arrow's record batches: whole batches, each range the fewest batches
    that reach ``pairs`` (default :data:`ARROW_CHUNK_PAIRS`) pairs (the last may have fewer)."""
    pairs = pairs or ARROW_CHUNK_PAIRS
    out, b, n = [], 0, len(bounds) - 1
    while b < n:
        e = int(np.searchsorted(bounds, bounds[b] + pairs, side="left"))
        e = min(max(e, b + 1), n)
        out.append((b, e))
        b = e
    return out


def write_batch_tokens(path: Path, ids: np.ndarray, order: np.ndarray, bounds: np.ndarray, src: FlatSide,
                       tgt: FlatSide, bar: Any = None) -> int:
    """Write ``train.arrow`` (``BATCH_TOKENS_SCHEMA``, uncompressed Arrow IPC): batch ``b`` is the rows
    ``order[bounds[b]:bounds[b + 1]]`` of the tokens split whose ids and sides are ``ids``, ``src`` and ``tgt``, in
    that order (the order of its ``ids`` in train.parquet). One record batch per :func:`chunk_bounds` range, so that
    memory stays bounded by that however large the split. Returns the number of batches."""
    ranges = chunk_bounds(bounds)
    task = bar.add_task(f"write {TRAIN_ARROW} (pairs)", total=int(bounds[-1])) if bar is not None else None
    with pa.ipc.new_file(str(path), BATCH_TOKENS_SCHEMA,
                         options=pa.ipc.IpcWriteOptions(compression=None)) as writer:
        for b, e in ranges:
            rows = order[bounds[b]:bounds[e]]
            local = from_numpy((bounds[b:e + 1] - bounds[b]).astype(np.int32))  # [batches + 1]: sentences per batch
            writer.write_batch(pa.RecordBatch.from_arrays([
                from_numpy(np.arange(b, e, dtype=np.int64)),
                pa.ListArray.from_arrays(local, from_numpy(np.ascontiguousarray(ids[rows], dtype=np.int64))),
                pa.ListArray.from_arrays(local, src.gather(rows)),
                pa.ListArray.from_arrays(local, tgt.gather(rows)),
            ], schema=BATCH_TOKENS_SCHEMA))
            if task is not None:
                bar.update(task, completed=int(bounds[e]))
    return len(bounds) - 1


def _spilled(path: Path) -> np.ndarray:
    """A scratch file of flat int32 token ids, memory-mapped (an empty one as an empty array: mmap refuses it)."""
    if path.stat().st_size == 0:
        return np.zeros(0, np.int32)
    return np.memmap(path, dtype=np.int32, mode="r")


def bucket_tokens(cfg: BucketConfig, tokens: Path, out: Path, *, force: bool = False) -> dict[str, SplitBatches]:
    """Batch the train and valid splits of the ``tokens`` artifact into the ``batches`` artifact ``out``."""
    tokens, out = Path(tokens), Path(out)
    read_manifest(tokens, "tokens")
    prepare_output(out, "batches", inputs=[tokens], force=force)
    have = splits_of(tokens, "tokens")
    if "train" not in have:
        raise MtpipeError(f"{tokens}: has no train split (it has: {', '.join(have) or 'nothing'})")
    splits = [s for s in SPLITS if s in have]
    if "valid" not in have:
        console.warn(f"{tokens}: has no valid split; only train is batched")
    stats: dict[str, SplitBatches] = {}
    with ArtifactWriter(out, "batches", {"bucket": to_dict(cfg)}, upstream={"tokens": tokens},
                        force=force) as w:
        with console.progress() as bar:
            for split in splits:
                if split != "train":
                    ids, src, tgt = read_lengths(tokens, split, bar)
                    table, stats[split], _, _ = make_batches(cfg, split, ids, src, tgt, f"{tokens}/{split}.parquet")
                    w.write_table(f"{split}.parquet", table)
                    continue
                # Train: the token ids go to a scratch directory inside the temporary artifact (removed with it
                # whatever happens) while the lengths are read; train.arrow is gathered from there.
                assert w.tmp is not None
                scratch = Path(tempfile.mkdtemp(prefix=".scratch-", dir=w.tmp))
                try:
                    with open(scratch / "src", "wb") as fs, open(scratch / "tgt", "wb") as ft:
                        ids, src, tgt = read_lengths(tokens, split, bar, spill=(fs, ft))
                    table, stats[split], order, bounds = make_batches(cfg, split, ids, src, tgt,
                                                                      f"{tokens}/{split}.parquet")
                    w.write_table(f"{split}.parquet", table)
                    sides = [FlatSide.from_lengths(_spilled(scratch / s), lens - 1, f"{tokens}/{split}.parquet")
                             for s, lens in (("src", src), ("tgt", tgt))]
                    w.rows[TRAIN_ARROW] = write_batch_tokens(w.path(TRAIN_ARROW), ids, order, bounds, *sides, bar=bar)
                    del sides
                finally:
                    shutil.rmtree(scratch, ignore_errors=True)
        if stats["train"].pairs == 0:
            raise MtpipeError(f"{tokens}/train.parquet: every pair is longer than bucket.max_len={cfg.max_len}")
        w.extra.update({
            "ids": "values of the tokens split's id column",
            "pairs_in": {s: b.pairs_in for s, b in stats.items()},
            "dropped_too_long": stats["train"].dropped,
            "pairs": {s: b.pairs for s, b in stats.items()},
            "batches": {s: b.batches for s, b in stats.items()},
            "tokens": {s: {"src": b.src_tokens, "tgt": b.tgt_tokens} for s, b in stats.items()},
            "padded_tokens": {s: {"src": b.src_padded, "tgt": b.tgt_padded} for s, b in stats.items()},
            "padding_ratio": {s: round(b.padding, 6) for s, b in stats.items()},
        })
    _summary(cfg, stats, out)
    return stats


def _summary(cfg: BucketConfig, stats: dict[str, SplitBatches], out: Path) -> None:
    splits = list(stats)
    rows: list[list[Any]] = [
        ["pairs in", *[stats[s].pairs_in for s in splits]],
        [f"  - longer than {cfg.max_len}", *[stats[s].dropped if s == "train" else "" for s in splits]],
        ["pairs batched", *[stats[s].pairs for s in splits]],
        ["batches", *[stats[s].batches for s in splits]],
        ["sentences / batch (min-max)", *[f"{stats[s].min_size}-{stats[s].max_size}" for s in splits]],
        ["src tokens", *[stats[s].src_tokens for s in splits]],
        ["tgt tokens", *[stats[s].tgt_tokens for s in splits]],
        ["padding ratio", *[f"{stats[s].padding:.2%}" for s in splits]],
        ["padded tokens / batch / side", *[(stats[s].src_padded + stats[s].tgt_padded) / 2 / max(1, stats[s].batches)
                                           for s in splits]],
    ]
    console.table(f"bucket: max_tokens {cfg.max_tokens:,}, multiple of {cfg.multiple_of} -> {out}", ["", *splits],
                  rows)
