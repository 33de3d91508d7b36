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

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
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
    """Read and validate ``directory/manifest.json`` (kind and format version)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.exists():
        raise MtpipeError(f"{directory}: artifact not found (run the stage that makes it first)")
    if not path.exists():
        raise MtpipeError(f"{directory}: not an mtpipe artifact (no {MANIFEST})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        m = Manifest(**data)
    except (json.JSONDecodeError, TypeError) as e:
        raise MtpipeError(f"{path}: corrupt manifest ({e})") from None
    if kind is not None and m.kind != kind:
        raise MtpipeError(f"{directory}: is a '{m.kind}' artifact, expected '{kind}'")
    want = FORMAT_VERSIONS.get(m.kind)
    if want is None:
        raise MtpipeError(f"{path}: unknown artifact kind '{m.kind}'")
    if m.format_version != want:
        raise MtpipeError(
            f"{directory}: '{m.kind}' format version {m.format_version}, this mtpipe ({__version__}) reads version "
            f"{want}; re-run the stage that made it"
        )
    return m


def manifest_hash(directory: Path | str) -> str:
    """The lineage hash of an artifact: the hash of its manifest (which holds the hashes of its files)."""
    return file_hash(Path(directory) / MANIFEST)


def verify_file(directory: Path | str, name: str, manifest: Manifest | None = None) -> Path:
    """Path of ``name`` inside an artifact after checking it is listed and its hash matches."""
    directory = Path(directory)
    m = manifest or read_manifest(directory)
    path = directory / name
    if name not in m.files:
        raise MtpipeError(f"{directory}: has no '{name}' (it has: {', '.join(sorted(m.files)) or 'nothing'})")
    if not path.exists():
        raise MtpipeError(f"{path}: listed in the manifest but missing")
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


class ArtifactWriter:
    """Write an artifact directory atomically.

    >>> with ArtifactWriter(out, "corpus", params, upstream={"corpus": src_dir}) as w:
    ...     w.write_table("train.parquet", table)
    ...     w.extra["filters"] = {...}

    Files go to a temporary sibling directory; on success the manifest is written last and the directory renamed
    over ``out``; on any exception the temporary directory is removed and ``out`` is left as it was.
    """

    def __init__(self, out: Path | str, kind: str, params: dict[str, Any] | None = None,
                 upstream: dict[str, Path | str] | None = None):
        self.out = Path(out)
        self.kind = kind
        self.manifest = Manifest(kind=kind, format_version=FORMAT_VERSIONS[kind], params=params or {})
        for name, d in (upstream or {}).items():
            self.manifest.upstream[name] = manifest_hash(d)
        self.rows = self.manifest.rows
        self.extra = self.manifest.extra
        self.tmp: Path | None = None

    def __enter__(self) -> "ArtifactWriter":
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the artifact should get the usual permissions
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
            return
        try:
            for p in sorted(self.tmp.rglob("*")):
                if p.is_file():
                    self.manifest.files[str(p.relative_to(self.tmp))] = file_hash(p)
            text = json.dumps(asdict(self.manifest), indent=2, sort_keys=True, default=str)
            (self.tmp / MANIFEST).write_text(text + "\n", encoding="utf-8")
            replace_dir(self.tmp, self.out)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise


def replace_dir(src: Path, dst: Path) -> None:
    """Move directory ``src`` to ``dst``, replacing ``dst``; the old one is removed only after the swap."""
    old = None
    if dst.exists() or dst.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.rename(dst, old / dst.name)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: Path | str, text: str) -> None:
    """Write a single file atomically (temp file in the same directory, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------------------


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
                     extra: dict[str, Any] | None = None) -> None:
    """Write a checkpoint directory atomically: ``model.safetensors`` (weights, no pickle) and, for resumable
    training checkpoints, ``trainer.pt`` (optimizer, schedule, RNG, data position; loads with weights_only=True)."""
    import torch
    from safetensors.torch import save_file

    with ArtifactWriter(out, "checkpoint", params, upstream) as w:
        tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
        meta = {"model_config": json.dumps(model_config, sort_keys=True), "vocab": json.dumps(vocab),
                "step": str(step), "format_version": str(FORMAT_VERSIONS["checkpoint"])}
        save_file(tensors, str(w.path("model.safetensors")), metadata=meta)
        if trainer_state is not None:
            torch.save(trainer_state, w.path("trainer.pt"))
        w.extra.update({"model_config": model_config, "vocab": vocab, "step": step, **(extra or {})})


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


def iter_rows(pf: pq.ParquetFile, batch_size: int = 65536, columns: list[str] | None = None) -> Iterable[pa.RecordBatch]:
    """Stream record batches of a Parquet file."""
    yield from pf.iter_batches(batch_size=batch_size, columns=columns)


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
