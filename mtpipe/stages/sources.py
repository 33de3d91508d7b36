"""Where ``mtpipe fetch`` reads a parallel corpus from: each split as a stream of aligned (src, tgt) Arrow arrays.

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
  - or the whole directory is a ``save_to_disk`` directory (it has ``dataset_dict.json``);
  - or the whole directory is a corpus artifact (``mtpipe fetch --out``, it has ``manifest.json``): its splits, in
    its languages (read in the other order when fetch asks for the other direction), e.g. halves of a corpus fetched
    once, or its train split with another model's translations as one side (``fetch.hypotheses``).

  Parquet files and datasets hold either a ``translation`` struct column keyed by language (WMT style) or one string
  column per language (Multi30k style: ``en``, ``de``).

``fetch.splits`` maps each output split to a source split name or a list of candidates (the first that exists wins),
so ``valid: [validation, val]`` reads ``val.en.gz`` from the Multi30k release and ``validation`` from the Hub. The
output split's own name is tried before them (``valid.en.gz`` needs no entry), unless the entry lists it itself.
"""

from __future__ import annotations

import re
import socket
import sys
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mtpipe import console, env
from mtpipe.config import FetchConfig
from mtpipe.errors import MtpipeError

BATCH_ROWS = 65536  # rows per Arrow batch: large enough to amortise per-call overhead, small enough for flat memory
READ_CHUNK = 1 << 24  # bytes read from a text file at a time
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
    ids: Optional[pa.Array] = None  # a corpus artifact: its rows' ids (what its hypotheses are matched by)


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
    swapped: Optional[bool] = None  # a corpus artifact: read in the other language order (None: not an artifact)


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
    if env.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return None
    if any(env.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urllib.parse.urlparse(env.get("HF_ENDPOINT", "https://huggingface.co"))
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
            env.put("HF_HUB_OFFLINE", "1")
            env.put("HF_DATASETS_OFFLINE", "1")
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


def _artifact_source(root: Path, cfg: FetchConfig) -> Source:
    """A corpus artifact: its split files, its two sides put in the order ``fetch`` asks for."""
    from mtpipe import artifacts

    m = artifacts.read_manifest(root, "corpus")
    langs = (m.extra.get("src_lang"), m.extra.get("tgt_lang"))
    if set(langs) != {cfg.src_lang, cfg.tgt_lang}:
        raise MtpipeError(f"{root}: a corpus artifact of {langs[0]}-{langs[1]}, not of {cfg.src_lang}-{cfg.tgt_lang} "
                          "(fetch.src_lang, fetch.tgt_lang)")
    swap = langs[0] != cfg.src_lang

    def opener(s: str) -> SplitReader:
        pf = artifacts.open_parquet(root, f"{s}.parquet", "corpus")

        def batches() -> Iterator[Batch]:
            done = 0
            for b in pf.iter_batches(batch_size=BATCH_ROWS):
                done += b.num_rows
                src, tgt = b.column("src"), b.column("tgt")
                yield Batch(*((tgt, src) if swap else (src, tgt)), done, ids=b.column("id"))

        return SplitReader(s, f"{root}/{s}.parquet", pf.metadata.num_rows, "rows", batches,
                           files=[root / f"{s}.parquet"], swapped=swap)

    return Source(str(root), artifacts.splits_of(root, "corpus"), opener)


def _local_source(root: Path, cfg: FetchConfig) -> Source:
    if (root / "manifest.json").is_file():
        return _artifact_source(root, cfg)
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
    """Output split -> source split name: the output split's own name (``valid``) first, so that a corpus that
    already uses mtpipe's names needs no mapping, then the candidates of ``fetch.splits``; an entry that names the
    output split itself keeps its place in the list (``test: [newstest2014, test]`` prefers newstest2014)."""
    if not isinstance(cfg.splits, dict) or "train" not in cfg.splits:
        raise MtpipeError(f"fetch.splits: must map at least 'train' to a source split, got {cfg.splits!r}")
    out = {}
    for split, cands in cfg.splits.items():
        cands = [cands] if isinstance(cands, str) else cands
        if not isinstance(cands, list) or not cands or not all(isinstance(c, str) for c in cands):
            raise MtpipeError(f"fetch.splits.{split}: must be a split name or a list of names, got {cands!r}")
        cands = [split, *cands] if split not in cands else cands
        found = next((c for c in cands if source.has(c)), None)
        if found is None:
            raise MtpipeError(f"{source.description}: no split for '{split}' (tried: {', '.join(cands)}; found: "
                              f"{', '.join(source.names) or 'nothing'})")
        out[split] = found
    return out


def local_source(source: str) -> Path | None:
    """The local path ``fetch.source`` names (a directory, or ``hf:PATH`` of a local dataset), else None."""
    spec = source[3:] if source.startswith("hf:") else source
    path = Path(spec).expanduser()
    return path if not source.startswith("hf:") or path.exists() else None
