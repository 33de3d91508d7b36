"""`mtpipe decode` end to end: a real SentencePiece model and a tiny model trained to memorise 20 pairs; splits,
raw text and stdin, the search's flags, int8, --compile, devices, decoding processes, and the checkpoint's recorded
decode settings in a project."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from conftest import memorise, train_spm
from typer.testing import CliRunner

from mtpipe import artifacts, writing
from mtpipe.artifacts import EOS_ID
from mtpipe.cli import app
from mtpipe.config import MAX_BEAM, DecodeConfig, to_dict
from mtpipe.engine.search import DecodeRules
from mtpipe.errors import MtpipeError
from mtpipe.model.ops import Linear


SUBJECTS = [("the dog", "der hund"), ("the cat", "die katze"), ("a man", "ein mann"), ("a woman", "eine frau"),
            ("the child", "das kind")]
VERBS = [("sees", "sieht"), ("likes", "mag"), ("eats", "isst"), ("finds", "findet")]
OBJECTS = [("an apple", "einen apfel"), ("a ball", "einen ball"), ("the house", "das haus"), ("a book", "ein buch")]


def corpus() -> list[tuple[str, str]]:
    return [(f"{s} {v} {o} .", f"{sd} {vd} {od} .") for (s, sd), (v, vd), (o, od)
            in itertools.product(SUBJECTS, VERBS, OBJECTS)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A bpe-like tokens artifact (SentencePiece model + test split) and a checkpoint that memorised the split."""
    root = tmp_path_factory.mktemp("decode_e2e")
    pairs = corpus()
    sp = train_spm(root / "spm", [line for pair in pairs for line in pair], vocab_size=90)
    test_pairs = pairs[::4][:20]
    src = [sp.encode(s) for s, _ in test_pairs]
    tgt = [sp.encode(t) for _, t in test_pairs]
    tokens = root / "tokens"
    with writing.ArtifactWriter(tokens, "tokens") as w:
        w.write_table("test.parquet", pa.table({"id": list(range(100, 100 + len(src))), "src": src, "tgt": tgt}))
        shutil.copy(root / "spm.model", w.path("spm.model"))
        w.extra.update({"spm_sha256": artifacts.file_hash(w.path("spm.model")), "vocab_size": sp.get_piece_size()})

    vocab = sp.get_piece_size()
    model = memorise(src, tgt, vocab, 40, steps=400, stop_loss=0.01)
    vocab_info = {"spm_sha256": artifacts.file_hash(root / "spm.model"), "size": vocab}
    ckpt = root / "ckpt"
    writing.write_checkpoint(ckpt, state_dict=model.state_dict(),
                             meta=artifacts.CheckpointManifest(model_config=to_dict(model.cfg), vocab=vocab_info,
                                                               step=400))
    return {"root": root, "tokens": tokens, "checkpoint": ckpt, "pairs": test_pairs, "model": model,
            "vocab": vocab_info}


def cli(trained, *args: str, input: str | None = None):
    """``mtpipe decode ARGS`` with an empty params file (defaults), not the repository's params.yaml."""
    params = trained["root"] / "params.yaml"
    params.write_text("", encoding="utf-8")
    return CliRunner().invoke(app, ["decode", "--params", str(params), *args], input=input)


def decode_args(trained, out: Path, *extra: str) -> list[str]:
    return ["--checkpoint", str(trained["checkpoint"]), "--tokens", str(trained["tokens"]), "--out", str(out),
            "--threads", "1", *extra]


def test_cli_decodes_a_split(trained):
    out = trained["root"] / "out_split"
    r = cli(trained, *decode_args(trained, out, "--split", "test", "--nbest", "2"))
    assert r.exit_code == 0, r.output
    m = artifacts.read_manifest(out, "hypotheses")
    assert m.extra["split"] == "test" and m.extra["checkpoint_step"] == 400
    assert m.extra["decode"]["beam"] == 4 and m.extra["decode"]["nbest"] == 2
    assert set(m.upstream) == {"checkpoint", "tokens"}
    t = artifacts.read_table(out, "test.parquet", "hypotheses").to_pylist()
    lines = (out / "test.txt").read_text(encoding="utf-8").splitlines()
    refs = [tgt for _, tgt in trained["pairs"]]
    assert [row["id"] for row in t] == list(range(100, 100 + len(refs)))  # the tokens split's ids, input order
    assert lines == [row["hypothesis"] for row in t]
    assert sum(h == ref for h, ref in zip(lines, refs)) >= 0.9 * len(refs)  # it memorised the pairs
    for row in t:
        assert len(row["nbest"]) == 2 and row["nbest"][0] == row["hypothesis"]
        assert row["nbest_scores"][0] == row["score"] >= row["nbest_scores"][1]


def test_int8_decodes_what_fp32_decodes_and_quantises_every_linear_layer(trained):
    """decode.precision=int8: every linear layer and the output projection of the decoding copy are int8 layers
    (the caller's model is untouched), the log-probabilities stay within int8's rounding of fp32's, and on the
    memorised pairs the outputs are fp32's; reachable from the CLI."""
    import torch.ao.nn.quantized.dynamic as nnqd

    from mtpipe.engine.variants import int8_copy

    model = trained["model"]
    q = int8_copy(model)
    kinds = {type(m) for m in q.modules()}
    assert nnqd.Linear in kinds and not any(type(m) is torch.nn.Linear or isinstance(m, Linear) for m in q.modules())
    assert any(isinstance(m, torch.nn.Linear) for m in model.modules())  # the original keeps float32 layers
    src = torch.tensor([[5, 6, 7, EOS_ID]])
    tgt = torch.tensor([[model.start_id, 8, 9]])
    with torch.no_grad():
        a, b = torch.log_softmax(model(src, tgt), -1), torch.log_softmax(q(src, tgt), -1)
    assert (a - b).abs().max() < 0.5 and (a - b).abs().max() > 0  # quantised, and close
    sp_pairs = trained["pairs"]
    out32, out8 = trained["root"] / "out_fp32", trained["root"] / "out_int8"
    for out, prec in ((out32, "fp32"), (out8, "int8")):
        r = cli(trained, *decode_args(trained, out, "--split", "test", "--precision", prec))
        assert r.exit_code == 0, r.output
    lines32 = (out32 / "test.txt").read_text(encoding="utf-8").splitlines()
    lines8 = (out8 / "test.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines8) == len(sp_pairs)
    assert sum(x == y for x, y in zip(lines32, lines8)) >= 0.9 * len(lines32)
    assert artifacts.read_manifest(out8, "hypotheses").extra["decode"]["precision"] == "int8"


def test_cli_stop_finished(trained):
    # --stop finished (fairseq's and CTranslate2's rule), reachable from the CLI and recorded in the manifest; on the
    # memorised pairs it finds the same outputs as the exact search.
    out = trained["root"] / "out_stop"
    r = cli(trained, *decode_args(trained, out, "--split", "test", "--stop", "finished", "--patience", "1.5"))
    assert r.exit_code == 0, r.output
    assert "stop finished (patience 1.5)" in r.stderr
    m = artifacts.read_manifest(out, "hypotheses")
    assert m.extra["decode"]["stop"] == "finished" and m.extra["decode"]["patience"] == 1.5
    lines = (out / "test.txt").read_text(encoding="utf-8").splitlines()
    refs = [tgt for _, tgt in trained["pairs"]]
    assert sum(h == ref for h, ref in zip(lines, refs)) >= 0.9 * len(refs)


def test_cli_min_len(trained):
    # --min-len 1 (fairseq's and CTranslate2's default), reachable from the CLI and recorded in the manifest.
    out = trained["root"] / "out_min_len"
    r = cli(trained, *decode_args(trained, out, "--split", "test", "--stop", "finished", "--min-len", "1"))
    assert r.exit_code == 0, r.output
    assert artifacts.read_manifest(out, "hypotheses").extra["decode"]["min_len"] == 1
    assert all((out / "test.txt").read_text(encoding="utf-8").splitlines())


def test_cli_compile(trained):
    # --compile from the CLI: the same translations as the eager step, and the setting in the manifest.
    eager, compiled = trained["root"] / "out_eager", trained["root"] / "out_compiled"
    for out, extra in ((eager, ()), (compiled, ("--compile",))):
        r = cli(trained, *decode_args(trained, out, "--split", "test", *extra))
        assert r.exit_code == 0, r.output
    assert artifacts.read_manifest(compiled, "hypotheses").extra["decode"]["compile"] == "aot"  # the flag alone
    assert "compile seconds (before decoding)" in r.output  # graphs built first, outside the decoding seconds
    assert (compiled / "test.txt").read_text(encoding="utf-8") == (eager / "test.txt").read_text(encoding="utf-8")


def test_cli_input_file_and_stdin(trained, tmp_path, monkeypatch):
    src = [s for s, _ in trained["pairs"][:5]]
    infile = trained["root"] / "input.en"
    infile.write_text("".join(f"  {s}\r\n" for s in src), encoding="utf-8")  # stripped like fetch does
    out = trained["root"] / "out_input"
    r = cli(trained, *decode_args(trained, out, "--input", str(infile)))
    assert r.exit_code == 0, r.output
    m = artifacts.read_manifest(out, "hypotheses")
    assert m.extra["split"] is None and sorted(m.files) == ["input.parquet", "input.txt"]
    lines = (out / "input.txt").read_text(encoding="utf-8").splitlines()
    assert r.stdout.splitlines() == lines
    assert lines == [t for _, t in trained["pairs"][:5]]
    rows = artifacts.read_table(out, "input.parquet", "hypotheses").to_pylist()
    assert [row["id"] for row in rows] == list(range(5))  # input line numbers
    assert [row["hypothesis"] for row in rows] == lines and all(row["nbest"] == [] for row in rows)

    # stdin -> stdout only: without --out no artifact is written (the pipeline's artifacts/decode is not touched).
    # A blank line gives a blank line (not decoded), so paragraph breaks and line alignment survive.
    monkeypatch.chdir(tmp_path)
    r = cli(trained, "--checkpoint", str(trained["checkpoint"]), "--tokens", str(trained["tokens"]), "--input", "-",
            input="\n".join(src[:2] + ["   "] + src[2:]) + "\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == lines[:2] + [""] + lines[2:]
    assert list(tmp_path.iterdir()) == []


def test_cli_truncates_sources_longer_than_the_model(trained):
    long_line = " ".join(["the dog sees a ball ."] * 30)  # far more than max_positions = 40 tokens
    out = trained["root"] / "out_long"
    infile = trained["root"] / "long.en"
    infile.write_text(f"{long_line}\nthe cat eats a book .\n", encoding="utf-8")
    r = cli(trained, *decode_args(trained, out, "--input", str(infile)))
    assert r.exit_code == 0, r.output
    assert "truncated" in r.stderr
    assert len((out / "input.txt").read_text(encoding="utf-8").splitlines()) == 2


@pytest.mark.parametrize("case", ["not_checkpoint", "tokens_as_checkpoint", "vocab_sha", "vocab_size", "beam0",
                                  "beam_over_limit", "nbest_over_limit", "nbest_over_beam", "missing_split",
                                  "missing_input", "penalty", "stop"])
def test_cli_bad_input_fails_cleanly(trained, case):
    root = trained["root"]
    out = root / f"out_bad_{case}"
    ckpt, extra = trained["checkpoint"], []
    if case == "not_checkpoint":
        ckpt = root / "plain_dir"
        ckpt.mkdir(exist_ok=True)
    elif case == "tokens_as_checkpoint":
        ckpt = trained["tokens"]
    elif case in ("vocab_sha", "vocab_size"):
        model = trained["model"]
        vocab = dict(trained["vocab"])
        if case == "vocab_sha":
            vocab["spm_sha256"] = "sha256:" + "0" * 64
        else:
            vocab["size"] += 1
        ckpt = root / f"ckpt_{case}"
        writing.write_checkpoint(ckpt, state_dict=model.state_dict(), meta=artifacts.CheckpointManifest(
            model_config=to_dict(model.cfg), step=1, vocab=vocab))
    elif case == "beam0":
        extra = ["--beam", "0"]
    elif case == "beam_over_limit":  # refused before any search: no minutes and gigabytes spent on it
        extra = ["--beam", "100000"]
    elif case == "nbest_over_limit":
        extra = ["--beam", str(MAX_BEAM), "--nbest", str(MAX_BEAM + 1)]
    elif case == "nbest_over_beam":
        extra = ["--beam", "2", "--nbest", "3"]
    elif case == "missing_split":
        extra = ["--split", "valid"]
    elif case == "missing_input":
        extra = ["--input", str(root / "no-such-file.txt")]
    elif case == "penalty":
        extra = ["--length-penalty", "average"]
    elif case == "stop":
        extra = ["--stop", "early"]
    args = ["--checkpoint", str(ckpt), "--tokens", str(trained["tokens"]), "--out", str(out), *extra]
    r = cli(trained, *args)
    assert r.exit_code == 1, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    expected = {"not_checkpoint": "plain_dir", "tokens_as_checkpoint": "expected 'checkpoint'",
                "vocab_sha": "SentencePiece", "vocab_size": "vocabulary size", "beam0": "decode.beam",
                "beam_over_limit": f"--beam: decode.beam = 100000 must be >= 1 and <= {MAX_BEAM}",
                "nbest_over_limit": f"--nbest: decode.nbest = {MAX_BEAM + 1} must be >= 1 and <= {MAX_BEAM}",
                "nbest_over_beam": "decode.nbest", "missing_split": "valid", "missing_input": "no-such-file",
                "penalty": "length_penalty", "stop": "decode.stop = 'early' is not one of bound, finished"}[case]
    assert expected in errors[0]
    assert not out.exists()
    assert not [p for p in root.iterdir() if p.name.startswith(f".{out.name}")]  # no temporary leftovers


@pytest.mark.parametrize("key, value", [("beam", 500), ("nbest", 500)])
def test_beam_and_nbest_over_the_limit_in_params_yaml_name_the_file_key_and_limit(trained, tmp_path, key, value):
    params = tmp_path / "params.yaml"
    params.write_text(f"decode:\n  {key}: {value}\n", encoding="utf-8")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["decode", "--params", str(params), *decode_args(trained, out)])
    assert r.exit_code == 1, r.output
    assert r.stderr.strip().splitlines() == [f"error: {params}: decode.{key} = {value} must be >= 1 and <= {MAX_BEAM}"]
    assert not out.exists()


def test_decode_device_picks_where_to_decode(monkeypatch):
    """decode.device: cpu always; cuda, or an error naming the key where no GPU is visible; auto the GPU when there
    is one, except for int8, which runs on the CPU only (so a GPU machine can decode int8 without hiding its GPU)."""
    from mtpipe.platform import check_decoding_device, decoding_device

    assert decoding_device("cpu", "fp32").type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert decoding_device("auto", "fp32").type == "cpu"
    with pytest.raises(MtpipeError, match="decode.device=cuda but no CUDA GPU is visible"):
        decoding_device("cuda", "fp32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert decoding_device("auto", "fp32").type == "cuda" and decoding_device("auto", "bf16").type == "cuda"
    assert decoding_device("auto", "int8").type == "cpu"
    assert decoding_device("cuda", "fp32").type == "cuda" and decoding_device("cpu", "bf16").type == "cpu"
    with pytest.raises(MtpipeError, match="decode.precision=int8 runs on CPU only"):  # asked for on a GPU
        check_decoding_device("int8", decoding_device("cuda", "int8"))
    check_decoding_device("int8", decoding_device("auto", "int8"))


def test_cli_device(trained):
    # --device cpu decodes what the default does; --device cuda without a GPU is one clear error and no output;
    # an unknown device is refused by the params rules.
    out_default, out_cpu = trained["root"] / "out_dev_default", trained["root"] / "out_dev_cpu"
    for out, extra in ((out_default, []), (out_cpu, ["--device", "cpu"])):
        r = cli(trained, *decode_args(trained, out, "--split", "test", *extra))
        assert r.exit_code == 0, r.output
    if not torch.cuda.is_available():
        assert (out_cpu / "test.txt").read_text(encoding="utf-8") == (out_default / "test.txt").read_text("utf-8")
        out = trained["root"] / "out_dev_cuda"
        r = cli(trained, *decode_args(trained, out, "--split", "test", "--device", "cuda"))
        assert r.exit_code == 1 and "decode.device=cuda but no CUDA GPU is visible" in r.stderr, r.output
        assert not out.exists()
    r = cli(trained, *decode_args(trained, trained["root"] / "out_dev_bad", "--device", "gpu"))
    assert r.exit_code == 1 and "decode.device" in r.stderr and "auto, cpu, cuda" in r.stderr, r.output


# --------------------------------------------------------------------------------------------------------------------
# Stdin translated as it arrives
# --------------------------------------------------------------------------------------------------------------------


def test_stream_batches_yields_each_line_when_it_arrives():
    """Stdin is read a line at a time, never waiting for more than one whole line: what else is already there joins
    the batch; the last line needs no newline."""
    from mtpipe.stages.decode import stream_batches

    r, w = os.pipe()
    try:
        batches = stream_batches(r)
        os.write(w, b"one\ntw")
        assert next(batches) == (1, b"one")  # would block here if it waited for more input
        os.write(w, b"o\nthree\nfour")
        assert next(batches) == (2, b"two\nthree")
        os.write(w, b"\n\n")
        assert next(batches) == (4, b"four\n")  # "four" and a blank line
        os.write(w, b"five")
        os.close(w)
        w = -1
        assert next(batches) == (6, b"five")
        assert next(batches, None) is None
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def read_line(stream, timeout: float) -> str:
    """One line from a subprocess pipe, or fail after ``timeout`` seconds (never hang)."""
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([stream], [], [], left)[0]:
            pytest.fail(f"no line within {timeout} s (got {data!r})")
        chunk = os.read(stream.fileno(), 1)
        if not chunk:
            pytest.fail(f"output ended before a whole line (got {data!r})")
        data += chunk
    return data.decode("utf-8").rstrip("\n")


def test_cli_stdin_translates_each_line_before_the_input_ends(trained, tmp_path):
    """`mtpipe decode --input -` through a pipe, as an interactive user or a process waiting for each answer: the
    translation of a line comes back while stdin is still open; no summary table on stderr (stdin input)."""
    params = tmp_path / "params.yaml"
    params.write_text("", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "mtpipe", "decode", "--params", str(params), "--checkpoint",
                             str(trained["checkpoint"]), "--tokens", str(trained["tokens"]), "--input", "-",
                             "--threads", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        for src, ref in trained["pairs"][:2]:
            proc.stdin.write(f"{src}\n".encode("utf-8"))
            proc.stdin.flush()
            assert read_line(proc.stdout, timeout=90) == ref
        proc.stdin.write(b"\n")  # a blank line, then the end of the input: a blank line back, exit 0
        proc.stdin.close()
        assert read_line(proc.stdout, timeout=30) == ""
        assert proc.wait(timeout=30) == 0
        stderr = proc.stderr.read().decode("utf-8")
        assert "translating stdin as lines arrive" in stderr and "sentences/s" not in stderr
        assert list(tmp_path.iterdir()) == [params]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_stdin_with_compile_builds_before_the_first_line(trained, tmp_path):
    """`mtpipe decode --input - --compile`: the compiled step is built before stdin is read, so the first line typed
    is answered without waiting for the build; the answers are the uncompiled ones."""
    params = tmp_path / "params.yaml"
    params.write_text("", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "mtpipe", "decode", "--params", str(params), "--checkpoint",
                             str(trained["checkpoint"]), "--tokens", str(trained["tokens"]), "--input", "-",
                             "--threads", "1", "--compile"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=tmp_path, env={**os.environ, "COLUMNS": "200"})
    try:
        deadline, line = time.monotonic() + 300, ""
        while "compiled step built" not in line:  # nothing has been written to stdin yet
            line = read_line(proc.stderr, timeout=max(1.0, deadline - time.monotonic()))
        assert "reading stdin" in line
        for src, ref in trained["pairs"][:2]:
            proc.stdin.write(f"{src}\n".encode("utf-8"))
            proc.stdin.flush()
            assert read_line(proc.stdout, timeout=90) == ref
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_stats_flag(trained, tmp_path):
    """The summary table: shown for a file piped to a file (a batch job), not for stdin unless --stats asks."""
    infile = tmp_path / "in.en"
    infile.write_text(trained["pairs"][0][0] + "\n", encoding="utf-8")
    args = ["--checkpoint", str(trained["checkpoint"]), "--tokens", str(trained["tokens"]), "--threads", "1"]
    assert "sentences/s" in cli(trained, *args, "--input", str(infile)).stderr
    assert "sentences/s" not in cli(trained, *args, "--input", str(infile), "--no-stats").stderr
    assert "sentences/s" not in cli(trained, *args, "--input", "-", input="the dog sees a ball .\n").stderr
    r = cli(trained, *args, "--input", "-", "--stats", input="the dog sees a ball .\n")
    assert r.exit_code == 0 and "sentences/s" in r.stderr


# --------------------------------------------------------------------------------------------------------------------
# decode.processes: a file or split shared out among decoding processes
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_deal_gives_every_sentence_once_in_batches_of_the_budget(processes):
    """Every index exactly once; a share fits max_tokens padded tokens (or is one over-long sentence); the shares
    of a group are the same size to within one sentence, longest groups first (what keeps every process busy)."""
    from mtpipe.engine.workers import deal

    rng = torch.Generator().manual_seed(processes)
    lengths = [int(n) for n in torch.randint(1, 60, (300,), generator=rng)] + [200, 150]  # two over the budget
    shares = deal(lengths, 100, processes)
    assert sorted(i for share in shares for i in share) == list(range(len(lengths)))
    for share in shares:
        assert len(share) * max(lengths[i] for i in share) <= 100 or len(share) == 1
    widths = [max(lengths[i] for i in share) for share in shares]
    assert widths == sorted(widths, reverse=True)
    full = [share for share in shares if len(share) > 1]
    groups = [full[k : k + processes] for k in range(0, len(full) - processes, processes)]
    assert all(max(map(len, g)) - min(map(len, g)) <= 1 for g in groups[:-1])
    assert deal([], 100, processes) == []


def test_cli_processes_decode_what_one_process_decodes(trained, tmp_path):
    """decode.processes 2 with batches small enough for several shares: the same hypotheses and scores as one
    process (nbest 2), in input order, the artifact otherwise the same; the summary names the processes."""
    rows = {}
    for p in (1, 2):
        out = tmp_path / f"out_p{p}"
        r = cli(trained, *decode_args(trained, out, "--nbest", "2", "--max-tokens", "24", "--processes", str(p),
                                      "--stats"))
        assert r.exit_code == 0, r.output
        rows[p] = artifacts.read_table(out, "test.parquet", "hypotheses").to_pylist()
        if p == 2:
            assert "processes x threads" in r.stderr and "2 x 1" in r.stderr
            assert "2 processes x 1 thread(s)" in artifacts.read_manifest(out, "hypotheses").extra["device"]
    assert [r["id"] for r in rows[2]] == [r["id"] for r in rows[1]]
    assert [r["nbest"] for r in rows[2]] == [r["nbest"] for r in rows[1]]
    for a, b in zip(rows[1], rows[2]):
        assert a["nbest_scores"] == pytest.approx(b["nbest_scores"], abs=1e-4)


def test_cli_processes_with_ctranslate2_and_stdin(trained, tmp_path):
    """The processes run whichever engine decode.engine names (CTranslate2 here: its note still logged); stdin that
    is not a terminal or pipe to stream from is read whole and shared out like a file."""
    pytest.importorskip("ctranslate2", reason="optional: the ctranslate2 extra is not installed")
    infile = tmp_path / "in.en"
    infile.write_text("".join(src + "\n" for src, _ in trained["pairs"]), encoding="utf-8")
    args = ["--checkpoint", str(trained["checkpoint"]), "--tokens", str(trained["tokens"]), "--threads", "1",
            "--engine", "ctranslate2", "--input", str(infile)]
    one, two = cli(trained, *args), cli(trained, *args, "--processes", "2", "--max-tokens", "24")
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    assert two.stdout == one.stdout and two.stdout.count("\n") == len(trained["pairs"])
    assert "starting 2 decoding processes" in two.stderr and "CTranslate2 stops a sentence" in two.stderr
    r = cli(trained, *args[:8], "--input", "-", "--processes", "2", input=trained["pairs"][1][0] + "\n")
    assert r.exit_code == 0, r.output
    assert "starting 2 decoding processes" in r.stderr and r.stdout == one.stdout.splitlines(True)[1]


def test_worker_processes_spread_over_the_gpus(monkeypatch):
    """With several GPUs, worker i decodes on GPU i mod count (decode.processes, serve.workers); with one GPU or none,
    or when the settings keep decoding on the CPU (device cpu, int8 under auto), no GPU is picked and CUDA is never
    asked."""
    from mtpipe.engine.workers import worker_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [worker_gpu(i, DecodeConfig()) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert worker_gpu(1, DecodeConfig(device="cuda", precision="bf16")) == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert worker_gpu(1, DecodeConfig()) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("CUDA asked for a CPU worker"))
    assert worker_gpu(1, DecodeConfig(device="cpu")) is None
    assert worker_gpu(1, DecodeConfig(precision="int8")) is None


def test_processes_that_fail_give_one_line_and_no_hang(trained, tmp_path):
    """A process that cannot open the model, and one killed while decoding: one MtpipeError line naming
    decode.processes and the process, not a hang or a traceback; the pool's processes are ended."""
    from mtpipe.engine.workers import DecodePool

    cfg = DecodeConfig(threads=1)
    with pytest.raises(MtpipeError, match=r"^decode.processes: worker process 0 could not open the model \("):
        DecodePool(cfg, tmp_path / "missing", trained["tokens"], 2)
    pool = DecodePool(cfg, trained["checkpoint"], trained["tokens"], 2)
    try:
        sources = [[5, 6, 7]] * 40
        assert len(pool.translate(sources, DecodeRules.from_config(cfg))) == 40  # it works ...
        pool.procs[0]._proc.kill()  # ... until a process dies (e.g. killed for memory)
        pool.procs[0]._proc.join(5)
        with pytest.raises(MtpipeError, match=r"^decode.processes: worker process 0 exited \(code -9\)$"):
            pool.translate(sources, dataclasses.replace(DecodeRules.from_config(cfg), beam=2))
    finally:
        procs = [w._proc for w in pool.procs]
        pool.close(wait=0)
    assert not any(p.is_alive() for p in procs)


# --------------------------------------------------------------------------------------------------------------------
# A checkpoint decodes on its own: it carries its SentencePiece model and the decode settings it was trained with
# --------------------------------------------------------------------------------------------------------------------


def in_dir(path: Path, *args: str, input: str | None = None):
    """``mtpipe ARGS`` run from the directory ``path`` (the user's current directory)."""
    before = Path.cwd()
    os.chdir(path)
    try:
        return CliRunner().invoke(app, list(args), input=input)
    finally:
        os.chdir(before)


@pytest.fixture(scope="module")
def project(trained, tmp_path_factory) -> dict:
    """A project as the quickstart leaves it, in miniature: a bpe artifact (train/valid/test, spm.model and
    spm.vocab), then `mtpipe bucket`, `mtpipe train` (two updates of a tiny model) and `mtpipe average`, all under a
    params.yaml whose decode section sets beam and alpha."""
    import sentencepiece as spm
    import yaml

    from mtpipe.stages.bpe import write_vocab

    root = tmp_path_factory.mktemp("project")
    spm_file = trained["root"] / "spm.model"
    sp = spm.SentencePieceProcessor(model_file=str(spm_file))
    pairs = corpus()
    tokens = root / "artifacts" / "bpe"
    with writing.ArtifactWriter(tokens, "tokens") as w:
        for split, part in (("train", pairs), ("valid", pairs[::5]), ("test", pairs[::4][:20])):
            w.write_table(f"{split}.parquet", pa.table({"id": list(range(len(part))),
                                                        "src": [sp.encode(s) for s, _ in part],
                                                        "tgt": [sp.encode(t) for _, t in part]}))
        shutil.copy(spm_file, w.path("spm.model"))
        write_vocab(sp, w.path("spm.vocab"))
        w.extra.update(spm_sha256=artifacts.file_hash(spm_file), vocab_size=sp.get_piece_size())
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump({
        "bucket": {"max_tokens": 256, "max_len": 64},
        "model": {"preset": "tiny", "max_positions": 64},
        "train": {"nproc": "1", "max_steps": 2, "max_epochs": 0, "max_time": 0, "tokens_per_update": 256,
                  "save_every_steps": 1, "save_every_minutes": 0, "valid_every_steps": 0, "threads": 1,
                  "precision": "fp32"},
        "average": {"last": 2},
        "decode": {"beam": 2, "alpha": 1.5, "threads": 1},
    }), encoding="utf-8")
    for args in (["bucket"], ["train"], ["average"]):
        r = in_dir(root, *args)
        assert r.exit_code == 0, r.output
    return {"root": root, "tokens": tokens, "average": root / "artifacts" / "average",
            "run": root / "artifacts" / "train", "vocab_sha": artifacts.file_hash(spm_file)}


def test_train_and_average_write_checkpoints_that_carry_their_spm_and_decode_settings(project):
    from mtpipe.artifacts import list_checkpoints

    found = [d for _, d in list_checkpoints(project["run"])]
    assert len(found) == 2
    for d in [*found, project["average"]]:
        m = artifacts.read_manifest(d, "checkpoint")
        assert m.format_version == 2 and {"spm.model", "spm.vocab"} <= set(m.files)
        assert artifacts.checkpoint_spm(d, m) == d / "spm.model"
        assert m.files["spm.model"] == project["vocab_sha"] == m.extra["vocab"]["spm_sha256"]
        assert (d / "spm.vocab").read_bytes() == (project["tokens"] / "spm.vocab").read_bytes()
        assert m.extra["decode"] == {"beam": 2, "alpha": 1.5}  # what params.yaml set; threads is not a rule
    # A checkpoint whose spm.model is not its vocabulary's is refused, naming the file.
    bad = project["root"] / "bad_ck"
    shutil.copytree(project["average"], bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["extra"]["vocab"]["spm_sha256"] = "sha256:" + "0" * 64
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(MtpipeError, match="spm.model: is not the SentencePiece model"):
        artifacts.load_checkpoint(bad)


def test_a_copied_checkpoint_decodes_outside_the_project(project, tmp_path):
    """`mtpipe decode --checkpoint COPY --input FILE` from an empty directory (no params.yaml, no artifacts/bpe):
    the checkpoint's own SentencePiece model and recorded settings; the same translations as in the project."""
    copy_dir = tmp_path / "elsewhere" / "model"
    shutil.copytree(project["average"], copy_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    infile = tmp_path / "in.en"
    infile.write_text("".join(f"{s}\n" for s, _ in corpus()[:6]), encoding="utf-8")
    out = tmp_path / "hyps"
    r = in_dir(empty, "decode", "--checkpoint", str(copy_dir), "--input", str(infile), "--out", str(out))
    assert r.exit_code == 0, r.output
    assert len(r.stdout.splitlines()) == 6
    assert "decode settings recorded in" in r.stderr and "beam 2, alpha 1.5" in r.stderr
    m = artifacts.read_manifest(out, "hypotheses")
    assert set(m.upstream) == {"checkpoint"}  # no bpe artifact was used
    assert (m.extra["decode"]["beam"], m.extra["decode"]["alpha"]) == (2, 1.5)
    home = in_dir(project["root"], "decode", "--checkpoint", str(project["average"]), "--tokens",
                  str(project["tokens"]), "--input", str(infile))
    assert home.exit_code == 0, home.output
    assert home.stdout == r.stdout
    assert list(empty.iterdir()) == []


def test_decode_settings_precedence_flag_params_yaml_checkpoint_default(project, tmp_path):
    """Flag > params.yaml of the current directory > the checkpoint's record > the built-in default."""
    infile = tmp_path / "in.en"
    infile.write_text("the dog sees a ball .\n", encoding="utf-8")

    def settings(where: Path, *extra: str) -> tuple:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        r = in_dir(where, "decode", "--checkpoint", str(project["average"]), "--input", str(infile), "--out",
                   str(out), *extra)
        assert r.exit_code == 0, r.output
        d = artifacts.read_manifest(out, "hypotheses").extra["decode"]
        return d["beam"], d["alpha"], d["max_len_b"]

    here = tmp_path / "here"
    here.mkdir()
    assert settings(here) == (2, 1.5, 50)  # the record; max_len_b was not recorded: the default
    (here / "params.yaml").write_text("decode:\n  alpha: 0.7\n", encoding="utf-8")
    assert settings(here) == (2, 0.7, 50)  # params.yaml over the record, which still gives beam
    assert settings(here, "--alpha", "0.2", "--beam", "3") == (3, 0.2, 50)
    # A bad recorded value is one error line naming the checkpoint's manifest.
    bad = tmp_path / "bad_record"
    shutil.copytree(project["average"], bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["extra"]["decode"]["beam"] = 0
    (bad / "manifest.json").write_text(json.dumps(m))
    r = in_dir(here, "decode", "--checkpoint", str(bad), "--input", str(infile))
    assert r.exit_code == 1 and f"{bad}/manifest.json: decode.beam = 0 must be >= 1" in r.stderr


def test_checkpoint_without_spm_needs_tokens_outside_a_project(trained, tmp_path):
    """A checkpoint that carries no SentencePiece model (format 1, or written without one) still decodes with
    --tokens; without it, away from a project, one clear error line."""
    old = tmp_path / "format1"
    shutil.copytree(trained["checkpoint"], old)
    m = json.loads((old / "manifest.json").read_text())
    m["format_version"] = 1
    (old / "manifest.json").write_text(json.dumps(m))
    infile = tmp_path / "in.en"
    infile.write_text(trained["pairs"][0][0] + "\n", encoding="utf-8")
    empty = tmp_path / "empty"
    empty.mkdir()
    r = in_dir(empty, "decode", "--checkpoint", str(old), "--input", str(infile))
    assert r.exit_code == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "carries no SentencePiece model" in errors[0] and "--tokens" in errors[0]
    r = in_dir(empty, "decode", "--checkpoint", str(old), "--tokens", str(trained["tokens"]), "--input", str(infile))
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [trained["pairs"][0][1]]
