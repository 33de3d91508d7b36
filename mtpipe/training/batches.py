"""The data side of ``mtpipe train``: sentences and batches in memory, the epoch's batch order, collation.

* Sentences (section 5.1): the bpe artifact's ``{split}.parquet`` read into one flat int32 array per side with
  offsets (:class:`TokenSplit`), not one Python object per sentence: a WMT-sized corpus stays a few arrays.
* Batches (section 5.1, "sentence pairs were batched together by approximate sequence length"): the bucket
  artifact's ``{split}.parquet`` as row positions into a :class:`TokenSplit` (:class:`BatchTable`); the token counts
  are recomputed from the sentences, so they cannot disagree with what is collated.
* Order: each epoch's batch order is a permutation drawn from ``(train.seed, epoch)`` alone (:func:`epoch_order`);
  an update takes the next ``per_update`` batches and rank r every world_size-th of them (:func:`rank_batches`) or
  its share of their sentences (:func:`rank_rows`), so ranks never share a sentence and any world size walks the
  same batch sequence.
* The global batch (section 5.1's ~25000 tokens per update, ``train.tokens_per_update``) does not depend on the
  number of processes (:func:`update_layout`): one process takes ``ceil(tokens_per_update / bucket.max_tokens)``
  batches per update; ``world_size`` processes take as many (or the next multiple of ``world_size``, when that is
  within 10 % of it), and when neither fits, the update's batches are cut into parts that the processes share
  (:func:`rank_rows`: whole sentences, the parts of a batch contiguous, so padding stays as low as the batch's).
* Collation (section 3, "the output embeddings are offset by one position"): ``src = tokens + EOS``,
  ``tgt_in = BOS + tgt``, ``tgt_out = tgt + EOS``, right-padded, batch-first (:func:`collate`).
* Train, memory-mapped (:func:`map_train`): the bucket artifact's ``train.arrow`` holds the train batches with their
  sentences' token ids, batch after batch (an uncompressed Arrow IPC file); its record batches become
  :class:`TokenSplit` views of the mapped file (:class:`MappedSplit`), so every process of a node reads the one copy
  the page cache holds, and a process's own memory for the train data is a few arrays per batch, not per sentence.
  The file is hashed at the first start only (:func:`mtpipe.reading.verify_remembered`). A bucket artifact without
  it (made by an older mtpipe) is read as before: ``train.parquet`` of both artifacts into each process's memory.
* :func:`load_train_data` reads and checks both artifacts for a run of ``world_size`` processes (:class:`TrainData`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from mtpipe import artifacts, reading
from mtpipe.artifacts import BOS_ID, EOS_ID, PAD_ID
from mtpipe.console import warn
from mtpipe.errors import MtpipeError

# --------------------------------------------------------------------------------------------------------------------
# Batch size and order
# --------------------------------------------------------------------------------------------------------------------


def accumulation(tokens_per_update: int, world_size: int, max_tokens: int) -> int:
    """Whole batches per process per update so that ``world_size * accum`` batches of ``max_tokens`` cover
    ``tokens_per_update`` (section 5.1's ~25000 source + 25000 target tokens per update). Their sum grows with the
    world size (8 GPUs x 1 batch, 16 x 1): :func:`update_layout` takes it only within 10 % of one process's."""
    return max(1, math.ceil(tokens_per_update / (world_size * max_tokens)))


# How far the global batch may exceed the one-process batch count before the processes share batches instead.
GLOBAL_BATCH_TOLERANCE = 0.10


class Layout(NamedTuple):
    """How the ``per_update`` batches of an update are shared among ``world_size`` processes: whole batches, rank r
    every world_size-th, ``accum`` each (``split`` False); or the batches' sentences divided among them, ``accum``
    being the most parts a process gets (``split`` True: :func:`rank_rows`)."""

    per_update: int
    accum: int
    split: bool


def layout_for(per_update: int, world_size: int) -> Layout:
    """``per_update`` batches on ``world_size`` processes: whole batches when ``world_size`` divides them, else
    process r takes the sentences of batches ``[r * per_update / world_size, (r + 1) * per_update / world_size)``
    (batch i being ``[i, i + 1)``), a part of each batch that range meets."""
    n, w = per_update, world_size
    if n % w == 0:
        return Layout(n, n // w, False)
    return Layout(n, max(((r + 1) * n - 1) // w - r * n // w + 1 for r in range(w)), True)


def update_layout(tokens_per_update: int, world_size: int, max_tokens: int) -> Layout:
    """The global batch of ``world_size`` processes (section 5.1: ~25000 target tokens per update, on any number of
    GPUs): one process takes ``ceil(tokens_per_update / max_tokens)`` batches; more processes take whole batches,
    :func:`accumulation` each, when their sum is within :data:`GLOBAL_BATCH_TOLERANCE` of that count (so the global
    batch is unchanged by the number of processes that divides it, and 8 GPUs x 1 equals 1 GPU x 8), else share
    exactly that count (:func:`layout_for`: 8 batches on 16 GPUs are 16 half batches, not 16 batches)."""
    one = accumulation(tokens_per_update, 1, max_tokens)
    whole = world_size * accumulation(tokens_per_update, world_size, max_tokens)
    if whole * 100 <= one * round(100 * (1 + GLOBAL_BATCH_TOLERANCE)):
        return Layout(whole, whole // world_size, False)
    return layout_for(one, world_size)


def epoch_order(n_batches: int, seed: int, epoch: int) -> np.ndarray:
    """The batch order of an epoch: a permutation drawn from ``(seed, epoch)`` alone, so a resumed run (or any rank)
    recomputes it instead of storing it."""
    return np.random.default_rng([seed, epoch]).permutation(n_batches)


def rank_batches(order: np.ndarray, position: int, world_size: int, accum: int, rank: int) -> np.ndarray:
    """This rank's micro-batches of the update that starts at ``position`` of the epoch's ``order``: the update
    takes ``order[position : position + world_size * accum]`` and rank r every world_size-th from the r-th."""
    return order[position : position + world_size * accum][rank::world_size]


def rank_rows(data: TrainData, order: np.ndarray, position: int, world_size: int, rank: int) -> list[
        tuple[int, np.ndarray]]:
    """This rank's micro-batches of the update that starts at ``position``, as ``(batch, sentence rows)``: whole
    batches (:func:`rank_batches`), or with ``data.split`` the rows of its share of the update's batches
    (:func:`layout_for`). In units of 1 / world_size batch, rank r covers ``[r * n, (r + 1) * n)`` of the update's
    ``n`` batches and batch i is ``[i * world_size, (i + 1) * world_size)``: its part of a batch of R sentences is
    rows ``[s * R // world_size, e * R // world_size)`` of the overlap ``[s, e)``, so the parts of a batch meet
    exactly, and a part holds contiguous sentences of the batch (the bucket's lengths, little padding)."""
    t = data.train
    if not data.split:
        return [(int(b), t.batch(int(b))) for b in rank_batches(order, position, world_size, data.accum, rank)]
    n, w = data.per_update, world_size
    group = order[position : position + n]
    parts = []
    for i in range(rank * n // w, ((rank + 1) * n - 1) // w + 1):
        rows = t.batch(int(group[i]))
        s, e = max(rank * n, i * w) - i * w, min((rank + 1) * n, (i + 1) * w) - i * w
        parts.append((int(group[i]), rows[s * len(rows) // w : e * len(rows) // w]))
    return parts


# --------------------------------------------------------------------------------------------------------------------
# Sentences and batches: flat token arrays (no Python object per sentence)
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class TokenSplit:
    """One split of the bpe artifact: every sentence's ids in one flat int32 array per side, with offsets."""

    name: str
    src: np.ndarray  # int32 [total source tokens]
    src_off: np.ndarray  # int64 [n + 1] (int32 in a MappedSplit: views of the file's list offsets)
    tgt: np.ndarray  # int32 [total target tokens]
    tgt_off: np.ndarray  # int64 [n + 1] (int32 in a MappedSplit)
    ids: np.ndarray  # int64 [n]: the rows' ``id`` column

    @property
    def src_len(self) -> np.ndarray:
        return np.diff(self.src_off)

    @property
    def tgt_len(self) -> np.ndarray:
        return np.diff(self.tgt_off)

    def rows(self, ids: np.ndarray, where: str) -> np.ndarray:
        """Row positions of ``ids`` (values of the ``id`` column); an unknown id is an error naming ``where``."""
        n = len(self.ids)
        # The bpe stage writes ids 0..n-1 in order: then an id is its row, and the sort below is not needed.
        if n and self.ids[0] == 0 and self.ids[-1] == n - 1 and np.array_equal(self.ids, np.arange(n)):
            rows = ids
            bad = (ids < 0) | (ids >= n)
        else:
            order = np.argsort(self.ids, kind="stable")
            pos = np.searchsorted(self.ids, ids, sorter=order)
            pos = np.minimum(pos, max(n - 1, 0))
            rows = order[pos] if n else pos
            bad = (self.ids[rows] != ids) if n else np.ones(len(ids), bool)
        if bad.any():
            raise MtpipeError(f"{where}: references id {int(ids[bad.argmax()])}, which is not in the tokens artifact's "
                              f"{self.name} split (batches and tokens come from different runs: re-run "
                              "`mtpipe bucket`)")
        return rows.astype(np.int64)


def load_split(tokens: Path, split: str) -> TokenSplit:
    """Read ``{split}.parquet`` of the bpe artifact into flat arrays."""
    table_ = artifacts.read_table(tokens, f"{split}.parquet", "tokens")

    def flat(column: str) -> tuple[np.ndarray, np.ndarray]:
        arr = table_.column(column).combine_chunks()  # one ListArray; offsets index into arr.values
        offsets = reading.to_numpy(arr.offsets).astype(np.int64)
        values = np.asarray(reading.to_numpy(arr.values), dtype=np.int32)
        if offsets[0] != 0 or offsets[-1] != len(values):  # a sliced array: rebase so offsets start at 0
            values, offsets = values[offsets[0] : offsets[-1]], offsets - offsets[0]
        return values, offsets

    src, src_off = flat("src")
    tgt, tgt_off = flat("tgt")
    ids = reading.to_numpy(table_.column("id")).astype(np.int64)
    return TokenSplit(split, src, src_off, tgt, tgt_off, ids)


@dataclass
class MappedSplit:
    """A split memory-mapped from ``train.arrow`` (:func:`map_train`): the sentences of record batch ``k`` are the
    :class:`TokenSplit` ``chunks[k]`` (views of the mapped file), rows ``starts[k]:starts[k + 1]`` of the split; a
    batch never spans two record batches. :func:`collate` takes it where it takes a TokenSplit."""

    name: str
    chunks: list[TokenSplit]
    starts: np.ndarray  # int64 [n_chunks + 1]

    def locate(self, rows: np.ndarray) -> tuple[TokenSplit, np.ndarray]:
        """The record batch holding the rows (of one batch) and their positions in it."""
        k = int(np.searchsorted(self.starts, rows[0], side="right")) - 1
        return self.chunks[k], rows - self.starts[k]


@dataclass
class BatchTable:
    """The bucket artifact's batches of one split as row positions into a :class:`TokenSplit` (or a
    :class:`MappedSplit`)."""

    # int64 [sum of batch sizes]: every batch's sentence rows, batch after batch; None: batch i is rows
    # off[i]:off[i + 1] (the sentences are stored in batch order: train.arrow)
    rows: np.ndarray | None
    off: np.ndarray  # int64 [n_batches + 1]
    src_tokens: np.ndarray  # int64 [n_batches]: real source tokens incl. EOS
    tgt_tokens: np.ndarray  # int64 [n_batches]: real target tokens incl. EOS (= tokens the loss is computed on)
    src_width: np.ndarray  # int64 [n_batches]: padded source length (EOS included)
    tgt_width: np.ndarray  # int64 [n_batches]: padded target length (BOS / EOS included)

    def __len__(self) -> int:
        return len(self.off) - 1

    def batch(self, i: int) -> np.ndarray:
        if self.rows is None:
            return np.arange(self.off[i], self.off[i + 1], dtype=np.int64)
        return self.rows[self.off[i] : self.off[i + 1]]

    def subset(self, keep: np.ndarray) -> BatchTable:
        """The batches ``keep`` (indices, in that order) as a table of their own."""
        sizes = np.diff(self.off)[keep]  # [len(keep)]
        rows = np.concatenate([self.batch(int(i)) for i in keep])
        return BatchTable(rows=rows, off=np.concatenate([[0], np.cumsum(sizes)]), src_tokens=self.src_tokens[keep],
                          tgt_tokens=self.tgt_tokens[keep], src_width=self.src_width[keep],
                          tgt_width=self.tgt_width[keep])


def load_batches(batches: Path, split: str, tokens: TokenSplit) -> BatchTable:
    """Read ``{split}.parquet`` of the bucket artifact; token counts are recomputed from the sentences themselves."""
    name = f"{split}.parquet"
    t = artifacts.read_table(batches, name, "batches", columns=["batch", "ids"])
    arr = t.column("ids").combine_chunks()
    off = reading.to_numpy(arr.offsets).astype(np.int64)
    ids = reading.to_numpy(arr.values).astype(np.int64)[off[0] : off[-1]]
    off = off - off[0]
    if len(off) < 2:
        raise MtpipeError(f"{batches / name}: has no batches")
    sizes = np.diff(off)
    if (sizes == 0).any():
        raise MtpipeError(f"{batches / name}: batch {int(np.argmin(sizes))} is empty")
    rows = tokens.rows(ids, str(batches / name))
    src_len = tokens.src_len[rows] + 1  # + EOS
    tgt_len = tokens.tgt_len[rows] + 1  # + EOS (tgt_out) / + BOS (tgt_in)
    starts = off[:-1]
    return BatchTable(
        rows=rows, off=off,
        src_tokens=np.add.reduceat(src_len, starts), tgt_tokens=np.add.reduceat(tgt_len, starts),
        src_width=np.maximum.reduceat(src_len, starts), tgt_width=np.maximum.reduceat(tgt_len, starts),
    )


def map_train(batches: Path, manifest: artifacts.Manifest, name: str = "train") -> tuple[MappedSplit, BatchTable]:
    """The train batches and their sentences memory-mapped from the bucket artifact's ``train.arrow``: the token
    ids, offsets and ids are views of the mapped file; the per-batch token counts and widths are computed from the
    sentence offsets, one record batch at a time (the same values :func:`load_batches` computes from the tokens
    artifact)."""
    ipc = reading.open_ipc(batches, artifacts.TRAIN_ARROW, artifacts.BATCH_TOKENS_SCHEMA, manifest)
    path = ipc.path
    chunks: list[TokenSplit] = []
    starts, offs = [0], [np.zeros(1, np.int64)]
    counts: dict[str, list[np.ndarray]] = {"src_tokens": [], "tgt_tokens": [], "src_width": [], "tgt_width": []}
    for k in range(len(ipc)):
        rb = ipc.batch(k)
        if rb.num_rows == 0:
            continue
        cols = {c: rb.column(c) for c in ("ids", "src", "tgt")}
        nested = [cols["ids"], cols["ids"].values, *(a for c in ("src", "tgt") for a in (cols[c], cols[c].values,
                                                                                          cols[c].values.values))]
        if any(a.null_count for a in nested):
            raise MtpipeError(f"{path}: record batch {k} holds nulls")
        outer = reading.to_numpy(cols["ids"].offsets)  # int32 [batches + 1]: each batch's sentences
        n = len(cols["ids"].values)
        if not all(np.array_equal(outer, reading.to_numpy(cols[c].offsets)) for c in ("src", "tgt")) or \
                outer[0] != 0 or outer[-1] != n or len(cols["src"].values) != n or len(cols["tgt"].values) != n:
            raise MtpipeError(f"{path}: record batch {k}: ids, src and tgt do not hold the same sentences (not written "
                              "by `mtpipe bucket`): re-run it")
        sizes = np.diff(outer)
        if (sizes <= 0).any():
            raise MtpipeError(f"{path}: batch {sum(map(len, offs)) - 1 + int(np.argmin(sizes))} is empty")
        side = {}
        for c in ("src", "tgt"):
            sent = cols[c].values  # list<int32>: one row per sentence
            values, offsets = reading.to_numpy(sent.values), reading.to_numpy(sent.offsets)
            side[c] = (values, offsets)
            if offsets[0] < 0 or offsets[-1] > len(values):
                raise MtpipeError(f"{path}: record batch {k}: {c} offsets point outside its token ids")
            lens = np.diff(offsets).astype(np.int64) + 1  # + EOS (src, tgt_out) / + BOS (tgt_in)
            counts[f"{c}_tokens"].append(np.add.reduceat(lens, outer[:-1]))
            counts[f"{c}_width"].append(np.maximum.reduceat(lens, outer[:-1]))
        chunks.append(TokenSplit(name, *side["src"], *side["tgt"], ids=reading.to_numpy(cols["ids"].values)))
        offs.append(outer[1:].astype(np.int64) + starts[-1])
        starts.append(starts[-1] + n)
    off = np.concatenate(offs)
    want = manifest.rows.get("train.parquet")
    if want is not None and want != len(off) - 1:
        raise MtpipeError(f"{path}: holds {len(off) - 1} batches, train.parquet {want}: re-run `mtpipe bucket`")
    if len(off) < 2:
        raise MtpipeError(f"{path}: has no batches")
    table = BatchTable(rows=None, off=off, **{c: np.concatenate(v) for c, v in counts.items()})
    return MappedSplit(name, chunks, np.asarray(starts, np.int64)), table


# --------------------------------------------------------------------------------------------------------------------
# Collation
# --------------------------------------------------------------------------------------------------------------------


def _pad(values: np.ndarray, off: np.ndarray, rows: np.ndarray, bos: bool, eos: bool,
         start: int = BOS_ID) -> np.ndarray:
    """Right-padded ``[B, max_len + 1]`` int64 matrix of the sentences ``rows``, with ``start`` (BOS) in front or
    EOS after.

    Vectorised: one scatter of every token of the batch, no Python loop over sentences."""
    starts, lens = off[rows], off[rows + 1] - off[rows]  # [B], [B]
    b = len(rows)
    out = np.full((b, int(lens.max()) + 1), PAD_ID, dtype=np.int64)  # [B, max_len + 1]
    total = int(lens.sum())
    r = np.repeat(np.arange(b), lens)  # [total]: the batch row of every token
    c = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)  # [total]: its position in the sentence
    out[r, c + int(bos)] = values[np.repeat(starts, lens) + c]
    if bos:
        out[:, 0] = start
    if eos:
        out[np.arange(b), lens] = EOS_ID
    return out


def collate(split: TokenSplit | MappedSplit, rows: np.ndarray, start: int = BOS_ID) -> tuple[Tensor, Tensor, Tensor]:
    """``src [B, S]`` = tokens + EOS, ``tgt_in [B, T]`` = BOS + tgt, ``tgt_out [B, T]`` = tgt + EOS; PAD on the
    right (section 3: the decoder input is the target shifted right by one position). ``start``: the model's first
    decoder input (``Transformer.start_id``; EOS with ``model.decoder_start=eos``)."""
    if isinstance(split, MappedSplit):
        split, rows = split.locate(rows)
    src = _pad(split.src, split.src_off, rows, bos=False, eos=True)
    tgt_in = _pad(split.tgt, split.tgt_off, rows, bos=True, eos=False, start=start)
    tgt_out = _pad(split.tgt, split.tgt_off, rows, bos=False, eos=True)
    return torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out)


# --------------------------------------------------------------------------------------------------------------------
# A training run's data
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class TrainData:
    """Everything a training run reads from the bpe (``tokens``) and bucket (``batches``) artifacts, and the batch
    arithmetic of its world size (:func:`update_layout`): ``per_update`` batches per update (``world_size * accum``
    unless ``split``), of which the first ``usable`` of an epoch's order are used (the tail too short for a whole
    update is left out of that epoch)."""

    vocab: dict[str, Any]  # {"spm_sha256", "size"}: what a checkpoint must have been trained with to resume
    max_tokens: int  # the bucket stage's token budget per batch
    train_tokens: TokenSplit | MappedSplit
    train: BatchTable
    valid_tokens: TokenSplit | None
    valid: BatchTable | None
    accum: int
    per_update: int
    usable: int
    # What the train batches are: train.parquet's hash and the artifacts they were made from (so a bucket re-run that
    # only adds train.arrow leaves it alone); a checkpoint records it, and a resume compares it (train_batches_id).
    batches_id: str = ""
    split: bool = False  # the processes share the update's batches' sentences (rank_rows), not whole batches

    def with_layout(self, layout: Layout, world_size: int, where: Path | str) -> TrainData:
        """These data under ``layout`` on ``world_size`` processes (``usable`` 0 when one update needs more batches
        than there are). Batches too small to be shared (a part could get no sentence) are refused, naming the
        keys to change."""
        n = layout.per_update
        if layout.split:
            sizes = np.diff(self.train.off)  # [n_batches] sentences per batch
            parts = world_size // math.gcd(n, world_size)  # the smallest part is 1/parts of a batch
            if int(sizes.min()) < parts:
                raise MtpipeError(
                    f"{where}: {world_size} processes share each update's {n} batches in parts as small as 1/{parts} "
                    f"of a batch, but batch {int(sizes.argmin())} holds {int(sizes.min())} sentence(s): set "
                    f"train.tokens_per_update to a multiple of {world_size} x bucket.max_tokens "
                    f"({world_size * self.max_tokens:,}), or change bucket.max_tokens or train.nproc")
        return dataclasses.replace(self, accum=layout.accum, per_update=n, usable=len(self.train) // n * n,
                                   split=layout.split)

    def drop_long_valid(self, max_positions: int, where: Path) -> None:
        """The bucket stage never drops valid pairs, so an over-long one sits alone in its batch: leave such batches
        out of the validation loss (with a warning) instead of failing after hours of training."""
        v = self.valid
        if v is None:
            return
        ok = np.maximum(v.src_width, v.tgt_width) <= max_positions  # [n_batches]
        if ok.all():
            return
        warn(f"{where}: {int((~ok).sum())} valid batch(es) hold sentences longer than "
             f"model.max_positions={max_positions}: left out of the validation loss")
        if not ok.any():
            self.valid = self.valid_tokens = None
            return
        self.valid = v.subset(np.flatnonzero(ok))


def _vocab_and_max_tokens(tokens: Path, batches: Path) -> tuple[dict[str, Any], int, set[str], artifacts.Manifest]:
    """The manifests' facts training needs: the vocabulary, the batches' token budget, each artifact's files."""
    tm = artifacts.read_manifest(tokens, "tokens")
    spm, size = tm.extra.get("spm_sha256"), tm.extra.get("vocab_size")
    if not spm or not isinstance(size, int):
        raise MtpipeError(f"{tokens}: tokens manifest lacks extra.spm_sha256 / extra.vocab_size")
    bm = artifacts.read_manifest(batches, "batches")
    try:
        max_tokens = int(bm.params["bucket"]["max_tokens"])
    except (KeyError, TypeError, ValueError):
        raise MtpipeError(f"{batches}: batches manifest lacks params.bucket.max_tokens") from None
    if bm.upstream and artifacts.manifest_hash(tokens) not in bm.upstream.values():
        raise MtpipeError(f"{batches}: these batches were made from another bpe artifact than {tokens} "
                          "(upstream hash differs): re-run `mtpipe bucket` on it")
    return {"spm_sha256": spm, "size": size}, max_tokens, set(tm.files), bm


def load_train_data(tokens: Path, batches: Path, tokens_per_update: int, world_size: int) -> TrainData:
    """Read and check the artifacts for a run of ``world_size`` processes updating on ``tokens_per_update``."""
    vocab, max_tokens, token_files, bm = _vocab_and_max_tokens(tokens, batches)
    batch_files = set(bm.files)
    train_tokens: TokenSplit | MappedSplit
    if artifacts.TRAIN_ARROW in batch_files:
        train_tokens, train = map_train(batches, bm)
    else:
        warn(f"{batches}: has no {artifacts.TRAIN_ARROW} (made by an older mtpipe): every process reads the train "
             "split into its own memory; re-run `mtpipe bucket` to have it memory-mapped and shared")
        train_tokens = load_split(tokens, "train")
        train = load_batches(batches, "train", train_tokens)
    layout = update_layout(tokens_per_update, world_size, max_tokens)
    if len(train) < layout.per_update:
        raise MtpipeError(f"{batches}: train has {len(train)} batches, fewer than one update needs "
                          f"({layout.per_update} batches on {world_size} process(es)): lower "
                          "train.tokens_per_update or bucket.max_tokens")
    valid_tokens = valid = None
    if "valid.parquet" in batch_files and "valid.parquet" in token_files:
        valid_tokens = load_split(tokens, "valid")
        valid = load_batches(batches, "valid", valid_tokens)
    else:
        warn(f"{batches}: no valid split: validation is skipped")
    data = TrainData(vocab=vocab, max_tokens=max_tokens, train_tokens=train_tokens, train=train,
                     valid_tokens=valid_tokens, valid=valid, accum=0, per_update=0, usable=0,
                     batches_id=train_batches_id(bm))
    return data.with_layout(layout, world_size, batches)


def train_batches_id(bm: artifacts.Manifest) -> str:
    """The identity of a bucket artifact's train batches (:attr:`TrainData.batches_id`)."""
    what = [bm.files.get("train.parquet", ""), *sorted(bm.upstream.values())]
    return hashlib.sha256("\n".join(what).encode()).hexdigest()
