"""Artifact formats: every file a stage writes or reads is defined, versioned and validated here.

An *artifact* is a directory holding data files and a ``manifest.json``::

    {"kind": "tokens", "format_version": 1, "mtpipe_version": "0.1.0",
     "params": {...the params sections that made it...},
     "rows": {"train.parquet": 29000, ...},
     "files": {"train.parquet": "sha256:...", ...},
     "upstream": {"corpus": "sha256:<hash of the upstream manifest.json>"},
     "extra": {...kind-specific facts...}}

Artifacts are written atomically: everything goes to a hidden temporary sibling directory, the manifest last, and
the directory is renamed into place only when the stage succeeded. A killed stage leaves no directory that looks
valid. Readers check the manifest's kind and format version, each file's hash, and each Parquet file's schema.

| kind        | files                                   | schema                                                     |
|-------------|-----------------------------------------|------------------------------------------------------------|
| corpus      | {train,valid,test}.parquet              | id int64, src string, tgt string                            |
| tokens      | {split}.parquet, spm.model, spm.vocab   | id int64, src list<int32>, tgt list<int32> (EOS not stored) |
| batches     | {train,valid}.parquet                   | batch int64, ids list<int64>, src_tokens, tgt_tokens, ... |
| checkpoint  | model.safetensors [, trainer.pt]        | safetensors weights; trainer.pt loads with weights_only     |
| hypotheses  | {split}.parquet, {split}.txt            | id int64, hypothesis string, score float64, nbest ...       |
| export      | model.bin, config.json, *vocabulary.json, spm.model (CTranslate2) or Marian files | extra: format |

Hypotheses contract (written by ``decode``, read by ``score``): ``manifest.extra["split"]`` names the split that was
translated; the rows are in ``{split}.parquet`` (and ``{split}.txt``, one detokenised line per row in ``id`` order).
When decode translated a split of the bpe artifact, ``split`` is that corpus split's name (``"test"``) and each row's
``id`` is the row ``id`` of the same sentence in the tokens artifact and in the fetch (corpus) artifact it was encoded
from, so ``score`` pairs hypotheses with references by id and row order never matters. When decode translated raw
text (``--input``), ``extra["split"]`` is ``null``, the artifact holds exactly one ``*.parquet`` file and ``id`` is the
0-based input line number; ``score`` then pairs rows in id order with the reference lines.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from mtpipe import __version__
from mtpipe.errors import MtpipeError

MANIFEST = "manifest.json"

# Bump a kind's version whenever its files change incompatibly; readers refuse other versions.
FORMAT_VERSIONS: dict[str, int] = {
    "corpus": 1,
    "tokens": 1,
    "batches": 1,
    "checkpoint": 1,
    "hypotheses": 1,
    "export": 1,  # mtpipe export: a CTranslate2 or Hugging Face Marian model directory (mtpipe/export.py)
}

# Special token ids shared by the SentencePiece model, the batches and the Transformer's embedding table.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

CORPUS_SCHEMA = pa.schema([("id", pa.int64()), ("src", pa.string()), ("tgt", pa.string())])
TOKENS_SCHEMA = pa.schema([("id", pa.int64()), ("src", pa.list_(pa.int32())), ("tgt", pa.list_(pa.int32()))])
BATCHES_SCHEMA = pa.schema(
    [
        ("batch", pa.int64()),
        # values of the tokens split's `id` column (corpus line indices; NOT row positions: fetch drops train
        # lines), sorted by length inside the batch
        ("ids", pa.list_(pa.int64())),
        ("src_tokens", pa.int64()),  # real (non-pad) source tokens, EOS included
        ("tgt_tokens", pa.int64()),  # real target tokens, EOS included (= tokens the loss is computed on)
        ("src_len", pa.int32()),  # padded source length (longest source in the batch, EOS included)
        ("tgt_len", pa.int32()),  # padded target length
    ]
)
HYPOTHESES_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("hypothesis", pa.string()),  # detokenised best hypothesis
        ("tokens", pa.list_(pa.int32())),  # its token ids (no EOS)
        ("score", pa.float64()),  # length-penalised log-probability
        ("nbest", pa.list_(pa.string())),  # the n best hypotheses, best first (empty when nbest = 1)
        ("nbest_scores", pa.list_(pa.float64())),
    ]
)
SCHEMAS: dict[str, pa.Schema] = {
    "corpus": CORPUS_SCHEMA,
    "tokens": TOKENS_SCHEMA,
    "batches": BATCHES_SCHEMA,
    "hypotheses": HYPOTHESES_SCHEMA,
}


# --------------------------------------------------------------------------------------------------------------------
# Manifests
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Manifest:
    kind: str
    format_version: int
    mtpipe_version: str = __version__
    params: dict[str, Any] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    upstream: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def file_hash(path: Path, chunk: int = 1 << 22) -> str:
    """``sha256:<hex>`` of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


def read_manifest(directory: Path | str, kind: str | None = None) -> Manifest:
    """Read and validate ``directory/manifest.json``: kind, format version, and that every file it names lies inside
    the artifact (a manifest must never make a stage read or trust a file elsewhere)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.exists():
        raise MtpipeError(f"{directory}: artifact not found (run the stage that makes it first)")
    if not path.exists():
        raise MtpipeError(f"{directory}: not an mtpipe artifact (no {MANIFEST})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        m = Manifest(**data)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        raise MtpipeError(f"{path}: corrupt manifest ({e})") from None
    except OSError as e:
        raise MtpipeError(f"{path}: cannot read ({os_reason(e)})") from None
    if not isinstance(m.kind, str) or not isinstance(m.files, dict) or not isinstance(m.extra, dict):
        raise MtpipeError(f"{path}: corrupt manifest (kind, files or extra has the wrong type)")
    if kind is not None and m.kind != kind:
        raise MtpipeError(f"{directory}: is a '{m.kind}' artifact, expected '{kind}'")
    want = FORMAT_VERSIONS.get(m.kind)
    if want is None:
        raise MtpipeError(f"{path}: unknown artifact kind '{m.kind}'")
    if isinstance(m.format_version, bool) or not isinstance(m.format_version, int):
        raise MtpipeError(f"{path}: format_version must be an integer, got {m.format_version!r}")
    if m.format_version != want:
        raise MtpipeError(
            f"{directory}: '{m.kind}' format version {m.format_version}, this mtpipe ({__version__}) reads version "
            f"{want}; re-run the stage that made it"
        )
    for name in [*m.files, *m.rows]:
        check_member_name(path, name)
    return m


def check_member_name(manifest: Path, name: Any) -> None:
    """Refuse a file name from a manifest that could point outside its artifact: absolute paths, ``..``, empty
    names, backslashes (a Windows separator) and NUL."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        raise MtpipeError(f"{manifest}: lists an invalid file name {name!r}")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or name.startswith("~"):
        raise MtpipeError(f"{manifest}: lists '{name}', which is outside its artifact folder")


def manifest_hash(directory: Path | str) -> str:
    """The lineage hash of an artifact: the hash of its manifest (which holds the hashes of its files)."""
    return file_hash(Path(directory) / MANIFEST)


def verify_file(directory: Path | str, name: str, manifest: Manifest | None = None) -> Path:
    """Path of ``name`` inside an artifact after checking it is listed, lies inside the artifact (symlinks
    included), and its hash matches."""
    directory = Path(directory)
    m = manifest or read_manifest(directory)
    check_member_name(directory / MANIFEST, name)
    path = directory / name
    if name not in m.files:
        raise MtpipeError(f"{directory}: has no '{name}' (it has: {', '.join(sorted(m.files)) or 'nothing'})")
    if not path.exists():
        raise MtpipeError(f"{path}: listed in the manifest but missing")
    if not path.resolve().is_relative_to(directory.resolve()):
        raise MtpipeError(f"{directory / MANIFEST}: lists '{name}', a link to {path.resolve()}, outside its "
                          "artifact folder")
    if file_hash(path) != m.files[name]:
        raise MtpipeError(f"{path}: content does not match its manifest hash (modified or truncated)")
    return path


def _check_schema(path: Path, got: pa.Schema, want: pa.Schema) -> None:
    for f in want:
        idx = got.get_field_index(f.name)
        if idx < 0:
            raise MtpipeError(f"{path}: wrong schema, column '{f.name}' missing (has: {', '.join(got.names)})")
        if not got.field(idx).type.equals(f.type):
            raise MtpipeError(f"{path}: wrong schema, column '{f.name}' is {got.field(idx).type}, expected {f.type}")


def open_parquet(directory: Path | str, name: str, kind: str) -> pq.ParquetFile:
    """A validated ``ParquetFile`` of an artifact, for streaming reads (``iter_batches``)."""
    m = read_manifest(directory, kind)
    path = verify_file(directory, name, m)
    try:
        # pre_buffer=False: the default pre-buffers whole column chunks ahead of iter_batches (250 MB live for a
        # 4.5M-pair tokens file instead of 20 MB, and slower on local disks).
        pf = pq.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as e:
        raise MtpipeError(f"{path}: not a readable Parquet file ({e})") from None
    _check_schema(path, pf.schema_arrow, SCHEMAS[kind])
    return pf


def read_table(directory: Path | str, name: str, kind: str, columns: list[str] | None = None) -> pa.Table:
    """A whole validated Parquet table of an artifact."""
    return open_parquet(directory, name, kind).read(columns=columns)


def splits_of(directory: Path | str, kind: str) -> list[str]:
    """The split names (``train``, ``valid``, ...) with a Parquet file in an artifact."""
    m = read_manifest(directory, kind)
    return sorted(n[: -len(".parquet")] for n in m.files if n.endswith(".parquet"))


# --------------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------------


def os_reason(e: OSError) -> str:
    """An OS error's meaning in a few words: ``No space left on device (ENOSPC)``."""
    if e.errno is None:
        return str(e)
    return f"{os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)})"


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
            replace_dir(self.tmp, self.out)
        except OSError as e:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise MtpipeError(f"{self.out}: cannot write ({os_reason(e)}); nothing was written") from None
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


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


def atomic_write_text(path: Path | str, text: str) -> None:
    """Write a single file atomically (temp file in the same directory, then rename), with the permissions a plain
    ``open`` would give; an OS error becomes one :class:`MtpipeError` line and leaves ``path`` as it was."""
    path = Path(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise MtpipeError(f"{path}: cannot write ({os_reason(e)})") from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------------------


CHECKPOINTS = "checkpoints"
# What `mtpipe train` puts in its run directory; a run directory holding anything else was not made by it.
RUN_ENTRIES = (CHECKPOINTS, "live", "train.json", "train.log")


def checkpoint_path(run_dir: Path | str, step: int) -> Path:
    """Where training writes its checkpoint at ``step``."""
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


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


def list_checkpoints(run_dir: Path | str) -> list[tuple[int, Path]]:
    """``(step, directory)`` of the training checkpoints in ``run_dir/checkpoints``, by the step in their manifests.

    The one rule of what a checkpoint is, for training's resume and clean-up and for averaging: every visible
    directory there is a checkpoint artifact; hidden entries are writes in progress or killed ones, symbolic links
    are aliases, files are ignored, and averaged checkpoints put there are skipped (averaging them again would weight
    the inputs unequally). A directory without a readable checkpoint manifest is an error that names it: mtpipe never
    leaves one, so it is someone else's, and must not be skipped silently nor ever deleted.
    """
    ck_dir = Path(run_dir) / CHECKPOINTS
    if not ck_dir.is_dir():
        return []
    found: dict[int, Path] = {}
    for d in sorted(ck_dir.iterdir()):
        if d.name.startswith(".") or d.is_symlink() or not d.is_dir():
            continue
        if not (d / MANIFEST).is_file():
            raise MtpipeError(f"{d}: not an mtpipe checkpoint (no {MANIFEST}); move it out of {ck_dir}")
        m = read_manifest(d, "checkpoint")
        if "averaged" in m.extra:
            continue
        step = m.extra.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise MtpipeError(f"{d}: checkpoint manifest has no integer 'step' (got {step!r})")
        if step in found:
            raise MtpipeError(f"{ck_dir}: two checkpoints at step {step}: {found[step].name} and {d.name}")
        found[step] = d
    return sorted(found.items())


@dataclass
class Checkpoint:
    """A loaded checkpoint. ``model_config`` rebuilds the model alone (``ModelConfig(**model_config)``)."""

    path: Path
    state_dict: dict[str, Any]
    model_config: dict[str, Any]
    vocab: dict[str, Any]  # {"spm_sha256": ..., "size": ...}
    step: int
    manifest: Manifest
    trainer_state: dict[str, Any] | None = None


def write_checkpoint(out: Path | str, *, state_dict: dict[str, Any], model_config: dict[str, Any],
                     vocab: dict[str, Any], step: int, trainer_state: dict[str, Any] | None = None,
                     params: dict[str, Any] | None = None, upstream: dict[str, Path | str] | None = None,
                     extra: dict[str, Any] | None = None, force: bool = False) -> None:
    """Write a checkpoint directory atomically: ``model.safetensors`` (weights, no pickle) and, for resumable
    training checkpoints, ``trainer.pt`` (optimizer, schedule, RNG, data position; loads with weights_only=True)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    with ArtifactWriter(out, "checkpoint", params, upstream, force=force) as w:
        tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
        meta = {"model_config": json.dumps(model_config, sort_keys=True), "vocab": json.dumps(vocab),
                "step": str(step), "format_version": str(FORMAT_VERSIONS["checkpoint"])}
        try:
            save_file(tensors, str(w.path("model.safetensors")), metadata=meta)
        except SafetensorError as e:  # its I/O errors arrive as text: "... (os error 28)"
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from None
        if trainer_state is not None:
            _torch_save(trainer_state, w.path("trainer.pt"))
        w.extra.update({"model_config": model_config, "vocab": vocab, "step": step, **(extra or {})})


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


def _torch_save(obj: Any, path: Path) -> None:
    import torch

    with open(path, "wb") as f:
        w = _WriteRecorder(f)
        try:
            torch.save(obj, w)  # type: ignore[arg-type]
        except RuntimeError:
            if w.error is not None:
                raise w.error from None
            raise


def load_checkpoint(path: Path | str, *, trainer_state: bool = False, device: str = "cpu") -> Checkpoint:
    """Load and validate a checkpoint directory (no pickle: safetensors, and ``weights_only`` for trainer.pt)."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    m = read_manifest(path, "checkpoint")
    weights = verify_file(path, "model.safetensors", m)
    try:
        state = load_file(str(weights), device=device)
    except (SafetensorError, OSError) as e:
        raise MtpipeError(f"{weights}: not a readable safetensors file ({e})") from None
    ts = None
    if trainer_state:
        tpath = verify_file(path, "trainer.pt", m)
        ts = torch.load(tpath, map_location="cpu", weights_only=True)
    for key in ("model_config", "vocab", "step"):
        if key not in m.extra:
            raise MtpipeError(f"{path}: checkpoint manifest lacks '{key}'")
    return Checkpoint(path=path, state_dict=state, model_config=m.extra["model_config"], vocab=m.extra["vocab"],
                      step=int(m.extra["step"]), manifest=m, trainer_state=ts)


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
