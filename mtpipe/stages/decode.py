"""``mtpipe decode``: translate a bpe split or raw text, as the paper decodes (section 6.1: beam 4, alpha 0.6, maximum
output length input + 50, early termination).

The stage only: resolve the inputs (the model and its vocabulary located and checked, :func:`mtpipe.engine.opening.locate`;
the sources read), translate them with the engine ``decode.engine`` names (:class:`mtpipe.engine.protocol.Engine`:
mtpipe's beam search, :mod:`mtpipe.engine.translate`, or CTranslate2's, :mod:`mtpipe.engine.ct2`), write the
hypotheses, report the totals. The rules -- the length penalty and its score, the maximum output length, when a
sentence stops -- are :class:`mtpipe.engine.search.DecodeRules`.

``decode.processes`` N > 1: a file or a split is shared out among N decoding processes, each with its own copy of
the model and 1/N of the CPU threads (:class:`mtpipe.engine.workers.DecodePool`), as CTranslate2's
``inter_threads`` does.

Text from stdin (``--input -``) is translated as it arrives (:func:`stream_batches`): a line, with whatever else is
already waiting, is translated and its output flushed before more input is read, so typed input and a program that
waits for each answer get it at once; a file or a split is translated in length-sorted batches.

Blank input lines are not decoded: they give blank output lines (so paragraph breaks survive). Sources longer than
the model's ``max_positions`` are truncated (with a warning naming how many and the first id): one output line per
input line matters more for scoring than failing the whole run.

``decode.prune`` runs a LayerDrop-trained model with fewer layers (:func:`mtpipe.engine.pruning.prune_plan`), pruned
on the fly; ``mtpipe average --prune`` writes such a model as a checkpoint instead, which decodes with no flag.

``decode.engine=ctranslate2`` decodes through CTranslate2 with the same inputs, outputs and settings:
``--checkpoint`` is a ``mtpipe export`` directory or a checkpoint (converted to a temporary directory first). Greedy
output is mtpipe's; at beam > 1 CTranslate2 stops a sentence once ``beam x patience`` hypotheses have finished
(fairseq's rule, ``decode.stop=finished``) whatever ``decode.stop`` says, and its own length penalty is |Y|^alpha,
so ``gnmt`` is applied by re-ranking the hypotheses it finished (scores are mtpipe's).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from mtpipe import artifacts, writing
from mtpipe.config import DecodeConfig, to_dict
from mtpipe.engine.opening import BATCHES, LINES, ModelSource, detokenise, encode_lines, locate, warm_up
from mtpipe.engine.protocol import Engine
from mtpipe.engine.search import DecodeRules, Hypothesis, max_source_len
from mtpipe.errors import MtpipeError
from mtpipe.stages.decode_corpus import (
    LineChunks,
    Partial,
    fingerprint,
    line_offset,
    scan_lines,
    shard_range,
    text_lines,
)

INPUT_SPLIT = "input"  # file name ({INPUT_SPLIT}.parquet / .txt) of the output when translating --input text


# --------------------------------------------------------------------------------------------------------------------
# Reading the sources
# --------------------------------------------------------------------------------------------------------------------


def read_lines(path: Path) -> list[str]:
    """Raw text lines of a file or of stdin ('-') read to its end (:func:`text_lines`)."""
    name = "stdin" if str(path) == "-" else str(path)
    if str(path) == "-":
        stream = getattr(sys.stdin, "buffer", None)
        data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
    else:
        if not path.is_file():
            raise MtpipeError(f"{path}: input file not found")
        data = path.read_bytes()
    if not data:
        raise MtpipeError(f"{name}: empty input (no lines to translate)")
    return text_lines(data[:-1] if data.endswith(b"\n") else data, name)


STREAM_GATHER = 1 << 20  # bytes of input already waiting that one streaming batch takes at most
_READ = 1 << 16


def stdin_fd() -> int | None:
    """The file descriptor of stdin, or None when stdin is not a real file (a test runner's buffer)."""
    try:
        return sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def stream_batches(fd: int) -> Iterator[tuple[int, bytes]]:
    """``(number of the first line, whole lines)`` of ``fd`` as they arrive, for translating stdin line by line.

    Each batch blocks only for its first whole line (or the end of the input), then takes what else is already
    there without waiting (up to :data:`STREAM_GATHER` bytes): a line typed at a terminal, or written by a process
    that waits for its translation, is translated at once, while a pipe full of text is still translated in batches.
    """
    import select

    buf, line, eof = bytearray(), 1, False
    while not eof:
        found = b"\n" in buf
        while not eof and not found:
            chunk = os.read(fd, _READ)
            eof, found = not chunk, b"\n" in chunk
            buf += chunk
        while not eof and len(buf) < STREAM_GATHER and select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, _READ)
            eof = not chunk
            buf += chunk
        if eof:
            whole = bytes(buf[:-1] if buf.endswith(b"\n") else buf) if buf else None
            buf = bytearray()
        else:
            cut = buf.rindex(b"\n")
            whole, buf = bytes(buf[:cut]), buf[cut + 1 :]
        if whole is not None:
            yield line, whole
            line += whole.count(b"\n") + 1


@dataclass
class Inputs:
    """What a decode run translates, all checked before any work."""

    ids: list[int]  # the split's ids, or input line numbers
    sources: list[list[int]]  # token ids without EOS, cut to the model's positions
    split: str | None  # None: --input text
    desc: str  # where the sources come from (the log line and the manifest)
    sp: Any  # the SentencePiece model (sentencepiece.SentencePieceProcessor)
    step: int  # the checkpoint's training step
    upstream: dict[str, Path]  # the hypotheses manifest's lineage
    truncated: int  # sources cut to the model's positions
    pruned: dict[str, list[int]] | None  # decode.prune's kept layers


def read_sources(cfg: DecodeConfig, tokens: Path | None, input: Path | None,
                 sp: Any) -> tuple[list[int], list[list[int]], str | None, str]:
    """``(ids, sources, split, description)``: the split ``cfg.split`` of the bpe artifact, or the lines of
    ``input`` ('-' = stdin) encoded with ``sp``."""
    if input is None:
        assert tokens is not None, "a split is read from a bpe artifact"
        available = artifacts.splits_of(tokens, "tokens")
        if cfg.split not in available:
            raise MtpipeError(f"{tokens}: has no split '{cfg.split}' (decode.split; available: "
                              f"{', '.join(available)})")
        t = artifacts.read_table(tokens, f"{cfg.split}.parquet", "tokens", columns=["id", "src"])
        return t.column("id").to_pylist(), t.column("src").to_pylist(), cfg.split, f"{tokens}/{cfg.split}.parquet"
    lines = read_lines(input)
    return list(range(len(lines))), encode_lines(sp, lines), None, "stdin" if str(input) == "-" else str(input)


def fit_sources(sources: list[list[int]], max_positions: int,
                where: Callable[[int], str], quiet: bool = False) -> tuple[list[list[int]], int]:
    """``(sources cut to what the model takes with its EOS, how many were cut)``, with a warning naming the first
    (``where(row)``) unless ``quiet`` (a file's later chunks: their total is reported at the end)."""
    from mtpipe.console import warn

    limit = max_source_len(max_positions)
    long_rows = [i for i, s in enumerate(sources) if len(s) > limit]
    if not long_rows:
        return sources, 0
    if not quiet:
        warn(f"{len(long_rows)} source(s) longer than the model's {limit} tokens (max_positions {max_positions} "
             f"with EOS) truncated, the first {where(long_rows[0])}")
    return [s[:limit] for s in sources], len(long_rows)


# --------------------------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------------------------


def open_engine(cfg: DecodeConfig, source: ModelSource, tokens: Path | None) -> Engine:
    """The engine of a file or a split: ``source``'s, or with ``decode.processes`` > 1 a pool of processes that
    each open it (and prune it by the same plan)."""
    if cfg.processes <= 1:
        return source.open()
    from mtpipe.console import info
    from mtpipe.engine.workers import DecodePool

    info(f"starting {cfg.processes} decoding processes (decode.processes): each loads the model and warms up")
    return DecodePool(cfg, source.checkpoint, tokens, cfg.processes)


def resolve_inputs(cfg: DecodeConfig, checkpoint: Path, tokens: Path | None,
                   input: Path | None) -> tuple[Inputs, Engine]:
    """The model (a checkpoint, or with engine ctranslate2 also an export) and its vocabulary checked, the sources
    read (the split ``cfg.split`` of ``tokens``, by default the project's bpe artifact, or the lines of ``input``),
    the engine opened and the sources cut to its positions."""
    from mtpipe.params import PATHS

    if input is None and tokens is None:
        tokens = Path(PATHS["bpe"])
    source = locate(cfg, checkpoint, tokens)
    ids, sources, split, desc = read_sources(cfg, tokens, input, source.sp)
    engine = open_engine(cfg, source, tokens)
    sources, truncated = fit_sources(sources, engine.max_positions, lambda row: f"with id {ids[row]}")
    pruned = engine.facts(DecodeRules.from_config(cfg))["pruned"]
    return Inputs(ids, sources, split, desc, source.sp, source.step, source.upstream, truncated, pruned), engine


@contextlib.contextmanager
def sentence_bar(total: int, completed: int = 0) -> Iterator[Callable[[int], None]]:
    """A progress bar over ``total`` sentences, ``completed`` of them done before (by an earlier, killed run), with
    this run's sentences per second and the time left; yields ``on_done(n)``, to call as n sentences finish."""
    from rich.progress import TextColumn

    from mtpipe.console import progress

    start = time.perf_counter()
    with progress(TextColumn("{task.fields[rate]}")) as bar:
        task = bar.add_task("decode", total=total, completed=completed, rate="")
        done = 0

        def on_done(n: int) -> None:
            nonlocal done
            done += n
            rate = done / max(time.perf_counter() - start, 1e-9)
            bar.update(task, advance=n, rate=f"{rate:,.1f} sent/s")

        yield on_done


def translate_sources(engine: Engine, sources: list[list[int]],
                      rules: DecodeRules) -> tuple[list[list[Hypothesis]], float]:
    """``(hypotheses, seconds)``: the engine's translations, with a progress bar and its sentences per second."""
    start = time.perf_counter()
    with sentence_bar(len(sources)) as on_done:
        results = engine.translate(sources, rules, on_done=on_done)
    return results, time.perf_counter() - start


@contextlib.contextmanager
def closing(engine: Engine) -> Iterator[None]:
    """Close the engine when its work ends (a pool's processes): at once when it ended in an error or an interrupt
    (a process may be mid-batch), else after the processes finish."""
    try:
        yield
    except BaseException:
        engine.close(wait=0)
        raise
    engine.close()


# --------------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------------


def hypothesis_rows(results: list[list[Hypothesis]], ids: list[int], sp: Any, nbest: int) -> dict[str, list[Any]]:
    """The hypotheses table (:data:`mtpipe.artifacts.HYPOTHESES_SCHEMA`) of the sentences ``ids``, detokenised with
    ``sp``; n-best columns only when ``nbest`` > 1."""
    best = [r[0] for r in results]
    return {
        "id": ids,
        "hypothesis": detokenise(sp, [h.tokens for h in best]),
        "tokens": [h.tokens for h in best],
        "score": [h.score for h in best],
        "nbest": [detokenise(sp, [h.tokens for h in r]) if nbest > 1 else [] for r in results],
        "nbest_scores": [[h.score for h in r] if nbest > 1 else [] for r in results],
    }


def rows_table(rows: dict[str, list[Any]]) -> Any:
    """:func:`hypothesis_rows` as a ``pyarrow.Table`` of the hypotheses schema."""
    import pyarrow as pa

    return pa.table(rows, schema=artifacts.HYPOTHESES_SCHEMA)


def write_hypotheses(out: Path, tables: Iterable[Any], inputs: Inputs, cfg: DecodeConfig, checkpoint: Path,
                     device: str, *, force: bool = False, extra: dict[str, Any] | None = None) -> None:
    """The ``hypotheses`` artifact: ``{split}.parquet`` and ``{split}.txt`` (``input.*`` for raw text), from
    ``tables`` (:func:`rows_table`) in order, one Parquet row group each: a file translated in chunks streams
    through, one chunk in memory at a time (one table is written as ``pyarrow.parquet.write_table`` writes it)."""
    name = inputs.split if inputs.split is not None else INPUT_SPLIT
    with writing.ArtifactWriter(out, "hypotheses", {"decode": to_dict(cfg)}, upstream=inputs.upstream,
                                force=force) as w:
        rows = 0
        with w.parquet_writer(f"{name}.parquet") as parquet, \
                open(w.path(f"{name}.txt"), "w", encoding="utf-8") as text:
            for table in tables:
                parquet.write_table(table)
                text.write("".join(s + "\n" for s in table.column("hypothesis").to_pylist()))
                rows += table.num_rows
        w.rows[f"{name}.parquet"] = rows
        w.extra.update(extra or {})
        w.extra.update({
            "split": inputs.split,
            "input": None if inputs.split is not None else inputs.desc,
            "checkpoint": str(checkpoint),
            "checkpoint_step": inputs.step,
            "decode": to_dict(cfg),
            "device": device,
            "truncated_sources": inputs.truncated,
            "pruned": inputs.pruned,
        })


def write_lines(lines: list[str], stdout: Any = None) -> None:
    """Translations to stdout, one line each, flushed: a reader waiting for them gets them at once. ``stdout``: the
    stream taken before a progress bar started, which on a terminal puts its own in ``sys.stdout`` (rich's
    redirection prints there to the console, stderr), else ``sys.stdout``."""
    stream = stdout if stdout is not None else sys.stdout
    stream.write("".join(s + "\n" for s in lines))
    stream.flush()


def log_start(what: str, checkpoint: Path, step: int, engine: Engine, cfg: DecodeConfig, rules: DecodeRules) -> None:
    from mtpipe.console import info

    info(f"{what} with {checkpoint} (step {step:,}) on {engine.describe()}, beam {cfg.beam}, {cfg.length_penalty} "
         f"alpha {cfg.alpha}, {engine.settings(rules)}")
    if (note := engine.note(rules)) is not None:
        info(note)


@dataclass
class Totals:
    """What the summary table reports."""

    sentences: int = 0
    out_tokens: int = 0  # best hypotheses' tokens, with their EOS
    score: float = 0.0  # sum of the best hypotheses' scores
    seconds: float = 0.0
    build: float = 0.0  # decode.compile's warm-up before the timed decoding
    resumed: int = 0  # sentences an earlier, killed run translated (decode.chunk_lines' finished chunks)

    def add(self, results: list[list[Hypothesis]], seconds: float) -> None:
        self.sentences += len(results)
        self.out_tokens += sum(len(r[0].tokens) + 1 for r in results)
        self.score += sum(r[0].score for r in results)
        self.seconds += seconds


# --------------------------------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------------------------------


def warm_stdin(engine: Engine, sp: Any, rules: DecodeRules) -> None:
    """decode.compile: the compiled step built before the first line is read, not while it waits
    (:func:`mtpipe.engine.opening.warm_up` for stdin's lines)."""
    from mtpipe.console import info

    if (seconds := warm_up(engine, rules, LINES, sp=sp)) is not None:
        info(f"compiled step built in {seconds:.0f} s (decode.compile); reading stdin")


def translate_stream(cfg: DecodeConfig, rules: DecodeRules, checkpoint: Path, tokens: Path | None, fd: int,
                     keep: bool) -> tuple[Inputs, list[list[Hypothesis]], Totals, str]:
    """Translate the lines of ``fd`` (stdin) as they arrive (:func:`stream_batches`), each batch written to stdout
    and flushed before the next is read. Returns ``(inputs, hypotheses, totals, device)``; the sources and
    hypotheses only when ``keep`` (for ``--out``), else empty lists (a long session does not grow)."""
    from mtpipe.console import info

    source = locate(cfg, checkpoint, tokens)
    engine = source.open(lone_graph=True)  # lines come one at a time (decode.compile: a lone sentence's own graph)
    log_start("translating stdin as lines arrive", checkpoint, source.step, engine, cfg, rules)
    if cfg.processes > 1:
        info(f"decode.processes={cfg.processes} applies to a file or a split: stdin is translated in this process")
    warm_stdin(engine, source.sp, rules)
    sources: list[list[int]] = []
    results: list[list[Hypothesis]] = []
    totals, truncated = Totals(), 0
    for first, data in stream_batches(fd):
        batch, cut = fit_sources(encode_lines(source.sp, text_lines(data, "stdin", first)),
                                 engine.max_positions, lambda row: f"on stdin line {first + row}")
        start = time.perf_counter()
        hyps = engine.translate(batch, rules)
        totals.add(hyps, time.perf_counter() - start)
        write_lines(detokenise(source.sp, [r[0].tokens for r in hyps]))
        truncated += cut
        if keep:
            sources += batch
            results += hyps
    if totals.sentences == 0:
        raise MtpipeError("stdin: empty input (no lines to translate)")
    inputs = Inputs(list(range(len(sources))), sources, None, "stdin", source.sp, source.step, source.upstream,
                    truncated, engine.facts(rules)["pruned"])
    return inputs, results, totals, engine.describe()


def translate_file(cfg: DecodeConfig, rules: DecodeRules, checkpoint: Path, tokens: Path | None,
                   input: Path | None) -> tuple[Inputs, dict[str, list[Any]], Totals, str]:
    """Translate a split or a file in length-sorted batches: ``(inputs, hypothesis rows, totals, device)``."""
    inputs, engine = resolve_inputs(cfg, checkpoint, tokens, input)
    totals = Totals()
    with closing(engine):  # decode.processes: the processes end with the decoding
        log_start(f"decoding {len(inputs.sources):,} sentences of {inputs.desc}", checkpoint, inputs.step,
                  engine, cfg, rules)
        # decode.compile: building is not part of the decoding seconds
        totals.build = warm_up(engine, rules, BATCHES, sources=inputs.sources) or 0.0
        results, seconds = translate_sources(engine, inputs.sources, rules)
    totals.add(results, seconds)
    return inputs, hypothesis_rows(results, inputs.ids, inputs.sp, cfg.nbest), totals, engine.describe()


def resume_chunks(partial: Partial | None, n_chunks: int) -> list[dict[str, Any]]:
    """The chunks an earlier, killed run of the same command finished (:meth:`Partial.open`), their translations
    written to stdout again, as an uninterrupted run writes them there."""
    from mtpipe.console import info

    done = partial.open() if partial is not None else []
    if partial is not None and done:
        info(f"resuming after chunk {len(done):,} of {n_chunks:,}: {sum(c['rows'] for c in done):,} lines "
             f"translated by an earlier run ({partial.dir})")
        for table in partial.tables():
            write_lines(table.column("hypothesis").to_pylist())
    return done


def translate_chunks(engine: Engine, reader: LineChunks, rules: DecodeRules, cfg: DecodeConfig, sp: Any,
                     partial: Partial | None, keep: bool, totals: Totals, truncated: int,
                     total: int) -> tuple[list[Any], int]:
    """Translate ``reader``'s chunks one at a time, each kept in ``partial`` (or, ``keep``, returned) and written
    to stdout as it finishes, with a progress bar over the ``total`` lines (``totals.resumed`` of them done before):
    ``(the chunks' tables when keep, the sources truncated in all, from ``truncated`` resumed)``."""
    from mtpipe.console import info

    warned, kept = truncated, []  # warned: the truncations a warning told of (one warning, the first chunk's)
    stdout = sys.stdout  # not the bar's redirection (write_lines)

    def encoded() -> Iterator[tuple[int, list[list[int]], int]]:
        nonlocal warned
        for line, lines in reader:
            sources, cut = fit_sources(encode_lines(sp, lines), engine.max_positions,
                                       lambda row: f"with id {line + row}", quiet=warned > 0)
            del lines
            warned = warned or cut
            yield line, sources, cut
            del sources  # before the next chunk is read

    chunks = encoded()
    head = next(chunks, None)
    if head is not None:  # decode.compile: built before the timed decoding
        totals.build = warm_up(engine, rules, BATCHES, sources=head[1]) or 0.0

    def in_order() -> Iterator[tuple[int, list[list[int]], int]]:
        nonlocal head
        if head is not None:
            item, head = head, None
            yield item
            del item
        yield from chunks

    with sentence_bar(total, completed=totals.resumed) as on_done:
        for line, sources, cut in in_order():
            start = time.perf_counter()
            results = engine.translate(sources, rules, on_done=on_done)
            totals.add(results, time.perf_counter() - start)
            rows = hypothesis_rows(results, list(range(line, line + len(sources))), sp, cfg.nbest)
            del results, sources
            truncated += cut
            if partial is not None:
                partial.save(rows_table(rows), cut, reader.offset)
            elif keep:
                kept.append(rows_table(rows))
            write_lines(rows["hypothesis"], stdout)
            del rows
    if truncated > warned:
        info(f"{truncated:,} source(s) truncated in all (the warning above named the first chunk's)")
    return kept, truncated


def translate_corpus(cfg: DecodeConfig, rules: DecodeRules, source: ModelSource, open_engine: Callable[[], Engine],
                     input: Path, out: Path | None, checkpoint: Path, *, force: bool = False) -> Totals:
    """Translate the text file ``input`` (``decode.shard``'s part of it) chunk by chunk
    (:mod:`mtpipe.stages.decode_corpus` tells how, and what a rerun of a killed run does): each chunk's
    translations to stdout as it finishes, and with ``out`` the hypotheses artifact ``input.*`` at the end. Returns
    the totals of what this run translated."""
    size = cfg.chunk_lines
    total = scan_lines(input)
    part = cfg.shard_part()
    first, end = shard_range(part, total)
    n_chunks = -(-(end - first) // size)
    engine = open_engine()
    totals = Totals()
    with closing(engine):  # decode.processes: the processes end with the decoding
        device, pruned = engine.describe(), engine.facts(rules)["pruned"]
        where = (f" (shard {part[0]}/{part[1]}: lines {first:,} to {end - 1:,} of {total:,}, counted from 0)"
                 if part else "")
        chunked = f", in {n_chunks:,} chunks of {size:,} lines" if n_chunks > 1 else ""
        log_start(f"decoding {end - first:,} sentences of {input}{where}{chunked}", checkpoint, source.step, engine,
                  cfg, rules)
        partial = Partial(out, fingerprint(cfg, source, input)) if out is not None and n_chunks > 1 else None
        done = resume_chunks(partial, n_chunks)
        totals.resumed = sum(c["rows"] for c in done)
        reader = LineChunks(input, first + totals.resumed, end, size,
                            done[-1]["end_offset"] if done else line_offset(input, first))
        kept, truncated = translate_chunks(engine, reader, rules, cfg, source.sp, partial, out is not None, totals,
                                           sum(c["truncated"] for c in done), end - first)
    if out is not None:
        inputs = Inputs([], [], None, str(input), source.sp, source.step, source.upstream, truncated, pruned)
        extra = ({"shard": {"part": part[0], "of": part[1], "first_line": first, "lines": end - first,
                            "input_lines": total}} if part else {})
        write_hypotheses(out, partial.tables() if partial is not None else kept, inputs, cfg, checkpoint, device,
                         force=force, extra=extra)
        if partial is not None:
            partial.remove()
    return totals


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def summary(cfg: DecodeConfig, totals: Totals, out: Path | None, from_stdin: bool) -> None:
    """The summary table (stderr)."""
    from mtpipe.console import table
    from mtpipe.engine.workers import worker_threads

    n, seconds = totals.sentences, totals.seconds
    table("decode", ["", "value"], [
        ["engine", cfg.engine],
        ["sentences", n],
        ["output tokens (with EOS)", totals.out_tokens],
        ["seconds", round(seconds, 2)],
        ["sentences/s", n / max(seconds, 1e-9)],
        ["tokens/s", totals.out_tokens / max(seconds, 1e-9)],
        ["mean score", totals.score / max(n, 1)],
        *([["processes x threads", f"{cfg.processes} x {worker_threads(cfg, cfg.processes)}"]]
          if not from_stdin and cfg.processes > 1 else []),
        ["written to", str(out) if out is not None else "stdout"],
        *([["resumed (translated by an earlier run)", totals.resumed]] if totals.resumed else []),
        *([["compile seconds (before decoding)", round(totals.build, 2)]] if totals.build else []),
    ])


def translate_inputs(cfg: DecodeConfig, checkpoint: Path, tokens: Path | None = None, input: Path | None = None,
        out: Path | None = None, *, force: bool = False, stats: bool | None = None) -> None:
    """Translate a split of the bpe artifact (``cfg.split``) or raw text (``input``; '-' = stdin).

    The translations go to stdout, one line per sentence in id order; with ``out`` also a ``hypotheses`` artifact
    (``{split}.parquet`` / ``{split}.txt``, or ``input.*`` for raw text) is written there. All checks run before any
    output is written. Stdin is translated as its lines arrive (:func:`translate_stream`), a file in chunks of
    length-sorted batches (:func:`translate_corpus`: decode.chunk_lines, decode.shard,
    resuming a killed run), a split in length-sorted batches. ``stats``: print the summary table (None: unless the
    input is stdin or stdout a terminal, where it would interleave with the translations).
    """
    rules = DecodeRules.from_config(cfg)  # decode's rules across keys hold already (DecodeConfig.check)
    from_stdin = input is not None and str(input) == "-"
    if cfg.shard and (input is None or from_stdin):
        raise MtpipeError(f"decode.shard: '{cfg.shard}' applies to --input FILE; a split or stdin is translated whole")
    if out is not None:
        writing.prepare_output(out, "hypotheses", inputs=[checkpoint, tokens, input], force=force)
    fd = stdin_fd() if from_stdin else None
    if fd is not None:
        inputs, results, totals, device = translate_stream(cfg, rules, checkpoint, tokens, fd, keep=out is not None)
        if out is not None:
            write_hypotheses(out, [rows_table(hypothesis_rows(results, inputs.ids, inputs.sp, cfg.nbest))], inputs,
                             cfg, checkpoint, device, force=force)
    elif input is not None and not from_stdin:
        source = locate(cfg, checkpoint, tokens)
        totals = translate_corpus(cfg, rules, source, lambda: open_engine(cfg, source, tokens), input, out,
                                  checkpoint, force=force)
    else:
        inputs, rows, totals, device = translate_file(cfg, rules, checkpoint, tokens, input)
        if out is not None:
            write_hypotheses(out, [rows_table(rows)], inputs, cfg, checkpoint, device, force=force)
        write_lines(rows["hypothesis"])
    # The table would land between translations a user reads at a terminal, or after a stdin session ends.
    if stats if stats is not None else not from_stdin and not _isatty(sys.stdout):
        summary(cfg, totals, out, from_stdin)


__all__ = ["INPUT_SPLIT", "Inputs", "Totals", "closing", "fit_sources", "hypothesis_rows", "log_start",
           "open_engine", "read_lines", "read_sources", "resolve_inputs", "resume_chunks", "rows_table",
           "sentence_bar", "stdin_fd", "stream_batches", "summary", "text_lines", "translate_chunks",
           "translate_corpus", "translate_file", "translate_inputs", "translate_sources", "translate_stream",
           "warm_stdin", "write_hypotheses", "write_lines"]
