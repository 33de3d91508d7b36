"""``mtpipe fetch``: a parallel corpus -> a ``corpus`` artifact ({train,valid,test}.parquet: id, src, tgt).

Sources (``fetch.source``)
--------------------------
* ``hf:REPO[:CONFIG]`` -- a Hugging Face dataset loaded with ``datasets.load_dataset(REPO, CONFIG,
  revision=fetch.revision)``, e.g. ``hf:wmt/wmt14:de-en``. ``hf:`` also takes a local path: a directory written by
  ``DatasetDict.save_to_disk`` (read with ``datasets.load_from_disk``) or any directory ``load_dataset`` understands
  (e.g. ``train.parquet`` / ``validation.parquet`` / ``test.parquet`` files), so the ``datasets`` code path works
  offline.
* A local directory holding, for each split name ``S`` (exactly one of these layouts per split):

  - ``S.{src_lang}`` and ``S.{tgt_lang}``, plain or ``.gz``: line-aligned parallel files (``train.en.gz``);
  - ``S.{src_lang}-{tgt_lang}.tsv[.gz]`` (or the reverse pair, columns swapped accordingly), or ``S.tsv[.gz]`` whose
    first column is ``src_lang`` and second ``tgt_lang``: one pair per line, ``src<TAB>tgt``, no header;
  - ``S.parquet``, shards ``S-*.parquet`` (the Hugging Face Hub layout) or ``S/*.parquet``;
  - or the whole directory is a ``save_to_disk`` directory (it has ``dataset_dict.json``).

  Parquet files and datasets hold either a ``translation`` struct column keyed by language (WMT style) or one string
  column per language (Multi30k style: ``en``, ``de``).

``fetch.splits`` maps each output split to a source split name or a list of candidates (the first that exists wins),
so ``valid: [validation, val]`` reads ``val.en.gz`` from the Multi30k release and ``validation`` from the Hub.

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

import os
import re
import socket
import sys
import unicodedata
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mtpipe import console
from mtpipe.artifacts import (
    CORPUS_SCHEMA,
    ArtifactWriter,
    check_output_place,
    check_replaceable,
    from_numpy,
    to_numpy,
)
from mtpipe.config import FetchConfig, to_dict
from mtpipe.errors import MtpipeError

BATCH_ROWS = 65536  # rows per Arrow batch: large enough to amortise per-call overhead, small enough for flat memory
READ_CHUNK = 1 << 24  # bytes read from a text file at a time
FILTERS = ("invalid_utf8", "malformed", "empty", "too_short", "too_long", "ratio", "duplicate")
_LOCAL_LAYOUTS = "{split}.{lang}[.gz] parallel files, {split}.tsv, {split}.parquet or a save_to_disk directory"


# --------------------------------------------------------------------------------------------------------------------
# Sources: each split is a stream of aligned (src, tgt) Arrow arrays
# --------------------------------------------------------------------------------------------------------------------


class Batch(NamedTuple):
    """Aligned rows of one split: ``src`` and ``tgt`` are ``binary`` (raw bytes from text files, decoded and validated
    by the cleaner) or ``string`` arrays of equal length."""

    src: pa.Array
    tgt: pa.Array
    position: int  # progress so far, in the reader's unit
    malformed: Optional[pa.Array] = None  # TSV: lines without exactly one tab (their src/tgt are placeholders)


@dataclass
class SplitReader:
    """One split of a source; ``batches()`` streams it. ``total`` is the progress total in ``unit`` (rows, or MB of
    the source-side file)."""

    name: str
    where: str  # file(s) for messages
    total: int
    unit: str
    batches: Callable[[], Iterator[Batch]]
    files: list[Path] = field(default_factory=list)


class Source:
    """A corpus with named splits (what ``fetch.splits`` candidates are looked up in)."""

    def __init__(self, description: str, names: list[str], opener: Callable[[str], SplitReader],
                 has: Optional[Callable[[str], bool]] = None):
        self.description = description
        self.names = names
        self._opener = opener
        self._has = has

    def has(self, name: str) -> bool:
        return self._has(name) if self._has else name in self.names

    def open(self, name: str) -> SplitReader:
        return self._opener(name)


class _LineStream:
    """Lines of a plain or gzip text file as Arrow ``binary`` arrays.

    Splits on ``\\n`` only (like ``wc -l`` and Moses; a ``\\r`` is stripped later as whitespace), so line numbers match
    what users see in their editors. A UTF-8 byte-order mark at the start of the file is dropped.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            self.raw = pa.OSFile(str(path), "r")
            self.stream = pa.CompressedInputStream(self.raw, "gzip") if path.name.endswith(".gz") else self.raw
        except (OSError, pa.ArrowException) as e:
            raise MtpipeError(f"{path}: cannot open ({e})") from None
        self.emitted = 0
        self._buf: list[pa.Array] = []
        self._n = 0
        self._rest = b""
        self._eof = False
        self._first = True

    def _read_more(self) -> None:
        try:
            data = self.stream.read(READ_CHUNK)
        except (OSError, pa.ArrowException) as e:
            raise MtpipeError(f"{self.path}: not readable ({str(e).splitlines()[0]})") from None
        if self._first:
            self._first = False
            if data.startswith(b"\xef\xbb\xbf"):
                data = data[3:]
        if not data:
            self._eof = True
            if self._rest:  # last line without a trailing newline
                self._buf.append(_one_line(self._rest))
                self._n += 1
                self._rest = b""
            return
        data = self._rest + data
        cut = data.rfind(b"\n")
        if cut < 0:
            self._rest = data
            return
        self._rest = data[cut + 1:]
        lines = pc.split_pattern(_one_line(memoryview(data)[:cut]), pattern="\n").flatten()
        self._buf.append(lines)
        self._n += len(lines)

    def take(self, n: int) -> pa.Array:
        """The next ``min(n, remaining)`` lines."""
        while self._n < n and not self._eof:
            self._read_more()
        if not self._buf:
            return _one_line(b"").slice(0, 0)
        joined = self._buf[0] if len(self._buf) == 1 else pa.concat_arrays(self._buf)
        out, rest = joined.slice(0, n), joined.slice(n)
        self._buf = [rest] if len(rest) else []
        self._n = len(rest)
        self.emitted += len(out)
        return out

    def count_all(self) -> int:
        """Total line count of the file (drains the stream)."""
        while True:
            if not len(self.take(1 << 20)):
                return self.emitted

    def position_mb(self) -> int:
        return self.raw.tell() >> 20


def _one_line(data: bytes | memoryview) -> pa.Array:
    """A one-element ``binary`` array over ``data``, zero-copy (``pa.array`` would also import pandas)."""
    offsets = pa.py_buffer(np.array([0, len(data)], np.int32))
    return pa.Array.from_buffers(pa.binary(), 1, [None, offsets, pa.py_buffer(data)])


def _mb(path: Path) -> int:
    return max(1, path.stat().st_size >> 20)


def _parallel_reader(name: str, src: Path, tgt: Path) -> SplitReader:
    def batches() -> Iterator[Batch]:
        a, b = _LineStream(src), _LineStream(tgt)
        while True:
            x, y = a.take(BATCH_ROWS), b.take(BATCH_ROWS)
            if len(x) != len(y):
                na, nb = a.count_all(), b.count_all()
                raise MtpipeError(f"{src} has {na:,} lines but {tgt} has {nb:,}: parallel files must be line-aligned")
            if not len(x):
                return
            yield Batch(x, y, a.position_mb())

    return SplitReader(name, f"{src} + {tgt.name}", _mb(src), "MB", batches, files=[src, tgt])


def _tsv_reader(name: str, path: Path, swap: bool) -> SplitReader:
    def batches() -> Iterator[Batch]:
        s = _LineStream(path)
        while len(lines := s.take(BATCH_ROWS)):
            # Lines without exactly one tab become a placeholder pair here; the cleaner counts or rejects them.
            malformed = pc.not_equal(pc.count_substring(lines, "\t"), 1)
            fixed = pc.if_else(malformed, pa.scalar(b"\t", pa.binary()), lines)
            parts = pc.split_pattern(fixed, pattern="\t", max_splits=1)
            a, b = pc.list_element(parts, 0), pc.list_element(parts, 1)
            a, b = (b, a) if swap else (a, b)
            yield Batch(a, b, s.position_mb(), malformed)

    return SplitReader(name, str(path), _mb(path), "MB", batches, files=[path])


def _lang_columns(schema: pa.Schema, src_lang: str, tgt_lang: str, where: str, split: str) -> Callable:
    """A function (table or batch) -> (src, tgt) arrays for a Parquet/Arrow schema; fails naming what is there."""
    names = schema.names
    if "translation" in names and pa.types.is_struct(schema.field("translation").type):
        struct = schema.field("translation").type
        have = [struct.field(i).name for i in range(struct.num_fields)]
        for lang in (src_lang, tgt_lang):
            if lang not in have:
                raise MtpipeError(f"{where}: split '{split}' has no language '{lang}' (translation fields: "
                                  f"{', '.join(have)})")

        def get(t: Any) -> tuple[pa.Array, pa.Array]:
            col = _array(t.column("translation"))
            return pc.struct_field(col, src_lang), pc.struct_field(col, tgt_lang)

        return get
    for lang in (src_lang, tgt_lang):
        if lang not in names:
            raise MtpipeError(f"{where}: split '{split}' has no language '{lang}' (columns: {', '.join(names)}; "
                              "expected a 'translation' struct or one column per language)")
        if not (pa.types.is_string(schema.field(lang).type) or pa.types.is_large_string(schema.field(lang).type)):
            raise MtpipeError(f"{where}: column '{lang}' of split '{split}' is {schema.field(lang).type}, expected "
                              "string")
    return lambda t: (_array(t.column(src_lang)), _array(t.column(tgt_lang)))


def _array(col: Any) -> pa.Array:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _parquet_reader(name: str, files: list[Path], cfg: FetchConfig) -> SplitReader:
    pfs = []
    for f in files:
        try:
            pfs.append(pq.ParquetFile(f, pre_buffer=False))  # stream: see artifacts.open_parquet
        except (pa.ArrowException, OSError) as e:
            raise MtpipeError(f"{f}: not a readable Parquet file ({e})") from None
    getters = [_lang_columns(pf.schema_arrow, cfg.src_lang, cfg.tgt_lang, str(f), name) for f, pf in zip(files, pfs)]
    total = sum(pf.metadata.num_rows for pf in pfs)

    def batches() -> Iterator[Batch]:
        done = 0
        for f, pf, get in zip(files, pfs, getters):
            cols = ["translation"] if "translation" in pf.schema_arrow.names else [cfg.src_lang, cfg.tgt_lang]
            try:
                for b in pf.iter_batches(batch_size=BATCH_ROWS, columns=cols):
                    done += b.num_rows
                    yield Batch(*get(b), done)
            except (pa.ArrowException, OSError) as e:
                raise MtpipeError(f"{f}: not readable ({str(e).splitlines()[0]})") from None

    where = str(files[0]) if len(files) == 1 else f"{files[0].parent}/{name}*.parquet"
    return SplitReader(name, where, total, "rows", batches, files=files)


def _dataset_reader(name: str, ds: Any, cfg: FetchConfig, where: str) -> SplitReader:
    get = _lang_columns(ds.data.schema, cfg.src_lang, cfg.tgt_lang, where, name)

    def batches() -> Iterator[Batch]:
        done = 0
        for table in ds.with_format("arrow").iter(batch_size=BATCH_ROWS):
            done += table.num_rows
            yield Batch(*get(table), done)

    return SplitReader(name, f"{where} [{name}]", len(ds), "rows", batches)


# --- source resolution -------------------------------------------------------------------------------------------


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists())


def _datasets_source(dd: Any, cfg: FetchConfig, where: str) -> Source:
    import datasets

    if isinstance(dd, datasets.Dataset):
        raise MtpipeError(f"{where}: is a single Dataset without splits; save a DatasetDict (train/validation/test)")
    return Source(where, list(dd), lambda n: _dataset_reader(n, dd[n], cfg, where))


def _hub_unreachable(timeout: float = 3.0) -> Optional[str]:
    """Why the Hugging Face Hub cannot be reached, or None when it can (or when we cannot tell).

    Without this, ``datasets`` retries an unreachable Hub with back-off for ~30 s before failing. A failed DNS lookup
    or TCP connect here switches the Hub libraries to offline mode instead, so a cached copy still loads and a
    missing one fails at once. Skipped when the user already chose offline mode or routes through a proxy.
    """
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return None
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except OSError as e:
        return f"{host}:{port} unreachable: {e.strerror or e}"


def _hf_source(spec: str, cfg: FetchConfig) -> Source:
    """``hf:REPO[:CONFIG]`` or ``hf:/local/path`` through the ``datasets`` library."""
    local = Path(spec).expanduser()
    offline_reason = None
    if not local.exists() and "datasets" not in sys.modules:
        # The Hub libraries read HF_HUB_OFFLINE when imported: decide before importing them.
        offline_reason = _hub_unreachable()
        if offline_reason:
            os.environ["HF_HUB_OFFLINE"] = "1"
            os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets

    try:
        if local.exists():
            datasets.disable_progress_bars()  # a local read is quick; our own progress bars follow
            if _is_saved_dataset(local):
                return _datasets_source(datasets.load_from_disk(str(local)), cfg, str(local))
            return _datasets_source(datasets.load_dataset(str(local)), cfg, str(local))
        repo, _, config = spec.partition(":")
        if offline_reason:
            console.warn(f"the Hugging Face Hub is unreachable ({offline_reason}); looking for a cached copy")
        dd = datasets.load_dataset(repo, config or None, revision=cfg.revision)
        return _datasets_source(dd, cfg, f"hf:{spec}")
    except MtpipeError:
        raise
    except Exception as e:  # noqa: BLE001 -- datasets raises a zoo of types (ConnectionError, ValueError, ...)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if offline_reason:
            reason = f"{offline_reason}, and no cached copy"
        raise MtpipeError(
            f"fetch.source hf:{spec}: cannot load the Hugging Face dataset ({reason}); if it is unreachable or you "
            f"are offline, download the corpus and set fetch.source to a local directory ({_LOCAL_LAYOUTS})"
        ) from None


_TEXT_SUFFIX = re.compile(r"^(?P<split>[^/]+?)\.(?P<lang>[A-Za-z][A-Za-z0-9_]*)(\.gz)?$")


def _local_source(root: Path, cfg: FetchConfig) -> Source:
    if _is_saved_dataset(root):
        return _hf_source(str(root), cfg)
    if root.is_file():
        raise MtpipeError(f"fetch.source {root}: is a file; give the directory that holds it ({_LOCAL_LAYOUTS})")
    if not root.is_dir():
        raise MtpipeError(f"fetch.source {root}: no such directory (and not 'hf:REPO[:CONFIG]')")
    files = sorted(p.name for p in root.iterdir())
    src, tgt = cfg.src_lang, cfg.tgt_lang

    def one(*names: str) -> Optional[Path]:
        found = [root / n for n in names if (root / n).exists()]
        if len(found) > 1:
            raise MtpipeError(f"{root}: both {found[0].name} and {found[1].name} exist; keep one")
        return found[0] if found else None

    def layouts(s: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        langs = sorted({m["lang"] for f in files if (m := _TEXT_SUFFIX.match(f)) and m["split"] == s}
                       - {"tsv", "parquet"})
        if langs:
            out["text"] = langs
        for name in (f"{s}.{src}-{tgt}.tsv", f"{s}.{tgt}-{src}.tsv", f"{s}.tsv"):
            if p := one(name, name + ".gz"):
                out.setdefault("tsv", []).append((p, name == f"{s}.{tgt}-{src}.tsv"))
        shards = sorted(root.glob(f"{s}-*.parquet")) + sorted((root / s).glob("*.parquet") if (root / s).is_dir()
                                                              else [])
        if (root / f"{s}.parquet").exists():
            shards = [root / f"{s}.parquet"] + shards
        if shards:
            out["parquet"] = shards
        return out

    def opener(s: str) -> SplitReader:
        lay = layouts(s)
        if len(lay) > 1 or len(lay.get("tsv", [])) > 1:
            kinds = ", ".join(lay)
            raise MtpipeError(f"{root}: split '{s}' exists in several layouts ({kinds}); keep one")
        if "text" in lay:
            ps, pt = one(f"{s}.{src}", f"{s}.{src}.gz"), one(f"{s}.{tgt}", f"{s}.{tgt}.gz")
            for lang, p in ((src, ps), (tgt, pt)):
                if p is None:
                    raise MtpipeError(f"{root}/{s}.{lang}[.gz]: not found: split '{s}' has no language '{lang}' "
                                      f"(it has: {', '.join(lay['text'])})")
            return _parallel_reader(s, ps, pt)
        if "tsv" in lay:
            path, swap = lay["tsv"][0]
            return _tsv_reader(s, path, swap)
        return _parquet_reader(s, lay["parquet"], cfg)

    shard_dirs = {d for d in files if (root / d).is_dir() and any((root / d).glob("*.parquet"))}
    names = sorted(_split_names(files) | shard_dirs)
    return Source(str(root), names, opener, has=lambda s: bool(layouts(s)))


def _split_names(files: list[str]) -> set[str]:
    """Split names that the files of a directory offer (for 'found: ...' messages)."""
    out = set()
    langs: dict[str, int] = {}
    for f in files:
        base = f[:-3] if f.endswith(".gz") else f
        if base.endswith(".parquet"):
            out.add(re.sub(r"-\d+-of-\d+$", "", base[: -len(".parquet")]).split("-")[0])
        elif base.endswith(".tsv"):
            out.add(base[: -len(".tsv")].split(".")[0])
        elif m := _TEXT_SUFFIX.match(f):
            langs[m["split"]] = langs.get(m["split"], 0) + 1
    return out | {s for s, n in langs.items() if n >= 2}  # README.md is not a split


def open_source(cfg: FetchConfig) -> Source:
    """The corpus named by ``fetch.source`` (see the module docstring for what is accepted)."""
    if cfg.source.startswith("hf:"):
        return _hf_source(cfg.source[3:], cfg)
    return _local_source(Path(cfg.source).expanduser(), cfg)


def resolve_splits(cfg: FetchConfig, source: Source) -> dict[str, str]:
    """Output split -> source split name: the first candidate of ``fetch.splits`` that the source has."""
    if not isinstance(cfg.splits, dict) or "train" not in cfg.splits:
        raise MtpipeError(f"fetch.splits: must map at least 'train' to a source split, got {cfg.splits!r}")
    out = {}
    for split, cands in cfg.splits.items():
        cands = [cands] if isinstance(cands, str) else cands
        if not isinstance(cands, list) or not cands or not all(isinstance(c, str) for c in cands):
            raise MtpipeError(f"fetch.splits.{split}: must be a split name or a list of names, got {cands!r}")
        found = next((c for c in cands if source.has(c)), None)
        if found is None:
            raise MtpipeError(f"{source.description}: no split for '{split}' (tried: {', '.join(cands)}; found: "
                              f"{', '.join(source.names) or 'nothing'})")
        out[split] = found
    return out


# --------------------------------------------------------------------------------------------------------------------
# Cleaning
# --------------------------------------------------------------------------------------------------------------------


class SeenHashes:
    """A set of 64-bit hashes in a numpy open-addressing table (linear probing, load <= 0.7).

    8 bytes per slot: about 12 bytes per distinct pair on average, versus ~70 for a Python set of ints, which is what
    keeps deduplicating a 4.5M-pair corpus in tens of MB. Inserts are vectorised over a whole batch. Two different
    pairs share a 64-bit hash with probability about n^2 / 2^65 (5e-7 for 4.5M pairs): one pair wrongly dropped.
    """

    MAX_LOAD = 0.7

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
        old = self.table[self.table != 0]
        self.table = np.zeros(len(self.table) * 2, np.uint64)
        self.size = 0
        self._insert(old)


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


def _check_cfg(cfg: FetchConfig) -> None:
    if cfg.src_lang == cfg.tgt_lang:
        raise MtpipeError(f"fetch.src_lang and fetch.tgt_lang are both '{cfg.src_lang}'")
    if cfg.min_len < 0 or cfg.max_len < max(cfg.min_len, 1):
        raise MtpipeError(f"fetch.min_len={cfg.min_len} / fetch.max_len={cfg.max_len}: need 0 <= min_len <= max_len")


def local_source(source: str) -> Path | None:
    """The local path ``fetch.source`` names (a directory, or ``hf:PATH`` of a local dataset), else None."""
    spec = source[3:] if source.startswith("hf:") else source
    path = Path(spec).expanduser()
    return path if not source.startswith("hf:") or path.exists() else None


def run(cfg: FetchConfig, out: Path, *, force: bool = False) -> dict[str, SplitStats]:
    """Read ``cfg.source``, clean train, write the ``corpus`` artifact to ``out``; returns per-split statistics."""
    _check_cfg(cfg)
    out = Path(out)
    check_output_place(out, [local_source(cfg.source)])
    check_replaceable(out, "corpus", force=force)
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

