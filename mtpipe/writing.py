"""Writing artifacts safely: atomically, never over what mtpipe did not write, one line on an OS error.

* :class:`ArtifactWriter` writes an artifact (:mod:`mtpipe.artifacts` defines the formats) into a hidden temporary
  sibling, the manifest last, and renames it into place; a killed stage leaves nothing that looks valid, and the next
  run of the stage removes what the killed one left (:func:`remove_stale_temporaries`).
* ``--out`` is replaced only when it is absent, an empty directory or an mtpipe output of the same kind
  (:func:`check_replaceable`, :func:`check_replaceable_metrics`, :func:`check_run_dir`), unless ``force``; it may never
  be, contain or lie inside an input, nor contain the working directory (:func:`check_output_place`), ``force`` or
  not. :func:`prepare_output` runs every check before a stage starts work.
* An ``OSError`` while writing (a full disk, no permission, a read-only filesystem) becomes one
  :class:`~mtpipe.errors.MtpipeError` line naming the output and the errno's meaning (:func:`os_reason`).
* The same content gives the same bytes: a file's hash in a manifest, a manifest's hash upstream of the next stage,
  the server's model hash and DVC's output hashes change only when something did. Manifests are sorted JSON;
  checkpoint weights go through :func:`write_safetensors` (sorted header); ``trainer.pt`` is ``torch.save`` of plain
  data into a file object (no file name, no time in the archive). Every file and folder of an artifact gets the usual
  permissions (``0o666`` / ``0o777`` less the umask) when it is finalised, whichever library wrote it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from mtpipe.artifacts import (
    CHECKPOINT_SPM,
    CHECKPOINT_SPM_VOCAB,
    FORMAT_VERSIONS,
    MANIFEST,
    RUN_ENTRIES,
    SCHEMAS,
    TRAINER_STATE,
    WEIGHTS,
    CheckpointManifest,
    Manifest,
    bare_sha,
    file_hash,
    manifest_hash,
)
from mtpipe.atomic import _umask, atomic_write_text  # noqa: F401 (atomic_write_text: writing's own, used by its callers)
from mtpipe.errors import MtpipeError, os_reason


def _overlap(out: Path, other: Path) -> str | None:
    """How ``out`` overlaps ``other`` (both resolved): 'is', 'is inside' or 'contains', or None."""
    if out == other:
        return "is"
    if out.is_relative_to(other):
        return "is inside"
    if other.is_relative_to(out):
        return "contains"
    return None


def check_output_place(out: Path | str, inputs: Iterable[Path | str | None] = ()) -> None:
    """Refuse an output path that is, contains or lies inside an input, or contains the working directory; checked
    before any work starts, ``--force`` or not."""
    out = Path(out)
    target = out.resolve()
    how = _overlap(target, Path.cwd().resolve())
    if how in ("is", "contains"):
        raise MtpipeError(f"--out {out}: {how} the current directory; choose an output path below it")
    for inp in inputs:
        if inp is None or str(inp) in ("", "-"):
            continue
        how = _overlap(target, Path(inp).resolve())
        if how is not None:
            raise MtpipeError(f"--out {out}: {how} the input {inp}; writing there would destroy it: choose another "
                              "output path")


def _is_own_pid(name: str, prefix: str) -> int | None:
    """The process id in a temporary name ``{prefix}{pid}-{random}`` mtpipe made, or None."""
    if not name.startswith(prefix):
        return None
    pid = name[len(prefix):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(out: Path) -> None:
    """Remove the temporaries an earlier, killed write of ``out`` left beside it (``.{name}.tmp-{pid}-*`` and
    ``.{name}.old-{pid}-*``, names only mtpipe makes), unless their process is still running."""
    parent = out.parent
    if not parent.is_dir():
        return
    for entry in parent.iterdir():
        for prefix in (f".{out.name}.tmp-", f".{out.name}.old-"):
            pid = _is_own_pid(entry.name, prefix)
            if pid is not None and pid != os.getpid() and not _pid_alive(pid):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


def check_replaceable(out: Path | str, kind: str, *, force: bool = False) -> None:
    """Refuse to replace ``out`` unless it is absent, an empty directory, or an mtpipe artifact of ``kind`` (a
    readable manifest); ``force`` replaces anything but the checks of :func:`check_output_place`."""
    out = Path(out)
    if force or not (out.exists() or out.is_symlink()):
        return
    hint = "choose another --out, or pass --force to replace it"
    if out.is_symlink():
        raise MtpipeError(f"--out {out}: is a symbolic link, not an mtpipe '{kind}' artifact; {hint}")
    if not out.is_dir():
        raise MtpipeError(f"--out {out}: is a file, not an mtpipe '{kind}' artifact; {hint}")
    if not any(out.iterdir()):
        return
    try:
        found = json.loads((out / MANIFEST).read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        raise MtpipeError(f"--out {out}: exists and is not an mtpipe artifact (no readable {MANIFEST}); "
                          f"{hint}") from None
    if found != kind:
        raise MtpipeError(f"--out {out}: is an mtpipe '{found}' artifact, not a '{kind}' one; {hint}")


def prepare_output(out: Path | str, kind: str, *, inputs: Iterable[Path | str | None] = (),
                   force: bool = False) -> None:
    """Every check on an artifact output before a stage starts work, and the clean-up of a killed earlier run."""
    check_output_place(out, inputs)
    check_replaceable(out, kind, force=force)
    remove_stale_temporaries(Path(out))


# The keys every metrics JSON of ``mtpipe score`` has: how an existing file is recognised as one.
METRICS_KEYS = ("bleu", "chrf", "ter", "signatures")


def check_replaceable_metrics(out: Path | str, *, force: bool = False) -> None:
    """Refuse to replace ``out`` unless it is absent or a metrics JSON that ``mtpipe score`` wrote."""
    out = Path(out)
    if force or not (out.exists() or out.is_symlink()):
        return
    hint = "choose another --out, or pass --force to replace it"
    if out.is_dir() or out.is_symlink():
        raise MtpipeError(f"--out {out}: is a {'directory' if out.is_dir() else 'symbolic link'}, not a metrics "
                          f"JSON file; {hint}")
    try:
        data = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict) or not all(k in data for k in METRICS_KEYS):
        raise MtpipeError(f"--out {out}: exists and is not a metrics JSON of `mtpipe score`; {hint}")


class ArtifactWriter:
    """Write an artifact directory atomically.

    >>> with ArtifactWriter(out, "corpus", params, upstream={"corpus": src_dir}) as w:
    ...     w.write_table("train.parquet", table)
    ...     w.extra["filters"] = {...}

    ``out`` must be absent, empty or an artifact of the same kind (``force`` lifts that) and must not overlap an
    upstream artifact (:func:`prepare_output`). Files go to a temporary sibling directory; on success the manifest
    is written last and the directory renamed over ``out``; on any exception the temporary directory is removed and
    ``out`` is left as it was. An OS error (a full disk, no permission) becomes one :class:`MtpipeError` line.
    """

    def __init__(self, out: Path | str, kind: str, params: dict[str, Any] | None = None,
                 upstream: dict[str, Path | str] | None = None, *, force: bool = False):
        self.out = Path(out)
        self.kind = kind
        self.force = force
        self.upstream = dict(upstream or {})
        self.manifest = Manifest(kind=kind, format_version=FORMAT_VERSIONS[kind], params=params or {})
        self.rows = self.manifest.rows
        self.extra = self.manifest.extra
        self.tmp: Path | None = None

    def __enter__(self) -> "ArtifactWriter":
        prepare_output(self.out, self.kind, inputs=self.upstream.values(), force=self.force)
        for name, d in self.upstream.items():
            self.manifest.upstream[name] = manifest_hash(d)
        try:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-{os.getpid()}-", dir=self.out.parent))
            os.chmod(self.tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the artifact gets the usual permissions
        except OSError as e:
            raise MtpipeError(f"{self.out}: cannot write ({os_reason(e)})") from None
        return self

    def path(self, name: str) -> Path:
        """Where to write file ``name`` (inside the temporary directory)."""
        assert self.tmp is not None, "use ArtifactWriter as a context manager"
        p = self.tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def parquet_writer(self, name: str, schema: pa.Schema | None = None) -> pq.ParquetWriter:
        """A streaming Parquet writer for ``name`` with the kind's schema (zstd compressed)."""
        return pq.ParquetWriter(self.path(name), schema or SCHEMAS[self.kind], compression="zstd")

    def write_table(self, name: str, table: pa.Table) -> None:
        schema = SCHEMAS[self.kind]
        table = table.select(schema.names).cast(schema)
        pq.write_table(table, self.path(name), compression="zstd")
        self.rows[name] = table.num_rows

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self.tmp is not None
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(exc, OSError):  # ENOSPC, EACCES, EROFS ... while writing a file: one line, not a traceback
                raise MtpipeError(f"{self.out}: cannot write ({os_reason(exc)}); nothing was written") from None
            return
        try:
            for p in sorted(self.tmp.rglob("*")):
                if p.is_file():
                    self.manifest.files[str(p.relative_to(self.tmp))] = file_hash(p)
            text = json.dumps(asdict(self.manifest), indent=2, sort_keys=True, default=str)
            (self.tmp / MANIFEST).write_text(text + "\n", encoding="utf-8")
            usual_permissions(self.tmp)
            replace_dir(self.tmp, self.out)
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise MtpipeError(f"{self.out}: cannot write ({os_reason(e)}); nothing was written") from None
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise


def usual_permissions(root: Path) -> None:
    """Give ``root`` and everything below it the permissions a plain ``open`` / ``mkdir`` would: files
    ``0o666 & ~umask``, directories ``0o777 & ~umask`` (symbolic links are left alone).

    Writers that go through a temporary file (``tempfile.mkstemp``; safetensors' and so transformers'
    ``save_pretrained``) leave ``0600``, so that one file of an artifact would be unreadable to the group and others
    who read the rest; done once here, when an artifact is finalised, whatever wrote its files."""
    umask = _umask()
    os.chmod(root, 0o777 & ~umask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            if not os.path.islink(os.path.join(dirpath, name)):
                os.chmod(os.path.join(dirpath, name), 0o777 & ~umask)
        for name in filenames:
            if not os.path.islink(os.path.join(dirpath, name)):
                os.chmod(os.path.join(dirpath, name), 0o666 & ~umask)


def replace_dir(src: Path, dst: Path) -> None:
    """Move directory ``src`` to ``dst``, replacing ``dst``; the old one is removed only after the swap. Callers
    have checked that ``dst`` is theirs to replace (:func:`check_replaceable`)."""
    old = None
    if dst.exists() or dst.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-{os.getpid()}-", dir=dst.parent))
        os.rename(dst, old / dst.name)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_run_dir(out: Path | str, *, force: bool = False) -> None:
    """Refuse a training ``--out`` that holds anything `mtpipe train` does not write (training adds checkpoints and
    logs to its run directory and resumes from it; it must not mix them into someone else's folder)."""
    out = Path(out)
    if force or not (out.exists() or out.is_symlink()):
        return
    hint = "choose another --out, or pass --force to train into it anyway"
    if not out.is_dir():
        raise MtpipeError(f"--out {out}: is a file, not a training run directory; {hint}")
    foreign = sorted(e.name for e in out.iterdir() if e.name not in RUN_ENTRIES and not e.name.startswith("."))
    if foreign:
        raise MtpipeError(f"--out {out}: is not a `mtpipe train` run directory (it holds '{foreign[0]}'); {hint}")


def write_checkpoint(out: Path | str, *, state_dict: dict[str, Any], meta: CheckpointManifest,
                     trainer_state: dict[str, Any] | None = None, params: dict[str, Any] | None = None,
                     upstream: dict[str, Path | str] | None = None, spm: Path | None = None,
                     spm_vocab: Path | None = None, force: bool = False) -> None:
    """Write a checkpoint directory atomically: ``model.safetensors`` (weights, no pickle; the model config,
    vocabulary and step of ``meta`` in its metadata), for resumable training checkpoints ``trainer.pt`` (optimizer,
    schedule, RNG, data position; loads with weights_only=True), given ``spm`` a copy of the SentencePiece model (it
    must be the one ``meta.vocab`` names) and of its ``spm_vocab`` listing, so that the checkpoint decodes on its
    own, and the manifest, whose ``extra`` is ``meta`` (its one schema, :class:`CheckpointManifest`, validated here)
    with ``spm_model`` / ``spm_vocab`` naming the files written."""
    meta = dataclasses.replace(meta, spm_model=None if spm is None else CHECKPOINT_SPM,
                               spm_vocab=None if spm is None or spm_vocab is None else CHECKPOINT_SPM_VOCAB)
    meta.validate(Path(out) / MANIFEST)
    if spm is not None and bare_sha(file_hash(spm)) != bare_sha(meta.vocab.get("spm_sha256")):
        raise MtpipeError(f"{spm}: is not the SentencePiece model of the checkpoint's vocabulary (vocab.spm_sha256 "
                          f"{meta.vocab.get('spm_sha256')})")
    with ArtifactWriter(out, "checkpoint", params, upstream, force=force) as w:
        if spm is not None:
            shutil.copyfile(spm, w.path(CHECKPOINT_SPM))
            if spm_vocab is not None:
                shutil.copyfile(spm_vocab, w.path(CHECKPOINT_SPM_VOCAB))
        header = {"model_config": json.dumps(meta.model_config, sort_keys=True), "step": str(meta.step),
                  "vocab": json.dumps(meta.vocab, sort_keys=True), "format_version": str(FORMAT_VERSIONS["checkpoint"])}
        write_safetensors(state_dict, w.path(WEIGHTS), header)
        if trainer_state is not None:
            _torch_save(trainer_state, w.path(TRAINER_STATE))
        w.extra.update(meta.to_extra())


# safetensors' dtype names, in the order of its Rust ``Dtype`` enum: its serializer lays tensors out by that order,
# descending (the widest first, so that every tensor is aligned to its width), then by name.
_SAFETENSORS_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
                      "C64", "F64", "I64", "U64")
_SAFETENSORS_DTYPES = {  # torch dtype name -> safetensors dtype (the unsigned ones exist in torch 2.3 and later)
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
    "int16": "I16", "uint16": "U16", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "uint32": "U32",
    "float32": "F32", "complex64": "C64", "float64": "F64", "int64": "I64", "uint64": "U64",
}


def write_safetensors(tensors: dict[str, Any], path: Path | str, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` in the safetensors format, with the header's metadata in sorted key order.

    ``safetensors.torch.save_file`` takes the metadata as a Python dict but hands it to Rust as a ``HashMap``, whose
    iteration order is seeded afresh in every process: the same weights and metadata came out as different bytes
    (one of the 24 orders of a checkpoint's 4 keys), so the file's hash changed between a resumed and an uninterrupted
    run and between any two processes. The format is documented and small: an 8-byte little-endian header length, the
    JSON header (``__metadata__`` first, then each tensor's dtype, shape and ``data_offsets``) padded with spaces to a
    multiple of 8, then the tensors' bytes. This writes exactly what safetensors writes (the same tensor layout, order
    and JSON) but for the metadata's order, and refuses what it refuses (a sparse or non-tensor value, tensors sharing
    memory); anything that reads safetensors reads it. An OS error is an ``OSError``."""
    import struct
    import sys

    import torch

    path = Path(path)
    if sys.byteorder != "little":  # the format is little-endian; safetensors' own writer swaps (in whatever order)
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata)
        return
    entries, storages = [], {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise ValueError(f"{path}: '{name}' is not a named dense tensor; safetensors cannot hold it")
        dtype = _SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"{path}: tensor '{name}' has dtype {t.dtype}, which safetensors cannot hold")
        t = t.detach().cpu().contiguous()  # what safetensors was given before (a copy unless already so)
        if t.numel():
            key = t.untyped_storage().data_ptr()
            if key in storages:  # an alias would be written twice and load as two tensors (safetensors refuses it)
                raise ValueError(f"{path}: tensors '{storages[key]}' and '{name}' share memory; save one of them")
            storages[key] = name
        entries.append((name, dtype, t))
    entries.sort(key=lambda e: (-_SAFETENSORS_ORDER.index(e[1]), e[0]))
    header: dict[str, Any] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError(f"{path}: safetensors metadata must map strings to strings")
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    offset = 0
    for name, dtype, t in entries:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    # serde_json's compact form: no spaces, non-ASCII as UTF-8 (json.dumps escapes what serde_json escapes)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, t in entries:
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)


class _WriteRecorder:
    """A file for ``torch.save`` that keeps the OS error of a failed write: torch reports it only as a
    ``RuntimeError`` about a stream position."""

    def __init__(self, f: Any):
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def unshared(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples, strings, numbers, tensors) with every container and string of two or more
    characters a new object of its own.

    Why: pickle writes an object it has written before as a back-reference, so the bytes of ``torch.save`` depend on
    which equal strings and tuples happen to be one object. A resumed run's optimizer state holds the key strings it
    unpickled where an uninterrupted run holds the code's literals, and the two files differed though every value
    was equal. With nothing shared (CPython's one-character and empty strings are single objects everywhere), the
    bytes depend on the values alone."""
    if isinstance(obj, dict):
        return {unshared(k): unshared(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unshared(v) for v in obj]
    if type(obj) is tuple:
        return tuple(unshared(v) for v in obj)
    if type(obj) is str:
        return "".join(list(obj))  # a new object (the one-character and empty ones are shared singletons anyway)
    return obj


def _torch_save(obj: Any, path: Path) -> None:
    import torch

    with open(path, "wb") as f:
        w = _WriteRecorder(f)
        try:
            torch.save(unshared(obj), w)  # type: ignore[arg-type]
        except RuntimeError:
            if w.error is not None:
                raise w.error from None
            raise
