"""`mtpipe decode --input FILE` in chunks (decode.chunk_lines), resumed after a kill, and in shards (decode.shard):
the same output as the whole file translated at once, the memory bound a chunk, a stale partial output not reused,
and what mtpipe did not write left alone. A real SentencePiece model and a tiny model that memorised a few pairs; a
file of a few hundred lines (blank lines and a line longer than the model's positions among them) in chunks of 50."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from conftest import memorise, train_spm
from typer.testing import CliRunner

from mtpipe import artifacts, writing
from mtpipe.cli import app
from mtpipe.config import to_dict
from mtpipe.engine.translate import MtpipeEngine
from mtpipe.errors import MtpipeError
from mtpipe.stages import decode_corpus
from mtpipe.stages.decode import read_lines

WORDS = [("the dog", "der hund"), ("the cat", "die katze"), ("a man", "ein mann"), ("sees", "sieht"),
         ("likes", "mag"), ("an apple", "einen apfel"), ("the house", "das haus"), ("a book", "ein buch")]
LINES = 240
CHUNK = 50


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict:
    """A checkpoint carrying nothing but its weights, its SentencePiece model in a tokens artifact, and an input
    file of :data:`LINES` lines: sentences, blank lines, a line longer than the model's 40 positions, no newline at
    the end."""
    root = tmp_path_factory.mktemp("decode_corpus")
    pairs = [(" ".join(w[0] for w in ws), " ".join(w[1] for w in ws))
             for ws in itertools.permutations(WORDS[:5], 3)][:40]
    sp = train_spm(root / "spm", [side for pair in pairs for side in pair], vocab_size=60)
    src = [sp.encode(s) for s, _ in pairs[:16]]
    tgt = [sp.encode(t) for _, t in pairs[:16]]
    tokens = root / "tokens"
    with writing.ArtifactWriter(tokens, "tokens") as w:
        w.write_table("test.parquet", pa.table({"id": list(range(len(src))), "src": src, "tgt": tgt}))
        (root / "spm.model").replace(w.path("spm.model"))
        w.extra.update({"spm_sha256": artifacts.file_hash(w.path("spm.model")), "vocab_size": sp.get_piece_size()})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a few milliseconds a step; on 2 busy cores, 2 threads wait on each other
    try:
        net = memorise(src, tgt, sp.get_piece_size(), 40, steps=60)
    finally:
        torch.set_num_threads(threads)
    ckpt = root / "ckpt"
    writing.write_checkpoint(ckpt, state_dict=net.state_dict(), meta=artifacts.CheckpointManifest(
        model_config=to_dict(net.cfg), step=60,
        vocab={"spm_sha256": artifacts.file_hash(tokens / "spm.model"), "size": sp.get_piece_size()}))
    rng = random.Random(3)
    lines = [rng.choice(pairs)[0] if rng.random() > 0.1 else "" for _ in range(LINES)]
    lines[77] = " ".join(["the dog sees the cat"] * 20)  # longer than the model's positions: truncated
    text = root / "corpus.en"
    text.write_text("\n".join(lines), encoding="utf-8")  # no newline after the last line
    return {"root": root, "checkpoint": ckpt, "tokens": tokens, "input": text}


def decode(model: dict, out: Path | None, *extra: str, input: Path | None = None):
    """``mtpipe decode --input`` (beam 2, n-best 2, short outputs) with an empty params file."""
    params = model["root"] / "params.yaml"
    params.write_text("", encoding="utf-8")
    args = ["decode", "--params", str(params), "--checkpoint", str(model["checkpoint"]), "--tokens",
            str(model["tokens"]), "--input", str(input or model["input"]), "--threads", "1", "--beam", "2",
            "--nbest", "2", "--max-len-b", "6", *(["--out", str(out)] if out is not None else []), *extra]
    return CliRunner().invoke(app, args)


def output(out: Path) -> tuple[bytes, list[dict]]:
    return (out / "input.txt").read_bytes(), artifacts.read_table(out, "input.parquet", "hypotheses").to_pylist()


def assert_same_translations(got: tuple[bytes, list[dict]], want: tuple[bytes, list[dict]]) -> None:
    """The same text, byte for byte, and rows (ids, hypotheses, tokens, n-best); scores up to float rounding: a
    sentence's batch-mates differ when the lines are cut into other chunks, and with them the rounding."""
    assert got[0] == want[0]
    scores = ("score", "nbest_scores")
    assert [{k: v for k, v in r.items() if k not in scores} for r in got[1]] == \
        [{k: v for k, v in r.items() if k not in scores} for r in want[1]]
    for a, b in zip(got[1], want[1]):
        assert a["score"] == pytest.approx(b["score"], abs=1e-5)
        assert a["nbest_scores"] == pytest.approx(b["nbest_scores"], abs=1e-5)


@pytest.fixture(scope="module")
def whole(model) -> dict:
    """The file translated in one chunk (as before decode.chunk_lines): the reference every other run equals."""
    out = model["root"] / "whole"
    r = decode(model, out, "--chunk-lines", "100000")
    assert r.exit_code == 0, r.output
    assert "truncated" in r.stderr
    text, rows = output(out)
    assert r.stdout.encode() == text and len(rows) == LINES
    return {"text": text, "rows": rows, "stdout": r.stdout}


class Counting:
    """Wraps the engine's translate: how many sources each call got; ``fail_at``: raise KeyboardInterrupt (a kill,
    as Ctrl-C) in that call, after half its sentences were reported done."""

    def __init__(self, monkeypatch, fail_at: int | None = None):
        self.calls: list[int] = []
        original = MtpipeEngine.translate

        def translate(engine, sources, rules, on_done=None):
            self.calls.append(len(sources))
            if len(self.calls) == fail_at:
                if on_done is not None:
                    on_done(len(sources) // 2)
                raise KeyboardInterrupt
            return original(engine, sources, rules, on_done=on_done)

        monkeypatch.setattr(MtpipeEngine, "translate", translate)


@pytest.fixture(scope="module")
def chunked(model, whole, tmp_path_factory) -> dict:
    """The file translated in chunks of 50, uninterrupted: the engine's calls, stdout and the artifact's files."""
    out = tmp_path_factory.mktemp("chunked") / "out"
    with pytest.MonkeyPatch.context() as monkeypatch:
        count = Counting(monkeypatch)
        r = decode(model, out, "--chunk-lines", str(CHUNK))
    assert r.exit_code == 0, r.output
    return {"out": out, "calls": count.calls, "stdout": r.stdout,
            "files": {p.name: p.read_bytes() for p in out.iterdir()}}


def test_chunks_give_the_whole_file_output_and_hold_one_chunk(model, whole, chunked):
    """In chunks of 50: the same text (stdout and input.txt, byte for byte) and rows (ids, hypotheses, n-best;
    scores to float rounding) as in one chunk; each engine call gets one chunk; the partial area is gone at the
    end. Without --out: the same stdout, nothing written beside anything."""
    out = chunked["out"]
    assert_same_translations(output(out), (whole["text"], whole["rows"]))
    assert chunked["stdout"] == whole["stdout"]
    assert chunked["calls"] == [CHUNK] * (LINES // CHUNK) + [LINES % CHUNK]
    assert not artifacts.partial_dir(out).exists() and sorted(chunked["files"]) == [
        "input.parquet", "input.txt", "manifest.json"]
    m = artifacts.read_manifest(out, "hypotheses")
    assert m.extra["truncated_sources"] == 1 and m.rows == {"input.parquet": LINES}
    before = sorted(p.name for p in out.parent.iterdir())
    r = decode(model, None, "--chunk-lines", str(CHUNK))
    assert r.exit_code == 0, r.output
    assert r.stdout == whole["stdout"] and sorted(p.name for p in out.parent.iterdir()) == before


def test_the_reader_holds_one_chunk_and_reads_lines_as_the_whole_file_does(tmp_path):
    path = tmp_path / "t.txt"
    raw = "".join(f"line {i}\r\n" if i % 7 else "  \n" for i in range(130)) + "é last, no newline"
    path.write_bytes(raw.encode("utf-8"))
    n = decode_corpus.scan_lines(path)
    assert n == 131 == len(read_lines(path))
    reader = decode_corpus.LineChunks(path, 0, n, 20, 0)
    chunks = list(reader)
    assert [first for first, _ in chunks] == list(range(0, 131, 20)) and reader.held == 20
    assert [line for _, lines in chunks for line in lines] == read_lines(path)
    for first in (0, 1, 7, 64, 130):  # a shard's start, found by a streaming pass
        tail = list(decode_corpus.LineChunks(path, first, n, 50, decode_corpus.line_offset(path, first)))
        assert [line for _, lines in tail for line in lines] == read_lines(path)[first:]


def test_scan_names_the_first_line_that_is_not_utf8_and_refuses_an_empty_file(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_corpus, "SCAN_BLOCK", 16)  # the bad line in a later block, cut across blocks
    path = tmp_path / "bad.txt"
    path.write_bytes(b"a\n" * 30 + b"ok \xff bad\nfine\n")
    with pytest.raises(MtpipeError, match=r"bad.txt: line 31 is not valid UTF-8"):
        decode_corpus.scan_lines(path)
    path.write_bytes(b"")
    with pytest.raises(MtpipeError, match="empty input"):
        decode_corpus.scan_lines(path)


def test_a_killed_run_resumes_after_its_last_chunk_with_the_same_output(model, chunked, monkeypatch, tmp_path):
    """Killed in its fourth chunk: the rerun translates only the fourth and later chunks, and its stdout and every
    file of its artifact are byte-identical to the uninterrupted run's."""
    out = tmp_path / "resumed"
    Counting(monkeypatch, fail_at=4)
    r = decode(model, out, "--chunk-lines", str(CHUNK))
    assert r.exit_code == 130 and not out.exists()
    partial = artifacts.partial_dir(out)
    record = json.loads((partial / artifacts.PARTIAL_PROGRESS).read_text(encoding="utf-8"))
    assert [c["rows"] for c in record["chunks"]] == [CHUNK] * 3
    count = Counting(monkeypatch)
    r = decode(model, out, "--chunk-lines", str(CHUNK))
    assert r.exit_code == 0, r.output
    assert "resuming after chunk 3 of 5: 150 lines translated by an earlier run" in r.stderr
    assert count.calls == [CHUNK, LINES % CHUNK]  # the unfinished chunk and the one never started
    assert r.stdout == chunked["stdout"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == chunked["files"]
    assert not partial.exists()


@pytest.mark.parametrize("change", ["settings", "input"])
def test_a_partial_output_of_other_settings_or_another_input_is_not_reused(model, monkeypatch, tmp_path, change):
    text = tmp_path / "in.en"
    text.write_bytes(model["input"].read_bytes())
    out = tmp_path / "out"
    Counting(monkeypatch, fail_at=3)
    assert decode(model, out, "--chunk-lines", str(CHUNK), input=text).exit_code == 130
    extra = ["--beam", "1", "--nbest", "1"] if change == "settings" else []
    if change == "input":
        text.write_bytes(text.read_bytes().replace(b"the cat", b"the dog", 1))
    count = Counting(monkeypatch)
    r = decode(model, out, "--chunk-lines", str(CHUNK), *extra, input=text)
    assert r.exit_code == 0, r.output
    why = "decode.beam, decode.nbest" if change == "settings" else "input file"
    assert f"2 chunk(s) an earlier run finished are not reused ({why} differ); starting over" in r.stderr
    assert sum(count.calls) == LINES and not artifacts.partial_dir(out).exists()


def test_shards_concatenated_are_the_whole_output(model, whole, tmp_path):
    """4 parts (two chunks each), concatenated in order: the text and the rows (ids: the lines' numbers in the whole
    file) of the whole file; 300 parts of 240 lines: part 0 is empty, part 299 the last line."""
    text, rows = b"", []
    for i in range(4):
        out = tmp_path / f"part{i}"
        r = decode(model, out, "--shard", f"{i}/4", "--chunk-lines", "40")
        assert r.exit_code == 0, r.output
        text, rows = text + output(out)[0], rows + output(out)[1]
        assert artifacts.read_manifest(out, "hypotheses").extra["shard"] == {
            "part": i, "of": 4, "first_line": 60 * i, "lines": 60, "input_lines": LINES}
    assert_same_translations((text, rows), (whole["text"], whole["rows"]))
    for i, want in ((0, []), (299, whole["rows"][-1:])):
        out = tmp_path / f"part{i}-of-300"
        r = decode(model, out, "--shard", f"{i}/300")
        assert r.exit_code == 0, r.output
        assert_same_translations(output(out), ("".join(row["hypothesis"] + "\n" for row in want).encode(), want))


def test_shard_ranges_cover_every_line_once():
    for lines in (0, 1, 5, 240, 1001):
        for n in (1, 2, 3, 7, 300):
            ranges = [decode_corpus.shard_range((i, n), lines) for i in range(n)]
            assert ranges[0][0] == 0 and ranges[-1][1] == lines
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(e - f for f, e in ranges) - min(e - f for f, e in ranges) <= 1


@pytest.mark.parametrize("flags, message", [
    (["--shard", "4/4"], "decode.shard: '4/4' is not i/n with 0 <= i < n"),
    (["--shard", "1"], "decode.shard: '1' is not i/n"),
    (["--chunk-lines", "0"], "decode.chunk_lines = 0 must be >= 1"),
])
def test_bad_settings_fail_in_one_line(model, tmp_path, flags, message):
    out = tmp_path / "out"
    r = decode(model, out, *flags)
    assert r.exit_code == 1 and message in r.stderr and not out.exists()


def test_shard_of_a_split_is_refused(model, tmp_path):
    params = model["root"] / "params.yaml"
    params.write_text("", encoding="utf-8")
    r = CliRunner().invoke(app, ["decode", "--params", str(params), "--checkpoint", str(model["checkpoint"]),
                                 "--tokens", str(model["tokens"]), "--shard", "0/2"])
    assert r.exit_code == 1 and "decode.shard: '0/2' applies to --input FILE" in r.stderr


def test_what_mtpipe_did_not_write_in_the_partial_area_is_left_alone(model, monkeypatch, tmp_path):
    out = tmp_path / "out"
    partial = artifacts.partial_dir(out)
    partial.mkdir()
    (partial / "notes.txt").write_text("mine", encoding="utf-8")
    r = decode(model, out, "--chunk-lines", str(CHUNK))
    assert r.exit_code == 1 and "holds files and no readable progress.json of mtpipe's" in r.stderr
    assert (partial / "notes.txt").read_text(encoding="utf-8") == "mine" and not out.exists()
    # Beside a run's own record, a foreign file stays (and so does the area) when the run ends.
    (partial / "notes.txt").unlink()
    Counting(monkeypatch, fail_at=2)
    assert decode(model, out, "--chunk-lines", str(CHUNK)).exit_code == 130
    (partial / "notes.txt").write_text("mine", encoding="utf-8")
    Counting(monkeypatch)
    assert decode(model, out, "--chunk-lines", str(CHUNK)).exit_code == 0
    assert [p.name for p in partial.iterdir()] == ["notes.txt"]


def test_translations_go_to_stdout_while_a_progress_bar_shows_on_a_terminal(model, whole, tmp_path):
    """stderr a terminal (the progress bar live, which puts its own sys.stdout in place), stdout a file: every
    translation in the file, none on the terminal."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    params = tmp_path / "params.yaml"
    params.write_text("", encoding="utf-8")
    leader, follower = os.openpty()
    with open(tmp_path / "out.txt", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mtpipe", "decode", "--params", str(params), "--checkpoint",
             str(model["checkpoint"]), "--tokens", str(model["tokens"]), "--input", str(model["input"]), "--threads",
             "1", "--beam", "2", "--nbest", "2", "--max-len-b", "6", "--chunk-lines", str(CHUNK)],
            stdout=out, stderr=follower, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"})
        os.close(follower)
        terminal = b""
        while True:
            try:
                data = os.read(leader, 1 << 16)
            except OSError:  # the process closed its end
                break
            if not data:
                break
            terminal += data
        assert proc.wait(timeout=120) == 0, terminal.decode(errors="replace")
    os.close(leader)
    assert (tmp_path / "out.txt").read_bytes() == whole["text"]
    assert b"die katze" not in terminal and b"der hund" not in terminal
