"""`mtpipe decode --engine ctranslate2`: a small trained model decodes through CTranslate2 from an export directory or
straight from its checkpoint, greedy output equals the mtpipe engine's, beam 4 / nbest / raw text / stdin keep the
mtpipe engine's outputs and order, and bad input fails with one line and writes nothing."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from typer.testing import CliRunner

ctranslate2 = pytest.importorskip("ctranslate2")

from conftest import memorise, train_spm  # noqa: E402

from mtpipe import artifacts, writing  # noqa: E402
from mtpipe.cli import app  # noqa: E402
from mtpipe.config import to_dict  # noqa: E402
from mtpipe.engine.ct2_convert import export_ctranslate2  # noqa: E402

SUBJECTS = [("the dog", "der hund"), ("the cat", "die katze"), ("a man", "ein mann"), ("a woman", "eine frau")]
VERBS = [("sees", "sieht"), ("likes", "mag"), ("finds", "findet")]
OBJECTS = [("an apple", "einen apfel"), ("a ball", "einen ball"), ("the house", "das haus")]


def corpus() -> list[tuple[str, str]]:
    return [(f"{s} {v} {o} .", f"{sd} {vd} {od} .") for (s, sd), (v, vd), (o, od)
            in itertools.product(SUBJECTS, VERBS, OBJECTS)]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A tokens artifact (SentencePiece model + test split of all 36 pairs), a tiny model trained on 18 of them,
    its checkpoint and its CTranslate2 export."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls; the suite shares 2 cores
    root = tmp_path_factory.mktemp("decode_ct2")
    pairs = corpus()
    sp = train_spm(root / "spm", [x for pair in pairs for x in pair], 80)
    tokens = root / "tokens"
    with writing.ArtifactWriter(tokens, "tokens") as w:
        w.write_table("test.parquet", pa.table({"id": list(range(50, 50 + len(pairs))),
                                                "src": [sp.encode(s) for s, _ in pairs],
                                                "tgt": [sp.encode(t) for _, t in pairs]}))
        shutil.copy(root / "spm.model", w.path("spm.model"))
        w.extra.update({"spm_sha256": artifacts.file_hash(w.path("spm.model")), "vocab_size": sp.get_piece_size()})
    train = pairs[::2]
    vocab = sp.get_piece_size()
    model = memorise([sp.encode(a) for a, _ in train], [sp.encode(b) for _, b in train], vocab, 48, steps=250)
    ckpt = root / "ckpt"
    writing.write_checkpoint(ckpt, state_dict=model.state_dict(), meta=artifacts.CheckpointManifest(
        model_config=to_dict(model.cfg), step=250,
        vocab={"spm_sha256": artifacts.file_hash(root / "spm.model"), "size": vocab}))
    export = root / "ct2"
    export_ctranslate2(ckpt, tokens, export, summary=False)
    (root / "params.yaml").write_text("", encoding="utf-8")
    yield {"root": root, "tokens": tokens, "checkpoint": ckpt, "export": export, "pairs": pairs, "sp": sp}
    torch.set_num_threads(threads)


def cli(world, *args: str, input: str | None = None):
    """``mtpipe decode ARGS`` with an empty params file (the defaults), one thread."""
    return CliRunner().invoke(app, ["decode", "--params", str(world["root"] / "params.yaml"), "--threads", "1",
                                    *args], input=input)


def hypotheses(out: Path, name: str = "test") -> list[dict]:
    return artifacts.read_table(out, f"{name}.parquet", "hypotheses").to_pylist()


def test_greedy_through_ctranslate2_equals_mtpipe_greedy_from_export_and_from_checkpoint(world, tmp_path,
                                                                                         monkeypatch):
    tok = ["--tokens", str(world["tokens"]), "--beam", "1", "--max-len-a", "0.75", "--max-len-b", "1"]
    r = cli(world, "--checkpoint", str(world["checkpoint"]), *tok, "--out", str(tmp_path / "mtpipe"))
    assert r.exit_code == 0, r.output
    ref = hypotheses(tmp_path / "mtpipe")
    # the on-the-fly export goes to a temporary directory that is removed afterwards
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    for name, source in (("export", world["export"]), ("checkpoint", world["checkpoint"])):
        out = tmp_path / f"ct2_{name}"
        r = cli(world, "--engine", "ctranslate2", "--checkpoint", str(source), *tok, "--out", str(out))
        assert r.exit_code == 0, r.output
        got = hypotheses(out)
        assert [g["id"] for g in got] == [x["id"] for x in ref] == list(range(50, 50 + len(world["pairs"])))
        assert [g["tokens"] for g in got] == [x["tokens"] for x in ref]
        assert [g["hypothesis"] for g in got] == [x["hypothesis"] for x in ref]
        # mtpipe's score formula; CTranslate2 renormalises PAD/BOS away (~1e-5 per token on this model)
        assert [g["score"] for g in got] == pytest.approx([x["score"] for x in ref], abs=1e-3)
        assert (out / "test.txt").read_text(encoding="utf-8") == (tmp_path / "mtpipe" / "test.txt").read_text(
            encoding="utf-8")
        m = artifacts.read_manifest(out, "hypotheses")
        assert m.extra["decode"]["engine"] == "ctranslate2" and m.extra["checkpoint_step"] == 250
        assert "CTranslate2" in m.extra["device"] and set(m.upstream) == {"checkpoint", "tokens"}
    assert list((tmp_path / "tmp").iterdir()) == []
    # the test means something: the length limit (0.75 S + 1) cut some outputs, others ended with their own EOS
    src = artifacts.read_table(world["tokens"], "test.parquet", "tokens").column("src").to_pylist()
    cut = [len(x["tokens"]) == int(0.75 * len(s) + 1) for x, s in zip(ref, src)]
    assert 0 < sum(cut) < len(cut)
    assert len({tuple(x["tokens"]) for x in ref}) > 10


def test_beam_4_nbest_raw_text_and_stdin(world, tmp_path, monkeypatch):
    src = [s for s, _ in world["pairs"][:6]]
    infile = tmp_path / "in.en"
    infile.write_text("".join(f" {s}\n" for s in src[:3]) + "\n" + "".join(f"{s}\n" for s in src[3:]),
                      encoding="utf-8")
    args = ["--checkpoint", str(world["export"]), "--tokens", str(world["tokens"]), "--input", str(infile),
            "--beam", "4", "--nbest", "3"]
    r = cli(world, "--engine", "ctranslate2", "--ct2-compute-type", "int8", *args, "--out", str(tmp_path / "ct2"))
    assert r.exit_code == 0, r.output
    assert "stops a sentence once beam x patience" in r.stderr  # the difference to mtpipe's search, stated
    rows = hypotheses(tmp_path / "ct2", "input")
    lines = (tmp_path / "ct2" / "input.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert r.stdout.splitlines() == lines and len(lines) == 7 and lines[3] == ""  # blank line kept, input order
    assert [row["id"] for row in rows] == list(range(7))
    for i, row in enumerate(rows):
        if i == 3:
            continue
        assert 1 <= len(row["nbest"]) <= 3 and row["nbest"][0] == row["hypothesis"]
        assert row["nbest_scores"][0] == row["score"]
        assert row["nbest_scores"] == sorted(row["nbest_scores"], reverse=True)
    args[1] = str(world["checkpoint"])
    r = cli(world, *args, "--out", str(tmp_path / "mtpipe"))  # the mtpipe engine, same settings
    assert r.exit_code == 0, r.output
    same = sum(a == b for a, b in zip(lines, (tmp_path / "mtpipe" / "input.txt").read_text().split("\n")))
    assert same >= 5  # the memorised pairs: both searches agree (int8 weights, a different stopping rule)

    # stdin, and only the export directory at hand (no --tokens): its own spm.model is used, nothing is written
    monkeypatch.chdir(tmp_path)
    r = cli(world, "--engine", "ctranslate2", "--checkpoint", str(world["export"]), "--input", "-",
            input="".join(f"{s}\n" for s in src[:3]))
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == lines[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2", "in.en", "mtpipe"]


@pytest.mark.parametrize("case", ["tokens_dir", "plain_dir", "precision", "compute_type", "prune", "engine",
                                  "patience", "other_spm", "export_to_mtpipe_engine", "device"])
def test_bad_input_fails_with_one_line_and_writes_nothing(world, tmp_path, case):
    source, extra = world["export"], []
    want = {
        "tokens_dir": "is a 'tokens' artifact; --engine ctranslate2 needs a CTranslate2 export",
        "plain_dir": "not an mtpipe artifact (no manifest.json); --engine ctranslate2 needs",
        "precision": "decode.precision: bf16 applies to engine mtpipe",
        "compute_type": "--ct2-compute-type: decode.ct2_compute_type = 'int3' is not one of default, auto",
        "prune": "decode.prune: not available with engine ctranslate2",
        "engine": "decode.engine = 'onnx' is not one of mtpipe, ctranslate2",
        "patience": "decode.patience = 0.5 must be >= 1",
        "other_spm": "trained with another SentencePiece model",
        "export_to_mtpipe_engine": "is an `mtpipe export` model; decode it with --engine ctranslate2",
        "device": "decode.device=cuda but CTranslate2 sees no CUDA GPU",
    }[case]
    if case == "device" and ctranslate2.get_cuda_device_count() > 0:
        pytest.skip("this CTranslate2 sees a GPU")
    if case == "tokens_dir":
        source = world["tokens"]
    elif case == "plain_dir":
        source = tmp_path / "plain"
        source.mkdir()
        (source / "model.bin").write_bytes(b"not a model")
    elif case == "other_spm":
        train_spm(tmp_path / "o", [t for _, t in world["pairs"]], 60)
        other = tmp_path / "other_tokens"
        with writing.ArtifactWriter(other, "tokens") as w:
            w.write_table("test.parquet", pa.table({"id": [0], "src": [[4]], "tgt": [[5]]}))
            shutil.copy(tmp_path / "o.model", w.path("spm.model"))
        extra = ["--tokens", str(other)]
    elif case != "export_to_mtpipe_engine":
        extra = {"precision": ["--precision", "bf16"], "compute_type": ["--ct2-compute-type", "int3"],
                 "prune": ["--prune", "every_other"], "engine": ["--engine", "onnx"],
                 "patience": ["--patience", "0.5"], "device": ["--device", "cuda"]}[case]
    engine = "mtpipe" if case == "export_to_mtpipe_engine" else "ctranslate2"
    args = ["--engine", engine, "--checkpoint", str(source), "--tokens", str(world["tokens"]), *extra]
    out = tmp_path / "out"
    r = cli(world, *args, "--out", str(out))
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], r.output
    assert not out.exists()
