"""Bad input and careless use, through the CLI, at every stage: what mtpipe did not write is never touched.

One small project (every stage's artifact, a dvc.yaml like the repository's) is built once; each case runs one
command against it and checks three things: the exit status, exactly one ``error:`` line that names the file or
key at fault (and no traceback), and that every file and folder of the project is afterwards byte for byte what
it was before (no artifact replaced, none left half-written, no temporary left behind).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml
from conftest import REPO, write_corpus
from typer.testing import CliRunner

from mtpipe import artifacts, writing
from mtpipe.cli import app

PARAMS = {
    "fetch": {"src_lang": "en", "tgt_lang": "de"},
    "bpe": {"vocab_size": 200, "threads": 1},
    "bucket": {"max_tokens": 512},
    "model": {"preset": "tiny", "encoder_layers": 1, "decoder_layers": 1, "d_model": 32, "d_ff": 64, "heads": 2},
    "train": {"max_steps": 4, "max_epochs": 0, "max_time": 0, "warmup": 2, "tokens_per_update": 512, "threads": 1,
              "save_every_steps": 2, "save_every_minutes": 0, "valid_every_steps": 4, "log_every_steps": 2,
              "nproc": "1"},
    "average": {"last": 2},
    "decode": {"beam": 2, "threads": 1},
}
STAGES = [
    ["fetch", "--out", "artifacts/fetch"],
    ["bpe", "--corpus", "artifacts/fetch", "--out", "artifacts/bpe"],
    ["bucket", "--tokens", "artifacts/bpe", "--out", "artifacts/bucket"],
    ["train", "--tokens", "artifacts/bpe", "--batches", "artifacts/bucket", "--out", "artifacts/train"],
    ["average", "--run", "artifacts/train", "--out", "artifacts/average"],
    ["decode", "--checkpoint", "artifacts/average", "--tokens", "artifacts/bpe", "--out", "artifacts/decode"],
    ["score", "--hyp", "artifacts/decode", "--ref", "artifacts/fetch", "--out", "metrics/score.json"],
]


def invoke(args: list[str], input: str | None = None):
    return CliRunner().invoke(app, args, input=input)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project folder after the whole pipeline: params.yaml, dvc.yaml, artifacts/*, metrics/score.json."""
    root = tmp_path_factory.mktemp("project")
    corpus = write_corpus(root / "corpus", {"train": 300, "val": 20, "test_2016_flickr": 20})
    params = {**PARAMS, "fetch": {**PARAMS["fetch"], "source": str(corpus)}}
    (root / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        for args in STAGES:
            r = invoke(args)
            assert r.exit_code == 0, r.output
    finally:
        os.chdir(cwd)
    return root


@pytest.fixture
def at(project: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(project)
    return project


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root``: a file's sha256, a link's target, or 'dir'."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def copy_artifact(root: Path, src: str, name: str) -> Path:
    """A copy of one of the project's artifacts under ``cases/`` (a case's own, to spoil)."""
    dst = root / "cases" / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(root / src, dst, symlinks=True)
    return dst


def edit_manifest(d: Path, change: Callable[[dict], None]) -> Path:
    m = json.loads((d / artifacts.MANIFEST).read_text(encoding="utf-8"))
    change(m)
    (d / artifacts.MANIFEST).write_text(json.dumps(m), encoding="utf-8")
    return d


def rename_listed(d: Path, old: str, new: str) -> Path:
    """Move file ``old`` of artifact ``d`` to ``new`` (relative to ``d``) and list it under that name."""
    target = (d / new).resolve() if not Path(new).is_absolute() else Path(new)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(d / old, target)

    def change(m: dict) -> None:
        m["files"][new] = m["files"].pop(old)
        if old in m["rows"]:
            m["rows"][new] = m["rows"].pop(old)
        if m.get("extra", {}).get("split") is not None:
            m["extra"]["split"] = None  # score then takes the one Parquet file listed
    return edit_manifest(d, change)


# --------------------------------------------------------------------------------------------------------------------
# The cases: (setup, args, what the error line must name)
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    id: str
    args: Callable[[Path], list[str]]
    names: Callable[[Path], str]
    setup: Callable[[Path], None] = lambda root: None
    code: int = 1
    says: str = ""


def case_file(root: Path, name: str, data: bytes) -> None:
    (root / "cases").mkdir(exist_ok=True)
    (root / "cases" / name).write_bytes(data)


def foreign_dir(root: Path) -> None:
    (root / "scratch" / "sub").mkdir(parents=True, exist_ok=True)
    (root / "scratch" / "important.txt").write_text("precious\n")


def foreign_file(root: Path) -> None:
    (root / "notes.txt").write_text("my notes\n")


def step_dir(root: Path, name: str = "tampered") -> Path:
    run = copy_artifact(root, "artifacts/train", name)
    return run


def no_manifest_checkpoint(root: Path) -> None:
    run = step_dir(root, "run_stray")
    stray = run / "checkpoints" / "step_00000099"
    stray.mkdir()
    (stray / "weights.bin").write_bytes(b"not ours")


CASES = [
    # -- --out that mtpipe did not write ---------------------------------------------------------------------------
    Case("fetch-out-foreign-dir", lambda r: ["fetch", "--out", "scratch"], lambda r: "--out scratch",
         foreign_dir, says="not an mtpipe artifact"),
    Case("fetch-out-regular-file", lambda r: ["fetch", "--out", "notes.txt"], lambda r: "--out notes.txt",
         foreign_file, says="is a file"),
    Case("fetch-out-dot", lambda r: ["fetch", "--out", "."], lambda r: "--out .", says="the current directory"),
    Case("fetch-out-is-source", lambda r: ["fetch", "--out", "corpus"], lambda r: "--out corpus",
         says="is the input"),
    Case("bucket-out-foreign-dir", lambda r: ["bucket", "--tokens", "artifacts/bpe", "--out", "scratch"],
         lambda r: "--out scratch", foreign_dir, says="not an mtpipe artifact"),
    Case("bpe-out-other-kind", lambda r: ["bpe", "--corpus", "artifacts/fetch", "--out", "artifacts/bucket"],
         lambda r: "--out artifacts/bucket", says="is an mtpipe 'batches' artifact, not a 'tokens' one"),
    Case("train-out-foreign-dir", lambda r: ["train", "--out", "scratch"], lambda r: "--out scratch",
         foreign_dir, says="is not a `mtpipe train` run directory"),
    Case("average-out-regular-file", lambda r: ["average", "--out", "notes.txt"], lambda r: "--out notes.txt",
         foreign_file, says="is a file"),
    Case("score-out-foreign-file", lambda r: ["score", "--out", "notes.txt"], lambda r: "--out notes.txt",
         foreign_file, says="not a metrics JSON"),
    Case("export-out-foreign-dir", lambda r: ["export", "--out", "scratch"], lambda r: "--out scratch",
         foreign_dir, says="not an mtpipe artifact"),
    # -- --out overlapping an input --------------------------------------------------------------------------------
    Case("bucket-out-is-input", lambda r: ["bucket", "--tokens", "artifacts/bpe", "--out", "artifacts/bpe"],
         lambda r: "--out artifacts/bpe", says="is the input artifacts/bpe"),
    Case("bpe-out-inside-input", lambda r: ["bpe", "--corpus", "artifacts/fetch", "--out", "artifacts/fetch/bpe"],
         lambda r: "--out artifacts/fetch/bpe", says="is inside the input artifacts/fetch"),
    Case("bucket-out-contains-input", lambda r: ["bucket", "--tokens", "artifacts/bpe", "--out", "artifacts"],
         lambda r: "--out artifacts", says="contains the input artifacts/bpe"),
    Case("train-out-is-tokens", lambda r: ["train", "--out", "artifacts/bpe"], lambda r: "--out artifacts/bpe",
         says="is the input artifacts/bpe"),
    Case("average-out-is-a-checkpoint",
         lambda r: ["average", "--checkpoint", "artifacts/train/checkpoints/step_00000004", "--out",
                    "artifacts/train/checkpoints/step_00000004"],
         lambda r: "--out artifacts/train/checkpoints/step_00000004", says="is the input"),
    Case("decode-out-is-tokens", lambda r: ["decode", "--out", "artifacts/bpe"], lambda r: "--out artifacts/bpe",
         says="is the input artifacts/bpe"),
    Case("score-out-is-ref", lambda r: ["score", "--out", "artifacts/fetch"], lambda r: "--out artifacts/fetch",
         says="is the input artifacts/fetch"),
    Case("export-out-is-checkpoint", lambda r: ["export", "--out", "artifacts/average"],
         lambda r: "--out artifacts/average", says="is the input artifacts/average"),
    # -- a hand-run command with its default --out, which dvc.yaml tracks ------------------------------------------
    Case("bucket-default-out-is-dvc-tracked", lambda r: ["bucket"], lambda r: "artifacts/bucket",
         says="is the output of the DVC stage 'bucket'"),
    Case("train-default-out-is-dvc-tracked", lambda r: ["train"], lambda r: "artifacts/train",
         says="is the output of the DVC stage 'train'"),
    # -- params ----------------------------------------------------------------------------------------------------
    Case("params-equals-form-missing", lambda r: ["bucket", "--params=missing.yaml", "--out", "cases/b"],
         lambda r: "missing.yaml", says="params file not found"),
    Case("params-space-form-missing", lambda r: ["decode", "--params", "missing.yaml"], lambda r: "missing.yaml",
         says="params file not found"),
    Case("params-unknown-key", lambda r: ["bucket", "--params", "cases/bad.yaml", "--out", "cases/b"],
         lambda r: "cases/bad.yaml", lambda r: case_file(r, "bad.yaml", b"bucket:\n  max_tokenz: 5\n"),
         says="unknown key 'bucket.max_tokenz'"),
    Case("decode-negative-alpha", lambda r: ["decode", "--alpha", "-0.5"], lambda r: "decode.alpha",
         says="must be >= 0"),
    Case("decode-zero-beam", lambda r: ["decode", "--beam", "0"], lambda r: "decode.beam", says="must be >= 1"),
    Case("decode-beam-over-the-limit", lambda r: ["decode", "--beam", "100000"], lambda r: "--beam",
         says="decode.beam = 100000 must be >= 1 and <= 128"),
    Case("attention-text-over-the-limit",
         lambda r: ["attention", "--text", "a man in an orange hat " * 16, "--out", "cases/att"],
         lambda r: "--text", says="that attention draws"),
    # -- manifests that point outside their artifact ---------------------------------------------------------------
    Case("score-hyp-manifest-dotdot",
         lambda r: ["score", "--hyp", "cases/hyp_dotdot", "--ref", "artifacts/fetch"],
         lambda r: "cases/hyp_dotdot/manifest.json",
         lambda r: rename_listed(copy_artifact(r, "artifacts/decode", "hyp_dotdot"), "test.parquet",
                                 "../evil/h.parquet"),
         says="outside its artifact folder"),
    Case("score-hyp-manifest-absolute",
         lambda r: ["score", "--hyp", "cases/hyp_abs", "--ref", "artifacts/fetch"],
         lambda r: "cases/hyp_abs/manifest.json",
         lambda r: rename_listed(copy_artifact(r, "artifacts/decode", "hyp_abs"), "test.parquet",
                                 str(r / "cases" / "elsewhere" / "h.parquet")),
         says="outside its artifact folder"),
    Case("decode-checkpoint-symlink-out",
         lambda r: ["decode", "--checkpoint", "cases/ck_link", "--out", "cases/d"], lambda r: "cases/ck_link",
         lambda r: _link_weights_outside(r), says="outside its artifact folder"),
    Case("bucket-tokens-manifest-dotdot",
         lambda r: ["bucket", "--tokens", "cases/tok_dotdot", "--out", "cases/b"],
         lambda r: "cases/tok_dotdot/manifest.json",
         lambda r: rename_listed(copy_artifact(r, "artifacts/bpe", "tok_dotdot"), "train.parquet",
                                 "../stolen/train.parquet"),
         says="outside its artifact folder"),
    # -- spoiled artifacts -----------------------------------------------------------------------------------------
    Case("bpe-corpus-format-version-string",
         lambda r: ["bpe", "--corpus", "cases/fv", "--out", "cases/t"], lambda r: "cases/fv/manifest.json",
         lambda r: edit_manifest(copy_artifact(r, "artifacts/fetch", "fv"),
                                 lambda m: m.update(format_version="1")),
         says="format_version must be an integer"),
    Case("bpe-corpus-tampered-file",
         lambda r: ["bpe", "--corpus", "cases/tampered", "--out", "cases/t"],
         lambda r: "cases/tampered/train.parquet",
         lambda r: (copy_artifact(r, "artifacts/fetch", "tampered") / "train.parquet").write_bytes(b"PAR1junk"),
         says="does not match its manifest hash"),
    Case("bucket-tokens-corrupt-manifest",
         lambda r: ["bucket", "--tokens", "cases/corrupt", "--out", "cases/b"], lambda r: "cases/corrupt/manifest.json",
         lambda r: (copy_artifact(r, "artifacts/bpe", "corrupt") / "manifest.json").write_text("{not json"),
         says="corrupt manifest"),
    Case("train-checkpoint-without-manifest",
         lambda r: ["train", "--out", "cases/run_stray"], lambda r: "cases/run_stray/checkpoints/step_00000099",
         no_manifest_checkpoint, says="not an mtpipe checkpoint"),
    Case("average-checkpoint-without-manifest",
         lambda r: ["average", "--run", "cases/run_stray", "--out", "cases/avg"],
         lambda r: "cases/run_stray/checkpoints/step_00000099", no_manifest_checkpoint,
         says="not an mtpipe checkpoint"),
    Case("train-resume-with-another-model",
         lambda r: ["train", "--out", "cases/run_other", "--d-model", "64"], lambda r: "cases/run_other/checkpoints",
         lambda r: step_dir(r, "run_other"),
         says="checkpoint has model.d_model=32 but the params give 64, which makes model.d_k 16 -> 32"),
    Case("decode-missing-split", lambda r: ["decode", "--split", "nope"], lambda r: "artifacts/bpe",
         says="has no split 'nope'"),
    Case("decode-checkpoint-of-another-kind", lambda r: ["decode", "--checkpoint", "artifacts/bucket"],
         lambda r: "artifacts/bucket", says="is a 'batches' artifact, expected 'checkpoint'"),
    Case("score-empty-hyp-file", lambda r: ["score", "--hyp", "cases/empty.txt"], lambda r: "cases/empty.txt",
         lambda r: case_file(r, "empty.txt", b""),
         says="no hypotheses"),
    Case("score-non-utf8-hyp", lambda r: ["score", "--hyp", "cases/latin1.txt"], lambda r: "cases/latin1.txt",
         lambda r: case_file(r, "latin1.txt", b"gr\xfc\xdfe\n"),
         says="not UTF-8"),
    Case("fetch-missing-source", lambda r: ["fetch", "--source", "no/such/dir", "--out", "cases/f"],
         lambda r: "no/such/dir", says="no such directory"),
]


def _link_weights_outside(root: Path) -> None:
    """A checkpoint whose model.safetensors is a link to a file outside it (with the right hash)."""
    d = copy_artifact(root, "artifacts/average", "ck_link")
    outside = root / "cases" / "outside.safetensors"
    shutil.move(d / "model.safetensors", outside)
    (d / "model.safetensors").symlink_to(outside)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_cleanly_and_touches_nothing(case: Case, at: Path) -> None:
    case.setup(at)
    before = snapshot(at)
    r = invoke(case.args(at))
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == case.code, r.output
    assert len(errors) == 1, r.output
    assert "Traceback" not in r.output, r.output
    assert case.names(at) in errors[0], errors[0]
    assert case.says in errors[0], errors[0]
    assert snapshot(at) == before  # nothing replaced, nothing half-written, no temporary left


def test_at_least_thirty_cases_cover_every_stage() -> None:
    assert len(CASES) >= 30
    stages = {c.args(Path("."))[0] for c in CASES}
    assert stages >= {"fetch", "bpe", "bucket", "train", "average", "decode", "score", "export"}


# --------------------------------------------------------------------------------------------------------------------
# What --out may replace, and what a hand-run command writes
# --------------------------------------------------------------------------------------------------------------------


def test_out_replaces_its_own_kind_an_empty_dir_and_with_force_anything(at: Path) -> None:
    base = ["bucket", "--tokens", "artifacts/bpe", "--out"]
    (at / "cases" / "empty").mkdir(parents=True, exist_ok=True)
    assert invoke([*base, "cases/empty"]).exit_code == 0  # an empty directory
    assert artifacts.read_manifest(at / "cases" / "empty", "batches")
    assert invoke([*base, "cases/empty", "--max-tokens", "256"]).exit_code == 0  # its own kind, again
    assert artifacts.read_manifest(at / "cases" / "empty").params["bucket"]["max_tokens"] == 256
    foreign_dir(at)
    r = invoke([*base, "scratch", "--force"])
    assert r.exit_code == 0, r.output
    assert not (at / "scratch" / "important.txt").exists()
    assert artifacts.read_manifest(at / "scratch", "batches")
    shutil.rmtree(at / "scratch")
    # --force never lifts the overlap checks.
    r = invoke([*base, "artifacts/bpe", "--force"])
    assert r.exit_code == 1 and "is the input artifacts/bpe" in r.output


def test_stale_temporaries_of_a_killed_run_are_removed_live_ones_kept(at: Path) -> None:
    out = at / "cases" / "bk"
    out.parent.mkdir(exist_ok=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = out.parent / f".bk.tmp-{dead}-abc123"
    live = out.parent / ".bk.tmp-1-def456"  # pid 1 is always running
    stale_old = out.parent / f".bk.old-{dead}-xyz"
    for d in (stale, live, stale_old):
        d.mkdir()
        (d / "train.parquet").write_bytes(b"partial")
    foreign = out.parent / ".bk.tmp-notapid"
    foreign.mkdir()
    r = invoke(["bucket", "--tokens", "artifacts/bpe", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert not stale.exists() and not stale_old.exists()
    assert live.exists() and foreign.exists()  # another process's write, and a name mtpipe does not make


def test_hand_run_decode_and_score_write_nothing_unless_asked(at: Path) -> None:
    before = snapshot(at)
    r = CliRunner().invoke(app, ["decode", "--beam", "2", "--alpha", "0.6"])
    assert r.exit_code == 0, r.output
    n_test = artifacts.read_manifest(at / "artifacts" / "fetch").rows["test.parquet"]
    assert len(r.stdout.splitlines()) == n_test  # the translations, one per line, on stdout
    r2 = CliRunner().invoke(app, ["score", "--hyp", "-", "--min-bleu", "0"], input=r.stdout)
    assert r2.exit_code == 0, r2.output
    assert "BLEU" in r2.output and "gate passed" in r2.output
    r3 = invoke(["score", "--min-bleu", "99"])  # the CI gate: fails, writes nothing
    assert r3.exit_code == 3 and "gate failed" in r3.output
    assert snapshot(at) == before  # artifacts/decode and metrics/score.json untouched


def test_score_replaces_its_own_metrics_json(at: Path) -> None:
    out = at / "cases" / "m.json"
    out.parent.mkdir(exist_ok=True)
    assert invoke(["score", "--out", str(out)]).exit_code == 0
    assert invoke(["score", "--out", str(out), "--lowercase"]).exit_code == 0
    assert json.loads(out.read_text())["bleu"] >= 0
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # the usual permissions, not mkstemp's 0600


# --------------------------------------------------------------------------------------------------------------------
# A full disk
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def full_disk(tmp_path: Path):
    """A folder on a nearly full filesystem: a 1 MiB tmpfs where this process may mount one (root), else None."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        yield None
        return
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if p.returncode != 0:
        yield None
        return
    try:
        with open(mnt / "filler", "wb", buffering=0) as f:  # fill it up: nothing more fits
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        yield mnt
    finally:
        subprocess.run(["umount", "--lazy", str(mnt)], capture_output=True)  # lazy: a failed write may hold a file open


FULL_DISK_STAGES = {
    "fetch": ["fetch", "--out", "{out}/fetch"],
    "bpe": ["bpe", "--corpus", "artifacts/fetch", "--out", "{out}/bpe"],
    "decode": ["decode", "--out", "{out}/decode"],
    "score": ["score", "--out", "{out}/score.json"],
}


@pytest.mark.parametrize("stage", list(FULL_DISK_STAGES))
def test_full_disk_is_one_line_and_leaves_nothing(stage: str, at: Path, full_disk: Path | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if full_disk is None:  # no tmpfs here: every write raises ENOSPC instead
        full_disk = at / "cases" / f"enospc-{stage}"
        full_disk.mkdir(parents=True, exist_ok=True)
        _fail_writes_with_enospc(monkeypatch)
    before = snapshot(at)
    listing = sorted(p.name for p in full_disk.iterdir())
    r = invoke([a.format(out=full_disk) for a in FULL_DISK_STAGES[stage]])
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 1, r.output
    assert len(errors) == 1 and "Traceback" not in r.output, r.output
    assert str(full_disk) in errors[0] and "No space left on device (ENOSPC)" in errors[0], errors[0]
    assert sorted(p.name for p in full_disk.iterdir()) == listing  # nothing half-written, no temporary
    if not full_disk.is_relative_to(at):
        assert snapshot(at) == before


def _fail_writes_with_enospc(monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.parquet as pq

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pq, "write_table", enospc)
    monkeypatch.setattr(pq.ParquetWriter, "write_batch", enospc)
    monkeypatch.setattr(Path, "write_text", enospc)
    monkeypatch.setattr(Path, "write_bytes", enospc)
    monkeypatch.setattr(os, "fdopen", enospc)


@pytest.mark.parametrize("too_big", ["weights", "trainer_state"])
def test_full_disk_while_writing_a_checkpoint_is_one_line(too_big: str, tmp_path: Path) -> None:
    """safetensors and torch.save report a full disk in their own words (torch: a 'stream position'); a checkpoint
    write turns either into the one-line ENOSPC error and leaves no half-written checkpoint."""
    import torch

    from mtpipe.errors import MtpipeError

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("optional: mounting a small tmpfs needs root")
    try:
        big, small = torch.zeros(256 * 1024), torch.zeros(16)  # 1 MiB and 64 bytes
        weights = {"w": big if too_big == "weights" else small}
        state = {"moments": big if too_big == "trainer_state" else small}
        with pytest.raises(MtpipeError, match=r"ck: cannot write \(No space left on device \(ENOSPC\)\)"):
            writing.write_checkpoint(mnt / "ck", state_dict=weights,
                                     meta=artifacts.CheckpointManifest(model_config={}, vocab={}, step=1),
                                     trainer_state=state)
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", "--lazy", str(mnt)], capture_output=True)
