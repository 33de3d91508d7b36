"""`mtpipe score`: agreement with the sacrebleu command line, pairing by id, the gate's exit codes, paper BLEU,
and bad input (one-line error, exit 1, no metrics file)."""

from __future__ import annotations

import gzip
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from mtpipe import writing
from mtpipe.cli import app
from mtpipe.config import ScoreConfig
from mtpipe.errors import MtpipeError
from mtpipe.stages.score import GATE_EXIT_CODE, GateFailed, compound_split, paper_bleu, score_hypotheses

SACREBLEU = shutil.which("sacrebleu", path=str(Path(sys.executable).parent)) or shutil.which("sacrebleu")

WORDS = ("ein Mann eine Frau Kinder spielen im Park auf der Straße mit einem Hund Mädchen läuft schnell "
         "Hals-Nasen-Ohren-Arzt E-Mail schaut 3-4 1,5 Fußball \"Hallo\" (rot) Café blaue Jacke sitzt").split()


def corpus_lines(n: int, seed: int) -> tuple[list[str], list[str]]:
    """n (hypothesis, reference) pairs: references drawn from WORDS, hypotheses edited copies of them (drops,
    substitutions, swaps, case changes), so BLEU, chrF and TER are all far from 0 and 100."""
    rng = random.Random(seed)
    hyps, refs = [], []
    for _ in range(n):
        ref = [rng.choice(WORDS) for _ in range(rng.randint(3, 18))]
        hyp = []
        for w in ref:
            r = rng.random()
            if r < 0.1:
                continue
            if r < 0.2:
                w = rng.choice(WORDS)
            elif r < 0.25:
                w = w.upper()
            hyp.append(w)
        if len(hyp) > 2 and rng.random() < 0.3:
            i = rng.randrange(len(hyp) - 1)
            hyp[i], hyp[i + 1] = hyp[i + 1], hyp[i]
        refs.append(" ".join(ref) + rng.choice([".", " .", "!", "?", ""]))
        hyps.append(" ".join(hyp) + rng.choice([".", " .", ""]))
    return hyps, refs


def write_text(path: Path, lines: list[str], newline: str = "\n") -> Path:
    data = "".join(line + newline for line in lines).encode("utf-8")
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def corpus_artifact(out: Path, splits: dict[str, list[str]]) -> Path:
    """A fetch ('corpus') artifact whose split rows have ids 0..n-1 and the given targets."""
    with writing.ArtifactWriter(out, "corpus") as w:
        for split, tgts in splits.items():
            n = len(tgts)
            w.write_table(f"{split}.parquet", pa.table({
                "id": pa.array(range(n), pa.int64()), "src": pa.array([f"src {i}" for i in range(n)], pa.string()),
                "tgt": pa.array(tgts, pa.string())}))
    return out


def hyp_artifact(out: Path, split: str | None, rows: list[tuple[int, str]]) -> Path:
    """A decode ('hypotheses') artifact holding ``rows`` = (id, hypothesis) in the given (file) order."""
    n = len(rows)
    with writing.ArtifactWriter(out, "hypotheses") as w:
        w.write_table(f"{split or 'input'}.parquet", pa.table({
            "id": pa.array([i for i, _ in rows], pa.int64()),
            "hypothesis": pa.array([h for _, h in rows], pa.string()),
            "tokens": pa.array([[5, 6]] * n, pa.list_(pa.int32())),
            "score": pa.array([-1.0] * n, pa.float64()),
            "nbest": pa.array([[]] * n, pa.list_(pa.string())),
            "nbest_scores": pa.array([[]] * n, pa.list_(pa.float64())),
        }))
        w.extra["split"] = split
    return out


def score_cli(*args: str, params: Path | None = None) -> tuple[int, str]:
    argv = ["score", *args]
    if params is not None:
        argv[1:1] = ["--params", str(params)]
    res = CliRunner().invoke(app, argv)
    return res.exit_code, res.output


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path, list[str], list[str]]:
    hyps, refs = corpus_lines(300, seed=7)
    # CRLF hypotheses and a gzipped reference: both must be read exactly as sacrebleu reads them.
    return write_text(tmp_path / "hyp.txt", hyps, "\r\n"), write_text(tmp_path / "ref.de.gz", refs), hyps, refs


# --------------------------------------------------------------------------------------------------------------------
# Agreement with sacrebleu
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(SACREBLEU is None, reason="sacrebleu command line not installed")
@pytest.mark.parametrize("extra_cfg, extra_cli", [({}, []), ({"tokenize": "intl", "lowercase": True},
                                                             ["-tok", "intl", "-lc"])])
def test_agrees_with_sacrebleu_command_line(tmp_path: Path, files, extra_cfg: dict, extra_cli: list[str]) -> None:
    hyp, ref, _, _ = files
    out = tmp_path / "metrics.json"
    metrics = score_hypotheses(ScoreConfig(**extra_cfg), hyp=hyp, ref=ref, baseline=None, out=out)
    assert json.loads(out.read_text()) == json.loads(json.dumps(metrics))

    proc = subprocess.run([SACREBLEU, str(ref), "-i", str(hyp), "-m", "bleu", "chrf", "ter", "-f", "json", "-w", "2",
                           *extra_cli], capture_output=True, text=True, check=True)
    cli = {m["name"]: m for m in json.loads(proc.stdout)}
    assert 5 < metrics["bleu"] < 95  # a non-trivial score, so agreement means something
    assert round(metrics["bleu"], 2) == cli["BLEU"]["score"]
    assert metrics["signatures"]["bleu"] == cli["BLEU"]["signature"]
    assert round(metrics["chrf"], 2) == cli["chrF2"]["score"]
    assert metrics["signatures"]["chrf"] == cli["chrF2"]["signature"]
    assert round(metrics["ter"], 2) == cli["TER"]["score"]
    assert metrics["signatures"]["ter"] == cli["TER"]["signature"]
    assert metrics["n"] == 300


# --------------------------------------------------------------------------------------------------------------------
# Artifacts: pairing by id
# --------------------------------------------------------------------------------------------------------------------


def test_hypotheses_artifact_is_matched_to_references_by_id(tmp_path: Path, files) -> None:
    hyp_txt, ref_txt, hyps, refs = files
    expected = score_hypotheses(ScoreConfig(), hyp=hyp_txt, ref=ref_txt, baseline=None, out=tmp_path / "text.json")

    ref_dir = corpus_artifact(tmp_path / "fetch", {"test": refs, "valid": refs[:10]})
    rows = list(enumerate(hyps))
    random.Random(3).shuffle(rows)
    assert [i for i, _ in rows] != sorted(i for i, _ in rows)
    hyp_dir = hyp_artifact(tmp_path / "decode", "test", rows)

    got = score_hypotheses(ScoreConfig(), hyp=hyp_dir, ref=ref_dir, baseline=None, out=tmp_path / "art.json")
    for k in ("bleu", "chrf", "ter", "n", "hyp_len", "ref_len"):
        assert got[k] == expected[k], k
    assert got["inputs"]["split"] == "test"

    # The shuffled artifact against the reference text file pairs in id order too; a text hypothesis file against
    # the fetch artifact uses score.split (default test).
    for hyp, ref, name in ((hyp_dir, ref_txt, "a.json"), (hyp_txt, ref_dir, "b.json")):
        got = score_hypotheses(ScoreConfig(), hyp=hyp, ref=ref, baseline=None, out=tmp_path / name)
        assert got["bleu"] == expected["bleu"]
    # Raw-text decode output (extra.split null): rows in id order against the reference lines.
    raw = hyp_artifact(tmp_path / "raw", None, rows)
    got = score_hypotheses(ScoreConfig(), hyp=raw, ref=ref_txt, baseline=None, out=tmp_path / "c.json")
    assert got["bleu"] == expected["bleu"]

    # Pairing truly follows ids: swapping two ids' texts changes the score.
    (i, a), (j, b) = rows[0], rows[1]
    swapped = [(i, b), (j, a)] + rows[2:]
    other = score_hypotheses(ScoreConfig(), hyp=hyp_artifact(tmp_path / "swapped", "test", swapped), ref=ref_dir,
                             baseline=None, out=tmp_path / "d.json")
    assert other["bleu"] != expected["bleu"]


# --------------------------------------------------------------------------------------------------------------------
# The gate
# --------------------------------------------------------------------------------------------------------------------


def test_gate_exit_codes(tmp_path: Path, files) -> None:
    hyp, ref, _, _ = files
    params = tmp_path / "params.yaml"
    params.write_text("score:\n  tokenize: 13a\n")
    out = tmp_path / "m.json"
    io = ["--hyp", str(hyp), "--ref", str(ref), "--out", str(out)]

    code, text = score_cli(*io, params=params)
    assert code == 0, text
    bleu = json.loads(out.read_text())["bleu"]
    assert json.loads(out.read_text())["gate"]["passed"] is True

    code, text = score_cli(*io, "--min-bleu", f"{bleu - 1:.2f}", params=params)
    assert code == 0, text
    assert "gate passed" in text

    out.unlink()
    code, text = score_cli(*io, "--min-bleu", f"{bleu + 1:.2f}", params=params)
    assert code == GATE_EXIT_CODE == 3, text
    assert f"BLEU {bleu:.2f} is below --min-bleu {bleu + 1:.2f}" in text
    assert "metrics still written" in text
    written = json.loads(out.read_text())  # written despite the failure, for CI artifacts
    assert written["gate"]["passed"] is False and written["bleu"] == bleu

    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"bleu": bleu + 2.0, "signatures": written["signatures"]}))
    code, text = score_cli(*io, "--baseline", str(baseline), "--max-drop", "1.0", params=params)
    assert code == 3, text
    assert f"BLEU {bleu:.2f} is 2.00 below the baseline {bleu + 2:.2f}" in text and "--max-drop 1.00" in text
    assert json.loads(out.read_text())["gate"]["baseline_bleu"] == bleu + 2.0

    code, text = score_cli(*io, "--baseline", str(baseline), "--max-drop", "2.5", params=params)
    assert code == 0, text

    # Both gates failing: one exit, both reasons.
    code, text = score_cli(*io, "--baseline", str(baseline), "--max-drop", "0.5", "--min-bleu", "99", params=params)
    assert code == 3 and "--min-bleu 99.00" in text and "below the baseline" in text


def test_gate_from_python_raises_gate_failed(tmp_path: Path, files) -> None:
    hyp, ref, _, _ = files
    with pytest.raises(GateFailed) as e:
        score_hypotheses(ScoreConfig(min_bleu=100.0), hyp=hyp, ref=ref, baseline=None, out=tmp_path / "m.json")
    assert isinstance(e.value, MtpipeError) and e.value.exit_code == 3
    assert (tmp_path / "m.json").exists()


def test_chrf_and_ter_gates_floor_ceiling_and_baseline(tmp_path: Path, files) -> None:
    """--min-chrf / --max-ter against the scores; --max-drop-chrf / --max-rise-ter against a baseline (TER: lower is
    better, so a rise fails); every failed gate is named in the one error; the metrics JSON records them."""
    hyp, ref, _, _ = files
    params = tmp_path / "params.yaml"
    params.write_text("")
    out = tmp_path / "m.json"
    io = ["--hyp", str(hyp), "--ref", str(ref), "--out", str(out), "--force"]
    assert score_cli(*io, params=params)[0] == 0
    m = json.loads(out.read_text())
    chrf, ter = m["chrf"], m["ter"]

    code, text = score_cli(*io, "--min-chrf", f"{chrf - 1:.2f}", "--max-ter", f"{ter + 1:.2f}", params=params)
    assert code == 0 and "gate passed" in text and f"chrF2 {chrf:.2f} >= --min-chrf" in text, text
    code, text = score_cli(*io, "--min-chrf", f"{chrf + 1:.2f}", "--max-ter", f"{ter - 1:.2f}", params=params)
    assert code == 3, text
    assert f"chrF2 {chrf:.2f} is below --min-chrf {chrf + 1:.2f}" in text
    assert f"TER {ter:.2f} is above --max-ter {ter - 1:.2f}" in text
    gate = json.loads(out.read_text())["gate"]
    assert gate["passed"] is False and gate["min_chrf"] == pytest.approx(chrf + 1, abs=0.006)

    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({**m, "chrf": chrf + 2.0, "ter": ter - 2.0}))
    base = ["--baseline", str(baseline)]
    code, text = score_cli(*io, *base, "--max-drop-chrf", "1", "--max-rise-ter", "1", params=params)
    assert code == 3, text
    assert f"chrF2 {chrf:.2f} is 2.00 below the baseline {chrf + 2:.2f}" in text and "--max-drop-chrf 1.00" in text
    assert f"TER {ter:.2f} is 2.00 above the baseline {ter - 2:.2f}" in text and "at most" in text
    gate = json.loads(out.read_text())["gate"]
    assert gate["baseline_chrf"] == chrf + 2.0 and gate["max_rise_ter"] == 1.0 and gate["max_drop"] is None
    code, text = score_cli(*io, *base, "--max-drop-chrf", "2.5", "--max-rise-ter", "2.5", params=params)
    assert code == 0 and "gate passed" in text, text
    # BLEU alone gated against the same baseline: the chrF/TER differences do not matter.
    assert score_cli(*io, *base, "--max-drop", "0", params=params)[0] == 0


def test_exit_statuses(tmp_path: Path, files) -> None:
    """0 scored, 1 bad input (a baseline gate without --baseline, unless score.require_baseline is false), 2 a
    usage error (click's: an unknown flag, a value that is not a number), 3 a failed gate."""
    hyp, ref, _, _ = files
    params = tmp_path / "params.yaml"
    params.write_text("")
    io = ["--hyp", str(hyp), "--ref", str(ref)]
    assert score_cli(*io, params=params)[0] == 0
    code, text = score_cli(*io, "--max-drop", "0.5", params=params)
    assert code == 1 and "score.max_drop set but no --baseline given" in text and "--no-require-baseline" in text
    code, text = score_cli(*io, "--max-rise-ter", "1", "--max-drop-chrf", "1", params=params)
    assert code == 1 and "score.max_drop_chrf, score.max_rise_ter set but no --baseline" in text, text
    code, text = score_cli(*io, "--max-drop", "0.5", "--no-require-baseline", params=params)
    assert code == 0 and "baseline gates are skipped" in text, text
    params.write_text("score:\n  max_drop: 0.5\n  require_baseline: false\n")  # the same from params.yaml
    assert score_cli(*io, params=params)[0] == 0
    params.write_text("")
    assert score_cli(*io, "--no-such-flag", params=params)[0] == 2
    assert score_cli(*io, "--min-bleu", "high", params=params)[0] == 2
    assert score_cli(*io, "--min-bleu", "100", params=params)[0] == 3


# --------------------------------------------------------------------------------------------------------------------
# Paper BLEU
# --------------------------------------------------------------------------------------------------------------------


def test_compound_split_like_get_ende_bleu() -> None:
    assert compound_split("Hals-Nasen-Ohren-Arzt") == "Hals ##AT##-##AT## Nasen ##AT##-##AT## Ohren ##AT##-##AT## Arzt"
    # perl's s{(\S)-(\S)}{...}g consumes the character after the hyphen, so the second hyphen of "a-b-c" stays.
    assert compound_split("a-b-c") == "a ##AT##-##AT## b-c"
    assert compound_split("x - y, -z w-") == "x - y, -z w-"  # free-standing hyphens are untouched


def test_paper_bleu_splits_compounds_and_is_labelled(tmp_path: Path) -> None:
    hyps = ["Der Hals-Nasen-Ohren-Arzt kommt heute nicht in die Praxis."]
    refs = ["Der Hals-Nasen-Arzt kommt heute nicht in die Praxis."]
    # After splitting, "Hals ##AT##-##AT## Nasen" matches; as one token the whole compound is simply wrong.
    split_score, sig = paper_bleu(hyps, refs)
    from sacrebleu.metrics import BLEU

    unsplit = BLEU(tokenize="13a", smooth_method="none").corpus_score(hyps, [refs]).score
    assert split_score > unsplit > 0
    assert "compound-split" in sig and "NOT-sacreBLEU" in sig
    assert paper_bleu(refs, refs)[0] == pytest.approx(100.0)

    h, r = write_text(tmp_path / "h.txt", hyps), write_text(tmp_path / "r.txt", refs)
    m = score_hypotheses(ScoreConfig(paper_bleu=True), hyp=h, ref=r, baseline=None, out=tmp_path / "m.json")
    assert m["paper_bleu"] == split_score and m["signatures"]["paper_bleu"] == sig
    assert "paper_bleu" not in score_hypotheses(ScoreConfig(), hyp=h, ref=r, baseline=None, out=tmp_path / "n.json")


def test_piped_output_keeps_signatures_and_table_rows_whole(tmp_path: Path, files) -> None:
    """As in `mtpipe score ... 2>&1 | tee log`: stderr is a pipe, where rich used to wrap at 80 columns and split the
    longer signatures (TER's, the paper BLEU's) over two lines; each must be one line, equal to the JSON's."""
    import os

    hyp, ref, _, _ = files
    out = tmp_path / "m.json"
    (tmp_path / "none.yaml").write_text("", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "MTPIPE_QUIET")}
    res = subprocess.run([sys.executable, "-m", "mtpipe", "score", "--params", str(tmp_path / "none.yaml"),
                          "--hyp", str(hyp), "--ref", str(ref), "--paper-bleu", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    sigs = json.loads(out.read_text())["signatures"]
    lines = res.stderr.splitlines()
    for name, key in (("BLEU", "bleu"), ("chrF2", "chrf"), ("TER", "ter")):
        assert f"{name} signature: {sigs[key]}" in lines, res.stderr
    paper = [line for line in lines if line.endswith(sigs["paper_bleu"])]
    assert len(paper) == 1 and len(paper[0]) > 80, res.stderr  # longer than the old wrap width, yet one line
    assert any(line.startswith("BLEU ") and "ref_len = " in line for line in lines), res.stderr  # not wrapped


# --------------------------------------------------------------------------------------------------------------------
# Bad input: one-line error, exit 1, no metrics file
# --------------------------------------------------------------------------------------------------------------------


def _bad(tmp_path: Path, hyp: Path, ref: Path, *extra: str) -> str:
    out = tmp_path / "out" / "m.json"
    code, text = score_cli("--hyp", str(hyp), "--ref", str(ref), "--out", str(out), *extra,
                           params=tmp_path / "params.yaml")
    assert code == 1, text
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in text, text
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir()))
    return errors[0]


def test_bad_input(tmp_path: Path) -> None:
    (tmp_path / "params.yaml").write_text("")
    refs = ["ein Hund läuft .", "eine Katze schläft .", "zwei Kinder spielen ."]
    ref = write_text(tmp_path / "ref.txt", refs)
    short = write_text(tmp_path / "short.txt", refs[:2])
    msg = _bad(tmp_path, short, ref)
    assert "2 hypotheses" in msg and "3 references" in msg and "short.txt" in msg and "ref.txt" in msg

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "no hypotheses" in _bad(tmp_path, empty, ref)
    msg = _bad(tmp_path, tmp_path / "missing.txt", ref)
    assert "hypotheses not found" in msg and "mtpipe decode --out" in msg
    assert "references not found" in _bad(tmp_path, ref, tmp_path / "missing.de")

    fetch = corpus_artifact(tmp_path / "fetch", {"test": refs})
    foreign = hyp_artifact(tmp_path / "foreign", "test", [(0, "a"), (1, "b"), (7, "c")])
    msg = _bad(tmp_path, foreign, fetch)
    assert "1 hypothesis ids are not in the references" in msg and "first: 7" in msg
    partial = hyp_artifact(tmp_path / "partial", "test", [(2, "a"), (0, "b")])
    assert "has 2 hypotheses but" in _bad(tmp_path, partial, fetch)
    valid = hyp_artifact(tmp_path / "valid", "valid", [(0, "a")])
    assert "no split 'valid'" in _bad(tmp_path, valid, fetch)
    assert "expected 'hypotheses'" in _bad(tmp_path, fetch, ref)
    assert "expected 'corpus'" in _bad(tmp_path, ref, foreign)

    bad_json = tmp_path / "base.json"
    bad_json.write_text("{not json")
    assert "baseline is not a metrics JSON" in _bad(tmp_path, ref, ref, "--baseline", str(bad_json), "--max-drop", "1")
    bad_json.write_text(json.dumps({"chrf": 50}))
    assert "no numeric 'bleu'" in _bad(tmp_path, ref, ref, "--baseline", str(bad_json), "--max-drop", "1")
    assert "also give --max-drop, --max-drop-chrf, --max-rise-ter" in _bad(tmp_path, ref, ref, "--baseline",
                                                                           str(bad_json))
    assert "no numeric 'ter'" in _bad(tmp_path, ref, ref, "--baseline", str(bad_json), "--max-rise-ter", "1")
    assert "unknown sacreBLEU tokenizer 'nope'" in _bad(tmp_path, ref, ref, "--tokenize", "nope")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00bad\n")
    assert "not UTF-8" in _bad(tmp_path, binary, ref)
