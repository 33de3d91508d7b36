"""What every part of the anchors comparison shares: the run's paths and environment, running a process, the corpora.
The orchestrating process imports no torch (this module runs in the anchors' venvs too, for the workers)."""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

from bench import machine
from mtpipe import env as mtenv

REPO = machine.REPO
DATA = Path(mtenv.get("MTPIPE_MULTI30K") or REPO / "data" / "multi30k")  # {train,val,test_2016_flickr}.{en,de}.gz
SHARED_ANCHORS = Path(mtenv.get("MTPIPE_ANCHORS") or REPO / "anchors")  # the anchors' install scripts
PY = sys.executable  # the mtpipe venv
DIMS = {"small": dict(layers=3, d_model=256, heads=4, d_ff=1024), "base": dict(layers=6, d_model=512, heads=8,
                                                                                 d_ff=2048)}
# (dropout, attention, ReLU): "paper" = mtpipe's presets, fairseq told the same; "anchors" = fs_train.sh's values
DROPOUTS = {"paper": (0.1, 0.0, 0.0), "anchors": (0.1, 0.1, 0.1)}
# For every process of every system: glibc keeps freed memory (mtpipe sets this itself on CPU), and torch 1.13's MKL
# takes its fast path on AMD CPUs too (1,024^2 fp32 matmul, 1 thread: 15.7 GFLOP/s without, 48.8 with).
SAME_FOR_ALL = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "2147483647", "MKL_DEBUG_CPU_TYPE": "5"}
# --isa avx2: torch's side as every benchmark restricts it, and CTranslate2's and fairseq's MKL besides
AVX2_ONLY = {**machine.AVX2_ONLY, "CT2_FORCE_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def say(msg: str) -> None:  # a timestamped progress line
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def sh(cmd: list[Any], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
       peak: list[int] | None = None) -> float:
    """Run ``cmd``, its output to ``log``; its wall seconds (``peak``: its peak resident bytes appended). A failure
    stops the bench with the log's tail."""
    cmd = [str(c) for c in cmd]
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if peak is not None:
        peak.append(usage.ru_maxrss * 1024)  # KiB on Linux; the largest of the process and its children
    if os.waitstatus_to_exitcode(status) != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise SystemExit(f"{tail}\n--- failed: {' '.join(cmd)}\n--- log: {log}")
    return wall


def read_raw(path: Path, n: int | None = None) -> list[str]:
    """Lines of a (gzip) text file, NFC-normalised and stripped as ``mtpipe fetch`` / ``mtpipe decode`` read text."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        lines = [unicodedata.normalize("NFC", line.rstrip("\n")).strip() for line in f]
    return lines[:n] if n else lines


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bleu(hyps: list[str], refs: list[str]) -> float:
    import sacrebleu

    return round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)


def latest_checkpoint(train_out: Path) -> Path | None:
    found = sorted((train_out / "checkpoints").glob("step_*/manifest.json"))
    return found[-1].parent if found else None


def lines_of(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


class Env:
    """Paths, interpreters and process environment of one run."""

    def __init__(self, args: argparse.Namespace, fairseq: bool = True):
        self.a = Path(args.anchors)
        self.spm = self.a / "data" / "spm" / "spm8k.model"
        self.fs_py, self.ct2_py = self.a / "venv-fs38" / "bin" / "python", self.a / "venv-ct2" / "bin" / "python"
        self.fs_bin = self.a / "data" / "fs-bin"
        self.threads, self.work, self.out = args.threads, Path(args.workdir), Path(args.out)
        self.logs = self.out / "logs"
        self.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                    "ANCHORS": str(self.a), "COLUMNS": "120", "PYTHONUNBUFFERED": "1", **SAME_FOR_ALL,
                    **(AVX2_ONLY if args.isa == "avx2" else {})}
        self.fairseq = fairseq  # a decode-only run without fairseq needs CTranslate2's venv only
        need = [self.ct2_py] + ([self.spm, self.fs_py, self.fs_bin / "dict.en.txt"] if fairseq else [])
        if missing := [str(p) for p in need if not p.exists()]:
            raise SystemExit(f"anchors not set up: missing {', '.join(missing)} (run {SHARED_ANCHORS}/"
                             "setup_anchors.sh; its log ends with 'setup done')")
        if not (DATA / "train.en.gz").exists():
            raise SystemExit(f"Multi30k not found at {DATA} (set MTPIPE_MULTI30K)")
        self.probe: dict[str, Any] = {}

    def script(self, name: str) -> Path:
        """An anchors script: the copy setup_anchors.sh put under $ANCHORS, else the shared original."""
        return self.a / name if (self.a / name).exists() else SHARED_ANCHORS / name

    def mtpipe(self, *args: Any) -> list[Any]:
        return [PY, "-m", "mtpipe", *args]

    def worker(self, python: Path | str, name: str, *args: Any) -> list[Any]:
        """A measurement of this package in its own process (``python -m bench.anchors _NAME ...``)."""
        return [python, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); from bench.anchors.__main__ import "
                f"main; sys.exit(main())", name, *args]


def write_params(work: Path) -> None:
    """params.yaml for mtpipe's stages in ``work``: Multi30k's splits, no dedup (repeats kept), the anchors' batches."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "params.yaml").write_text(
        "fetch:\n  splits: {train: train, valid: val, test: test_2016_flickr}\n  dedup: false\nbpe:\n  threads: 0\n"
        "bucket:\n  max_tokens: 4096\n  multiple_of: 8\n", encoding="utf-8")


def m30k_artifacts(e: Env) -> Path:
    """mtpipe's fetch, bpe and bucket of Multi30k with the anchors' SentencePiece model (made once)."""
    d = e.work / "m30k"
    manifest = d / "bpe" / "manifest.json"
    if (d / "bucket" / "manifest.json").exists() and manifest.exists() and json.loads(manifest.read_text())[
            "extra"]["spm_sha256"].split(":")[-1] == sha256(e.spm):
        return d
    say(f"setup: mtpipe fetch + bpe (--spm-model {e.spm}) + bucket of Multi30k in {d}")
    write_params(d)
    for stage, args in (("fetch", ["--source", DATA]), ("bpe", ["--corpus", "fetch", "--spm-model", e.spm]),
                        ("bucket", ["--tokens", "bpe"])):
        sh(e.mtpipe(stage, *args, "--out", stage), e.logs / f"setup_m30k_{stage}.log", e.env, d)
    return d


def anchors_with_spm(args: argparse.Namespace, spm_model: Path) -> None:
    """Point the run at a copy of the anchors whose data is encoded with ``spm_model`` (e.g. the quickstart's) instead
    of spm8k: venvs and scripts linked, the Multi30k text re-encoded (NFC, as ``mtpipe fetch`` reads it) and
    re-binarised for fairseq, once per model, under the work dir; every system then sees the same pieces."""
    import sentencepiece as spm

    orig = Env(args)
    work = Path(args.workdir) / f"spm-{sha256(spm_model)[:10]}"
    a = work / "anchors"
    if not (a / ".done").exists():
        say(f"setup: anchors data re-encoded with {spm_model} -> {a}")
        shutil.rmtree(a, ignore_errors=True)
        (a / "data" / "spm").mkdir(parents=True)
        for item in orig.a.iterdir():
            if item.name.startswith("venv-") or item.suffix in (".py", ".sh"):
                (a / item.name).symlink_to(item.resolve())
        shutil.copy(spm_model, a / "data" / "spm" / "spm8k.model")
        sp = spm.SentencePieceProcessor(model_file=str(spm_model))
        d = a / "data" / "spm"
        for split in ("train", "val", "test_2016_flickr"):
            for lang in ("en", "de"):
                pieces = sp.encode(read_raw(DATA / f"{split}.{lang}.gz"), out_type=str)
                (d / f"{split}.{lang}").write_text("".join(" ".join(p) + "\n" for p in pieces), encoding="utf-8")
        sh([orig.a / "venv-fs38" / "bin" / "fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
            "--trainpref", d / "train", "--validpref", d / "val", "--testpref", d / "test_2016_flickr",
            "--destdir", a / "data" / "fs-bin", "--joined-dictionary", "--workers", 2],
           work / "setup_fairseq_preprocess.log", orig.env)
        (a / ".done").write_text(str(spm_model))
    args.anchors, args.workdir = str(a), str(work)

