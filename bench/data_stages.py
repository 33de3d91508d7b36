"""Data-stage benchmark: a WMT14-sized corpus through fetch -> bpe -> bucket, wall time and peak memory per stage.

    python bench/data_stages.py                 # 4.5M pairs (WMT14 en-de size), a few minutes on 2 cores
    python bench/data_stages.py --pairs 200000  # quick

The corpus is Multi30k train repeated up to ``--pairs`` lines, each line given a line-unique numeric suffix (so the
dedup filter keeps them), written as ``train.{en,de}.gz``; val and test are Multi30k's. Every stage runs as its own
process (``python -m mtpipe ...``), so its peak resident memory is the child's ``ru_maxrss``. BPE is measured twice:

* ``spm train``: SentencePiece training on a capped sample (``--sample-sentences``, the ``bpe.sample_sentences``
  param), including streaming that sample out of the 4.5M-pair Parquet file;
* ``bpe encode``: ``mtpipe bpe --spm-model`` with that model, i.e. the multi-threaded encoding of every split.

Baseline, measured in the same run: single-threaded SentencePiece batch encoding (``encode(list, num_threads=1)``)
of train sentences already in memory -- what one core does with no I/O at all. Speeds drift between machines and
runs, so compare the ratio, not the absolute rate, across runs.

Targets (2 cores): fetch and bucket under 2 minutes each, encoding at least 30,000 pairs/s, peak memory
under 3 GB for every stage. Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MULTI30K = Path(os.environ.get("MTPIPE_MULTI30K", REPO / "data" / "multi30k"))  # {split}.{en,de}.gz
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

console = Console(stderr=True, highlight=False)
GB = 1 << 30


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def make_corpus(root: Path, pairs: int) -> None:
    """Multi30k train repeated to ``pairs`` lines with a line-unique suffix, as gzip parallel files."""
    root.mkdir(parents=True)
    base = {}
    for lang in ("en", "de"):
        with gzip.open(MULTI30K / f"train.{lang}.gz", "rt", encoding="utf-8") as f:
            base[lang] = f.read().splitlines()
    n = len(base["en"])
    for lang in ("en", "de"):
        lines = base[lang]
        with gzip.open(root / f"train.{lang}.gz", "wt", encoding="utf-8", compresslevel=1) as f:
            for start in range(0, pairs, n):
                stop = min(pairs, start + n)
                f.write("".join(f"{lines[k - start]} {k}\n" for k in range(start, stop)))
        for split in ("val", "test_2016_flickr"):
            shutil.copy(MULTI30K / f"{split}.{lang}.gz", root / f"{split}.{lang}.gz")


def run_stage(name: str, cmd: list[str], cwd: Path, log: Path) -> dict:
    """Run one stage as a child process; wall seconds, CPU seconds and the child's peak RSS.

    Linux carries the parent's RSS high-water mark into a child at exec (the child's ``ru_maxrss`` is at least the
    parent's RSS at spawn time), so this process stays small: even the baseline runs in a child.
    """
    console.print(f"[bold]{name}[/bold]: {' '.join(cmd[2:] if cmd[1] == '-m' else cmd[1:3])}")
    env = {**os.environ, "COLUMNS": "120"}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        console.print(log.read_text()[-4000:])
        raise SystemExit(f"{name} failed (exit {proc.returncode}); log: {log}")
    # ru_maxrss is in KiB on Linux; CPU seconds / wall seconds = cores the stage kept busy.
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss * 1024}


def baseline_rate(work: Path, sentences: int = 400_000) -> tuple[float, float]:
    """Single-threaded SentencePiece on train sentences already in memory (in a child process): sentences per wall
    second and per CPU second."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from bench.data_stages import _baseline; "
            f"_baseline({sentences})")
    out = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, check=True)
    wall, cpu = out.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def _baseline(sentences: int) -> None:
    import pyarrow.parquet as pq
    import sentencepiece as spm

    model, fetch_dir = Path("spm_bench.model"), Path("artifacts/fetch")

    sp = spm.SentencePieceProcessor(model_file=str(model))
    pf = pq.ParquetFile(fetch_dir / "train.parquet")
    texts: list[str] = []
    for b in pf.iter_batches(batch_size=65536, columns=["src", "tgt"]):
        texts += b.column(0).to_pylist() + b.column(1).to_pylist()
        if len(texts) >= sentences:
            break
    texts = texts[:sentences]
    sp.encode(texts[:1000], num_threads=1)  # warm-up
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    sp.encode(texts, num_threads=1)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    print(len(texts) / wall, len(texts) / cpu)


STAGES = ("fetch", "spm train", "bpe encode", "bucket")


def prepare(work: Path, pairs: int, args: argparse.Namespace) -> None:
    """The corpus and params.yaml in ``work``; an existing corpus of the same size is kept (``--stages`` reruns)."""
    marker = work / "corpus" / ".pairs"
    if marker.exists() and marker.read_text() == str(pairs):
        console.print(f"reusing the {pairs:,}-pair corpus in {work}/corpus")
    else:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        console.print(f"writing a {pairs:,}-pair corpus to {work}/corpus ...")
        t0 = time.perf_counter()
        make_corpus(work / "corpus", pairs)
        marker.write_text(str(pairs))
        console.print(f"  done in {time.perf_counter() - t0:.0f}s")
    (work / "params.yaml").write_text(
        "fetch:\n  splits: {train: train, valid: val, test: test_2016_flickr}\n"
        f"bpe:\n  vocab_size: {args.vocab_size}\n  sample_sentences: {args.sample_sentences}\n"
        f"bucket:\n  max_tokens: {args.max_tokens}\n", encoding="utf-8")


def run_stages(work: Path, stages: list[str], args: argparse.Namespace) -> tuple[dict, list]:
    """Run the chosen stages in order; per-stage results and the baseline measurements."""
    py = [sys.executable, "-m", "mtpipe"]
    res: dict[str, dict] = {}
    base: list[tuple[float, float]] = []
    for name in stages:
        missing = {"spm train": "artifacts/fetch", "bpe encode": "spm_bench.model", "bucket": "artifacts/bpe"}
        if name in missing and not (work / missing[name]).exists():
            raise SystemExit(f"{name}: needs {work / missing[name]} (run the earlier stages first)")
        if name == "fetch":
            res[name] = run_stage(name, py + ["fetch", "--source", "corpus"], work, work / "fetch.log")
            m = json.loads((work / "artifacts/fetch/manifest.json").read_text())
            res[name]["pairs"] = sum(m["extra"]["pairs_in"].values())
        elif name == "spm train":
            code = (
                "from pathlib import Path; from mtpipe.bpe import train_spm, nproc; "
                "from mtpipe.config import BpeConfig; "
                f"m, n = train_spm(BpeConfig(vocab_size={args.vocab_size}, sample_sentences={args.sample_sentences}),"
                " Path('artifacts/fetch'), nproc()); Path('spm_bench.model').write_bytes(m); print('sentences', n)"
            )
            res[name] = run_stage(name, [sys.executable, "-c", code], work, work / "spm_train.log")
        elif name == "bpe encode":
            # The baseline right before and right after the encode stage: on a shared machine the load drifts.
            console.print("baseline: single-threaded SentencePiece, 400,000 train sentences in memory ...")
            base.append(baseline_rate(work))
            res[name] = run_stage(name, py + ["bpe", "--spm-model", "spm_bench.model"], work, work / "bpe.log")
            base.append(baseline_rate(work))
            m = json.loads((work / "artifacts/bpe/manifest.json").read_text())
            res[name]["pairs"] = sum(m["extra"]["pairs"].values())
        elif name == "bucket":
            res[name] = run_stage(name, py + ["bucket"], work, work / "bucket.log")
            m = json.loads((work / "artifacts/bucket/manifest.json").read_text())
            res[name]["pairs"] = sum(m["extra"]["pairs_in"].values())
        if "pairs" in res[name]:
            res[name]["pairs_per_s"] = res[name]["pairs"] / res[name]["wall"]
    return res, base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=4_500_000, help="train pairs (default: WMT14 en-de size)")
    ap.add_argument("--vocab-size", type=int, default=37000, help="BPE vocabulary (paper en-de: 37000)")
    ap.add_argument("--sample-sentences", type=int, default=1_000_000, help="BPE training sample cap")
    ap.add_argument("--max-tokens", type=int, default=4096, help="bucket.max_tokens")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep everything here (default: a temp dir); a corpus of the same --pairs there is reused")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"comma-separated subset of: {', '.join(STAGES)} (later ones need --workdir with the "
                         "earlier ones' outputs)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    args = ap.parse_args()
    stages = [x.strip() for x in args.stages.split(",") if x.strip()]
    if unknown := [x for x in stages if x not in STAGES]:
        raise SystemExit(f"--stages: unknown {unknown} (choose from {', '.join(STAGES)})")
    stages = [x for x in STAGES if x in stages]
    if not (MULTI30K / "train.en.gz").exists():
        raise SystemExit(f"Multi30k not found at {MULTI30K} (set MTPIPE_MULTI30K)")

    load0 = os.getloadavg()
    tmp = tempfile.TemporaryDirectory(prefix="mtpipe-bench-") if args.workdir is None else None
    work = Path(tmp.name) / "w" if tmp is not None else args.workdir
    try:
        prepare(work, args.pairs, args)
        res, base = run_stages(work, stages, args)
    finally:
        if tmp is not None:
            tmp.cleanup()

    threads = len(os.sched_getaffinity(0))
    load = os.getloadavg()
    targets = {"fetch": ("wall < 120 s", lambda r: r["wall"] < 120),
               "spm train": ("", lambda r: True),
               "bpe encode": (">= 30,000 pairs/s", lambda r: r["pairs_per_s"] >= 30_000),
               "bucket": ("wall < 120 s", lambda r: r["wall"] < 120)}
    t = Table(title=f"data stages, {args.pairs:,} train pairs -- {datetime.date.today()}, {cpu_name()}, "
                    f"{threads} threads, load average at start {load0[0]:.1f}, at end {load[0]:.1f}",
              title_justify="left")
    for c in ("stage", "wall s", "CPU s", "peak RSS MB", "pairs/s", "target", "peak < 3 GB", "ok"):
        t.add_column(c, justify="left" if c in ("stage", "target") else "right")
    ok_all = True
    for name, r in res.items():
        target, check = targets[name]
        mem_ok = r["rss"] < 3 * GB
        ok = check(r) and mem_ok
        ok_all &= ok
        rate = f"{r['pairs_per_s']:,.0f}" if "pairs_per_s" in r else ""
        t.add_row(name, f"{r['wall']:.1f}", f"{r['cpu']:.1f}", f"{r['rss'] / 2**20:,.0f}", rate, target,
                  "yes" if mem_ok else "NO", "yes" if ok else "NO")
    if base:
        base_sent = sum(b[0] for b in base) / len(base)
        base_pairs, base_pairs_cpu = base_sent / 2, sum(b[1] for b in base) / len(base) / 2
        t.add_row("baseline: spm 1 thread", "", "", "", f"{base_pairs:,.0f}",
                  f"({base_sent:,.0f} sentences/s; before {base[0][0]:,.0f}, after {base[1][0]:,.0f})", "", "")
    Console(highlight=False, width=160).print(t)
    if "spm train" in res:
        print(f"spm train: {args.sample_sentences:,}-sentence sample cap, vocab {args.vocab_size:,}")
    if base:
        enc = res["bpe encode"]
        enc_cpu = enc["pairs"] / enc["cpu"]
        print(f"encoding vs single-threaded SentencePiece (same run): {enc['pairs_per_s'] / base_pairs:.2f}x in "
              f"wall-clock pairs/s; {enc_cpu:,.0f} vs {base_pairs_cpu:,.0f} pairs per CPU-second "
              f"({enc_cpu / base_pairs_cpu:.2f}x: the whole stage, I/O and start-up included, against bare encoding)")
        print(f"cores the encode stage kept busy: {enc['cpu'] / enc['wall']:.2f} of {threads} "
              f"(load average now {load[0]:.1f}; other processes may share the machine)")
    if args.json:
        args.json.write_text(json.dumps({"pairs": args.pairs, "threads": threads, "cpu": cpu_name(),
                                         "load_average": [load0[0], load[0]], "stages": res,
                                         "baseline": base}, indent=2))
    if not ok_all:
        print("TARGET MISSED")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
