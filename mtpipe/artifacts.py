"""Artifact formats: every file a stage writes or reads is defined, versioned and validated here.

An *artifact* is a directory holding data files and a ``manifest.json``::

    {"kind": "tokens", "format_version": 1, "mtpipe_version": "0.1.0",
     "params": {...the params sections that made it...},
     "rows": {"train.parquet": 29000, ...},
     "files": {"train.parquet": "sha256:...", ...},
     "upstream": {"corpus": "sha256:<hash of the upstream manifest.json>"},
     "extra": {...kind-specific facts...}}

Artifacts are written atomically (:mod:`mtpipe.writing`): everything goes to a hidden temporary sibling directory, the
manifest last, and the directory is renamed into place only when the stage succeeded. A killed stage leaves no
directory that looks valid. Readers (here) check the manifest's kind and format version, that every file it names
lies inside the artifact, each file's hash, and each Parquet file's schema. Importing this module loads no pyarrow
(imported at first use): :mod:`mtpipe.params` reads checkpoint manifests with it at a command's start-up.

| kind        | files                                   | schema                                                     |
|-------------|-----------------------------------------|------------------------------------------------------------|
| corpus      | {train,valid,test}.parquet              | id int64, src string, tgt string                            |
| tokens      | {split}.parquet, spm.model, spm.vocab   | id int64, src list<int32>, tgt list<int32> (EOS not stored) |
| batches     | {train,valid}.parquet                   | batch int64, ids list<int64>, src_tokens, tgt_tokens, ... |
|             | train.arrow (Arrow IPC, uncompressed)   | batch int64, ids list<int64>, src/tgt list<list<int32>>     |
| checkpoint  | model.safetensors [, trainer.pt, spm.*] | safetensors weights; trainer.pt loads with weights_only     |
| hypotheses  | {split}.parquet, {split}.txt            | id int64, hypothesis string, score float64, nbest ...       |
| export      | model.bin, config.json, *vocabulary.json, spm.model (CTranslate2) or Marian files | extra: format |

A checkpoint's ``extra`` holds the fields of one typed, versioned schema, :class:`CheckpointManifest`: training,
``mtpipe import`` and ``mtpipe average`` build one and :func:`mtpipe.writing.write_checkpoint` writes it (validated
first: :meth:`~CheckpointManifest.to_extra`); every reader reads it through :meth:`~CheckpointManifest.from_extra`
(:func:`checkpoint_fields`, a :class:`Checkpoint`'s ``meta``; :meth:`~CheckpointManifest.of_artifact` for an export
too), each field's type checked, the first wrong or missing one named with the file in one line. A field added later
is an addition with a default (the format stays 2); a newer mtpipe's keys are kept in ``others`` and written back as
they are. An average is its newest input's manifest with the averaging's fields set
(:meth:`~CheckpointManifest.for_average`): every other field is carried, but those measured on that input's weights
(:data:`OF_ITS_WEIGHTS`: ``valid``). Format 2 (format 1 is still read): the checkpoint may carry the SentencePiece
model it was trained with, ``spm.model`` (and the bpe artifact's ``spm.vocab`` listing), named by
``extra["spm_model"]`` (``extra["spm_vocab"]``), so that it decodes away from the bpe artifact (:func:`checkpoint_spm`
validates it against ``extra["vocab"]``); ``extra["decode"]`` may record the decode settings it was trained with (the
params.yaml ``decode`` keys of :data:`mtpipe.config.RECORDED_DECODE`), which ``decode`` and ``serve`` use where
neither params.yaml nor a flag sets them.

Lineage of a fine-tune (an addition: the checkpoint format stays 2, an older mtpipe ignores it): a checkpoint of a
run started from another checkpoint's weights (``train.finetune_from``) records that parent in
``extra["finetuned_from"]`` = ``{"path": as given, "sha256": the parent's manifest hash, "step": its step}``, and an
average of such checkpoints carries it on; a bpe artifact encoded with a checkpoint's SentencePiece model
(``bpe.from_model``) records that checkpoint alike in ``extra["from_model"]`` (and its manifest hash under
``upstream["checkpoint"]``). :func:`check_lineage` validates either record.

Batches ``train.arrow``: the train batches again, with their sentences' token ids, one row per batch in the order of
``train.parquet``, as an uncompressed Arrow IPC file (:data:`BATCH_TOKENS_SCHEMA`, record batches of whole batches)
that training memory-maps and hashes once (:func:`mtpipe.reading.open_ipc`): the processes of a node share one copy
through the page cache instead of each reading the tokens artifact into its memory. An addition, so the batches format
stays 1: an older mtpipe ignores the file, and an artifact without it (an older mtpipe's) still trains, from the
Parquet files.

Hypotheses contract (written by ``decode``, read by ``score``): ``manifest.extra["split"]`` names the split that was
translated; the rows are in ``{split}.parquet`` (and ``{split}.txt``, one detokenised line per row in ``id`` order).
When decode translated a split of the bpe artifact, ``split`` is that corpus split's name (``"test"``) and each row's
``id`` is the row ``id`` of the same sentence in the tokens artifact and in the fetch (corpus) artifact it was encoded
from, so ``score`` pairs hypotheses with references by id and row order never matters. When decode translated raw
text (``--input``), ``extra["split"]`` is ``null``, the artifact holds exactly one ``*.parquet`` file and ``id`` is the
0-based input line number; ``score`` then pairs rows in id order with the reference lines.

Partial hypotheses (``decode --input FILE --out OUT`` in more than one chunk, ``decode.chunk_lines``): the finished
chunks wait in the hidden sibling ``.OUT.partial`` (:func:`partial_dir`) until the artifact is assembled from them and
they are removed: ``chunk-NNNNNN.parquet`` (the hypotheses schema, one file per chunk, written under a temporary name
and renamed) and :data:`PARTIAL_PROGRESS` (format :data:`PARTIAL_FORMAT`): what made them (the decode settings, the
model's manifest hashes, the input's size, mtime and a hash of its first and last bytes) and each finished chunk's
file, rows, hash, truncated sources and the input's byte offset after it. A rerun of the same command continues after
the last finished chunk; a rerun with anything of that different starts over. mtpipe removes only these names there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

from mtpipe import __version__
from mtpipe.errors import MtpipeError, os_reason

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

MANIFEST = "manifest.json"

# Bump a kind's version whenever its files change incompatibly; readers refuse other versions (but those of
# OLDER_READABLE).
FORMAT_VERSIONS: dict[str, int] = {
    "corpus": 1,
    "tokens": 1,
    "batches": 1,
    "checkpoint": 2,  # 2: may carry spm.model / spm.vocab and the decode settings (CheckpointManifest)
    "hypotheses": 1,
    "export": 1,  # mtpipe export: a CTranslate2 or Hugging Face Marian model directory (mtpipe/stages/export.py)
    "attention": 1,  # mtpipe attention: heatmap PNGs, index.html, attention.npz / .json (mtpipe/stages/attention.py)
    "plots": 1,  # mtpipe plots: training-curve PNGs and index.html (mtpipe/stages/plots.py)
}

# Earlier versions a reader still accepts: a format-1 checkpoint is a format-2 one without spm.model.
OLDER_READABLE: dict[str, tuple[int, ...]] = {"checkpoint": (1,)}

# decode's finished chunks of a file (the module docstring): the progress record in partial_dir(out), its format.
PARTIAL_PROGRESS, PARTIAL_FORMAT = "progress.json", 1


def partial_dir(out: Path | str) -> Path:
    """Where ``decode`` keeps the finished chunks of the hypotheses artifact ``out`` (the module docstring)."""
    out = Path(out)
    return out.parent / f".{out.name}.partial"


# Special token ids shared by the SentencePiece model, the batches and the Transformer's embedding table.
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
TRAIN_ARROW = "train.arrow"  # the batches artifact's train batches with their sentences (BATCH_TOKENS_SCHEMA)


@functools.cache
def _schemas() -> dict[str, Any]:
    """The data files' Arrow schemas by name, and SCHEMAS, each kind's Parquet schema: read as module attributes
    (``artifacts.TOKENS_SCHEMA``, :func:`__getattr__`), built at the first (pyarrow costs a start-up ~0.2 s)."""
    import pyarrow as pa

    corpus = pa.schema([("id", pa.int64()), ("src", pa.string()), ("tgt", pa.string())])
    tokens = pa.schema([("id", pa.int64()), ("src", pa.list_(pa.int32())), ("tgt", pa.list_(pa.int32()))])
    batches = pa.schema([
        ("batch", pa.int64()),
        # values of the tokens split's `id` column (corpus line indices; NOT row positions: fetch drops train
        # lines), sorted by length inside the batch
        ("ids", pa.list_(pa.int64())),
        ("src_tokens", pa.int64()),  # real (non-pad) source tokens, EOS included
        ("tgt_tokens", pa.int64()),  # real target tokens, EOS included (= tokens the loss is computed on)
        ("src_len", pa.int32()),  # padded source length (longest source in the batch, EOS included)
        ("tgt_len", pa.int32()),  # padded target length
    ])
    hypotheses = pa.schema([
        ("id", pa.int64()),
        ("hypothesis", pa.string()),  # detokenised best hypothesis
        ("tokens", pa.list_(pa.int32())),  # its token ids (no EOS)
        ("score", pa.float64()),  # length-penalised log-probability
        ("nbest", pa.list_(pa.string())),  # the n best hypotheses, best first (empty when nbest = 1)
        ("nbest_scores", pa.list_(pa.float64())),
    ])
    # The batches artifact's train.arrow (TRAIN_ARROW): the train batches with their sentences (in the order of the
    # batch's ``ids``), one row per batch, batches in train.parquet's order; an uncompressed Arrow IPC file whose
    # record batches hold whole batches, written by the bucket stage and memory-mapped by training.
    batch_tokens = pa.schema([
        ("batch", pa.int64()),
        ("ids", pa.list_(pa.int64())),  # as in train.parquet
        ("src", pa.list_(pa.list_(pa.int32()))),  # every sentence's token ids (EOS not stored), as in the tokens split
        ("tgt", pa.list_(pa.list_(pa.int32()))),
    ])
    return {"CORPUS_SCHEMA": corpus, "TOKENS_SCHEMA": tokens, "BATCHES_SCHEMA": batches,
            "HYPOTHESES_SCHEMA": hypotheses, "BATCH_TOKENS_SCHEMA": batch_tokens,
            "SCHEMAS": {"corpus": corpus, "tokens": tokens, "batches": batches, "hypotheses": hypotheses}}


def __getattr__(name: str) -> Any:
    """The schemas of :func:`_schemas` as module attributes, built at the first lookup (PEP 562)."""
    if name.endswith(("_SCHEMA", "SCHEMAS")) and name in _schemas():
        return _schemas()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    import hashlib

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
    if m.format_version != want and m.format_version not in OLDER_READABLE.get(m.kind, ()):
        readable = (*OLDER_READABLE.get(m.kind, ()), want)
        raise MtpipeError(
            f"{directory}: '{m.kind}' format version {m.format_version}, this mtpipe ({__version__}) reads version"
            f"{'s' if len(readable) > 1 else ''} {', '.join(map(str, readable))}; re-run the stage that made it"
        )
    for name in [*m.files, *m.rows]:
        check_member_name(path, name)
    if m.kind == "checkpoint":
        CheckpointManifest.from_extra(m.extra, path, m.format_version)
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


def member_path(directory: Path | str, name: str, manifest: Manifest) -> Path:
    """Path of ``name`` inside an artifact after checking it is listed and present and lies inside the artifact
    (symlinks included); its hash is :func:`verify_file`'s."""
    directory = Path(directory)
    check_member_name(directory / MANIFEST, name)
    path = directory / name
    if name not in manifest.files:
        raise MtpipeError(f"{directory}: has no '{name}' (it has: {', '.join(sorted(manifest.files)) or 'nothing'})")
    if not path.exists():
        raise MtpipeError(f"{path}: listed in the manifest but missing")
    if not path.resolve().is_relative_to(directory.resolve()):
        raise MtpipeError(f"{directory / MANIFEST}: lists '{name}', a link to {path.resolve()}, outside its "
                          "artifact folder")
    return path


def verify_file(directory: Path | str, name: str, manifest: Manifest | None = None) -> Path:
    """Path of ``name`` inside an artifact after checking it is listed, lies inside the artifact (symlinks
    included), and its hash matches (a large file read at every start: :func:`mtpipe.reading.verify_remembered`)."""
    m = manifest or read_manifest(directory)
    path = member_path(directory, name, m)
    if file_hash(path) != m.files[name]:
        raise MtpipeError(f"{path}: content does not match its manifest hash (modified or truncated)")
    return path


def check_schema(path: Path, got: pa.Schema, want: pa.Schema) -> None:
    """That a file's schema has every column of ``want``, each of its type (more columns are allowed)."""
    for f in want:
        idx = got.get_field_index(f.name)
        if idx < 0:
            raise MtpipeError(f"{path}: wrong schema, column '{f.name}' missing (has: {', '.join(got.names)})")
        if not got.field(idx).type.equals(f.type):
            raise MtpipeError(f"{path}: wrong schema, column '{f.name}' is {got.field(idx).type}, expected {f.type}")


def open_parquet(directory: Path | str, name: str, kind: str) -> pq.ParquetFile:
    """A validated ``ParquetFile`` of an artifact, for streaming reads (``iter_batches``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    m = read_manifest(directory, kind)
    path = verify_file(directory, name, m)
    try:
        # pre_buffer=False: the default pre-buffers whole column chunks ahead of iter_batches (250 MB live for a
        # 4.5M-pair tokens file instead of 20 MB, and slower on local disks).
        pf = pq.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as e:
        raise MtpipeError(f"{path}: not a readable Parquet file ({e})") from None
    check_schema(path, pf.schema_arrow, _schemas()["SCHEMAS"][kind])
    return pf


def read_table(directory: Path | str, name: str, kind: str, columns: list[str] | None = None) -> pa.Table:
    """A whole validated Parquet table of an artifact."""
    return open_parquet(directory, name, kind).read(columns=columns)


def splits_of(directory: Path | str, kind: str) -> list[str]:
    """The split names (``train``, ``valid``, ...) with a Parquet file in an artifact."""
    m = read_manifest(directory, kind)
    return sorted(n[: -len(".parquet")] for n in m.files if n.endswith(".parquet"))


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------------------------


CHECKPOINTS = "checkpoints"
# What `mtpipe train` puts in its run directory; a run directory holding anything else was not made by it.
# ("plots": `mtpipe plots` draws the run's curves there by default; "clock.json": each checkpoint's training time.)
RUN_ENTRIES = (CHECKPOINTS, "live", "train.json", "train.log", "best.json", "clock.json", "plots")
# A checkpoint directory: the weights (safetensors, with the model config in its metadata) and, for a resumable
# training checkpoint, the trainer state (optimizer, schedule, RNG, data position; torch.load with weights_only).
WEIGHTS, TRAINER_STATE = "model.safetensors", "trainer.pt"
# The SentencePiece model a checkpoint carries (format 2), and the bpe artifact's listing of its pieces.
CHECKPOINT_SPM, CHECKPOINT_SPM_VOCAB = "spm.model", "spm.vocab"
# The lineage records (check_lineage): a checkpoint's parent (train.finetune_from), a bpe artifact's checkpoint
# (bpe.from_model).
FINETUNED_FROM, FROM_MODEL = "finetuned_from", "from_model"
# train.stop_metric -> (the valid/* curve it reads, whether higher is better). Training records that curve's value at
# a checkpoint's step in its manifest (``extra["valid"]``), and ``mtpipe average --select best`` ranks checkpoints by it.
STOP_METRICS = {"valid_ppl": ("valid/ppl", False), "valid_bleu": ("valid/bleu", True)}
# A field whose value describes the checkpoint's own weights (a validation measured on them): an average of
# checkpoints has other weights, so it does not carry such a field (CheckpointManifest.for_average).
OF_ITS_WEIGHTS = {"of_its_weights": True}
# The keys of ``vocab`` and their types: the SentencePiece model's ``sha256:<hex>`` and its number of pieces.
VOCAB_KEYS = {"spm_sha256": str, "size": int}


@dataclass(frozen=True)
class CheckpointManifest:
    """The fields a checkpoint's manifest records in ``extra`` (the module docstring; format 1: the same but
    spm_model / spm_vocab); None: not recorded (the key is absent from the file)."""

    model_config: dict[str, Any]  # the ModelConfig that rebuilds the model alone (ModelConfig(**model_config))
    vocab: dict[str, Any]  # the SentencePiece model it was trained with: VOCAB_KEYS
    step: int  # the update it was written at (an average: its newest input's; an import: 0)
    spm_model: Literal["spm.model"] | None = None  # the SentencePiece model it carries (mtpipe.writing sets it)
    spm_vocab: Literal["spm.vocab"] | None = None  # ... and that model's listing of pieces
    decode: dict[str, Any] | None = None  # the decode settings it was trained with (config.RECORDED_DECODE)
    finetuned_from: dict[str, Any] | None = None  # the parent of a fine-tune: a lineage record (check_lineage)
    epoch: int | None = None  # training: epochs completed
    world_size: int | None = None  # training: processes
    precision: str | None = None  # training: train.precision as resolved
    train_batches: str | None = None  # training: the identity of the train batches (a resume compares it)
    valid: dict[str, float] | None = field(default=None, metadata=OF_ITS_WEIGHTS)  # validation at its step
    imported_from: dict[str, Any] | None = None  # mtpipe import: the foreign checkpoint and its settings
    averaged: list[dict[str, Any]] | None = None  # mtpipe average: its inputs (path, step, manifest sha256)
    pruned: dict[str, Any] | None = None  # average.prune: the spec and the layers kept
    others: dict[str, Any] = field(default_factory=dict)  # keys of a newer mtpipe, carried as they are

    @classmethod
    def from_extra(cls, extra: Any, where: Any,
                   format_version: int = FORMAT_VERSIONS["checkpoint"]) -> CheckpointManifest:
        """The fields of a checkpoint manifest's ``extra`` (of ``format_version``), validated; ``where``: the
        manifest's path, named in the one-line error about the first missing or wrongly typed field."""
        if not isinstance(extra, dict):
            raise MtpipeError(f"{where}: checkpoint manifest's extra must be a mapping, got {type(extra).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "others"}
        for name, f in known.items():
            if name not in extra and f.default is dataclasses.MISSING:
                raise MtpipeError(f"{where}: checkpoint manifest lacks extra.{name}")
        meta = cls(**{k: v for k, v in extra.items() if k in known},
                   others={k: v for k, v in extra.items() if k not in known})
        meta.validate(where)
        if format_version < 2 and meta.spm_model is not None:
            raise MtpipeError(f"{where}: extra.spm_model in a format {format_version} checkpoint (format 2 or "
                              "later carries one)")
        return meta

    @classmethod
    def of_artifact(cls, kind: Any, extra: Any, where: Any,
                    format_version: int = FORMAT_VERSIONS["checkpoint"]) -> CheckpointManifest:
        """The checkpoint fields of a model artifact's manifest (its ``kind``, ``extra`` and format version): a
        checkpoint's own (:meth:`from_extra`), or those an export records of the checkpoint it was made from
        (``checkpoint_step``, ``model_config``, ``vocab`` and ``decode``:
        :func:`mtpipe.engine.ct2_convert.export_extra`)."""
        if kind == "checkpoint":
            return cls.from_extra(extra, where, format_version)
        if kind != "export":
            raise MtpipeError(f"{where}: is a '{kind}' manifest, not a checkpoint's or an export's")
        if not isinstance(extra, dict) or "checkpoint_step" not in extra:
            raise MtpipeError(f"{where}: export manifest lacks extra.checkpoint_step")
        record = {k: extra[k] for k in ("model_config", "vocab", "decode") if k in extra}
        return cls.from_extra({**record, "step": extra["checkpoint_step"]}, where)

    def validate(self, where: Any) -> None:
        """Every field has its type (an error naming ``where`` and the first field that has not)."""
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _has_type(value, hints[f.name]):
                shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
                raise MtpipeError(f"{where}: extra.{f.name} = {shown}, expected {f.type}")
        for key, tp in VOCAB_KEYS.items():
            if key in self.vocab and not _has_type(self.vocab[key], tp):
                raise MtpipeError(f"{where}: extra.vocab.{key} = {self.vocab[key]!r}, expected {tp.__name__}")
        if self.finetuned_from is not None:
            check_lineage(where, "finetuned_from", self.finetuned_from)
        clash = sorted(set(self.others) & {f.name for f in dataclasses.fields(self) if f.name != "others"})
        if clash:
            raise MtpipeError(f"{where}: extra.{clash[0]} given twice (as a field and in others)")

    def to_extra(self) -> dict[str, Any]:
        """The manifest's ``extra``: every recorded field (None ones left out) and ``others``, as JSON values."""
        extra = dict(self.others)
        extra.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                      if f.name != "others" and getattr(self, f.name) is not None})
        return extra

    def for_average(self, **own: Any) -> CheckpointManifest:
        """The manifest of an average whose newest input this is: every field carried, but those that describe
        this checkpoint's weights alone (:data:`OF_ITS_WEIGHTS`), and ``own``, the averaging's fields, set."""
        dropped = {f.name: None for f in dataclasses.fields(self) if f.metadata.get("of_its_weights")}
        return dataclasses.replace(self, **{**dropped, **own})


def check_lineage(where: Any, key: str, record: Any) -> dict[str, Any]:
    """A lineage record (``{"path": as given, "sha256": the manifest hash, "step": its step or None}``: a
    checkpoint's ``finetuned_from``, a bpe artifact's ``from_model``), validated; an error naming ``where``
    (the manifest) and ``key`` when malformed."""
    if (not isinstance(record, dict) or not isinstance(record.get("path"), str)
            or not str(record.get("sha256", "")).startswith("sha256:")
            or not (record.get("step") is None or type(record.get("step")) is int)):
        raise MtpipeError(f"{where}: extra.{key} = {record!r} is not a lineage record (path, sha256:<manifest hash>, "
                          "step)")
    return {"path": record["path"], "sha256": record["sha256"], "step": record.get("step")}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _has_type(value: Any, tp: Any) -> bool:
    """Whether the JSON value ``value`` has the annotated type ``tp`` (a bool is no number)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in args)
    if origin is Literal:
        return value in args
    if tp is type(None):
        return value is None
    if tp in (int, float):
        return isinstance(value, (int, float) if tp is float else int) and not isinstance(value, bool)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and _has_type(v, args[1]) for k, v in value.items())
    if origin is list:
        return isinstance(value, list) and all(_has_type(v, args[0]) for v in value)
    return isinstance(value, tp)


def checkpoint_path(run_dir: Path | str, step: int) -> Path:
    """Where training writes its checkpoint at ``step``."""
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


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
        meta = checkpoint_fields(d)
        if meta.averaged is not None:
            continue
        step = meta.step
        if step in found:
            raise MtpipeError(f"{ck_dir}: two checkpoints at step {step}: {found[step].name} and {d.name}")
        found[step] = d
    return sorted(found.items())


# The special ids of every SentencePiece model mtpipe reads: the ids the batches and the embedding table use.
SPECIALS = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}


def load_spm(path: Path | str) -> Any:
    """A SentencePiece processor, after checking that its special ids are mtpipe's (:data:`SPECIALS`): one with
    other ids would map the batches' pads and sentence marks to ordinary pieces without any error."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise MtpipeError(f"{path}: not a SentencePiece model ({str(e).splitlines()[0] if str(e) else e})") from None
    got = {"pad": sp.pad_id(), "unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id()}
    if got != SPECIALS:
        raise MtpipeError(
            f"{path}: special ids {got} differ from mtpipe's {SPECIALS}; train it with --pad_id=0 --unk_id=1 "
            "--bos_id=2 --eos_id=3 (or let `mtpipe bpe` train one)"
        )
    return sp


def bare_sha(value: Any) -> str:
    """A sha256 as bare lowercase hex (manifests write ``sha256:<hex>``)."""
    text = str(value).strip().lower()
    return text.split(":", 1)[1] if text.startswith("sha256:") else text


def checkpoint_fields(path: Path | str, m: Manifest | None = None) -> CheckpointManifest:
    """The checkpoint fields of ``path``'s manifest (``m``, read when not given), validated: the one way to read
    them (:class:`CheckpointManifest`)."""
    m = m or read_manifest(path, "checkpoint")
    return CheckpointManifest.from_extra(m.extra, Path(path) / MANIFEST, m.format_version)


def checkpoint_spm(path: Path | str, m: Manifest) -> Path | None:
    """The SentencePiece model checkpoint ``path`` carries, after checking that its manifest lists it, its hash, and
    that it is the model the checkpoint's ``vocab`` record names; None for a checkpoint without one (format 1, or
    written without it)."""
    path = Path(path)
    meta = checkpoint_fields(path, m)
    name, vocab = meta.spm_model, meta.vocab
    if name is None:
        return None
    spm = verify_file(path, name, m)
    if bare_sha(m.files[name]) != bare_sha(vocab.get("spm_sha256")):
        raise MtpipeError(f"{spm}: is not the SentencePiece model of the checkpoint's vocabulary (vocab.spm_sha256 "
                          f"{bare_sha(vocab.get('spm_sha256'))[:12]}..., the file {bare_sha(m.files[name])[:12]}...)")
    return spm


def lineage_record(path: Path | str, m: Manifest) -> dict[str, Any]:
    """The lineage record naming the checkpoint ``path`` (manifest ``m``): its path as given, its manifest's hash
    (which holds the hashes of its weights) and its step (the module docstring)."""
    return {"path": str(path), "sha256": manifest_hash(path), "step": checkpoint_fields(path, m).step}


@dataclass
class Checkpoint:
    """A loaded checkpoint. ``model_config`` rebuilds the model alone (``ModelConfig(**model_config)``)."""

    path: Path
    state_dict: dict[str, Any]
    manifest: Manifest
    meta: CheckpointManifest  # the manifest's checkpoint fields, validated
    trainer_state: dict[str, Any] | None = None
    spm: Path | None = None  # the SentencePiece model it carries (checkpoint_spm), or None

    model_config = property(lambda self: self.meta.model_config)
    vocab = property(lambda self: self.meta.vocab)  # {"spm_sha256": ..., "size": ...}
    step = property(lambda self: self.meta.step)


def load_checkpoint(path: Path | str, *, trainer_state: bool = False, device: str = "cpu") -> Checkpoint:
    """Load and validate a checkpoint directory (no pickle: safetensors, and ``weights_only`` for trainer.pt)."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    m = read_manifest(path, "checkpoint")
    weights = verify_file(path, WEIGHTS, m)
    try:
        state = load_file(str(weights), device=device)
    except (SafetensorError, OSError) as e:
        raise MtpipeError(f"{weights}: not a readable safetensors file ({e})") from None
    ts = None
    if trainer_state:
        tpath = verify_file(path, TRAINER_STATE, m)
        ts = torch.load(tpath, map_location="cpu", weights_only=True)
    return Checkpoint(path=path, state_dict=state, manifest=m, meta=checkpoint_fields(path, m), trainer_state=ts,
                      spm=checkpoint_spm(path, m))

