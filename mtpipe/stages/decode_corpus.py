"""``mtpipe decode --input FILE``'s file side: a text file of any size read in chunks, so that memory is bounded by
``decode.chunk_lines`` and not by the file; ``decode.shard`` i/n's part of it; the finished chunks a killed run
leaves, which a rerun of the same command resumes after. The loop is :func:`mtpipe.stages.decode.translate_corpus`.

Why: back-translation and distillation translate corpora of tens of millions of lines. Read whole, such a file needs
all of its sentences, token ids and hypotheses in memory at once, nothing is written before the end, and a killed run
starts again from zero.

* Before any work, one streaming pass over the file's bytes (:func:`scan_lines`) counts its lines (the progress bar's
  total, a shard's range) and checks that they are UTF-8 (an error names the first bad line): a bad line stops the
  run before any output, as when the file was read whole.
* Each chunk of ``chunk_lines`` lines (:class:`LineChunks`) is encoded, translated in length-sorted batches (the
  engine sorts within the chunk: tens of thousands of lines fill batches of equal lengths about as well as the whole
  file would) and its translations written in input order before the next chunk is read.
* ``decode.shard`` "i/n": the lines ``[i * N // n, (i + 1) * N // n)`` of the file's N lines (part i counted from 0,
  as fairseq's ``--shard-id``), reached by another streaming pass (:func:`line_offset`). The rows' ids are the lines'
  numbers in the whole file, so the n parts' outputs concatenated in order are the unsharded output.
* With ``--out`` and more than one chunk, each finished chunk is kept in a partial area beside the output
  (:class:`Partial`; its format is :func:`mtpipe.artifacts.partial_dir`'s); at the end the artifact is assembled
  from the chunks (one in memory at a time) and written atomically as every artifact is, and the chunks removed. A
  rerun of the same command (the settings, the model and the input unchanged: :func:`fingerprint`) writes the
  finished chunks' translations to stdout again and continues after them, so that its output is byte-identical to an
  uninterrupted run's: what a kill loses is the chunk being translated. A rerun with anything else different says
  what in one line and starts over.
* Without ``--out`` each chunk's translations go to stdout as it finishes and nothing is kept: a rerun starts over.
* A file of one chunk (at most ``chunk_lines`` lines) is translated and written as before: no partial area.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

from mtpipe import __version__, artifacts
from mtpipe.atomic import atomic_write_text
from mtpipe.config import DecodeConfig, to_dict
from mtpipe.engine.opening import ModelSource, clean_line
from mtpipe.errors import MtpipeError, os_reason

NL = b"\n"
SCAN_BLOCK = 1 << 22  # bytes read at a time by the streaming passes over a file
ENDS = 1 << 20  # bytes at each end of the input hashed into a partial area's fingerprint
# decode settings that cannot change a translation of --input, left out of a partial area's fingerprint
NOT_FINGERPRINTED = ("package_cache", "package_cache_gb", "split")
PARTIAL_KIND = "decode-partial"
CHUNK_NAME = re.compile(r"chunk-\d{6,}\.parquet")
TEMP_NAME = re.compile(r"\.(chunk-\d{6,}\.parquet|" + re.escape(artifacts.PARTIAL_PROGRESS) + r")\.tmp-\d+.*")


# --------------------------------------------------------------------------------------------------------------------
# Reading a file in chunks
# --------------------------------------------------------------------------------------------------------------------


def utf8_text(data: bytes, name: str, first: int = 1) -> str:
    """``data`` as text; bytes that are not UTF-8 are an error naming their line (counting from ``first``)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MtpipeError(f"{name}: line {first + data.count(NL, 0, e.start)} is not valid UTF-8") from None


def text_lines(data: bytes, name: str, first: int = 1) -> list[str]:
    """Whole lines (``data`` without the newline that ends the last one) as text: UTF-8 (:func:`utf8_text`),
    NFC-normalised and stripped as ``fetch`` cleans text (a trailing ``\\r`` included).

    Lines are split on ``\\n`` only, so the output has one line per input line.
    """
    return [clean_line(line) for line in utf8_text(data, name, first).split("\n")]


def scan_lines(path: Path) -> int:
    """The number of lines of a text file, as :func:`mtpipe.stages.decode.read_lines` splits it (on ``\\n``; the
    one that ends the last line starts no other), each checked to be UTF-8: one streaming pass over its bytes,
    holding a block and the line it cuts, never the file."""
    if not path.is_file():
        raise MtpipeError(f"{path}: input file not found")
    lines, size, carry = 0, 0, b""
    with open(path, "rb") as f:
        while block := f.read(SCAN_BLOCK):
            size += len(block)
            data = carry + block
            cut = data.rfind(NL) + 1
            utf8_text(data[:cut], str(path), lines + 1)
            lines += data.count(NL, 0, cut)
            carry = data[cut:]
    if size == 0:
        raise MtpipeError(f"{path}: empty input (no lines to translate)")
    utf8_text(carry, str(path), lines + 1)
    return lines + (1 if carry else 0)


def line_offset(path: Path, line: int) -> int:
    """The byte offset where line ``line`` (0-based) of ``path`` starts: a streaming pass over its bytes."""
    pos, seen = 0, 0
    with open(path, "rb") as f:
        while seen < line and (block := f.read(SCAN_BLOCK)):
            n = block.count(NL)
            if seen + n < line:
                seen, pos = seen + n, pos + len(block)
                continue
            at = -1
            for _ in range(line - seen):
                at = block.index(NL, at + 1)
            return pos + at + 1
    return pos


def shard_range(part: tuple[int, int] | None, lines: int) -> tuple[int, int]:
    """``(first, end)``: the lines of part ``(i, n)`` (decode.shard) of ``lines`` lines, or all of them."""
    if part is None:
        return 0, lines
    i, n = part
    return i * lines // n, (i + 1) * lines // n


class LineChunks:
    """The lines ``[first, end)`` of a text file, from byte ``offset`` (where line ``first`` starts), ``size`` at a
    time, cleaned as :func:`mtpipe.stages.decode.text_lines` cleans them: one chunk read at a time, handed out and
    not kept. ``offset``: where the next chunk starts; ``held``: the most lines it has read at once."""

    def __init__(self, path: Path, first: int, end: int, size: int, offset: int):
        self.path, self.first, self.end, self.size, self.offset = path, first, end, size, offset
        self.held = 0

    def __iter__(self) -> Iterator[tuple[int, list[str]]]:
        """``(the chunk's first line, 0-based; its lines)``."""
        line = self.first
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            while line < self.end:
                raw = list(islice(f, min(self.size, self.end - line)))
                if not raw:
                    raise MtpipeError(f"{self.path}: changed while it was read (line {line + 1} is gone)")
                self.held = max(self.held, len(raw))
                data = b"".join(raw)
                first, line = line, line + len(raw)
                del raw
                self.offset += len(data)
                yield first, text_lines(data[:-1] if data.endswith(NL) else data, str(self.path), first + 1)


# --------------------------------------------------------------------------------------------------------------------
# The partial area: finished chunks kept for a rerun
# --------------------------------------------------------------------------------------------------------------------


def _ends_hash(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(ENDS))
        if size > ENDS:
            f.seek(max(size - ENDS, ENDS))
            h.update(f.read(ENDS))
    return h.hexdigest()


def fingerprint(cfg: DecodeConfig, source: ModelSource, input: Path) -> dict[str, Any]:
    """What a finished chunk's translations depend on: the decode settings (but :data:`NOT_FINGERPRINTED`), the
    model and vocabulary (their manifests' hashes), the input (size, mtime and its first and last bytes' hash) and
    mtpipe's version. A partial area is reused only when all of it is equal."""
    st = input.stat()
    model = {name: artifacts.manifest_hash(p) if (Path(p) / artifacts.MANIFEST).is_file() else str(p)
             for name, p in sorted(source.upstream.items())}
    fp = {"settings": {k: v for k, v in to_dict(cfg).items() if k not in NOT_FINGERPRINTED}, "model": model,
          "input": {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ends_sha256": _ends_hash(input, st.st_size)},
          "mtpipe": __version__}
    return json.loads(json.dumps(fp, sort_keys=True, default=str))  # as it reads back from the progress record


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, in words."""
    if not isinstance(old, dict):
        return ["format"]
    why = [f"decode.{k}" for k in sorted(set(old.get("settings") or {}) | set(new["settings"]))
           if (old.get("settings") or {}).get(k) != new["settings"].get(k)]
    names = {"model": "model", "input": "input file", "mtpipe": "mtpipe version"}
    return why + [words for key, words in names.items() if old.get(key) != new[key]]


class Partial:
    """The finished chunks of a hypotheses artifact ``out`` in the making (:func:`mtpipe.artifacts.partial_dir`):
    ``chunk-NNNNNN.parquet`` each and the progress record (:data:`mtpipe.artifacts.PARTIAL_PROGRESS`). Only these
    names are ever written or removed there."""

    def __init__(self, out: Path, fp: dict[str, Any]):
        self.dir = artifacts.partial_dir(out)
        self.fp = fp
        self.chunks: list[dict[str, Any]] = []  # the finished chunks' records, in order

    def open(self) -> list[dict[str, Any]]:
        """The finished chunks an earlier run of the same fingerprint left (the longest run of intact ones), else
        none (an earlier run's of another fingerprint removed, saying why in one line); the area made ready."""
        from mtpipe.console import info

        d = self.dir
        try:
            if d.is_symlink() or (d.exists() and not d.is_dir()):
                raise MtpipeError(f"{d}: is not a directory of mtpipe's partial output; remove it or choose another "
                                  "--out")
            record = self._read() if d.is_dir() else None
            if d.is_dir() and record is None and any(not TEMP_NAME.fullmatch(e.name) for e in d.iterdir()):
                raise MtpipeError(f"{d}: holds files and no readable {artifacts.PARTIAL_PROGRESS} of mtpipe's; remove "
                                  "it or choose another --out")
            self._remove_temporaries()
            if record is not None:
                why = _differences(record.get("fingerprint"), self.fp)
                kept = self._intact(record.get("chunks") or []) if not why else []
                stale = [c for c in record.get("chunks") or [] if c not in kept]
                if why and stale:
                    info(f"{d}: {len(stale):,} chunk(s) an earlier run finished are not reused ({', '.join(why)} "
                         "differ); starting over")
                elif stale:
                    info(f"{d}: chunk {len(kept):,} and after are not intact; translating them again")
                for c in stale:
                    self._unlink(c.get("file"))
                self.chunks = kept
            d.mkdir(parents=True, exist_ok=True)
            self._write()
        except OSError as e:
            raise MtpipeError(f"{d}: cannot write ({os_reason(e)})") from None
        return self.chunks

    def _read(self) -> dict[str, Any] | None:
        try:
            record = json.loads((self.dir / artifacts.PARTIAL_PROGRESS).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("kind") != PARTIAL_KIND:
            return None
        if record.get("format_version") != artifacts.PARTIAL_FORMAT:
            record["fingerprint"] = None  # another format: not reused
        return record

    def _intact(self, chunks: list[Any]) -> list[dict[str, Any]]:
        """The leading chunks whose files are there with the hash their record names."""
        kept = []
        for k, c in enumerate(chunks):
            ok = (isinstance(c, dict) and c.get("file") == self.name(k) and (self.dir / c["file"]).is_file()
                  and artifacts.bare_sha(artifacts.file_hash(self.dir / c["file"])) == artifacts.bare_sha(
                      c.get("sha256")))
            if not ok:
                break
            kept.append(c)
        return kept

    @staticmethod
    def name(k: int) -> str:
        return f"chunk-{k:06d}.parquet"

    def _unlink(self, name: Any) -> None:
        if isinstance(name, str) and CHUNK_NAME.fullmatch(name):
            (self.dir / name).unlink(missing_ok=True)

    def _remove_temporaries(self) -> None:
        if self.dir.is_dir():
            for e in self.dir.iterdir():
                if TEMP_NAME.fullmatch(e.name) and e.is_file():
                    e.unlink(missing_ok=True)

    def _write(self) -> None:
        atomic_write_text(self.dir / artifacts.PARTIAL_PROGRESS, json.dumps(
            {"kind": PARTIAL_KIND, "format_version": artifacts.PARTIAL_FORMAT, "fingerprint": self.fp,
             "chunks": self.chunks}, indent=1, sort_keys=True) + "\n")

    def save(self, table: Any, truncated: int, end_offset: int) -> None:
        """Keep the next chunk's hypotheses (a table of the hypotheses schema): its file renamed into place, then
        the progress record naming it."""
        import pyarrow.parquet as pq

        name = self.name(len(self.chunks))
        tmp = self.dir / f".{name}.tmp-{os.getpid()}"
        try:
            pq.write_table(table, tmp, compression="zstd")
            os.replace(tmp, self.dir / name)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise MtpipeError(f"{self.dir}: cannot write ({os_reason(e)})") from None
        self.chunks.append({"file": name, "rows": table.num_rows, "sha256": artifacts.file_hash(self.dir / name),
                            "truncated": truncated, "end_offset": end_offset})
        self._write()

    def tables(self) -> Iterator[Any]:
        """The finished chunks' tables, in order, one read at a time."""
        import pyarrow.parquet as pq

        for c in self.chunks:
            yield pq.read_table(self.dir / c["file"], schema=artifacts.HYPOTHESES_SCHEMA)

    def remove(self) -> None:
        """Remove the chunks and the record (the area too when nothing else is left in it)."""
        for c in self.chunks:
            self._unlink(c["file"])
        (self.dir / artifacts.PARTIAL_PROGRESS).unlink(missing_ok=True)
        try:
            self.dir.rmdir()
        except OSError:
            pass


__all__ = ["LineChunks", "Partial", "fingerprint", "line_offset", "scan_lines", "shard_range", "text_lines",
           "utf8_text"]
