"""Reading an artifact's large files fast: memory-mapped, hashed once, without pandas.

The formats and their checks are :mod:`mtpipe.artifacts`'; this is how the large files are read (and
:mod:`mtpipe.writing` how they are written).

* :func:`open_ipc`: an Arrow IPC file of an artifact (the batches' ``train.arrow``), memory-mapped: its record
  batches are views of the mapped file (:class:`MappedIpc`), so the processes of a node share the one copy the page
  cache holds instead of each reading the file into its memory.
* Such large files are hashed once (:func:`verify_remembered`): a successful check is recorded under
  ``$MTPIPE_CACHE_DIR/verified`` (:func:`cache_root`), keyed by the file's real path, size, mtime, ctime and inode and
  its manifest hash, and later reads compare that key only; a changed key (the file was written, touched or
  replaced) means hashing it again.
* :func:`from_numpy` / :func:`to_numpy`: numeric columns between Arrow and numpy, zero-copy and without pandas.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from mtpipe import artifacts, env
from mtpipe.atomic import atomic_write_text
from mtpipe.errors import MtpipeError

# --------------------------------------------------------------------------------------------------------------------
# Verification records: a large file is hashed once, not at every start
# --------------------------------------------------------------------------------------------------------------------

VERIFIED_FORMAT = 1
# A file whose mtime or ctime is less than this before the end of its check is not recorded (it is hashed again at
# the next start): a filesystem stamps times from a coarse clock (a tick of a few ms; an NFS server's own clock), and a
# change within the tick of the check would leave the stat key as it was ("racy" entries, as git calls them).
RACY_NS = 2_000_000_000


def cache_root(configured: str = "") -> Path:
    """mtpipe's per-user cache: ``$MTPIPE_CACHE_DIR``, else ``configured`` (a setting, e.g. decode.package_cache),
    else ``$XDG_CACHE_HOME/mtpipe`` (``~/.cache/mtpipe``)."""
    root = env.get("MTPIPE_CACHE_DIR") or configured or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mtpipe")
    return Path(root)


def _stat_key(path: Path) -> dict[str, int]:
    """What changes when a file is written, truncated, touched or replaced: size, mtime, ctime (which no user can
    set back) and inode. The device number is left out: it differs between the nodes that mount one NFS export."""
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def verification_record(path: Path | str) -> Path:
    """Where the verification record of the file ``path`` lives: ``<cache_root>/verified/<hash of its real
    path>.json``, one small JSON file per data file (so that processes checking different files never write the
    same record)."""
    real = str(Path(path).resolve())
    return cache_root() / "verified" / (hashlib.sha256(real.encode("utf-8")).hexdigest()[:32] + ".json")


def verified_before(path: Path, want: str) -> bool:
    """Whether a record says that the file ``path``, with exactly its current stat key, was hashed to ``want`` (its
    manifest hash); an unreadable, foreign or stale record is no record."""
    try:
        rec = json.loads(verification_record(path).read_text(encoding="utf-8"))
        return (isinstance(rec, dict) and rec.get("format") == VERIFIED_FORMAT
                and rec.get("path") == str(path.resolve()) and rec.get("sha256") == want
                and rec.get("stat") == _stat_key(path))
    except (OSError, ValueError):
        return False


def remember_verified(path: Path, want: str, before: dict[str, int]) -> None:
    """Record that ``path`` hashed to ``want``, if its stat key is still ``before`` (taken before hashing) and no
    change of it could hide within the filesystem's clock tick (:data:`RACY_NS`). Written atomically; a cache that
    cannot be written costs a warning and another check at the next start, nothing else."""
    key = _stat_key(path)
    if key != before or time.time_ns() - max(key["mtime_ns"], key["ctime_ns"]) < RACY_NS:
        return
    record = {"format": VERIFIED_FORMAT, "path": str(path.resolve()), "sha256": want, "stat": key}
    try:
        atomic_write_text(verification_record(path), json.dumps(record, sort_keys=True) + "\n")
    except MtpipeError as e:
        from mtpipe.console import warn

        warn(f"{e}: the check of {path} is not recorded; the next start hashes it again")


def verify_remembered(directory: Path | str, name: str, manifest: artifacts.Manifest) -> Path:
    """:func:`mtpipe.artifacts.verify_file` for a large file read at every start (training's ``train.arrow``): the
    hash is checked only when no verification record of the file matches its current stat key
    (:func:`verified_before`), and a successful check is recorded (:func:`remember_verified`)."""
    path = artifacts.member_path(directory, name, manifest)
    if verified_before(path, manifest.files[name]):
        return path
    before = _stat_key(path)
    artifacts.verify_file(directory, name, manifest)
    remember_verified(path, manifest.files[name], before)
    return path


# --------------------------------------------------------------------------------------------------------------------
# Arrow IPC files, memory-mapped
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class MappedIpc:
    """An Arrow IPC file of an artifact, memory-mapped (:func:`open_ipc`)."""

    path: Path
    reader: pa.ipc.RecordBatchFileReader
    region: tuple[int, int]  # the mapping's [start, end) addresses

    def __len__(self) -> int:
        return self.reader.num_record_batches

    def batch(self, k: int) -> pa.RecordBatch:
        """Record batch ``k``, every buffer of it a view of the mapped file (checked: a compressed file would be
        decompressed into each process's memory), its structure validated (lengths and end offsets, not every
        value: the file's hash is checked)."""
        try:
            rb = self.reader.get_batch(k)
            rb.validate()
        except (pa.ArrowInvalid, OSError) as e:
            raise MtpipeError(f"{self.path}: record batch {k} is unreadable ({e})") from None
        lo, hi = self.region
        for col in rb.columns:
            for buf in col.buffers():  # a nested array's buffers include its children's
                if buf is not None and buf.size and not (lo <= buf.address and buf.address + buf.size <= hi):
                    raise MtpipeError(f"{self.path}: record batch {k} is not stored as plain buffers (compressed?) "
                                      "and cannot be memory-mapped: re-run the stage that made it")
        return rb


def open_ipc(directory: Path | str, name: str, schema: pa.Schema,
             manifest: artifacts.Manifest | None = None) -> MappedIpc:
    """A validated, memory-mapped Arrow IPC file of an artifact: its hash checked once and remembered
    (:func:`verify_remembered`), its schema checked. Its record batches (:meth:`MappedIpc.batch`) are views of the
    mapped file: no copy, and the page cache holds one copy for every process that maps it."""
    m = manifest or artifacts.read_manifest(directory)
    path = verify_remembered(directory, name, m)
    try:
        mm = pa.memory_map(str(path), "r")
        whole = mm.read_buffer(mm.size())  # zero-copy: the mapping itself, for MappedIpc.batch's check
        mm.seek(0)
        reader = pa.ipc.open_file(mm)
    except (pa.ArrowInvalid, OSError) as e:
        raise MtpipeError(f"{path}: not a readable Arrow IPC file ({e})") from None
    artifacts.check_schema(path, reader.schema, schema)
    return MappedIpc(path, reader, (whole.address, whole.address + whole.size))


# --------------------------------------------------------------------------------------------------------------------
# Arrow <-> numpy, without pandas
# --------------------------------------------------------------------------------------------------------------------


def from_numpy(a: Any) -> pa.Array:
    """A 1-D numeric numpy array as an Arrow array, zero-copy.

    ``pa.array(ndarray)`` imports pandas on first use (~0.6 s of start-up per stage); this does not.
    """
    import numpy as np

    a = np.ascontiguousarray(a)
    if a.ndim != 1 or a.dtype.kind not in "iuf":
        raise TypeError(f"from_numpy: need a 1-D numeric array, got {a.dtype} with shape {a.shape}")
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), len(a), [None, pa.py_buffer(a)])


def to_numpy(arr: Any) -> Any:
    """A numeric or boolean Arrow array (or a one-chunk ChunkedArray) without nulls as numpy, zero-copy for numbers.

    ``Array.to_numpy`` imports pandas on first use (~0.6 s of start-up per stage); this does not.
    """
    import numpy as np

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_boolean(arr.type):  # bit-packed in Arrow: one byte per value for numpy
        return to_numpy(arr.cast(pa.uint8())).astype(bool)
    if arr.null_count or not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
        return arr.to_numpy(zero_copy_only=False)
    dtype = np.dtype(arr.type.to_pandas_dtype())
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)
