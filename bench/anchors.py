#!/usr/bin/env python3
"""Side by side with the real anchors: fairseq 0.12.2 and CTranslate2 versus mtpipe, one command.

On a Multi30k copy (``$MTPIPE_MULTI30K``) with the anchors' joint SentencePiece 8k model
(``$ANCHORS/data/spm/spm8k.model``, made by the anchors' ``setup_anchors.sh`` in ``$MTPIPE_ANCHORS``), 2 CPU threads
everywhere, every measurement in its own process, the parts
interleaved in rounds (train, decode, data; train, decode, data; ...) because this machine's speed drifts by up to
40 % within an hour: only the ratios measured in the same round compare.

1. **train** -- source+target tokens/s (non-pad pieces, each sentence with its EOS) of ``fairseq-train`` (fp32, its
   only CPU mode; ``fs_train.sh``, dims passed explicitly and checked in its log) against mtpipe fp32 and bf16
   (``mtpipe.train.make_train_step`` -- exactly the update ``mtpipe train`` runs -- on the batches of ``mtpipe
   bucket``, with ``tune_cpu_allocator()`` as ``mtpipe train`` calls it on CPU), at the ``small`` dims (d256, 3+3
   layers, 4 heads, d_ff 1024) and the paper's ``base`` dims, max tokens 4096 per batch. Measured as fairseq measures
   ``wps``: tokens over the wall time of each interval of updates (data loading included), the first interval
   skipped (warm-up), the median interval reported. fairseq logs target tokens only: converted to src+tgt with the
   corpus ratio of the spm files (as ``fs_wps.py``). Targets: fp32 >= 1.5x fairseq (the headline); bf16
   >= 3x, where the CPU has native bf16.
2. **decode** -- every system on the same weights (fairseq's anchor model: fairseq, mtpipe after ``mtpipe import``,
   CTranslate2 after ``mtpipe export``; mtpipe's model: mtpipe and CTranslate2), the same search (beam 4, stop once 4
   hypotheses finished, |Y|^0.6, max length source + 50), the same batches (``--decode-max-tokens`` source tokens),
   a warm-up for each, on the first ``--decode-sentences`` of test_2016_flickr; mtpipe fp32, bf16 where native, int8.
   Sentences/s and target tokens/s (hypothesis pieces without EOS), sacreBLEU and output lengths to show the outputs
   match. Targets: mtpipe fp32 >= 1.0x CTranslate2 fp32, mtpipe's best mode >= 1.0x CTranslate2's best, >= 3x
   fairseq-generate.
3. **data** -- ``fairseq-preprocess`` (binarising the already SentencePiece-encoded text, ``--joined-dictionary
   --workers 2``) against ``mtpipe bpe --spm-model`` (encoding the fetch artifact's raw text with the same model) +
   ``mtpipe bucket``, process wall times, at Multi30k size and at ``--data-pairs`` (Multi30k train repeated; fetch
   with ``dedup: false`` so the repeats stay). mtpipe's side includes the encoding that fairseq's side was given done.
   Target: mtpipe >= 3x.
4. ``--quality MINUTES`` (its own mode): fairseq and mtpipe (``mtpipe train``, train.precision auto) trained for the
   same wall time, small dims, the same warm-up (400) and peak learning rate (1e-3), then beam 4 on
   test_2016_flickr and sacreBLEU. Target: mtpipe >= fairseq + 1 BLEU. ``--quality-run DIR`` instead compares with
   an existing ``mtpipe train`` run (e.g. the quickstart's): fairseq trains for that run's minutes with the run's
   settings or its own anchor settings (``--quality-fairseq``), each side's model and alpha chosen on valid.
   ``--quality-equal-updates`` with ``--quality-run`` compares at an equal number of updates instead: the run must
   have ended at its own ``train.max_steps`` (its schedule ends there), and fairseq trains exactly as many updates,
   with no time limit.

    python bench/anchors.py --smoke --out /tmp/anchors-smoke         # every part, tiny step counts (a few minutes)
    python bench/anchors.py --rounds 2 --out bench/out/anchors        # the comparison (see bench/README.md: time)
    python bench/anchors.py --only decode --checkpoint artifacts/average --tokens artifacts/bpe
    python bench/anchors.py --quality 30 --out bench/out/quality      # equal wall-time training, then BLEU

The orchestrating process imports no torch; mtpipe runs in this Python (its venv), fairseq in ``venv-fs38`` (torch
1.13.1), CTranslate2 in ``venv-ct2`` (both built by ``setup_anchors.sh``). Writes ``results.json``, ``results.md`` and
every subprocess's log under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

from isa_probe import AVX2_ONLY as TORCH_AVX2_ONLY  # bench/ is on the path: run as python bench/anchors.py

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("MTPIPE_MULTI30K", REPO / "data" / "multi30k"))  # {train,val,test_2016_flickr}.{en,de}.gz
SHARED_ANCHORS = Path(os.environ.get("MTPIPE_ANCHORS", REPO / "anchors"))  # the anchors' install scripts
PY = sys.executable  # the mtpipe venv

DIMS = {  # mtpipe presets of the same names; fairseq flags below
    "small": dict(layers=3, d_model=256, heads=4, d_ff=1024),
    "base": dict(layers=6, d_model=512, heads=8, d_ff=2048),
}
# (dropout, attention dropout, ReLU/activation dropout): "paper" = mtpipe's presets (and fairseq's own defaults for
# the last two); "anchors" = what fs_train.sh uses, mtpipe set to match.
DROPOUTS = {"paper": (0.1, 0.0, 0.0), "anchors": (0.1, 0.1, 0.1)}
TARGETS = {("train", "small", "mtpipe bf16"): 3.0, ("train", "base", "mtpipe bf16"): 3.0,
           ("train", "small", "mtpipe fp32"): 1.5, ("train", "base", "mtpipe fp32"): 1.5}
M30K_TRAIN = 29000
# Every process of every system gets these (mtpipe sets the glibc two itself on CPU; fairseq and the reference
# trainer get them here): the allocator keeps freed memory instead of returning it to the OS at every step, and
# torch 1.13's MKL takes its fast code path on AMD CPUs too (1,024^2 fp32 matmul, 1 thread, AMD EPYC: 15.7 GFLOP/s
# without, 48.8 with; harmless on Intel).
SAME_FOR_ALL = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "2147483647", "MKL_DEBUG_CPU_TYPE": "5"}
# --isa avx2: what most users' CPUs have, on a CPU with more (each library's own switch; the ISA probe shows it took):
# torch's side as every benchmark restricts it, and CTranslate2's and fairseq's MKL (torch 1.13) besides.
AVX2_ONLY = {**TORCH_AVX2_ONLY, "CT2_FORCE_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
# mtpipe's decoding precisions measured (bf16 only where the CPU has it natively), all with fairseq's and
# CTranslate2's search: decode.stop=finished, decode.length_penalty=fairseq.
MTPIPE_DECODE_PRECISIONS = ["fp32", "bf16", "int8"]


# --------------------------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------------------------


def say(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def sh(cmd: list[Any], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None) -> float:
    """Run ``cmd`` (stdout and stderr to ``log``); its wall seconds. A failure stops the bench with the log's tail."""
    cmd = [str(c) for c in cmd]
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    wall = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise SystemExit(f"{tail}\n--- failed (exit {rc}): {' '.join(cmd)}\n--- log: {log}")
    return wall


def read_raw(path: Path, n: int | None = None) -> list[str]:
    """Lines of a (gzip) text file, NFC-normalised and stripped as ``mtpipe fetch`` / ``mtpipe decode`` read text."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [unicodedata.normalize("NFC", line.rstrip("\n")).strip() for line in f]
    return lines[:n] if n else lines


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bleu(hyps: list[str], refs: list[str]) -> float:
    import sacrebleu

    return round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)


def latest_checkpoint(train_out: Path) -> Path | None:
    found = sorted((train_out / "checkpoints").glob("step_*/manifest.json"))
    return found[-1].parent if found else None


# --------------------------------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------------------------------


class Env:
    """Paths, interpreters and process environments of one run."""

    probe: dict[str, Any] = {}

    def __init__(self, args: argparse.Namespace):
        self.a = Path(args.anchors)
        self.spm = self.a / "data" / "spm" / "spm8k.model"
        self.fs_py = self.a / "venv-fs38" / "bin" / "python"
        self.ct2_py = self.a / "venv-ct2" / "bin" / "python"
        self.threads = args.threads
        self.work = Path(args.workdir)
        self.out = Path(args.out)
        self.logs = self.out / "logs"
        self.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                    "ANCHORS": str(self.a), "COLUMNS": "120", "PYTHONUNBUFFERED": "1", **SAME_FOR_ALL}
        self.isa = getattr(args, "isa", "native")
        if self.isa == "avx2":
            self.env.update(AVX2_ONLY)
        # Only CTranslate2's venv is needed when fairseq is left out of a decode-only run (--decode-systems).
        self.fairseq = not (getattr(args, "only", "") == "decode" and "fairseq" not in args.decode_systems)
        need = (self.spm, self.fs_py, self.ct2_py, self.a / "data" / "fs-bin" / "dict.en.txt") if self.fairseq else (
            self.ct2_py,)
        missing = [p for p in need if not p.exists()]
        if missing:
            raise SystemExit(f"anchors not set up: missing {', '.join(map(str, missing))} (run "
                             f"{SHARED_ANCHORS}/setup_anchors.sh; its log ends with 'setup done')")
        if not (DATA / "train.en.gz").exists():
            raise SystemExit(f"Multi30k not found at {DATA} (set MTPIPE_MULTI30K)")

    def script(self, name: str) -> Path:
        """An anchors script: the copy setup_anchors.sh put under $ANCHORS, else the shared original."""
        p = self.a / name
        return p if p.exists() else SHARED_ANCHORS / name

    def mtpipe(self, *args: Any) -> list[Any]:
        return [PY, "-m", "mtpipe", *args]

    def worker(self, python: Path | str, name: str, *args: Any) -> list[Any]:
        return [python, Path(__file__).resolve(), name, *args]


def write_params(work: Path) -> None:
    """params.yaml for the mtpipe stages run in ``work``: Multi30k's split names, no dedup (the repeated corpus keeps
    its repeats; Multi30k itself has no exact duplicates to speak of), the anchors' batch size."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "params.yaml").write_text(
        "fetch:\n  splits: {train: train, valid: val, test: test_2016_flickr}\n  dedup: false\n"
        "bpe:\n  threads: 0\n"
        "bucket:\n  max_tokens: 4096\n  multiple_of: 8\n", encoding="utf-8")


def corpus_dir(e: Env, pairs: int) -> Path:
    """Raw text (mtpipe's input: ``{split}.{lang}.gz``) and SentencePiece pieces (fairseq's input) of Multi30k with
    train repeated to ``pairs`` lines; made once under the work dir."""
    d = e.work / "data" / str(pairs)
    if (d / ".done").exists():
        return d
    say(f"data: writing the {pairs:,}-pair corpus (raw for mtpipe, spm pieces for fairseq) to {d}")
    shutil.rmtree(d, ignore_errors=True)
    (d / "raw").mkdir(parents=True)
    (d / "spm").mkdir()
    for lang in ("en", "de"):
        for split in ("val", "test_2016_flickr"):
            shutil.copy(DATA / f"{split}.{lang}.gz", d / "raw" / f"{split}.{lang}.gz")
            shutil.copy(e.a / "data" / "spm" / f"{split}.{lang}", d / "spm" / f"{split}.{lang}")
        for src, dst, opener in ((DATA / f"train.{lang}.gz", d / "raw" / f"train.{lang}.gz", gzip.open),
                                 (e.a / "data" / "spm" / f"train.{lang}", d / "spm" / f"train.{lang}", open)):
            with (gzip.open if src.suffix == ".gz" else open)(src, "rt", encoding="utf-8") as f:
                lines = f.read().splitlines(keepends=True)
            kw = {"compresslevel": 1} if opener is gzip.open else {}
            with opener(dst, "wt", encoding="utf-8", **kw) as f:
                for start in range(0, pairs, len(lines)):
                    f.writelines(lines[: min(len(lines), pairs - start)])
    (d / ".done").write_text(str(pairs))
    return d


def m30k_artifacts(e: Env) -> Path:
    """mtpipe's fetch/bpe/bucket artifacts of Multi30k with the anchors' SentencePiece model (made once): the
    training batches of part 1 and the tokens of the fallback decoding model."""
    d = e.work / "m30k"
    want = sha256(e.spm)
    bpe_manifest = d / "bpe" / "manifest.json"
    if (d / "bucket" / "manifest.json").exists() and bpe_manifest.exists():
        if json.loads(bpe_manifest.read_text())["extra"]["spm_sha256"].split(":")[-1] == want:
            return d
    say(f"setup: mtpipe fetch + bpe (--spm-model {e.spm}) + bucket of Multi30k in {d}")
    write_params(d)
    sh(e.mtpipe("fetch", "--source", DATA, "--out", "fetch"), e.logs / "setup_m30k_fetch.log", e.env, d)
    sh(e.mtpipe("bpe", "--corpus", "fetch", "--spm-model", e.spm, "--out", "bpe"), e.logs / "setup_m30k_bpe.log",
       e.env, d)
    sh(e.mtpipe("bucket", "--tokens", "bpe", "--out", "bucket"), e.logs / "setup_m30k_bucket.log", e.env, d)
    return d


def versions(e: Env) -> dict[str, str]:
    def out(cmd: list[Any]) -> str:
        try:
            return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return "?"

    v = {"python_mtpipe": sys.version.split()[0]}
    v["torch_mtpipe"] = out([PY, "-c", "import torch; print(torch.__version__)"])
    v["ctranslate2_mtpipe_venv"] = out([PY, "-c", "import ctranslate2; print(ctranslate2.__version__)"])
    v["torch_fairseq"] = out([e.fs_py, "-c", "import torch; print(torch.__version__)"])
    v["fairseq"] = out([e.fs_py, "-c", "import fairseq; print(fairseq.__version__)"]).splitlines()[-1:] or ["?"]
    v["fairseq"] = v["fairseq"][0]
    v["ctranslate2"] = out([e.ct2_py, "-c", "import ctranslate2; print(ctranslate2.__version__)"])
    from mtpipe import __version__

    v["mtpipe"] = __version__
    return v


def machine() -> dict[str, Any]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", lscpu)[1].strip()  # type: ignore[index]
    except (OSError, TypeError):
        model = "unknown"
    return {"cpu_model": model, "nproc": os.cpu_count(), "load_average": os.getloadavg()}


# --------------------------------------------------------------------------------------------------------------------
# Part 1: training throughput
# --------------------------------------------------------------------------------------------------------------------


def fairseq_dims(dims: str, dropout: str) -> list[str]:
    d = DIMS[dims]
    p, pa, pr = DROPOUTS[dropout]
    return ["--encoder-layers", d["layers"], "--decoder-layers", d["layers"],
            "--encoder-embed-dim", d["d_model"], "--decoder-embed-dim", d["d_model"],
            "--encoder-ffn-embed-dim", d["d_ff"], "--decoder-ffn-embed-dim", d["d_ff"],
            "--encoder-attention-heads", d["heads"], "--decoder-attention-heads", d["heads"],
            "--dropout", p, "--attention-dropout", pa, "--activation-dropout", pr]


def corpus_ratio(e: Env) -> float:
    """(src + tgt) / tgt non-pad tokens of the spm train files, each sentence with its EOS (fs_wps.py's ratio)."""
    def ntok(p: Path) -> int:
        with open(p, encoding="utf-8") as f:
            return sum(len(line.split()) + 1 for line in f)

    s, t = ntok(e.a / "data" / "spm" / "train.en"), ntok(e.a / "data" / "spm" / "train.de")
    return (s + t) / t


FS_INTERVAL = re.compile(r"epoch (\d+):\s+(\d+) / (\d+) .*?wps=([\d.]+),.*?num_updates=(\d+)")


def verify_fairseq_model(log: str, dims: str, dropout: str) -> dict[str, Any]:
    """Read the model fairseq actually built from its log (its config dump and the module tree): later flags
    override earlier ones in fairseq's argparse, and this checks that the dims passed after fs_train.sh's own won."""
    d = DIMS[dims]

    def cfg(key: str) -> str | None:
        m = re.search(rf"['\"]?\b{key}['\"]?\s*[=:]\s*([\w.]+)", log)
        return m[1] if m else None

    fc1 = re.findall(r"\(fc1\): Linear\(in_features=(\d+), out_features=(\d+)", log)
    emb = re.search(r"\(embed_tokens\): Embedding\((\d+), (\d+)", log)
    found = {
        "d_model": int(emb[2]) if emb else None,
        "vocab": int(emb[1]) if emb else None,
        "ffn_layers": len(fc1),  # encoder + decoder layers (fairseq 0.12.2 lists each layer's fc1 once)
        "d_ff": sorted({int(o) for _, o in fc1}),
        "heads": cfg("encoder_attention_heads"),
        "attention_dropout": cfg("attention_dropout"),
        "activation_dropout": cfg("activation_dropout"),
    }
    p, pa, pr = DROPOUTS[dropout]
    ok = (found["d_model"] == d["d_model"] and found["ffn_layers"] == 2 * d["layers"] and found["d_ff"] == [d["d_ff"]]
          and found["heads"] == str(d["heads"]) and found["attention_dropout"] is not None
          and float(found["attention_dropout"]) == pa and float(found["activation_dropout"] or -1) == pr)
    return {"ok": ok, **found}


def fairseq_train(e: Env, dims: str, updates: int, interval: int, dropout: str, log: Path,
                  ratio: float) -> dict[str, Any]:
    scratch = e.work / "fs-tmp"
    shutil.rmtree(scratch, ignore_errors=True)
    cmd = ["bash", e.script("fs_train.sh"), updates, scratch, "--no-save", "--log-interval", interval,
           "--num-workers", 0, *fairseq_dims(dims, dropout)]
    wall = sh(cmd, log, e.env)
    text = log.read_text(encoding="utf-8", errors="replace")
    rates = []
    for m in FS_INTERVAL.finditer(text):
        i, wps, upd = int(m[2]), float(m[4]), int(m[5])
        if upd <= interval or i < interval:  # the first interval (warm-up) and ones that span an epoch end
            continue
        rates.append(wps)
    if not rates:
        raise SystemExit(f"{log}: no fairseq train intervals after the first (updates {updates}, interval {interval})")
    check = verify_fairseq_model(text, dims, dropout)
    if not check["ok"]:
        say(f"WARNING: fairseq did not build the {dims} model asked for: {check} (log {log})")
    return {"value": median(rates) * ratio, "tgt_tok_s": median(rates), "intervals_tgt_tok_s": rates,
            "process_wall_s": wall, "model_check": check}


def ref_train(e: Env, python: Path | str, steps: int, log: Path) -> dict[str, Any]:
    """The anchors' plain training loop (``ref_train.py``: ``torch.nn.Transformer`` at the small dims, the same
    batches' rule), on a given torch: how fast this environment runs a Transformer step at all, so that the share of
    any gap that is the environment's (torch version, MKL, allocator) shows."""
    js = log.with_suffix(".json")
    sh([python, e.script("ref_train.py"), "--data", e.a / "data", "--threads", e.threads, "--warmup-steps", 5,
        "--steps", steps, "--json", js], log, e.env)
    res = json.loads(js.read_text())
    return {"value": res["src_plus_tgt_tok_per_s"], "raw": res}


def mtpipe_train(e: Env, m30k: Path, dims: str, precision: str, updates: int, interval: int, dropout: str,
                 log: Path) -> dict[str, Any]:
    js = log.with_suffix(".json")
    sh(e.worker(PY, "_mtpipe-train", "--tokens", m30k / "bpe", "--batches", m30k / "bucket", "--dims", dims,
                "--precision", precision, "--updates", updates, "--interval", interval, "--dropout", dropout,
                "--threads", e.threads, "--json", js), log, e.env)
    res = json.loads(js.read_text())
    timed = res["intervals"][1:]  # the first interval is warm-up, as for fairseq
    st = [(x["src"] + x["tgt"]) / x["seconds"] for x in timed]
    tg = [x["tgt"] / x["seconds"] for x in timed]
    return {"value": median(st), "tgt_tok_s": median(tg), "intervals_src_tgt_tok_s": st, "params": res["params"]}


def worker_mtpipe_train(argv: list[str]) -> None:
    """One mtpipe training measurement (its own process): ``make_train_step`` on the bucket artifact's batches in
    ``mtpipe train``'s epoch order, per ``--interval`` updates: seconds (collation included) and real tokens."""
    ap = argparse.ArgumentParser()
    for k in ("--tokens", "--batches", "--dims", "--precision", "--dropout", "--json"):
        ap.add_argument(k, required=True)
    for k in ("--updates", "--interval", "--threads"):
        ap.add_argument(k, type=int, required=True)
    a = ap.parse_args(argv)
    import torch

    from mtpipe import artifacts, runtime
    from mtpipe import batches as mbatches
    from mtpipe import train as mtrain
    from mtpipe.config import ModelConfig, TrainConfig
    from mtpipe.model import Transformer

    torch.set_num_threads(a.threads)
    runtime.tune_cpu_allocator()  # `mtpipe train` does this on CPU
    split = mbatches.load_split(Path(a.tokens), "train")
    table = mbatches.load_batches(Path(a.batches), "train", split)
    vocab = int(artifacts.read_manifest(a.tokens, "tokens").extra["vocab_size"])
    p, pa, pr = DROPOUTS[a.dropout]
    cfg = ModelConfig(preset=a.dims, dropout=p, attention_dropout=pa, relu_dropout=pr)
    torch.manual_seed(1)
    model = Transformer(cfg, vocab).train()
    step = mtrain.make_train_step(model, TrainConfig(precision=a.precision, threads=a.threads, warmup=4000,
                                                     label_smoothing=0.1, tokens_per_update=4096))
    order = mbatches.epoch_order(len(table), 1, 0)
    intervals, src_n, tgt_n = [], 0, 0
    t0 = time.perf_counter()
    for k in range(1, a.updates + 1):
        b = int(order[(k - 1) % len(order)])
        src, tgt_in, tgt_out = mbatches.collate(split, table.batch(b))
        step(src, tgt_in, tgt_out)
        src_n, tgt_n = src_n + int(table.src_tokens[b]), tgt_n + int(table.tgt_tokens[b])
        if k % a.interval == 0:
            now = time.perf_counter()
            intervals.append({"update": k, "seconds": now - t0, "src": src_n, "tgt": tgt_n})
            print(f"update {k}: {(src_n + tgt_n) / (now - t0):,.0f} src+tgt tok/s", flush=True)
            t0, src_n, tgt_n = now, 0, 0
    params = sum(p.numel() for p in model.parameters())
    Path(a.json).write_text(json.dumps({"intervals": intervals, "params": params, "vocab": vocab,
                                        "model": {k: getattr(model.cfg, k) for k in ("d_model", "d_ff", "heads",
                                                  "encoder_layers", "decoder_layers", "dropout",
                                                  "attention_dropout", "relu_dropout")}}))


# --------------------------------------------------------------------------------------------------------------------
# Part 2: decoding
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DecodeModel:
    """One model every system decodes, on the same weights: an mtpipe checkpoint (``mtpipe import``-ed from fairseq's,
    or mtpipe's own), its bpe artifact, its CTranslate2 export (``mtpipe export``) and, for fairseq's model, the
    fairseq checkpoint itself."""

    key: str  # "fairseq-model" / "mtpipe-model"
    ckpt: Path
    tokens: Path
    export: Path
    fs_ckpt: Path | None = None

    @property
    def spm(self) -> Path:
        return self.tokens / "spm.model"


class DecodeSetup:
    """The models and inputs every decoding measurement needs, made once per run."""

    def __init__(self, e: Env, args: argparse.Namespace, m30k: Path | None):
        self.n = args.decode_sentences
        self.max_tokens = args.decode_max_tokens
        self.models: list[DecodeModel] = []
        d = e.work / "decode"
        d.mkdir(parents=True, exist_ok=True)
        self.refs = read_raw(DATA / "test_2016_flickr.de.gz", self.n)
        self.src_raw = d / f"test.{self.n}.en"
        self.src_raw.write_text("".join(s + "\n" for s in read_raw(DATA / "test_2016_flickr.en.gz", self.n)),
                                encoding="utf-8")
        # fairseq: the checkpoint (trained with the anchors' protocol when absent) and the test set binarised
        self.systems = args.decode_systems
        self.fs_ckpt = self.fs_bin = None
        if "fairseq" in self.systems:
            self.fs_ckpt = Path(args.fs_checkpoint) if args.fs_checkpoint else self._fairseq_checkpoint(e, args)
            self.fs_bin = self._fairseq_bin(e, d)
        # mtpipe: the checkpoint and its tokens (a short training run of `mtpipe train` when absent)
        if args.checkpoint:
            self.ckpt, self.tokens = Path(args.checkpoint), Path(args.tokens)
        else:
            assert m30k is not None
            self.ckpt, self.tokens = self._mtpipe_checkpoint(e, args, m30k), m30k / "bpe"
        self.spm = self.tokens / "spm.model"
        say(f"decode: mtpipe export of {self.ckpt} (CTranslate2, float32 weights)")
        self.export = e.work / "export-ct2"
        sh(e.mtpipe("export", "--checkpoint", self.ckpt, "--tokens", self.tokens, "--out", self.export, "--force"),
           e.logs / "setup_export.log", e.env)
        ck = json.loads((self.ckpt / "manifest.json").read_text())["extra"]
        self.mt_model = {k: ck["model_config"].get(k) for k in ("d_model", "d_ff", "heads", "encoder_layers",
                                                                  "decoder_layers")}
        self.mt_step = ck.get("step")
        self.greedy_match: dict[str, Any] | None = None
        if self.fs_ckpt is not None:
            self.models.append(self._import_fairseq(e))
        self.models.append(DecodeModel("mtpipe-model", self.ckpt, self.tokens, self.export))

    def _import_fairseq(self, e: Env) -> DecodeModel:
        """fairseq's checkpoint through ``mtpipe import`` and ``mtpipe export``: one set of weights for all three
        systems; then mtpipe's greedy output against fairseq's on the test sentences (the import's end-to-end
        check: identical piece sequences expected)."""
        assert self.fs_ckpt is not None and self.fs_bin is not None
        d = e.work / "import-fs"
        say(f"decode: mtpipe import of {self.fs_ckpt}, then export to CTranslate2")
        sh(e.mtpipe("import", "--checkpoint", self.fs_ckpt, "--dict", e.a / "data" / "fs-bin", "--spm-model", e.spm,
                    "--out", d / "ck", "--tokens-out", d / "bpe", "--force"), e.logs / "setup_import.log", e.env)
        sh(e.mtpipe("export", "--checkpoint", d / "ck", "--tokens", d / "bpe", "--out", d / "ct2", "--force"),
           e.logs / "setup_import_export.log", e.env)
        dm = DecodeModel("fairseq-model", d / "ck", d / "bpe", d / "ct2", self.fs_ckpt)
        say("decode: greedy outputs of fairseq and of mtpipe on the imported weights")
        # fairseq-generate's default --min-len 1 and mtpipe's decode.min_len 1 (mtpipe_decode): the same search
        fs = fairseq_decode(e, self, dm, 1, e.logs / "setup_greedy_fairseq.log")
        mt = mtpipe_decode(e, self, dm, "fp32", "fairseq", "finished", e.logs / "setup_greedy_mtpipe.log", beam=1)
        same = sum(a == b for a, b in zip(fs["pieces"], mt["pieces"]))
        # fairseq's length limit is per batch (a x the batch's widest source + b), mtpipe's per sentence; outputs
        # that only differ past the shorter limit are counted apart.
        cut = sum(a != b and (a.startswith(b) or b.startswith(a)) and min(len(a), len(b)) > 0
                  for a, b in zip(fs["pieces"], mt["pieces"]))
        self.greedy_match = {"sentences": self.n, "identical": same, "rate": same / max(1, self.n),
                             "equal_up_to_the_length_limit": cut,
                             "first_differences": [(i, a, b) for i, (a, b) in enumerate(zip(fs["pieces"],
                                                                                           mt["pieces"]))
                                                   if a != b][:5]}
        say(f"decode: greedy outputs identical on {same} of {self.n} sentences ({cut} more equal up to the "
            "shorter length limit)")
        return dm

    def _fairseq_checkpoint(self, e: Env, args: argparse.Namespace) -> Path:
        if args.smoke:
            save = e.work / "fs-ckpt-smoke"
            updates = 4
        else:
            save = e.a / "fs-ckpt"
            updates = 800
        ckpt = save / "checkpoint_last.pt"
        if not ckpt.exists():
            say(f"decode: no fairseq checkpoint at {ckpt}: fs_train.sh {updates} (the anchors' protocol)")
            sh(["bash", e.script("fs_train.sh"), updates, save], e.logs / f"setup_fs_train_{updates}.log", e.env)
        return ckpt

    def _fairseq_bin(self, e: Env, d: Path) -> Path:
        full = e.a / "data" / "fs-bin"
        if self.n >= 1000:
            return full
        out = d / f"fs-bin-{self.n}"
        if not (out / "test.en-de.en.idx").exists():  # the first n test sentences, with fairseq's dictionaries
            for lang in ("en", "de"):
                lines = (e.a / "data" / "spm" / f"test_2016_flickr.{lang}").read_text(encoding="utf-8").splitlines()
                (d / f"fs-test-{self.n}.{lang}").write_text("\n".join(lines[: self.n]) + "\n", encoding="utf-8")
            sh([e.a / "venv-fs38" / "bin" / "fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
                "--testpref", d / f"fs-test-{self.n}", "--destdir", out, "--srcdict", full / "dict.en.txt",
                "--tgtdict", full / "dict.de.txt", "--workers", 1], e.logs / "setup_fs_bin_subset.log", e.env)
        return out

    def _mtpipe_checkpoint(self, e: Env, args: argparse.Namespace, m30k: Path) -> Path:
        minutes = args.train_minutes if args.train_minutes is not None else (0.5 if args.smoke else 10.0)
        out = e.work / f"mt-ckpt-{minutes:g}min"
        ck = latest_checkpoint(out)
        if ck is None:
            say(f"decode: no --checkpoint: mtpipe train (small) for {minutes:g} min -> {out}")
            sh(e.mtpipe("train", *mtpipe_train_flags(args, minutes, out, m30k)), e.logs / "setup_mtpipe_train.log",
               e.env, m30k)
            ck = latest_checkpoint(out)
            assert ck is not None
        return ck


def mtpipe_train_flags(args: argparse.Namespace, minutes: float, out: Path, m30k: Path) -> list[Any]:
    """`mtpipe train` for an equal-budget run: small dims, the anchors' schedule (warm-up 400, peak lr 1e-3:
    d_model^-0.5 * 400^-0.5 = 3.125e-3 times lr_scale 0.32), batches of 4096 tokens, one update per batch."""
    p, pa, pr = DROPOUTS[args.dropout]
    return ["--tokens", m30k / "bpe", "--batches", m30k / "bucket", "--out", out, "--preset", "small",
            "--dropout", p, "--attention-dropout", pa, "--relu-dropout", pr, "--max-time", minutes, "--max-steps", 0,
            "--tokens-per-update", 4096, "--warmup", 400, "--lr-scale", 0.32, "--save-every-minutes", 0,
            "--valid-every-steps", 0, "--threads", args.threads, "--seed", 1, *args.mtpipe_train_args.split()]


def fairseq_generate(e: Env, ckpt: Path, data_bin: Path, n: int, log: Path, subset: str = "test",
                     lenpen: float = 0.6) -> dict[str, Any]:
    """fairseq-generate (through the anchors' launcher that avoids its broken fused encoder path on torch 1.13),
    beam 4, lenpen 0.6, batch 64, max length source + 50 (fairseq's --max-len-a/b; its source length is the batch's
    longest). Speed from its own "Translated ..." timer (generation only)."""
    out = log.with_suffix(".out")
    cmd = [e.fs_py, e.script("fs_generate_nobt.py"), data_bin, "--path", ckpt, "--gen-subset", subset,
           "--source-lang", "en", "--target-lang", "de", "--beam", 4, "--lenpen", lenpen, "--batch-size", 64, "--cpu",
           "--remove-bpe", "sentencepiece", "--max-len-a", 1, "--max-len-b", 50]
    t0 = time.perf_counter()
    with open(out, "w", encoding="utf-8") as f, open(log, "w", encoding="utf-8") as err:
        rc = subprocess.call([str(c) for c in cmd], stdout=f, stderr=err, env=e.env)
    wall = time.perf_counter() - t0
    text = out.read_text(encoding="utf-8") + log.read_text(encoding="utf-8", errors="replace")
    if rc != 0:
        raise SystemExit(f"{text[-3000:]}\n--- fairseq-generate failed (exit {rc}); log {log}")
    m = re.search(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s", text)
    if not m:
        raise SystemExit(f"{log}: no 'Translated ...' line from fairseq-generate")
    secs = float(m[3])
    ntok, det = 0, {}
    for line in out.read_text(encoding="utf-8").splitlines():
        if line.startswith("P-"):  # one positional score per output piece, the last for </s>
            ntok += len(line.split("\t")[1].split()) - 1
        elif line.startswith("D-"):
            i, _, t = line.split("\t")
            det[int(i[2:])] = t
    hyps = [det.get(i, "") for i in range(n)]
    return {"seconds": secs, "sentences": len(det), "hyp_tokens": ntok, "hyps": hyps, "process_wall_s": wall}


def fairseq_decode(e: Env, s: DecodeSetup, dm: DecodeModel, beam: int, log: Path) -> dict[str, Any]:
    """fairseq's SequenceGenerator through bench/fairseq_decode.py: fairseq's own batches of ``--max-tokens``
    source tokens (the budget every system gets), a warm-up, beam ``beam``, |Y|^0.6, max length source + 50."""
    js, txt, pcs = log.with_suffix(".json"), log.with_suffix(".txt"), log.with_suffix(".pieces")
    sh([e.fs_py, REPO / "bench" / "fairseq_decode.py", "--checkpoint", dm.fs_ckpt, "--data", s.fs_bin,
        "--max-tokens", s.max_tokens, "--beam", beam, "--alpha", 0.6, "--warmup", warmup_count(s.n),
        "--min-len", 1, "--threads", e.threads, "--json", js, "--hyps", txt, "--pieces", pcs], log, e.env)
    res = json.loads(js.read_text())
    res["hyps"] = txt.read_text(encoding="utf-8").split("\n")[:-1]
    res["pieces"] = pcs.read_text(encoding="utf-8").split("\n")[:-1]
    return res


def mtpipe_decode(e: Env, s: DecodeSetup, dm: DecodeModel, precision: str, penalty: str, stop: str, log: Path,
                  beam: int = 4, compile: bool = False, processes: int = 1) -> dict[str, Any]:
    js, txt, pcs = log.with_suffix(".json"), log.with_suffix(".txt"), log.with_suffix(".pieces")
    sh(e.worker(PY, "_mtpipe-decode", "--checkpoint", dm.ckpt, "--spm", dm.spm, "--src", s.src_raw,
                "--precision", precision, "--penalty", penalty, "--stop", stop, "--threads", e.threads, "--json", js,
                "--hyps", txt, "--pieces", pcs, "--max-tokens", s.max_tokens, "--beam", beam,
                "--processes", processes, *(["--compile"] if compile else [])),
       log, e.env)
    res = json.loads(js.read_text())
    res["hyps"] = txt.read_text(encoding="utf-8").split("\n")[:-1]
    res["pieces"] = pcs.read_text(encoding="utf-8").split("\n")[:-1]
    return res


def worker_mtpipe_decode(argv: list[str]) -> None:
    """One mtpipe decoding measurement: ``mtpipe.decode.translate`` (what ``mtpipe decode`` runs) after a warm-up
    on the first sentences (:func:`warmup_count`); the timer covers translation only (as fairseq's and
    CTranslate2's)."""
    ap = argparse.ArgumentParser()
    for k in ("--checkpoint", "--spm", "--src", "--precision", "--penalty", "--stop", "--json", "--hyps", "--pieces"):
        ap.add_argument(k, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--beam", type=int, required=True)
    ap.add_argument("--compile", action="store_true", help="decode.compile (built in the warm-up)")
    ap.add_argument("--processes", type=int, default=1,
                    help="decode.processes: a DecodePool of N processes, --threads split among them")
    a = ap.parse_args(argv)
    import sentencepiece as spm
    import torch

    from mtpipe import artifacts, runtime
    from mtpipe.config import DecodeConfig
    from mtpipe.decode import translate
    from mtpipe.model import build_model

    torch.set_num_threads(a.threads)
    runtime.tune_cpu_allocator()  # `mtpipe decode` does this on CPU
    ck = artifacts.load_checkpoint(a.checkpoint)
    model = build_model(ck.model_config, int(ck.vocab["size"]))
    model.load_state_dict(ck.state_dict)
    model.eval()
    sp = spm.SentencePieceProcessor(model_file=a.spm)
    sources = [s[: model.cfg.max_positions - 1] for s in sp.encode(read_raw(Path(a.src)))]
    # min_len 1: fairseq-generate's --min-len and CTranslate2's min_decoding_length default (never an empty output)
    cfg = DecodeConfig(beam=a.beam, alpha=0.6, length_penalty=a.penalty, max_len_a=1.0, max_len_b=50,
                       precision=a.precision, stop=a.stop, max_tokens=a.max_tokens, min_len=1, compile=a.compile)
    if a.processes > 1:
        # What `mtpipe decode --processes N` runs: the processes (started, loaded and warmed up here, untimed)
        # share the sentences out; the same warm-up decode as below.
        from mtpipe.search import DecodeRules
        from mtpipe.workers import DecodePool

        pool = DecodePool(dataclasses.replace(cfg, processes=a.processes, threads=max(1, a.threads // a.processes)),
                          Path(a.checkpoint), None, a.processes)
        try:
            rules = DecodeRules.from_config(cfg)
            pool.translate(sources[: warmup_count(len(sources))], rules)
            t0 = time.perf_counter()
            results = pool.translate(sources, rules)
            secs = time.perf_counter() - t0
        finally:
            pool.close()
    else:
        translate(model, sources[: warmup_count(len(sources))], cfg, "cpu")  # warm-up: allocator, oneDNN kernels
        if a.compile:  # and one sentence alone (a batch's tail, run as two), which the line above may not meet
            translate(model, sources[:1], cfg, "cpu")
        t0 = time.perf_counter()
        results = translate(model, sources, cfg, "cpu")
        secs = time.perf_counter() - t0
    hyps = [r[0].tokens for r in results]
    Path(a.hyps).write_text("".join(line + "\n" for line in sp.decode(hyps)), encoding="utf-8")
    Path(a.pieces).write_text("".join(" ".join(sp.id_to_piece(hyp)) + "\n" for hyp in hyps), encoding="utf-8")
    Path(a.json).write_text(json.dumps({"seconds": secs, "sentences": len(hyps),
                                        "hyp_tokens": sum(map(len, hyps))}))


def ct2_decode(e: Env, s: DecodeSetup, dm: DecodeModel, compute_type: str, limit: str,
               log: Path, replicas: int = 1) -> dict[str, Any]:
    js, txt = log.with_suffix(".json"), log.with_suffix(".txt")
    sh(e.worker(e.ct2_py, "_ct2-decode", "--model", dm.export, "--spm", dm.spm, "--src", s.src_raw,
                "--compute-type", compute_type, "--batch", s.max_tokens, "--batch-type", "tokens", "--limit", limit,
                "--threads", e.threads, "--replicas", replicas, "--json", js, "--hyps", txt), log,
       {**e.env, "CT2_VERBOSE": "1"})
    res = json.loads(js.read_text())
    isa = re.search(r"ISA:?\s*([\w-]+)", log.read_text(errors="replace"))  # CTranslate2 logs the ISA it dispatches to
    res["isa"] = isa[1] if isa else "?"
    res["hyps"] = txt.read_text(encoding="utf-8").split("\n")[:-1]
    return res


def worker_ct2_decode(argv: list[str]) -> None:
    """One CTranslate2 measurement (runs in venv-ct2: ctranslate2 and sentencepiece only): ``translate_batch``,
    beam 4, length_penalty 0.6 (|Y|^alpha), ``batch`` sentences per batch. CTranslate2's length limit is one number
    per call: ``--limit batch`` makes one call for all sentences with the longest sentence's limit (source + 50; how
    CTranslate2 is used, and its fastest way), ``--limit sentence`` one call per group of sentences with the same
    limit (exactly mtpipe's per-sentence limit, but small groups make small batches). A warm-up on the first
    sentences (:func:`warmup_count`); the timer covers translation only."""
    ap = argparse.ArgumentParser()
    for k in ("--model", "--spm", "--src", "--compute-type", "--limit", "--json", "--hyps"):
        ap.add_argument(k, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--batch-type", choices=["examples", "tokens"], default="examples")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--replicas", type=int, default=1,
                    help="CTranslate2's inter_threads (model replicas decoding batches side by side), --threads "
                         "split among them")
    a = ap.parse_args(argv)
    import ctranslate2
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=a.spm)
    pieces = sp.encode(read_raw(Path(a.src)), out_type=str)
    tr = ctranslate2.Translator(a.model, device="cpu", compute_type=a.compute_type, inter_threads=a.replicas,
                                intra_threads=max(1, a.threads // a.replicas))

    def run(idx: list[int]) -> dict[int, list[str]]:
        groups: dict[int, list[int]] = {}
        for i in idx:
            groups.setdefault(int(len(pieces[i]) + 50), []).append(i)
        if a.limit == "batch":
            groups = {max(groups): [i for g in groups.values() for i in g]}
        out = {}
        for lim, g in groups.items():
            res = tr.translate_batch([pieces[i] for i in g], beam_size=4, length_penalty=0.6, max_batch_size=a.batch,
                                     batch_type=a.batch_type, max_decoding_length=lim)
            out.update({i: r.hypotheses[0] for i, r in zip(g, res)})
        return out

    run(list(range(warmup_count(len(pieces)))))
    t0 = time.perf_counter()
    hyps = run(list(range(len(pieces))))
    secs = time.perf_counter() - t0
    Path(a.hyps).write_text("".join(sp.decode_pieces(hyps[i]) + "\n" for i in range(len(pieces))),
                            encoding="utf-8")
    Path(a.json).write_text(json.dumps({"seconds": secs, "sentences": len(pieces),
                                        "hyp_tokens": sum(len(h) for h in hyps.values()),
                                        "ctranslate2": ctranslate2.__version__}))


def warmup_count(n: int) -> int:
    """Sentences decoded untimed first (allocator, kernel caches): 48 of 1000, fewer for a smoke run's handful."""
    return min(48, max(4, n // 20), n)


def decode_result(r: dict[str, Any], refs: list[str]) -> dict[str, Any]:
    hyps = r.pop("hyps")
    return {**r, "value": r["sentences"] / r["seconds"], "sent_s": r["sentences"] / r["seconds"],
            "tgt_tok_s": r["hyp_tokens"] / r["seconds"], "bleu": bleu(hyps, refs),
            "mean_len": r["hyp_tokens"] / max(r["sentences"], 1)}


# --------------------------------------------------------------------------------------------------------------------
# Part 3: data preparation
# --------------------------------------------------------------------------------------------------------------------


def data_round(e: Env, pairs: int, r: int) -> dict[str, dict[str, Any]]:
    d = corpus_dir(e, pairs)
    if not (d / "fetch" / "manifest.json").exists():  # not timed: mtpipe's counterpart of having text files
        write_params(d)
        wall = sh(e.mtpipe("fetch", "--source", "raw", "--out", "fetch"), e.logs / f"setup_fetch_{pairs}.log",
                  e.env, d)
        (d / "fetch_seconds").write_text(f"{wall:.3f}")
    fs_dest = d / "fs-bin"
    shutil.rmtree(fs_dest, ignore_errors=True)
    fs = sh([e.a / "venv-fs38" / "bin" / "fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
             "--trainpref", d / "spm" / "train", "--validpref", d / "spm" / "val",
             "--testpref", d / "spm" / "test_2016_flickr", "--destdir", fs_dest, "--joined-dictionary",
             "--workers", 2], e.logs / f"r{r}_data_{pairs}_fairseq_preprocess.log", e.env)
    shutil.rmtree(fs_dest, ignore_errors=True)
    bpe = sh(e.mtpipe("bpe", "--corpus", "fetch", "--spm-model", e.spm, "--out", "bpe_t"),
             e.logs / f"r{r}_data_{pairs}_mtpipe_bpe.log", e.env, d)
    bucket = sh(e.mtpipe("bucket", "--tokens", "bpe_t", "--out", "bucket_t"),
                e.logs / f"r{r}_data_{pairs}_mtpipe_bucket.log", e.env, d)
    pairs_in = sum(json.loads((d / "bpe_t" / "manifest.json").read_text())["extra"]["pairs"].values())
    return {"fairseq-preprocess": {"value": fs, "seconds": fs},
            "mtpipe bpe+bucket": {"value": bpe + bucket, "seconds": bpe + bucket, "bpe_s": bpe, "bucket_s": bucket,
                                  "pairs_encoded": pairs_in,
                                  "fetch_s_not_counted": float((d / "fetch_seconds").read_text())}}


# --------------------------------------------------------------------------------------------------------------------
# Rounds, table, files
# --------------------------------------------------------------------------------------------------------------------


ISA_PROBE = REPO / "bench" / "isa_probe.py"  # one line of JSON: what torch uses under the run's environment


def isa_probe(e: Env) -> dict[str, Any]:
    """What each library will use on this CPU under this run's environment (``--isa``): torch's dispatch
    capability, whether mtpipe sees native bf16 (a bf16 matmul then runs at bf16 speed), fp32/bf16 matmul rates,
    and CTranslate2's ISA as it logs it."""
    log = e.logs / "isa_probe.log"
    sh([PY, ISA_PROBE, "--size", 512], log, e.env)
    probe = json.loads(log.read_text().splitlines()[-1])
    ct2 = e.logs / "isa_probe_ct2.log"
    sh([e.ct2_py, "-c", "import ctranslate2; print(ctranslate2.get_supported_compute_types('cpu'))"], ct2, e.env)
    probe["ctranslate2_compute_types"] = ct2.read_text(errors="replace").strip().splitlines()[-1]
    return probe  # CTranslate2's ISA is in each of its decode results ("isa", from its log)


def matmul_probe(e: Env, log: Path) -> float:
    sh([PY, e.script("matmul_bench.py"), e.threads, 5, 2048], log, e.env)
    m = re.search(r"median=([\d.]+)", log.read_text())
    return float(m[1]) if m else float("nan")


def run_rounds(e: Env, args: argparse.Namespace, parts: list[str]) -> dict[str, Any]:
    ratio = corpus_ratio(e) if e.fairseq else float("nan")  # training's token ratio: not needed by a decode-only run
    m30k = m30k_artifacts(e) if ("train" in parts or ("decode" in parts and not args.checkpoint)) else None
    dec = DecodeSetup(e, args, m30k) if "decode" in parts else None
    steps = {k: int(v) for k, v in (kv.split("=") for kv in args.train_updates.split(","))}
    rounds: list[dict[str, Any]] = []
    for r in range(1, args.rounds + 1):
        res: dict[str, Any] = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        res["machine"] = {"matmul": {"value": matmul_probe(e, e.logs / f"r{r}_matmul.log")}}
        for part in parts:
            if part == "train":
                for dims in args.train_dims.split(","):
                    n, iv = steps[dims], max(1, steps[dims] // args.train_intervals)
                    say(f"round {r}: train {dims}: fairseq fp32, {n} updates")
                    row = {"fairseq fp32": fairseq_train(e, dims, n, iv, args.dropout,
                                                         e.logs / f"r{r}_train_{dims}_fairseq.log", ratio)}
                    assert m30k is not None
                    if dims == "small":  # ref_train.py's model is the small one
                        for label, py, tag in (("plain loop, torch 1.13", e.fs_py, "t113"),
                                               ("plain loop, mtpipe's torch", PY, "mt")):
                            say(f"round {r}: train {dims}: {label}")
                            row[label] = ref_train(e, py, max(10, n // 2), e.logs / f"r{r}_train_{dims}_ref_{tag}.log")
                    for p in ("fp32", "bf16"):
                        if p == "bf16" and not e.probe["native_bf16"]:
                            continue  # no native bf16 on this CPU (or --isa avx2): emulated bf16 is not a mode
                        say(f"round {r}: train {dims}: mtpipe {p}, {n} updates")
                        row[f"mtpipe {p}"] = mtpipe_train(e, m30k, dims, p, n, iv, args.dropout,
                                                          e.logs / f"r{r}_train_{dims}_mtpipe_{p}.log")
                    res[f"train {dims}"] = row
            elif part == "decode":
                # Every system on the same weights, the same search (beam 4, stop once 4 hypotheses finished,
                # |Y|^0.6, max length source + 50), the same token budget per batch, each after a warm-up.
                assert dec is not None
                for dm in dec.models:
                    row = {}
                    tag = f"r{r}_decode_{dm.key}"
                    if dm.fs_ckpt is not None:
                        say(f"round {r}: decode {dm.key}, {dec.n} sentences: fairseq fp32")
                        row["fairseq fp32"] = decode_result(
                            fairseq_decode(e, dec, dm, 4, e.logs / f"{tag}_fairseq.log"), dec.refs)
                    for p in MTPIPE_DECODE_PRECISIONS:
                        if p == "bf16" and not e.probe["native_bf16"]:
                            continue  # no native bf16: emulated, minutes per matmul
                        say(f"round {r}: decode {dm.key}: mtpipe {p}")
                        row[f"mtpipe {p}"] = decode_result(
                            mtpipe_decode(e, dec, dm, p, "fairseq", "finished", e.logs / f"{tag}_mtpipe_{p}.log"),
                            dec.refs)
                    compiled_precisions = [p for p in ("fp32", "bf16") if args.decode_compile
                                           and (p == "fp32" or e.probe["native_bf16"])]
                    for p in compiled_precisions:
                        say(f"round {r}: decode {dm.key}: mtpipe {p}, decode.compile")
                        row[f"mtpipe {p} compiled"] = decode_result(
                            mtpipe_decode(e, dec, dm, p, "fairseq", "finished",
                                          e.logs / f"{tag}_mtpipe_{p}_compiled.log", compile=True), dec.refs)
                    for ct in ("float32", "int8"):
                        say(f"round {r}: decode {dm.key}: CTranslate2 {ct}")
                        row[f"CTranslate2 {ct}"] = decode_result(
                            ct2_decode(e, dec, dm, ct, args.ct2_limit, e.logs / f"{tag}_ct2_{ct}.log"), dec.refs)
                    n = args.decode_processes
                    if n > 1:  # each side's own way of decoding batches side by side, --threads split among them
                        for p, ct in (("fp32", "float32"), ("int8", "int8")):
                            say(f"round {r}: decode {dm.key}: mtpipe {p}, {n} processes")
                            row[f"mtpipe {p}, {n} processes"] = decode_result(
                                mtpipe_decode(e, dec, dm, p, "fairseq", "finished",
                                              e.logs / f"{tag}_mtpipe_{p}_p{n}.log", processes=n), dec.refs)
                            for cp in compiled_precisions if p == "fp32" else ():
                                say(f"round {r}: decode {dm.key}: mtpipe {cp} compiled, {n} processes")
                                row[f"mtpipe {cp} compiled, {n} processes"] = decode_result(
                                    mtpipe_decode(e, dec, dm, cp, "fairseq", "finished",
                                                  e.logs / f"{tag}_mtpipe_{cp}_compiled_p{n}.log", compile=True,
                                                  processes=n), dec.refs)
                            say(f"round {r}: decode {dm.key}: CTranslate2 {ct}, {n} replicas")
                            row[f"CTranslate2 {ct}, {n} replicas"] = decode_result(
                                ct2_decode(e, dec, dm, ct, args.ct2_limit, e.logs / f"{tag}_ct2_{ct}_r{n}.log",
                                           replicas=n), dec.refs)
                    res[f"decode {dm.key}"] = row
            elif part == "data":
                for pairs in (M30K_TRAIN, args.data_pairs):
                    say(f"round {r}: data {pairs:,} pairs: fairseq-preprocess, mtpipe bpe + bucket")
                    res[f"data {pairs}"] = data_round(e, pairs, r)
        rounds.append(res)
        say(f"round {r} done")
    info: dict[str, Any] = {"corpus_src_tgt_over_tgt": ratio}
    if dec is not None:
        info["decode"] = {"sentences": dec.n, "max_tokens_per_batch": dec.max_tokens,
                          "fairseq_checkpoint": str(dec.fs_ckpt), "mtpipe_checkpoint":
                          str(dec.ckpt), "mtpipe_tokens": str(dec.tokens), "mtpipe_model": dec.mt_model,
                          "mtpipe_step": dec.mt_step, "ct2_export": str(dec.export),
                          "greedy_match_on_imported_fairseq_model": dec.greedy_match}
    return {"rounds": rounds, "setup": info}


def side_by_side(system: str) -> int:
    """How many processes (mtpipe, "..., N processes") or replicas (CTranslate2, "..., N replicas") a decoding row's
    system ran side by side: 1 for the one-process rows."""
    m = re.search(r", (\d+) (?:processes|replicas)$", system)
    return int(m[1]) if m else 1


def summarise(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (group, system, unit): per-round values, per-round ratios to the group's baselines measured in
    the same round, and min / median / max of both."""
    rows = []
    groups = [g for g in rounds[0] if g != "started"]
    for g in groups:
        decode = g.startswith("decode")
        for system in rounds[0][g]:
            units = [("tgt tok/s", "tgt_tok_s"), ("sent/s", "sent_s")] if decode else [(None, "value")]
            for unit, key in units:
                if unit is None:
                    unit = {"machine": "GFLOP/s", "data": "s (wall)"}.get(g.split()[0], "src+tgt tok/s")
                vals = [rd[g][system][key] for rd in rounds]
                base = []
                if g.startswith("train"):
                    base = [("fairseq", "fairseq fp32", False)]
                elif decode:
                    base = [("fairseq", "fairseq fp32", False), ("ct2 fp32", "CTranslate2 float32", False)]
                    n = side_by_side(system)
                    if n > 1 and system.startswith("mtpipe"):  # decode.processes: also against CTranslate2's replicas
                        base.append((f"ct2 fp32, {n} replicas", f"CTranslate2 float32, {n} replicas", False))
                elif g.startswith("data"):
                    base = [("fairseq", "fairseq-preprocess", True)]  # times: ratio = fairseq s / mtpipe s
                ratios = {}
                for label, ref, inverse in base:
                    if ref == system or ref not in rounds[0][g]:  # the same system, or one left out of the run
                        continue
                    per = [(rd[g][ref][key] / rd[g][system][key]) if inverse else
                           (rd[g][system][key] / rd[g][ref][key]) for rd in rounds]
                    ratios[label] = per
                rows.append({"group": g, "system": system, "unit": unit, "values": vals, "median": median(vals),
                             "min": min(vals), "max": max(vals), "ratios": ratios,
                             "median_ratios": {k: median(v) for k, v in ratios.items()},
                             "ratio_ranges": {k: (min(v), max(v)) for k, v in ratios.items()}})
    for row in rows:
        g, s = row["group"], row["system"]
        key = ("train", g.split()[-1], s) if g.startswith("train") else None
        target, vs = None, "fairseq"
        if key in TARGETS:
            target = TARGETS[key]
        elif g.startswith("data") and s.startswith("mtpipe"):
            target = 3.0
        row["target"] = target
        if isinstance(target, float):
            row["pass"] = row["median_ratios"].get(vs, 0) >= target
    return rows


def fmt_num(x: float) -> str:
    if x != x:
        return "nan"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:,.1f}" if abs(x) >= 10 else f"{x:.2f}"


def cell(value: float, ratios: dict[str, float]) -> str:
    if not ratios:
        return fmt_num(value)
    return fmt_num(value) + " (" + ", ".join(f"{r:.2f}x {k}" for k, r in ratios.items()) + ")"


def table_rows(rows: list[dict[str, Any]], n_rounds: int) -> tuple[list[str], list[list[str]]]:
    header = ["part", "system", "unit", *[f"round {i + 1}" for i in range(n_rounds)], "min / median / max",
              "ratio: median (min-max)", "target"]
    out = []
    for row in rows:
        per = [cell(v, {k: r[i] for k, r in row["ratios"].items()}) for i, v in enumerate(row["values"])]
        spread = " / ".join(fmt_num(row[k]) for k in ("min", "median", "max"))
        ratio = ", ".join(f"{row['median_ratios'][k]:.2f}x {k} ({lo:.2f}-{hi:.2f})"
                          for k, (lo, hi) in row["ratio_ranges"].items())
        target = row["target"]
        verdict = ""
        if isinstance(target, float):
            verdict = f">= {target:g}x fairseq: " + ("pass" if row.get("pass") else "MISSED")
        out.append([row["group"], row["system"], row["unit"], *per, spread, ratio, verdict])
    return header, out


def decode_verdict(rows: list[dict[str, Any]], rounds: list[dict[str, Any]] | None = None) -> str | None:
    """The decoding targets per model, on target tokens/s: mtpipe fp32 >= 1.0x CTranslate2 fp32; mtpipe's best mode
    >= 1.0x CTranslate2's best mode (each side's fastest in that round); mtpipe's best >= 3x fairseq."""
    lines = []
    for g in sorted({r["group"] for r in rows if r["group"].startswith("decode")}):
        fp32 = next((r for r in rows if r["group"] == g and r["system"] == "mtpipe fp32"
                     and r["unit"] == "tgt tok/s"), None)
        if fp32 is None:
            continue
        ct = fp32["median_ratios"].get("ct2 fp32", float("nan"))
        parts = [f"{g}: mtpipe fp32 = {ct:.2f}x CTranslate2 fp32 (>= 1.0x: {'pass' if ct >= 1.0 else 'MISSED'})"]
        compiled = next((r for r in rows if r["group"] == g and r["system"] == "mtpipe fp32 compiled"
                         and r["unit"] == "tgt tok/s"), None)
        if compiled is not None:  # --decode-compile
            cc = compiled["median_ratios"].get("ct2 fp32", float("nan"))
            parts.append(f"with decode.compile {cc:.2f}x (>= 1.0x: {'pass' if cc >= 1.0 else 'MISSED'})")
        for par in (r for r in rows if r["group"] == g and r["unit"] == "tgt tok/s" and side_by_side(r["system"]) > 1
                    and r["system"].split(",")[0] in ("mtpipe fp32", "mtpipe fp32 compiled")):
            n = side_by_side(par["system"])  # --decode-processes: against CTranslate2's replicas
            how = " compiled" if "compiled" in par["system"] else ""
            pr = par["median_ratios"].get(f"ct2 fp32, {n} replicas", float("nan"))
            parts.append(f"with {n} processes{how} {pr:.2f}x CTranslate2 fp32 with {n} replicas (>= 1.0x: "
                         f"{'pass' if pr >= 1.0 else 'MISSED'})")
        if rounds:
            best = []
            for rd in rounds:
                mt = max(v["tgt_tok_s"] for k, v in rd[g].items() if k.startswith("mtpipe"))
                c2 = max(v["tgt_tok_s"] for k, v in rd[g].items() if k.startswith("CTranslate2"))
                # against fairseq-generate, which decodes in one process: mtpipe's best in one process too
                mt1 = max(v["tgt_tok_s"] for k, v in rd[g].items() if k.startswith("mtpipe") and side_by_side(k) == 1)
                fs = rd[g].get("fairseq fp32", {}).get("tgt_tok_s")
                best.append((mt / c2, mt1 / fs if fs else float("nan")))
            b = median([x for x, _ in best])
            parts.append(f"best mode vs best mode (processes / replicas included) = {b:.2f}x "
                         f"({min(x for x, _ in best):.2f}-{max(x for x, _ in best):.2f}; >= 1.0x: "
                         f"{'pass' if b >= 1.0 else 'MISSED'})")
            if all(y == y for _, y in best):
                f = median([y for _, y in best])
                parts.append(f"best in one process vs fairseq = {f:.2f}x (>= 3x: {'pass' if f >= 3.0 else 'MISSED'})")
        lines.append("; ".join(parts))
    return "\n".join(lines) or None


def print_and_write(out: Path, meta: dict[str, Any], result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = summarise(result["rounds"])
    header, body = table_rows(rows, len(result["rounds"]))
    title = (f"mtpipe vs anchors, {meta['date']} UTC, {meta['machine']['cpu_model']}, {meta['threads']} threads, "
             f"torch {meta['versions']['torch_mtpipe']} (mtpipe) / {meta['versions']['torch_fairseq']} (fairseq "
             f"{meta['versions']['fairseq']}), CTranslate2 {meta['versions']['ctranslate2']}"
             + (", SMOKE (tiny step counts: not a measurement)" if meta["smoke"] else ""))
    t = Table()
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i < 3 else "right")
    for b in body:
        t.add_row(*b)
    con = Console(stderr=True, width=max(200, Console(stderr=True).width), highlight=False)
    con.print(title)
    con.print(t)
    verdict = decode_verdict(rows, result["rounds"])
    if verdict:
        con.print(verdict)
    greedy = result.get("setup", {}).get("decode", {}).get("greedy_match_on_imported_fairseq_model")
    if greedy:
        con.print(f"mtpipe import: greedy outputs identical to fairseq's on {greedy['identical']} of "
                  f"{greedy['sentences']} sentences ({greedy['rate']:.1%}); "
                  f"{greedy['equal_up_to_the_length_limit']} more equal up to the shorter length limit")
    for rd_i, rd in enumerate(result["rounds"]):
        for g, systems in rd.items():
            if g.startswith("train"):
                for s, v in systems.items():
                    if "model_check" in v and not v["model_check"]["ok"]:
                        con.print(f"[red]round {rd_i + 1} {g}: fairseq's model does not match the dims asked "
                                  f"for[/red]: {v['model_check']}")
    md = [f"# mtpipe vs the anchors ({meta['date']} UTC)", "",
          f"`{meta['command']}`", "",
          f"CPU {meta['machine']['cpu_model']} ({meta['machine']['nproc']} CPUs), {meta['threads']} threads; "
          f"versions {json.dumps(meta['versions'])}; load average at start {meta['machine']['load_average'][0]:.2f}."
          + (" **Smoke run: tiny step counts, not a measurement.**" if meta["smoke"] else ""), "",
          f"ISA ({meta['isa']}), probed under the run's environment: torch dispatch "
          f"{meta['isa_probe'].get('torch_capability')}, native bf16 {meta['isa_probe'].get('native_bf16')}, matmul "
          f"fp32 {meta['isa_probe'].get('fp32_gflops')} / bf16 {meta['isa_probe'].get('bf16_gflops')} GFLOP/s, "
          f"int8 decoding layer {meta['isa_probe'].get('int8_gops')} GOP/s; CTranslate2's own choice is in each of "
          "its rows' logs.", "",
          "Cells: value (ratio to the baseline measured in the same round). Train: median over intervals of "
          "updates (first skipped); decode: one timed pass; data: process wall seconds, ratio = fairseq s / mtpipe s.",
          "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(b) + " |" for b in body]
    if verdict:
        md += ["", verdict]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    (out / "results.json").write_text(json.dumps({**meta, **result, "summary": rows}, indent=1, default=str),
                                      encoding="utf-8")
    con.print(f"written: {out / 'results.json'}, {out / 'results.md'}, logs in {out / 'logs'}")


# --------------------------------------------------------------------------------------------------------------------
# Part 4: quality at an equal training budget
# --------------------------------------------------------------------------------------------------------------------


def run_quality(e: Env, args: argparse.Namespace) -> dict[str, Any]:
    minutes = args.quality
    m30k = m30k_artifacts(e)
    args.decode_sentences = args.decode_sentences or 1000
    q = e.work / f"quality-{minutes:g}min"
    shutil.rmtree(q, ignore_errors=True)
    say(f"quality: fairseq-train small for {minutes:g} min (--stop-time-hours)")
    fs_log = e.logs / "quality_fairseq_train.log"
    fs_wall = sh(["bash", e.script("fs_train.sh"), 10**9, q / "fs", "--stop-time-hours", minutes / 60,
                  "--log-interval", 50, *fairseq_dims("small", args.dropout)], fs_log, e.env)
    fs_updates = re.findall(r"num_updates[=: ]+(\d+)", fs_log.read_text(errors="replace"))
    say(f"quality: mtpipe train small for {minutes:g} min (train.max_time)")
    mt_log = e.logs / "quality_mtpipe_train.log"
    mt_wall = sh(e.mtpipe("train", *mtpipe_train_flags(args, minutes, q / "mt", m30k)), mt_log, e.env, m30k)
    mt_ck = latest_checkpoint(q / "mt")
    assert mt_ck is not None
    args.fs_checkpoint, args.checkpoint, args.tokens = str(q / "fs" / "checkpoint_last.pt"), str(mt_ck), str(
        m30k / "bpe")
    dec = DecodeSetup(e, args, m30k)
    say(f"quality: beam 4 on {dec.n} test_2016_flickr sentences")
    fs = decode_result(fairseq_generate(e, dec.fs_ckpt, dec.fs_bin, dec.n, e.logs / "quality_decode_fairseq.log"),
                       dec.refs)
    mt_out = q / "mt-decode"
    sh(e.mtpipe("decode", "--checkpoint", mt_ck, "--tokens", m30k / "bpe", "--input", dec.src_raw, "--out", mt_out,
                "--beam", 4, "--alpha", 0.6, "--length-penalty", args.mtpipe_penalty, "--threads", e.threads),
       e.logs / "quality_decode_mtpipe.log", e.env, m30k)
    mt_hyps = (mt_out / "input.txt").read_text(encoding="utf-8").split("\n")[:-1]
    mt_bleu = bleu(mt_hyps, dec.refs)
    mt_step = json.loads((mt_ck / "manifest.json").read_text())["extra"]["step"]
    res = {"minutes": minutes, "sentences": dec.n,
           "fairseq": {"bleu": fs["bleu"], "updates": int(fs_updates[-1]) if fs_updates else None,
                       "process_wall_s": fs_wall, "checkpoint": args.fs_checkpoint},
           "mtpipe": {"bleu": mt_bleu, "updates": mt_step, "process_wall_s": mt_wall, "checkpoint": str(mt_ck),
                      "length_penalty": args.mtpipe_penalty}}
    res["delta_bleu"] = mt_bleu - fs["bleu"]
    res["pass"] = res["delta_bleu"] >= 1.0
    return res


def anchors_with_spm(args: argparse.Namespace, spm_model: Path) -> None:
    """Point the run at a copy of the anchors whose data is encoded with ``spm_model`` (e.g. the quickstart's
    ``artifacts/bpe/spm.model``) instead of the anchors' own spm8k: the venvs and scripts are linked, the Multi30k
    text is re-encoded (NFC, as ``mtpipe fetch`` reads it) and re-binarised with ``fairseq-preprocess``, once per
    model, under the work dir; ``--anchors`` and ``--workdir`` then point there, so fairseq, mtpipe and CTranslate2
    all see exactly the same pieces as the mtpipe model being compared."""
    import sentencepiece as spm

    orig = Env(args)  # checks the original anchors
    tag = sha256(spm_model)[:10]
    work = Path(args.workdir) / f"spm-{tag}"
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
        for split in ("train", "val", "test_2016_flickr"):
            for lang in ("en", "de"):
                pieces = sp.encode(read_raw(DATA / f"{split}.{lang}.gz"), out_type=str)
                (a / "data" / "spm" / f"{split}.{lang}").write_text("".join(" ".join(p) + "\n" for p in pieces),
                                                                    encoding="utf-8")
        d = a / "data" / "spm"
        sh([orig.a / "venv-fs38" / "bin" / "fairseq-preprocess", "--source-lang", "en", "--target-lang", "de",
            "--trainpref", d / "train", "--validpref", d / "val", "--testpref", d / "test_2016_flickr",
            "--destdir", a / "data" / "fs-bin", "--joined-dictionary", "--workers", 2],
           work / "setup_fairseq_preprocess.log", orig.env)
        (a / ".done").write_text(str(spm_model))
    args.anchors, args.workdir = str(a), str(work)


FS_AVERAGE = """
import sys, torch
paths, out = sys.argv[1:-1], sys.argv[-1]
states = [torch.load(p, map_location="cpu") for p in paths]
avg = {k: sum(s["model"][k].double() for s in states).div(len(states)).to(v.dtype)
       for k, v in states[0]["model"].items()}
states[0]["model"] = avg
torch.save(states[0], out)
"""


FS_BUDGET = REPO / "bench" / "fs_budget"  # fairseq --user-dir: mtpipe's linear schedule as "budget_linear"


def fairseq_settings(which: str, mc: dict[str, Any], tc: dict[str, Any],
                     every: int) -> tuple[dict[str, Any], list[Any]]:
    """fairseq-train flags for the quality comparison (appended after ``fs_train.sh``'s own; its argparse keeps the
    last value) and a summary of them.

    ``run``: the mtpipe run's model and schedule as fairseq can express them: dims, dropouts, label smoothing, norm
    position (``--*-normalize-before``), warm-up and peak learning rate; the run's ``linear`` schedule through the
    ``budget_linear`` scheduler of ``bench/fs_budget`` (``mtpipe.train.linear_learning_rate`` in fairseq: the decay
    follows the share spent of the time budget (``--budget-hours``, given with ``--stop-time-hours``) or of the
    update budget (``--budget-updates``, with ``--max-update``), as mtpipe's does, so it reaches 0 as fairseq's own
    budget runs out, at whatever speed fairseq runs).
    ``anchors``: ``fs_train.sh``'s own settings (d256, 3+3 layers, dropout 0.1, lr 1e-3, warm-up 400,
    inverse square root), only the time budget, the seed and the checkpoint spacing added."""
    if which == "anchors":
        return ({"settings": "fairseq's anchor settings (fs_train.sh)", "d_model": 256, "layers": "3+3",
                 "dropout": 0.1, "peak_lr": 1e-3, "warmup": 400, "schedule": "inverse_sqrt",
                 "save_every_updates": every}, [])
    peak = tc["lr_scale"] * mc["d_model"] ** -0.5 * tc["warmup"] ** -0.5
    schedule = tc.get("schedule", "inverse_sqrt")
    scheduler: list[Any] = []
    if schedule == "linear":
        scheduler = ["--user-dir", FS_BUDGET, "--lr-scheduler", "budget_linear"]
    elif schedule != "inverse_sqrt":
        raise SystemExit(f"--quality-run: schedule {schedule!r} has no fairseq counterpart here")
    flags: list[Any] = ["--encoder-layers", mc["encoder_layers"], "--decoder-layers", mc["decoder_layers"],
                        "--encoder-embed-dim", mc["d_model"], "--decoder-embed-dim", mc["d_model"],
                        "--encoder-ffn-embed-dim", mc["d_ff"], "--decoder-ffn-embed-dim", mc["d_ff"],
                        "--encoder-attention-heads", mc["heads"], "--decoder-attention-heads", mc["heads"],
                        "--dropout", mc["dropout"], "--attention-dropout", mc["attention_dropout"],
                        "--activation-dropout", mc["relu_dropout"], "--label-smoothing", tc["label_smoothing"],
                        "--lr", f"{peak:.6g}", "--warmup-updates", tc["warmup"]]
    if mc.get("norm_position") == "pre":
        flags += ["--encoder-normalize-before", "--decoder-normalize-before"]
    return ({"settings": "the mtpipe run's", "d_model": mc["d_model"],
             "layers": f"{mc['encoder_layers']}+{mc['decoder_layers']}", "norm_position": mc.get("norm_position"),
             "dropout": mc["dropout"], "peak_lr": peak, "warmup": tc["warmup"],
             "schedule": ("mtpipe's linear (bench/fs_budget's budget_linear: min(update / warmup, 1 - budget "
                          "spent), to 0 at the end of the budget)" if schedule == "linear" else schedule),
             "save_every_updates": every}, flags + scheduler)


def fs_train_script(e: Env, flags: list[Any]) -> Path:
    """``fs_train.sh``, or, when ``flags`` set another learning-rate scheduler, a copy of it under the work dir
    without its inverse-square-root scheduler's options (fairseq refuses ``--warmup-init-lr`` with
    ``polynomial_decay``); every other setting of the anchor script stays as it is."""
    script = e.script("fs_train.sh")
    if "--lr-scheduler" not in flags:
        return script
    text = script.read_text()
    for opt in ("--lr-scheduler inverse_sqrt ", "--warmup-init-lr 1e-7 "):
        if opt not in text:
            raise SystemExit(f"{script}: expected '{opt.strip()}' in it, to replace the scheduler")
        text = text.replace(opt, "")
    out = e.work / "fs_train_scheduler.sh"
    out.write_text(text)
    return out


def fairseq_rate_probe(e: Env, flags: list[Any], updates: int = 200) -> float:
    """fairseq's updates per second with ``flags``: a short ``fs_train.sh`` run (no checkpoints), the rate between
    its first logged interval (start-up and warm-up excluded) and its last, from the log's cumulative ``wall``."""
    log = e.logs / "quality_fairseq_rate_probe.log"
    sh(["bash", fs_train_script(e, flags), updates, e.work / "fs-rate-probe", *flags, "--max-update", updates,
        "--no-save", "--log-interval", 25], log, e.env)
    points = [(int(u), float(w)) for u, w in
              re.findall(r"num_updates=(\d+),.*?\bwall=([\d.]+)", log.read_text(errors="replace"))]
    if len(points) < 3:
        raise SystemExit(f"{log}: too few logged intervals to measure fairseq's rate")
    (u0, w0), (u1, w1) = points[1], points[-1]
    return (u1 - u0) / max(w1 - w0, 1e-9)


def run_quality_vs_run(e: Env, args: argparse.Namespace) -> dict[str, Any]:
    """Quality at an equal budget against an existing ``mtpipe train`` run (``--quality-run DIR``, e.g. the
    quickstart's ``artifacts/train``): fairseq trains for the run's own training minutes (``train.json``), on the
    same pieces (``--tokens``' spm model, see :func:`anchors_with_spm`), with ``--quality-fairseq`` settings (the
    run's model and schedule, or fairseq's anchor settings: :func:`fairseq_settings`), saving a checkpoint every
    ~5 % of its expected updates (``--quality-fs-updates``, else from :func:`fairseq_rate_probe`); both sides
    average their last ``--quality-average`` checkpoints, pick the model (average or last) and the length-penalty
    alpha on the valid split from ``--quality-alphas`` (each with its own penalty formula), and decode
    test_2016_flickr with beam 4. sacreBLEU of both."""
    run, tokens = Path(args.quality_run), Path(args.tokens)
    info = json.loads((run / "train.json").read_text())
    ck = latest_checkpoint(run)
    assert ck is not None, f"no checkpoint under {run}"
    params = json.loads((ck / "manifest.json").read_text())["params"]
    mc, tc = params["model"], params["train"]
    minutes = float(info["train_minutes"])
    expected = args.quality_fs_updates
    if args.quality_equal_updates:
        # Equal updates: the run's schedule must have ended where it stopped (train.max_steps), so that fairseq's
        # budget_linear over --max-update at the same count is the same schedule; fairseq then gets no time limit.
        if int(tc.get("max_steps") or 0) != int(info["steps"]):
            raise SystemExit(f"--quality-equal-updates: {run} stopped at {info['steps']} updates, not at its "
                             f"train.max_steps ({tc.get('max_steps')}): train it with --max-steps N --max-time 0")
        expected = int(info["steps"])
    if not expected:
        # fairseq's own rate with these settings, from a short run: the spacing of its checkpoints (every ~5 % of
        # its run, as the quickstart saves every 5 % of its budget). Only the spacing: its schedule follows the
        # time budget itself, so a probe taken at a slow or fast moment of the machine's drift cannot cut it short.
        _, probe_flags = fairseq_settings(args.quality_fairseq, mc, tc, 10**9)
        expected = int(fairseq_rate_probe(e, probe_flags + ["--seed", tc["seed"]]) * minutes * 60)
        say(f"quality: fairseq's expected updates in {minutes:.1f} min: {expected}")
    every = max(1, round(expected / 20))
    keep = args.quality_average
    settings, fs_flags = fairseq_settings(args.quality_fairseq, mc, tc, every)
    settings["expected_updates"] = expected
    q = e.work / (f"quality-updates-{expected}-{args.quality_fairseq}-seed{tc['seed']}" if args.quality_equal_updates
                  else f"quality-run-{minutes:.1f}min-{args.quality_fairseq}-seed{tc['seed']}")
    say("quality: fairseq-train for " + (f"{expected} updates" if args.quality_equal_updates else
                                          f"{minutes:.1f} min") + f", {settings}")
    fs_log = e.logs / "quality_fairseq_train.log"
    fs_flags += ["--seed", tc["seed"], "--save-interval-updates", every, "--keep-interval-updates", keep,
                 "--log-interval", 50]
    if args.quality_equal_updates:
        fs_flags += ["--max-update", expected] + (["--budget-updates", expected] if "budget_linear" in fs_flags else [])
    else:
        fs_flags += ["--stop-time-hours", minutes / 60] + (["--budget-hours", minutes / 60] if "budget_linear" in
                                                           fs_flags else [])
    # A finished fairseq run is reused (e.g. after a failure in the decoding part), but only one trained with these
    # very flags: a run from before a change of the settings mapping is trained again, not silently compared.
    done = q / "fs" / "trained.json"
    record = json.loads(done.read_text()) if done.exists() else None
    if record is not None and record.get("flags") != [str(f) for f in fs_flags]:
        say(f"quality: the finished fairseq run in {q / 'fs'} ran other flags: training it again")
        record = None
    if record is None:
        shutil.rmtree(q, ignore_errors=True)
        q.mkdir(parents=True)
        fs_wall = sh(["bash", fs_train_script(e, fs_flags), 10**9, q / "fs", *fs_flags], fs_log, e.env)
        fs_updates = re.findall(r"num_updates[=: ]+(\d+)", fs_log.read_text(errors="replace"))
        done.write_text(json.dumps({"wall": fs_wall, "updates": fs_updates, "flags": [str(f) for f in fs_flags]}))
    else:
        say(f"quality: reusing the finished fairseq run in {q / 'fs'}")
        fs_wall, fs_updates = record["wall"], record["updates"]
    fs_ckpts = sorted(q.joinpath("fs").glob("checkpoint_*_*.pt"), key=lambda p: int(p.stem.split("_")[-1]))[-keep:]
    fs_avg = q / "fs" / "averaged.pt"
    sh([e.fs_py, "-c", FS_AVERAGE, *fs_ckpts, fs_avg], e.logs / "quality_fairseq_average.log", e.env)
    mt_avg = q / "mt-average"
    sh(e.mtpipe("average", "--run", run, "--last", keep, "--out", mt_avg), e.logs / "quality_mtpipe_average.log",
       e.env)
    fs_bin = e.a / "data" / "fs-bin"
    refs = {"valid": read_raw(DATA / "val.de.gz"), "test": read_raw(DATA / "test_2016_flickr.de.gz")}

    # Candidates per system, chosen on valid with alpha: the average of the last `keep` checkpoints and the last one
    # (a short run's early checkpoints can make the average worse than the last checkpoint).
    models = {"fairseq": {"average": fs_avg, "last": q / "fs" / "checkpoint_last.pt"},
              "mtpipe": {"average": mt_avg, "last": ck}}

    def fairseq_bleu(split: str, which: str, alpha: float) -> float:
        r = fairseq_generate(e, models["fairseq"][which], fs_bin, len(refs[split]),
                             e.logs / f"quality_fairseq_{split}_{which}_{alpha:g}.log",
                             subset="valid" if split == "valid" else "test", lenpen=alpha)
        return bleu(r["hyps"], refs[split])

    def mtpipe_bleu(split: str, which: str, alpha: float) -> float:
        out = q / f"mt-decode-{split}-{which}-{alpha:g}"
        sh(e.mtpipe("decode", "--checkpoint", models["mtpipe"][which], "--tokens", tokens, "--split", split,
                    "--out", out, "--beam", 4, "--alpha", alpha, "--threads", e.threads),
           e.logs / f"quality_mtpipe_{split}_{which}_{alpha:g}.log", e.env)
        return bleu((out / f"{split}.txt").read_text(encoding="utf-8").split("\n")[:-1], refs[split])

    res: dict[str, Any] = {"minutes": minutes, "sentences": len(refs["test"]), "average": keep,
                           "equal_updates": expected if args.quality_equal_updates else None,
                           "fairseq_settings": settings, "mtpipe_settings": {"model": mc, "train": tc}}
    for name, fn, penalty in (("fairseq", fairseq_bleu, "|Y|^alpha"), ("mtpipe", mtpipe_bleu, "((5+|Y|)/6)^alpha")):
        valid = {f"{which} alpha={a:g}": fn("valid", which, a) for which in ("average", "last")
                 for a in args.quality_alphas}
        best = max(valid, key=lambda c: valid[c])
        which, alpha = best.split(" alpha=")[0], float(best.split("=")[1])
        say(f"quality: {name} valid BLEU {valid} -> {best}")
        res[name] = {"valid_bleu": valid, "model": which, "alpha": alpha, "length_penalty": penalty,
                     "bleu": fn("test", which, alpha)}
    # Where fairseq's schedule stood when its budget ended (with budget_linear: near 0, as mtpipe's at its end).
    lrs = re.findall(r"num_updates=(\d+),.*?\blr=([\d.e+-]+)", fs_log.read_text(errors="replace"))
    res["fairseq"].update(updates=int(fs_updates[-1]) if fs_updates else None, process_wall_s=fs_wall,
                          checkpoints=[str(p) for p in fs_ckpts],
                          last_logged_lr={"update": int(lrs[-1][0]), "lr": float(lrs[-1][1])} if lrs else None)
    res["mtpipe"].update(updates=info["steps"], process_wall_s=minutes * 60, run=str(run))
    res["delta_bleu"] = res["mtpipe"]["bleu"] - res["fairseq"]["bleu"]
    res["pass"] = res["delta_bleu"] >= 1.0
    return res


def print_quality(out: Path, meta: dict[str, Any], res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table()
    for h in ("system", "updates", "process wall s", "model, alpha (on valid)", "sacreBLEU"):
        t.add_column(h, justify="left" if h == "system" else "right")
    for s in ("fairseq", "mtpipe"):
        t.add_row(s, str(res[s]["updates"]), f"{res[s]['process_wall_s']:.0f}",
                  f"{res[s].get('model', 'last')}, {res[s].get('alpha', 0.6)}",
                  f"{res[s]['bleu']:.2f}")
    con = Console(stderr=True, width=160, highlight=False)
    if "fairseq_settings" in res:
        con.print(f"fairseq settings: {res['fairseq_settings']}")
    budget = (f"{res['equal_updates']} updates each" if res.get("equal_updates")
              else f"{res['minutes']:g} min of training each")
    con.print(f"quality at equal budget: {budget}, beam 4, "
              f"{res['sentences']} test_2016_flickr sentences, {meta['date']} UTC, {meta['machine']['cpu_model']}, "
              f"{meta['threads']} threads" + (" (SMOKE: not a measurement)" if meta["smoke"] else ""))
    con.print(t)
    con.print(f"mtpipe - fairseq = {res['delta_bleu']:+.2f} BLEU (target >= +1): "
              f"{'pass' if res['pass'] else 'MISSED'}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps({**meta, "quality": res}, indent=1, default=str), encoding="utf-8")
    (out / "quality.md").write_text(
        f"# Quality at equal budget: {budget} ({meta['date']} UTC)\n\n`{meta['command']}`\n\n"
        "| system | updates | process wall s | model, alpha (on valid) | sacreBLEU |\n|---|---|---|---|---|\n"
        + "".join(f"| {s} | {res[s]['updates']} | {res[s]['process_wall_s']:.0f} | "
                  f"{res[s].get('model', 'last')}, {res[s].get('alpha', 0.6)} "
                  f"| {res[s]['bleu']:.2f} |\n" for s in ("fairseq", "mtpipe"))
        + f"\nmtpipe - fairseq = {res['delta_bleu']:+.2f} BLEU (target >= +1)\n"
        + (f"\nfairseq settings: {res['fairseq_settings']}\n" if "fairseq_settings" in res else "")
        + (f"\nfairseq's last logged learning rate: {res['fairseq']['last_logged_lr']}\n"
           if res["fairseq"].get("last_logged_lr") else "")
        + "".join(f"\n{s} valid BLEU: {res[s]['valid_bleu']}\n" for s in ("fairseq", "mtpipe")
                  if "valid_bleu" in res[s]), encoding="utf-8")


# --------------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------------


WORKERS = {"_mtpipe-train": worker_mtpipe_train, "_mtpipe-decode": worker_mtpipe_decode,
           "_ct2-decode": worker_ct2_decode}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in WORKERS:
        WORKERS[argv[0]](argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every part, interleaved (default 2)")
    ap.add_argument("--only", default="train,decode,data", help="comma list of parts: train, decode, data")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny step counts, 40 decoded sentences, a 60k-pair data run: checks that everything runs")
    ap.add_argument("--quality", type=float, default=None, metavar="MINUTES",
                    help="instead of the rounds: fairseq and mtpipe trained MINUTES each, then beam 4 + sacreBLEU")
    ap.add_argument("--quality-run", default=None, metavar="DIR",
                    help="instead of the rounds: fairseq trained as long as, and with the settings of, this existing "
                         "`mtpipe train` run (with --tokens: its bpe artifact), then both averaged, alpha picked on "
                         "valid, beam 4 + sacreBLEU on test")
    ap.add_argument("--quality-average", type=int, default=5, help="--quality-run: checkpoints averaged per side")
    ap.add_argument("--quality-fairseq", choices=("run", "anchors"), default="run",
                    help="--quality-run: fairseq's settings: the mtpipe run's model and schedule (default), or "
                         "fairseq's anchor settings (fs_train.sh: d256, 3+3, dropout 0.1, lr 1e-3, warm-up 400)")
    ap.add_argument("--quality-fs-updates", type=int, default=0,
                    help="--quality-run: fairseq's expected updates in the budget, for a checkpoint every 1/20 of "
                         "it (default: measured with a short fairseq run)")
    ap.add_argument("--quality-equal-updates", action="store_true",
                    help="--quality-run: fairseq trains as many updates as the run made (the run must have stopped "
                         "at its train.max_steps), with no time limit, instead of the run's minutes")
    ap.add_argument("--quality-alphas", default="0.6,1.0,1.5",
                    help="--quality-run: length-penalty alphas tried on valid, per system")
    ap.add_argument("--spm-model", default=None,
                    help="use this SentencePiece model for every system instead of the anchors' spm8k (the data "
                         "is re-encoded and re-binarised once); default with --quality-run: --tokens' spm.model")
    ap.add_argument("--out", default=None, help="results and logs (default bench/out/anchors/<UTC time>)")
    ap.add_argument("--workdir", default=str(REPO / "bench" / "out" / "anchors" / "work"),
                    help="prepared corpora, artifacts and fallback models, reused across runs")
    ap.add_argument("--anchors", default=os.environ.get("ANCHORS", "/tmp/anchors"), help="setup_anchors.sh's dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dropout", choices=list(DROPOUTS), default="paper",
                    help="paper: dropout 0.1, attention/ReLU dropout 0 on both sides (mtpipe's presets; fairseq "
                         "told so); anchors: 0.1/0.1/0.1 on both sides (fs_train.sh's values)")
    ap.add_argument("--train-dims", default="small,base", help="comma list: small, base")
    ap.add_argument("--train-updates", default=None, help="updates per measurement (default small=60,base=30)")
    ap.add_argument("--train-intervals", type=int, default=None,
                    help="intervals the updates are timed in; the first is skipped (default 6)")
    ap.add_argument("--checkpoint", default=None, help="mtpipe checkpoint to decode (with --tokens)")
    ap.add_argument("--tokens", default=None, help="the bpe artifact of --checkpoint")
    ap.add_argument("--fs-checkpoint", default=None,
                    help="fairseq checkpoint to decode (default $ANCHORS/fs-ckpt/checkpoint_last.pt, trained with "
                         "fs_train.sh 800 when absent)")
    ap.add_argument("--train-minutes", type=float, default=None,
                    help="without --checkpoint: train mtpipe (small) this long for decoding (default 10; smoke 0.5)")
    ap.add_argument("--mtpipe-train-args", default="", help="extra `mtpipe train` flags for --quality / fallback")
    ap.add_argument("--decode-sentences", type=int, default=None, help="first N test sentences (default 1000)")
    ap.add_argument("--mtpipe-penalty", choices=["gnmt", "fairseq"], default="gnmt",
                    help="mtpipe's length penalty (gnmt: the paper's; fairseq: |Y|^alpha as fairseq and CTranslate2)")
    ap.add_argument("--decode-systems", default="fairseq,mtpipe,ct2",
                    help="with --only decode: the systems to run (leave fairseq out to need only CTranslate2's venv "
                         "and no fairseq checkpoint)")
    ap.add_argument("--decode-max-tokens", type=int, default=8000,
                    help="source tokens per decoding batch, the same budget for every system (mtpipe's "
                         "decode.max_tokens, fairseq's --max-tokens, CTranslate2's max_batch_size in tokens)")
    ap.add_argument("--decode-processes", type=int, default=1,
                    help="N > 1: also mtpipe fp32 / int8 (and with --decode-compile its compiled modes) with "
                         "decode.processes N and CTranslate2 float32 / int8 with N replicas (inter_threads), --threads "
                         "split among them on both sides")
    ap.add_argument("--decode-compile", action="store_true",
                    help="also decode with mtpipe fp32 and bf16 (where native) with decode.compile (its graphs built "
                         "in the warm-up)")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native",
                    help=f"avx2: restrict every library to AVX2 ({', '.join(AVX2_ONLY)}), as most users' CPUs are; "
                         "the ISA probe in the results shows whether it took effect")
    ap.add_argument("--ct2-limit", choices=["batch", "sentence"], default="batch",
                    help="CTranslate2's max output length: batch = one call, the longest source + 50 for all "
                         "(default: its normal, fastest use); sentence = source + 50 per sentence, as mtpipe and "
                         "fairseq, by one call per group of equal limits")
    ap.add_argument("--data-pairs", type=int, default=None, help="the large data run (default 4,500,000)")
    args = ap.parse_args(argv)

    if args.smoke:
        args.rounds = 1 if "--rounds" not in argv else args.rounds
        args.train_updates = args.train_updates or "small=6,base=2"
        args.train_intervals = args.train_intervals or 2
        args.decode_sentences = args.decode_sentences or 40
        args.data_pairs = args.data_pairs or 60_000
    args.train_updates = args.train_updates or "small=60,base=30"
    args.train_intervals = args.train_intervals or 6
    args.decode_sentences = args.decode_sentences or 1000
    args.data_pairs = args.data_pairs or 4_500_000
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    args.decode_systems = [x.strip() for x in args.decode_systems.split(",") if x.strip()]
    chosen = set(args.decode_systems)
    if not chosen >= {"mtpipe", "ct2"} or not chosen <= {"fairseq", "mtpipe", "ct2"}:
        ap.error("--decode-systems: mtpipe and ct2, optionally fairseq")
    if "fairseq" not in args.decode_systems and parts != ["decode"]:
        ap.error("--decode-systems without fairseq needs --only decode")
    if bad := [p for p in parts if p not in ("train", "decode", "data")]:
        ap.error(f"--only: unknown part(s) {bad}")
    args.quality_alphas = [float(a) for a in args.quality_alphas.split(",") if a.strip()]
    if args.quality_equal_updates and not args.quality_run:
        ap.error("--quality-equal-updates needs --quality-run")
    if args.quality_run:
        if not args.tokens:
            ap.error("--quality-run needs --tokens (the run's bpe artifact)")
        args.spm_model = args.spm_model or str(Path(args.tokens) / "spm.model")
    elif (args.checkpoint is None) != (args.tokens is None):
        ap.error("give --checkpoint and --tokens together")
    stamp = datetime.datetime.now(datetime.timezone.utc)
    args.out = args.out or str(REPO / "bench" / "out" / "anchors" / stamp.strftime("%Y%m%dT%H%M%SZ"))
    if args.spm_model:
        anchors_with_spm(args, Path(args.spm_model))
    e = Env(args)
    e.out.mkdir(parents=True, exist_ok=True)
    e.work.mkdir(parents=True, exist_ok=True)
    e.probe = isa_probe(e)
    say(f"ISA probe: {e.probe}")
    meta = {"isa": args.isa, "isa_probe": e.probe,
            "date": stamp.strftime("%Y-%m-%d %H:%M"), "command": "python bench/anchors.py " + " ".join(argv),
            "smoke": args.smoke, "threads": args.threads, "machine": machine(), "versions": versions(e),
            "settings": {k: v for k, v in vars(args).items()}, "spm_model": str(e.spm)}
    t0 = time.perf_counter()
    if args.quality is not None or args.quality_run:
        res = run_quality_vs_run(e, args) if args.quality_run else run_quality(e, args)
        meta["seconds"] = time.perf_counter() - t0
        print_quality(e.out, meta, res)
        return 0
    result = run_rounds(e, args, parts)
    meta["seconds"] = time.perf_counter() - t0
    print_and_write(e.out, meta, result)
    say(f"total {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
