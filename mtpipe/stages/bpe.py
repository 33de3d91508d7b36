"""``mtpipe bpe``: a joint SentencePiece BPE vocabulary (paper section 5.1) and every split encoded to token ids.

The paper encodes WMT14 en-de with byte-pair encoding into a shared source-target vocabulary of about 37000 tokens
(section 5.1) and ties the embedding matrices across the two languages (section 3.4); one joint model trained on both
sides of train is what makes that sharing possible.

* Training: both sides of train, or a random sample of ``bpe.sample_sentences`` of them (seed ``bpe.seed``, drawn
  here so it is reproducible), streamed to SentencePiece, which learns ``bpe.vocab_size`` pieces with
  ``character_coverage`` and ``threads``. ``--spm-model`` skips training and encodes with an existing model (its
  special ids must be mtpipe's); ``bpe.from_model`` (``--from-model CHECKPOINT``) encodes with the SentencePiece
  model a checkpoint carries, so that a corpus to fine-tune that checkpoint on (``train.finetune_from``) has its
  vocabulary by construction; the manifest records the checkpoint (``extra["from_model"]``: path, manifest hash,
  step; ``upstream["checkpoint"]``).
* Special ids, shared with the batches and the model's embedding table (``mtpipe.artifacts``): pad 0, unk 1,
  bos 2, eos 3.
* Output: a ``tokens`` artifact: ``{split}.parquet`` (``id``, ``src`` list<int32>, ``tgt`` list<int32>; EOS is not
  stored, the model and the batching add it), ``spm.model``, ``spm.vocab``; the manifest's ``extra`` records the
  vocabulary size, ``spm_sha256`` (the ``sha256:<hex>`` of ``spm.model``; the train stage stores it in checkpoints to
  detect a vocabulary mismatch), token counts, the unknown-token rate and the share of the vocabulary train uses.
* Encoding is multi-threaded (SentencePiece's batch ``encode`` with ``num_threads``), batch by batch.
* BPE-dropout (``bpe.dropout``, ``bpe.dropout_copies``; Provilkov et al. 2020): train's rows are followed by
  ``dropout_copies`` more encodings of the same pairs, each merge skipped with probability ``dropout``, with ids
  offset by a multiple of (largest id + 1) so every row's id stays distinct (:func:`id_stride`). A regulariser for
  small corpora: the model sees each word split in several ways, and decoding still reads the usual segmentation.
"""

from __future__ import annotations

import io
import itertools
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import pyarrow as pa

from mtpipe import artifacts, console, memory, platform
from mtpipe.artifacts import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIALS,
    TOKENS_SCHEMA,
    UNK_ID,
    file_hash,
    load_spm,
    open_parquet,
    read_manifest,
    splits_of,
)
from mtpipe.config import BpeConfig, to_dict
from mtpipe.errors import MtpipeError
from mtpipe.reading import from_numpy
from mtpipe.writing import ArtifactWriter, prepare_output

ENCODE_ROWS = 32768  # pairs per encode call: enough work per call for every thread, bounded memory


# --------------------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------------------


def training_sentences(corpus: Path, cfg: BpeConfig, counter: list[int], bar: Any = None) -> Iterator[str]:
    """Both sides of train, or a seeded sample of ``cfg.sample_sentences`` of them, streamed from Parquet.

    Sentence ``i < n`` is source row ``i``, sentence ``n + i`` its target. ``counter[0]`` counts what was yielded;
    ``bar`` (a console.progress) shows the pairs read.
    """
    pf = open_parquet(corpus, "train.parquet", "corpus")
    n = pf.metadata.num_rows
    keep_src = keep_tgt = None
    if 2 * n > cfg.sample_sentences:
        pick = np.zeros(2 * n, bool)
        pick[np.random.default_rng(cfg.seed).choice(2 * n, size=cfg.sample_sentences, replace=False)] = True
        keep_src, keep_tgt = pick[:n], pick[n:]
    row = 0
    task = bar.add_task("read BPE training text (pairs)", total=n) if bar is not None else None
    for b in pf.iter_batches(batch_size=65536, columns=["src", "tgt"]):
        k = b.num_rows
        for col, keep in ((b.column(0), keep_src), (b.column(1), keep_tgt)):
            if keep is not None:
                col = col.take(from_numpy(np.flatnonzero(keep[row:row + k])))
            texts = col.to_pylist()
            counter[0] += len(texts)
            yield from texts
        row += k
        if task is not None:
            bar.update(task, completed=row)
    if task is not None:
        # SentencePiece now learns the merges: an open-ended task whose clock keeps ticking meanwhile.
        bar.add_task(f"learn {cfg.vocab_size:,} BPE pieces", total=None)


def train_spm(cfg: BpeConfig, corpus: Path, threads: int) -> tuple[bytes, int]:
    """Train the joint BPE model; returns the model file's bytes and the number of training sentences.

    Sentences are streamed to SentencePiece (no temporary file) and the model comes back in memory, so the model
    file records no paths: the same corpus, params and thread count give a byte-identical ``spm.model`` (SentencePiece
    stores its trainer settings, ``num_threads`` included, in the file).
    """
    import sentencepiece as spm

    counter = [0]
    model = io.BytesIO()
    console.info(f"training SentencePiece BPE: {cfg.vocab_size:,} pieces, {threads} threads")
    t0 = time.perf_counter()
    try:
        with console.progress() as bar:
            spm.SentencePieceTrainer.train(
                sentence_iterator=training_sentences(corpus, cfg, counter, bar),
                model_writer=model,
                model_type="bpe",
                vocab_size=cfg.vocab_size,
                character_coverage=cfg.character_coverage,
                num_threads=threads,
                pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                input_sentence_size=0,  # the sample above is the input: no second sampling inside SentencePiece
                shuffle_input_sentence=False,
                minloglevel=2,  # SentencePiece logs thousands of lines to stderr otherwise
            )
    except RuntimeError as e:
        raise MtpipeError(_explain(str(e), cfg, corpus, counter[0])) from None
    console.info(f"trained on {counter[0]:,} sentences in {time.perf_counter() - t0:.1f}s")
    # The trainer's gigabytes are freed but glibc would keep them resident through the whole encoding (about 4 GB
    # on 9M sentences): hand them back now.
    memory.release_free_heap()
    return model.getvalue(), counter[0]


def _explain(msg: str, cfg: BpeConfig, corpus: Path, n: int) -> str:
    """SentencePiece's training errors as one line a user can act on."""
    where = f"{corpus}/train.parquet"
    if m := re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", msg):
        return (f"bpe.vocab_size={cfg.vocab_size} is larger than the {n:,} training sentences of {where} support: "
                f"they hold at most {int(m[2]):,} distinct pieces; use --vocab-size {m[2]} or less, or more data")
    if m := re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", msg):
        return (f"bpe.vocab_size={cfg.vocab_size} is smaller than the {int(m[2]):,} characters {where} needs at "
                f"character_coverage={cfg.character_coverage}; raise --vocab-size above {m[2]} or lower "
                "--character-coverage")
    first = msg.strip().splitlines()[0] if msg.strip() else "unknown error"
    return f"SentencePiece training on {where} failed: {first}"


def write_vocab(sp: Any, path: Path) -> None:
    """``piece<TAB>score`` per id, the format ``spm_train`` writes."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(sp.get_piece_size()):
            f.write(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n")


# --------------------------------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------------------------------


def flatten(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """SentencePiece's nested id lists as ``(offsets int32 [len + 1], flat ids int32)``.

    ``np.fromiter`` is ~10x faster than ``pa.array`` on nested Python lists, which matters at millions of sentences.
    """
    offsets = np.zeros(len(ids) + 1, np.int32)
    np.cumsum(np.fromiter(map(len, ids), dtype=np.int32, count=len(ids)), out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(offsets[-1]))
    return offsets, flat


def to_arrow(ids: list[list[int]], n_src: int) -> tuple[pa.Array, pa.Array, np.ndarray, np.ndarray]:
    """The ids of ``src + tgt`` (one list, as encoded) split back into list<int32> arrays and each side's flat ids."""
    offsets, flat = flatten(ids)
    cut = int(offsets[n_src])
    src_flat, tgt_flat = flat[:cut], flat[cut:]
    src = pa.ListArray.from_arrays(from_numpy(offsets[: n_src + 1]), from_numpy(src_flat))
    tgt = pa.ListArray.from_arrays(from_numpy(offsets[n_src:] - cut), from_numpy(tgt_flat))
    return src, tgt, src_flat, tgt_flat


class SplitTokens:
    """Token statistics of one split."""

    def __init__(self, vocab: int):
        self.pairs = 0
        self.tokens = {"src": 0, "tgt": 0}
        self.unk = {"src": 0, "tgt": 0}
        self.counts = np.zeros(vocab, np.int64)

    def add(self, side: str, flat: np.ndarray) -> None:
        self.tokens[side] += len(flat)
        self.unk[side] += int(np.count_nonzero(flat == UNK_ID))
        self.counts += np.bincount(flat, minlength=len(self.counts))

    @property
    def unk_rate(self) -> float:
        total = sum(self.tokens.values())
        return sum(self.unk.values()) / total if total else 0.0


def encode_split(sp: Any, corpus: Path, split: str, w: ArtifactWriter, threads: int, bar: Any,
                 cfg: BpeConfig | None = None) -> SplitTokens:
    """Encode one split, batch by batch, into ``{split}.parquet``; for train, then ``cfg.dropout_copies`` more
    encodings with BPE-dropout (:func:`dropout_encodings`).

    SentencePiece's batch ``encode`` runs both sides of a batch on ``threads`` threads and releases the GIL while it
    does; meanwhile one writer thread turns the previous batch into Arrow, counts it and writes it (Parquet writes
    release the GIL too), so that serial work overlaps the encoding instead of adding to it.
    """
    pf = open_parquet(corpus, f"{split}.parquet", "corpus")
    copies = cfg.dropout_copies if cfg is not None and split == "train" else 0
    stats = SplitTokens(sp.get_piece_size())
    task = bar.add_task(f"encode {split} (pairs)", total=pf.metadata.num_rows * (1 + copies))
    writer = w.parquet_writer(f"{split}.parquet")

    def finish(row_ids: pa.Array, ids: list[list[int]], n: int) -> None:
        src, tgt, src_flat, tgt_flat = to_arrow(ids, n)
        stats.add("src", src_flat)
        stats.add("tgt", tgt_flat)
        writer.write_batch(pa.RecordBatch.from_arrays([row_ids, src, tgt], schema=TOKENS_SCHEMA))
        stats.pairs += n
        bar.update(task, advance=n)

    encodings = [lambda texts: sp.encode(texts, out_type=int, num_threads=threads)]
    if copies:
        assert cfg is not None
        encodings += dropout_encodings(sp, cfg)
        stride = id_stride(pf)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="bpe-writer") as pool:
            pending = None
            for copy, encode in enumerate(encodings):
                for b in pf.iter_batches(batch_size=ENCODE_ROWS, columns=["id", "src", "tgt"]):
                    src = b.column(1).to_pylist()
                    ids = encode(src + b.column(2).to_pylist())
                    row_ids = b.column(0) if copy == 0 else pa.array(b.column(0).to_numpy() + copy * stride)
                    if pending is not None:
                        pending.result()  # at most one batch in flight; re-raises the writer's errors here
                    pending = pool.submit(finish, row_ids, ids, len(src))
            if pending is not None:
                pending.result()
    finally:
        writer.close()
    w.rows[f"{split}.parquet"] = stats.pairs
    return stats


def dropout_encodings(sp: Any, cfg: BpeConfig) -> list["DropoutEncoder"]:
    """BPE-dropout (Provilkov et al., ACL 2020): ``cfg.dropout_copies`` encoders, each of which splits a sentence by
    the BPE merges with every merge skipped with probability ``cfg.dropout`` (SentencePiece's sampling mode)."""
    return [DropoutEncoder(sp, cfg.dropout, seed=int(cfg.seed) * 1_000_003 + copy * 10_007)
            for copy in range(1, cfg.dropout_copies + 1)]


class DropoutEncoder:
    """One BPE-dropout copy of train. SentencePiece's generator is reseeded before each call (``seed`` + the call's
    number) and the call runs on one thread, so the samples depend on the seed and the sentences alone (with several
    threads they would depend on the scheduling)."""

    def __init__(self, sp: Any, p: float, seed: int):
        self.sp, self.p, self.seed, self.calls = sp, p, seed, 0

    def __call__(self, texts: list[str]) -> list[list[int]]:
        import sentencepiece as spm

        self.calls += 1
        spm.set_random_generator_seed(self.seed + self.calls)
        return self.sp.encode(texts, out_type=int, enable_sampling=True, alpha=self.p, num_threads=1)


def id_stride(pf: Any) -> int:
    """The ``id`` offset between BPE-dropout copies of train: copy ``k`` of the row with id ``i`` has id
    ``i + k * stride``, so every row of the split keeps a distinct id (the bucket artifact references rows by id)."""
    ids = pf.read(columns=["id"]).column("id").to_numpy()
    return int(ids.max()) + 1 if len(ids) else 1


# --------------------------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------------------------


def tokenize_corpus(cfg: BpeConfig, corpus: Path, out: Path, spm_model: Optional[Path] = None, *,
        force: bool = False) -> dict[str, SplitTokens]:
    """Train (or take ``spm_model``, or the SentencePiece model of the checkpoint ``cfg.from_model``) a joint BPE
    model and encode every split of the ``corpus`` artifact."""
    corpus, out = Path(corpus), Path(out)
    read_manifest(corpus, "corpus")
    prepare_output(out, "tokens", inputs=[corpus, spm_model, cfg.from_model], force=force)
    lineage = None
    if cfg.from_model is not None:
        spm_model, lineage = checkpoint_spm_model(Path(cfg.from_model), spm_model)
    splits = splits_of(corpus, "corpus")
    if spm_model is None and "train" not in splits:
        raise MtpipeError(f"{corpus}: has no train split to learn BPE from (it has: {', '.join(splits)})")
    if spm_model is not None:
        spm_model = Path(spm_model)
        if not spm_model.is_file():
            raise MtpipeError(f"{spm_model}: SentencePiece model not found")
        load_spm(spm_model)  # validate before any work
    threads = platform.threads_per_process(cfg.threads)
    known = ["train", "valid", "test"]
    order = sorted(splits, key=lambda s: (known.index(s) if s in known else len(known), s))
    upstream = {"corpus": corpus, **({"checkpoint": Path(cfg.from_model)} if cfg.from_model is not None else {})}
    with ArtifactWriter(out, "tokens", {"bpe": to_dict(cfg)}, upstream=upstream, force=force) as w:
        if spm_model is None:
            model, n = train_spm(cfg, corpus, threads)
            w.path("spm.model").write_bytes(model)
            facts: dict[str, Any] = {"sample_sentences": n}
        else:
            shutil.copyfile(spm_model, w.path("spm.model"))
            facts = {"spm_model_source": str(spm_model)}
            if lineage is not None:
                facts[artifacts.FROM_MODEL] = lineage
        sp = load_spm(w.path("spm.model"))
        write_vocab(sp, w.path("spm.vocab"))
        stats: dict[str, SplitTokens] = {}
        with console.progress() as bar:
            for split in order:
                stats[split] = encode_split(sp, corpus, split, w, threads, bar, cfg)
        vocab = sp.get_piece_size()
        used = stats["train"].counts if "train" in stats else sum(s.counts for s in stats.values())
        coverage = float(np.count_nonzero(used[len(SPECIALS):])) / max(1, vocab - len(SPECIALS))
        w.extra.update({
            "vocab_size": vocab,
            "spm_sha256": file_hash(w.path("spm.model")),
            "special_ids": SPECIALS,
            "eos_stored": False,
            "train_encodings": 1 + cfg.dropout_copies,  # the usual one, then the BPE-dropout samples
            **facts,
            "pairs": {s: t.pairs for s, t in stats.items()},
            "tokens": {s: t.tokens for s, t in stats.items()},
            "unk_rate": {s: round(t.unk_rate, 8) for s, t in stats.items()},
            "vocab_coverage": round(coverage, 6),
        })
    _summary(stats, vocab, coverage, out)
    if coverage < 0.5 and "train" in stats:
        console.warn(f"only {coverage:.0%} of the {vocab:,} pieces occur in the encoded train split: the vocabulary "
                     "is probably too large for this corpus (SentencePiece pads it with pieces that never occur)")
    return stats


def checkpoint_spm_model(checkpoint: Path, spm_model: Optional[Path]) -> tuple[Path, dict[str, Any]]:
    """``bpe.from_model``: the SentencePiece model checkpoint ``checkpoint`` carries (verified against its vocabulary
    record, :func:`mtpipe.artifacts.checkpoint_spm`) and the lineage record naming the checkpoint."""
    if spm_model is not None:
        raise MtpipeError(f"--spm-model {spm_model} and bpe.from_model {checkpoint}: give one SentencePiece model")
    m = read_manifest(checkpoint, "checkpoint")
    own = artifacts.checkpoint_spm(checkpoint, m)
    if own is None:
        raise MtpipeError(f"{checkpoint}: carries no SentencePiece model (written by an older mtpipe); pass "
                          "--spm-model with the spm.model of the bpe artifact it was trained on")
    return own, artifacts.lineage_record(checkpoint, m)


def _summary(stats: dict[str, SplitTokens], vocab: int, coverage: float, out: Path) -> None:
    splits = list(stats)
    rows: list[list[Any]] = [
        ["pairs", *[stats[s].pairs for s in splits]],
        ["src tokens", *[stats[s].tokens["src"] for s in splits]],
        ["tgt tokens", *[stats[s].tokens["tgt"] for s in splits]],
        ["src tokens / sentence", *[stats[s].tokens["src"] / max(1, stats[s].pairs) for s in splits]],
        ["tgt tokens / sentence", *[stats[s].tokens["tgt"] / max(1, stats[s].pairs) for s in splits]],
        ["unk rate", *[f"{stats[s].unk_rate:.4%}" for s in splits]],
    ]
    console.table(f"bpe: {vocab:,} pieces, {coverage:.1%} of them used by train -> {out}", ["", *splits], rows)
