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
lies inside the artifact, each file's hash, and each Parquet file's schema.

| kind        | files                                   | schema                                                     |
|-------------|-----------------------------------------|------------------------------------------------------------|
| corpus      | {train,valid,test}.parquet              | id int64, src string, tgt string                            |
| tokens      | {split}.parquet, spm.model, spm.vocab   | id int64, src list<int32>, tgt list<int32> (EOS not stored) |
| batches     | {train,valid}.parquet                   | batch int64, ids list<int64>, src_tokens, tgt_tokens, ... |
|             | train.arrow (Arrow IPC, uncompressed)   | batch int64, ids list<int64>, src/tgt list<list<int32>>     |
| checkpoint  | model.safetensors [, trainer.pt, spm.*] | safetensors weights; trainer.pt loads with weights_only     |
| hypotheses  | {split}.parquet, {split}.txt            | id int64, hypothesis string, score float64, nbest ...       |
| export      | model.bin, config.json, *vocabulary.json, spm.model (CTranslate2) or Marian files | extra: format |

Checkpoint format 2 (format 1 is still read): the checkpoint may carry the SentencePiece model it was trained with,
``spm.model`` (and the bpe artifact's ``spm.vocab`` listing), named by ``extra["spm_model"]`` (``extra["spm_vocab"]``),
so that it decodes away from the bpe artifact (:func:`checkpoint_spm` validates it against ``extra["vocab"]``);
``extra["decode"]`` may record the decode settings it was trained with (the params.yaml ``decode`` keys of
:data:`mtpipe.config.RECORDED_DECODE`), which ``decode`` and ``serve`` use where neither params.yaml nor a flag sets
them.

Lineage of a fine-tune (an addition: the checkpoint format stays 2, an older mtpipe ignores it): a checkpoint of a
run started from another checkpoint's weights (``train.finetune_from``) records that parent in
``extra["finetuned_from"]`` = ``{"path": as given, "sha256": the parent's manifest hash, "step": its step}``, and an
average of such checkpoints carries it on; a bpe artifact encoded with a checkpoint's SentencePiece model
(``bpe.from_model``) records that checkpoint alike in ``extra["from_model"]`` (and its manifest hash under
``upstream["checkpoint"]``). :func:`read_lineage` validates either record.

Batches ``train.arrow``: the train batches again, with their sentences' token ids, one row per batch in the order of
``train.parquet``, as an uncompressed Arrow IPC file (:data:`BATCH_TOKENS_SCHEMA`, record batches of whole batches)
that training memory-maps (:func:`open_ipc`): the processes of a node share one copy through the page cache instead
of each reading the tokens artifact into its memory. An addition, so the batches format stays 1: an older mtpipe
ignores the file, and an artifact without it (an older mtpipe's) still trains, from the Parquet files. Such large
files are hashed once: :func:`verify_file` with ``remember`` records a successful check under
``$MTPIPE_CACHE_DIR/verified``, keyed by the file's real path, size, mtime, ctime and inode and its manifest hash, and
later reads compare that key only; a changed key (the file was written, touched or replaced) means hashing it again.

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

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mtpipe import __version__, env
from mtpipe.atomic import atomic_write_text
from mtpipe.errors import MtpipeError, os_reason

MANIFEST = "manifest.json"

# Bump a kind's version whenever its files change incompatibly; readers refuse other versions (but those of
# OLDER_READABLE).
FORMAT_VERSIONS: dict[str, int] = {
    "corpus": 1,
    "tokens": 1,
    "batches": 1,
    "checkpoint": 2,  # 2: may carry spm.model / spm.vocab and the decode settings (see the module docstring)
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
# The batches artifact's train.arrow: the train batches with their sentences (in the order of the batch's ``ids``),
# one row per batch, batches in train.parquet's order; an uncompressed Arrow IPC file whose record batches hold whole
# batches, written by the bucket stage and memory-mapped by training (mtpipe.training.batches.map_train).
TRAIN_ARROW = "train.arrow"
BATCH_TOKENS_SCHEMA = pa.schema(
    [
        ("batch", pa.int64()),
        ("ids", pa.list_(pa.int64())),  # as in train.parquet
        ("src", pa.list_(pa.list_(pa.int32()))),  # every sentence's token ids (EOS not stored), as in the tokens split
        ("tgt", pa.list_(pa.list_(pa.int32()))),
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
    if m.format_version != want and m.format_version not in OLDER_READABLE.get(m.kind, ()):
        readable = (*OLDER_READABLE.get(m.kind, ()), want)
        raise MtpipeError(
            f"{directory}: '{m.kind}' format version {m.format_version}, this mtpipe ({__version__}) reads version"
            f"{'s' if len(readable) > 1 else ''} {', '.join(map(str, readable))}; re-run the stage that made it"
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


def verify_file(directory: Path | str, name: str, manifest: Manifest | None = None, *,
                remember: bool = False) -> Path:
    """Path of ``name`` inside an artifact after checking it is listed, lies inside the artifact (symlinks
    included), and its hash matches.

    ``remember``: for large files read at every start (training's ``train.arrow``): the hash is checked only when no
    verification record of the file matches its current stat key (:func:`verified_before`), and a successful check
    is recorded (:func:`remember_verified`)."""
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
    if remember and verified_before(path, m.files[name]):
        return path
    before = _stat_key(path) if remember else None
    if file_hash(path) != m.files[name]:
        raise MtpipeError(f"{path}: content does not match its manifest hash (modified or truncated)")
    if before is not None:
        remember_verified(path, m.files[name], before)
    return path


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


def open_ipc(directory: Path | str, name: str, schema: pa.Schema, manifest: Manifest | None = None) -> MappedIpc:
    """A validated, memory-mapped Arrow IPC file of an artifact: its hash checked once and remembered
    (``verify_file(remember=True)``), its schema checked. Its record batches (:meth:`MappedIpc.batch`) are views of
    the mapped file: no copy, and the page cache holds one copy for every process that maps it."""
    directory = Path(directory)
    m = manifest or read_manifest(directory)
    path = verify_file(directory, name, m, remember=True)
    try:
        mm = pa.memory_map(str(path), "r")
        whole = mm.read_buffer(mm.size())  # zero-copy: the mapping itself, for MappedIpc.batch's check
        mm.seek(0)
        reader = pa.ipc.open_file(mm)
    except (pa.ArrowInvalid, OSError) as e:
        raise MtpipeError(f"{path}: not a readable Arrow IPC file ({e})") from None
    _check_schema(path, reader.schema, schema)
    return MappedIpc(path, reader, (whole.address, whole.address + whole.size))


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
# The lineage records (read_lineage): a checkpoint's parent (train.finetune_from), a bpe artifact's checkpoint
# (bpe.from_model).
FINETUNED_FROM, FROM_MODEL = "finetuned_from", "from_model"
# train.stop_metric -> (the valid/* curve it reads, whether higher is better). Training records that curve's value at
# a checkpoint's step in its manifest (``extra["valid"]``), and ``mtpipe average --select best`` ranks checkpoints by it.
STOP_METRICS = {"valid_ppl": ("valid/ppl", False), "valid_bleu": ("valid/bleu", True)}


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


def checkpoint_spm(path: Path | str, m: Manifest) -> Path | None:
    """The SentencePiece model checkpoint ``path`` carries, after checking that its manifest lists it, its hash, and
    that it is the model the checkpoint's ``vocab`` record names; None for a checkpoint without one (format 1, or
    written without it)."""
    path = Path(path)
    name = m.extra.get("spm_model")
    if name is None:
        return None
    if name != CHECKPOINT_SPM or m.format_version < 2:
        raise MtpipeError(f"{path / MANIFEST}: extra.spm_model = {name!r} in a format {m.format_version} checkpoint; "
                          f"expected '{CHECKPOINT_SPM}' in format 2 or later")
    spm = verify_file(path, name, m)
    vocab = m.extra.get("vocab") if isinstance(m.extra.get("vocab"), dict) else {}
    if bare_sha(m.files[name]) != bare_sha(vocab.get("spm_sha256")):
        raise MtpipeError(f"{spm}: is not the SentencePiece model of the checkpoint's vocabulary (vocab.spm_sha256 "
                          f"{bare_sha(vocab.get('spm_sha256'))[:12]}..., the file {bare_sha(m.files[name])[:12]}...)")
    return spm


def lineage_record(path: Path | str, m: Manifest) -> dict[str, Any]:
    """The lineage record naming the checkpoint ``path`` (manifest ``m``): its path as given, its manifest's hash
    (which holds the hashes of its weights) and its step (the module docstring)."""
    return {"path": str(path), "sha256": manifest_hash(path), "step": m.extra.get("step")}


def read_lineage(path: Path | str, m: Manifest, key: str) -> dict[str, Any] | None:
    """The lineage record ``extra[key]`` of an artifact (``finetuned_from`` of a checkpoint, ``from_model`` of a bpe
    artifact; the module docstring), validated: None when absent, an error naming the manifest when malformed."""
    record = m.extra.get(key)
    if record is None:
        return None
    if (not isinstance(record, dict) or not isinstance(record.get("path"), str)
            or not str(record.get("sha256", "")).startswith("sha256:")
            or not (record.get("step") is None or type(record.get("step")) is int)):
        raise MtpipeError(f"{Path(path) / MANIFEST}: extra.{key} = {record!r} is not a lineage record (path, "
                          "sha256:<manifest hash>, step)")
    return {"path": record["path"], "sha256": record["sha256"], "step": record.get("step")}


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
    spm: Path | None = None  # the SentencePiece model it carries (checkpoint_spm), or None


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
    for key in ("model_config", "vocab", "step"):
        if key not in m.extra:
            raise MtpipeError(f"{path}: checkpoint manifest lacks '{key}'")
    return Checkpoint(path=path, state_dict=state, model_config=m.extra["model_config"], vocab=m.extra["vocab"],
                      step=int(m.extra["step"]), manifest=m, trainer_state=ts, spm=checkpoint_spm(path, m))


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
