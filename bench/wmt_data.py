"""Every data stage at the paper's sizes on this CPU: a synthetic corpus shaped like WMT14 (testkit/wmt_corpus.py),
then fetch, bpe, bucket, the train loader and the first update after a restart, each timed with its peak memory.

    python bench/wmt_data.py --pairs 4500000 --form both      # WMT14 en-de's size
    python bench/wmt_data.py --pairs 36000000 --stages gen,fetch,spm,tokens,bucket,loader,restart   # en-fr's

Stages (``--stages``, run in this order; default gen,fetch,bpe,bucket,loader,restart):

* ``gen``: the corpus of ``--pairs`` train pairs (3,000 valid, 3,003 test) under ``--out``/data, as ``--form``:
  ``local`` (``{split}.{en,de}.gz``), ``datasets`` (a saved DatasetDict with a ``translation`` column, like
  ``wmt/wmt14``'s) or ``both``, by a child process. Not a pipeline stage: its time is reported, not judged.
* ``fetch``, ``bpe``, ``bucket``: the real CLI (``mtpipe <stage> --params``; the bench writes params.yaml from
  recipes/wmt14-en-de-base.yaml: vocabulary 37,000, SentencePiece trained on a sample of 10M sentences, 3,200-token
  batches) as a subprocess. Every ~0.5 s (every 0.05 s in the first 3 s) the RSS, PSS and anonymous PSS (allocated
  memory; the rest is mapped files, page cache) of its process tree (``/proc/<pid>/smaps_rollup`` of it and its
  children, summed) are read: the peaks (peak RSS at least the largest process's, which the kernel records), a
  timeline, the wall and CPU seconds. bpe's SentencePiece training is told apart by its log line ("trained
  on N sentences in S s"): its seconds and the peaks up to ``HANDBACK_S`` after that line (when bpe hands the
  trainer's heap back) are the training's, the rest the encoding's.
  fetch reads ``--form`` (``both``: local files, then the datasets directory, a second row).
* ``spm`` (not by default): bpe's SentencePiece training alone, and ``tokens`` (not by default): a synthetic tokens
  artifact in place of bpe's (bench/train_data.py's): a quicker look at a size whose encoding is long on a small CPU.
* ``loader``: bench/train_data.py's measurements on these artifacts: time to rank 0's first batch for a fresh start
  (train.arrow hashed), a restart, cold and warm page cache; ``--workers`` ranks of one node holding the train data
  (the sum of their PSS against one copy).
* ``restart``: ``mtpipe train`` with a tiny model (2+2 layers, d_model 64; the data's cost does not depend on the
  model) on one CPU process: one run of 1 update writes a checkpoint, then the same command with ``--max-steps 2``
  resumes from it. The figure: seconds from that process's start to its update's step line in its output (Python
  and torch imports, loading and verifying the data, restoring the checkpoint, one update); its exit comes later
  (a checkpoint write and the final validation).

Writes ``bench/results/wmt_data-<UTC time>.json`` (or ``--results``; an existing one of the same ``--pairs`` is
continued) after every stage, so a run cut short keeps what it measured. The artifacts stay under ``--out``; each
stage's output is deleted before the stage runs again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import machine  # noqa: E402

STAGES = ("gen", "fetch", "spm", "bpe", "tokens", "bucket", "loader", "restart")
DEFAULT = ("gen", "fetch", "bpe", "bucket", "loader", "restart")
MTPIPE = [sys.executable, "-m", "mtpipe"]
MB = 2**20
HANDBACK_S = 1.5  # seconds after bpe's "trained on" line in which it returns SentencePiece's heap (3 samples)


# --------------------------------------------------------------------------------------------------------------------
# A process tree's memory
# --------------------------------------------------------------------------------------------------------------------


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/<pid>/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
    return out


def tree_memory(pid: int) -> tuple[int, int, int]:
    """(RSS, PSS, anonymous PSS) in bytes of ``pid``'s process tree, summed (0 for a process that has gone). The
    anonymous part is what the processes allocated; the rest is mapped files (page cache the kernel can drop)."""
    out = {"Rss": 0, "Pss": 0, "Pss_Anon": 0}
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()[1:]:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] += int(rest.split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            pass
    return out["Rss"], out["Pss"], out["Pss_Anon"]


class Sampler(threading.Thread):
    """Reads a process tree's memory every ``every`` seconds: ``samples`` of (seconds since start, RSS, PSS,
    anonymous PSS)."""

    def __init__(self, pid: int, t0: float, every: float = 0.5, first: float = 0.05, warmup: float = 3.0):
        super().__init__(daemon=True)
        self.pid, self.t0, self.every, self.first, self.warmup = pid, t0, every, first, warmup
        self.samples: list[tuple[float, int, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            rss, pss, anon = tree_memory(self.pid)
            if rss:
                self.samples.append((time.perf_counter() - self.t0, rss, pss, anon))
            # densely at first: a short stage (a toy size, a starved CPU) could otherwise end between two samples
            self.stop.wait(self.first if time.perf_counter() - self.t0 < self.warmup else self.every)

    def timeline(self, points: int = 120) -> list[list[float]]:
        """At most ``points`` samples, evenly spaced: [seconds, RSS MB, PSS MB, anonymous PSS MB]."""
        step = max(1, -(-len(self.samples) // points))
        return [[round(t, 1), *(round(x / MB) for x in rest)] for t, *rest in self.samples[::step]]

    def peaks(self, start: float = 0.0, end: float = float("inf")) -> dict[str, float]:
        inside = [s for s in self.samples if start <= s[0] <= end]
        return {"peak_rss_mb": round(max((s[1] for s in inside), default=0) / MB, 1),
                "peak_pss_mb": round(max((s[2] for s in inside), default=0) / MB, 1),
                "peak_anon_pss_mb": round(max((s[3] for s in inside), default=0) / MB, 1)}


def measured(cmd: list[str], log: Path, marks: dict[str, str] | None = None,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` (output to ``log``), sampling its tree's memory; wall seconds, peaks, CPU seconds, and the
    seconds at which a line first matched each regular expression of ``marks`` (with the line)."""
    t0 = time.perf_counter()
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}  # each line as it is printed: the marks' times
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                errors="replace")
        sampler = Sampler(proc.pid, t0)
        sampler.start()
        seen: dict[str, Any] = {}
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            for name, pattern in (marks or {}).items():
                if name not in seen and re.search(pattern, line):
                    seen[name] = (round(time.perf_counter() - t0, 2), line.strip())
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise SystemExit(f"{' '.join(map(str, cmd))}: exit {code} (see {log})")
    peaks, biggest = sampler.peaks(), round(usage.ru_maxrss / 1024, 1)
    # the tree's peak is at least its largest process's, which the kernel records exactly; sampling can miss it
    peaks["peak_rss_mb"] = max(peaks["peak_rss_mb"], biggest)
    return {"seconds": round(wall, 1), **peaks, "max_process_rss_mb": biggest,
            "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1), "samples": len(sampler.samples),
            "marks": seen, "timeline": sampler.timeline(), "_sampler": sampler}


def du(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# --------------------------------------------------------------------------------------------------------------------
# The stages
# --------------------------------------------------------------------------------------------------------------------


def write_params(a: argparse.Namespace, source: Path) -> Path:
    """The recipe's params.yaml with the source, the splits the synthetic corpus has and the bench's BPE settings."""
    import yaml

    p = yaml.safe_load((REPO / "recipes" / "wmt14-en-de-base.yaml").read_text())
    p["fetch"].update(source=str(source), splits={"train": ["train"], "valid": ["valid", "validation"],
                                                   "test": ["test"]})
    p["bpe"].update(vocab_size=a.vocab, sample_sentences=a.sample_sentences)
    p["bucket"]["max_tokens"] = 3200
    path = a.out / f"params-{source.name}.yaml"
    path.write_text(yaml.safe_dump(p, sort_keys=False))
    return path


def stage_gen(a: argparse.Namespace) -> dict[str, Any]:
    """The corpus, written by a child process (this one stays small: a child's peak RSS counts its parent's at the
    fork); its figures, with the child's wall time and peak memory."""
    cmd = [sys.executable, __file__, "--gen-child", "--pairs", str(a.pairs), "--form", a.form, "--seed", str(a.seed),
           "--out", str(a.out), "--types", str(a.types)]
    r = measured(cmd, a.out / "gen.log", env={**os.environ, "PYTHONPATH": str(REPO)})
    r.pop("_sampler")
    r.pop("marks")
    return {**json.loads((a.out / "data" / "gen.json").read_text()), "process": r}


def generate(a: argparse.Namespace) -> None:
    from testkit import wmt_corpus

    data = a.out / "data"
    shutil.rmtree(data, ignore_errors=True)
    t = time.perf_counter()
    vocabs = {lang: wmt_corpus.vocabulary(lang, a.seed, a.types) for lang in wmt_corpus.LANGS}
    out: dict[str, Any] = {"vocabulary_s": round(time.perf_counter() - t, 1)}
    for form in (["local", "datasets"] if a.form == "both" else [a.form]):
        t = time.perf_counter()
        if form == "local":
            wmt_corpus.write_local(data / "local", a.pairs, a.seed, vocabs)
        else:
            wmt_corpus.write_datasets(data / "hf", a.pairs, a.seed, vocabs)
        d = data / ("local" if form == "local" else "hf")
        out[form] = {"seconds": round(time.perf_counter() - t, 1), "disk_mb": round(du(d) / MB, 1),
                     "pairs_per_s": round(a.pairs / (time.perf_counter() - t))}
    (data / "gen.json").write_text(json.dumps(out))
    (data / "corpus.json").write_text(json.dumps({"pairs": a.pairs, "seed": a.seed, "form": a.form}))


def run_stage(a: argparse.Namespace, name: str, args: list[str], out: Path,
              marks: dict[str, str] | None = None) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}
    r = measured([*MTPIPE, name, *args, "--out", str(out)], a.out / f"{out.name}.log", marks, env)
    r["artifact_mb"] = round(du(out) / MB, 1)
    return r


def stage_fetch(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for form in (["local", "datasets"] if a.form == "both" else [a.form]):
        source = a.out / "data" / ("local" if form == "local" else "hf")
        if not source.exists():
            raise SystemExit(f"{source}: no corpus of this form; run --stages gen --form {form} first")
        target = a.out / ("fetch" if form == a.fetch_form else f"fetch_{form}")
        r = run_stage(a, "fetch", ["--params", str(write_params(a, source))], target)
        r.pop("_sampler")
        manifest = json.loads((target / "manifest.json").read_text())
        r["pairs_out"] = manifest.get("extra", {}).get("pairs_out")
        r["filters"] = {k: v for k, v in manifest.get("extra", {}).get("filters", {}).items() if v}
        r["source_mb"] = round(du(source) / MB, 1)
        out[form] = r
        if target.name != "fetch":
            shutil.rmtree(target)  # the other form's corpus: measured, not needed downstream
    return out


def stage_bpe(a: argparse.Namespace) -> dict[str, Any]:
    params = write_params(a, a.out / "data" / ("local" if a.fetch_form == "local" else "hf"))
    r = run_stage(a, "bpe", ["--params", str(params), "--corpus", str(a.out / "fetch")], a.out / "bpe",
                  {"trained": r"trained on ([\d,]+) sentences in ([\d.]+)s"})
    sampler = r.pop("_sampler")
    mark = r["marks"].get("trained")
    if mark:
        m = re.search(r"trained on ([\d,]+) sentences in ([\d.]+)s", mark[1])
        assert m
        # bpe hands the trainer's heap back just after that line: the samples of the next HANDBACK_S are training's.
        done = mark[0] + HANDBACK_S
        r["training"] = {"sentences": int(m[1].replace(",", "")), "seconds": float(m[2]), **sampler.peaks(0, done)}
        r["encoding"] = {"seconds": round(r["seconds"] - mark[0], 1), **sampler.peaks(done)}
    extra = json.loads((a.out / "bpe" / "manifest.json").read_text()).get("extra", {})
    r["tokens"], r["unk_rate"] = extra.get("tokens"), extra.get("unk_rate")
    r["vocab_coverage"] = extra.get("vocab_coverage")
    return r


def stage_spm(a: argparse.Namespace) -> dict[str, Any]:
    """bpe's SentencePiece training alone (``bpe.train_spm`` on the fetch artifact, with the stage's settings), in a
    process of its own: where encoding every pair would take longer than there is time for."""
    code = ("import sys; from pathlib import Path; from mtpipe import platform; from mtpipe.config import BpeConfig; "
            "from mtpipe.stages import bpe; "
            "cfg = BpeConfig(vocab_size=int(sys.argv[2]), sample_sentences=int(sys.argv[3]), seed=1); "
            "model, n = bpe.train_spm(cfg, Path(sys.argv[1]), platform.cpu_count()); "
            "Path(sys.argv[4]).write_bytes(model)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}
    cmd = [sys.executable, "-c", code, str(a.out / "fetch"), str(a.vocab), str(a.sample_sentences),
           str(a.out / "spm.model")]
    r = measured(cmd, a.out / "spm.log", {"trained": r"trained on ([\d,]+) sentences in ([\d.]+)s"}, env)
    r.pop("_sampler")
    m = re.search(r"trained on ([\d,]+) sentences in ([\d.]+)s", r["marks"].get("trained", (0, ""))[1])
    return {**r, "sentences": int(m[1].replace(",", "")) if m else None, "training_s": float(m[2]) if m else None}


def stage_tokens(a: argparse.Namespace) -> dict[str, Any]:
    """In place of bpe's output: bench/train_data.py's synthetic tokens artifact of ``--pairs`` pairs (lengths of
    BPE-encoded WMT: log-normal, means 27 and 30 tokens; ids from the vocabulary), for bucket and the loader at a size
    whose encoding would not fit the time."""
    shutil.rmtree(a.out / "bpe", ignore_errors=True)
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[3]); from bench import train_data; "
            "train_data.make_tokens(Path(sys.argv[1]), int(sys.argv[2]))")
    r = measured([sys.executable, "-c", code, str(a.out / "bpe"), str(a.pairs), str(REPO)], a.out / "tokens.log",
                 env={**os.environ, "PYTHONPATH": str(REPO)})
    r.pop("_sampler")
    r.pop("marks")
    return {**r, "synthetic": True, "artifact_mb": round(du(a.out / "bpe") / MB, 1)}


def stage_bucket(a: argparse.Namespace) -> dict[str, Any]:
    params = write_params(a, a.out / "data" / "local")
    r = run_stage(a, "bucket", ["--params", str(params), "--tokens", str(a.out / "bpe")], a.out / "bucket")
    r.pop("_sampler")
    manifest = json.loads((a.out / "bucket" / "manifest.json").read_text())
    r["batches"] = manifest.get("rows", {}).get("train.parquet")
    r["train_arrow_mb"] = round((a.out / "bucket" / "train.arrow").stat().st_size / MB, 1)
    return r


def stage_loader(a: argparse.Namespace) -> dict[str, Any]:
    from bench import train_data

    ns = argparse.Namespace(out=a.out, workers=a.workers, pairs=a.pairs)
    batches = a.out / "bucket"
    cache = Path(tempfile.mkdtemp(prefix="mtpipe-bench-verified-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTPIPE_CACHE_DIR": str(cache)}
    try:
        time.sleep(max(0.0, 2.5 - (time.time() - (batches / "train.arrow").stat().st_mtime)))  # reading.RACY_NS
        runs = {"fresh_cold": train_data.first_batch(ns, batches, env, cold=True),
                "restart_cold": train_data.first_batch(ns, batches, env, cold=True),
                "restart_warm": train_data.first_batch(ns, batches, env, cold=False)}
        node = train_data.node(ns, batches, env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {"first_batch": runs, "node": node}


def train_cmd(a: argparse.Namespace, steps: int) -> list[str]:
    params = write_params(a, a.out / "data" / "local")
    return [*MTPIPE, "train", "--params", str(params), "--tokens", str(a.out / "bpe"), "--batches",
            str(a.out / "bucket"), "--out", str(a.out / "train"), "--preset", "tiny", "--max-steps", str(steps),
            "--nproc", "1", "--device", "cpu", "--precision", "fp32", "--threads", str(os.cpu_count() or 1),
            "--tokens-per-update", "3200", "--warmup", "10", "--save-every-steps", "1", "--save-every-minutes", "0",
            "--save-every-progress", "0", "--valid-every-steps", "0", "--valid-bleu-every-steps", "0",
            "--log-every-steps", "1", "--keep-last", "2", "--max-restarts", "0"]


def stage_restart(a: argparse.Namespace) -> dict[str, Any]:
    """A 1-update run, then the same command resumed for 1 more: seconds to the update logged, and to the exit."""
    shutil.rmtree(a.out / "train", ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}
    out = {}
    for name, steps in (("fresh", 1), ("restart", 2)):
        r = measured(train_cmd(a, steps), a.out / f"train-{name}.log", {"update": rf"step {steps}\b"}, env)
        r.pop("_sampler")
        mark = r.pop("marks").get("update")
        out[name] = {**r, "to_update_logged_s": mark[0] if mark else None, "line": mark[1] if mark else None}
    return out


# --------------------------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pairs", type=int, default=100_000, help="train pairs of the corpus (default 100000; WMT14 "
                    "en-de 4500000, en-fr 36000000)")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "mtpipe-wmt-data",
                    help="work directory: the corpus and the artifacts (default /tmp/mtpipe-wmt-data)")
    ap.add_argument("--stages", default=",".join(DEFAULT), help=f"a subset of {','.join(STAGES)} (default "
                    f"{','.join(DEFAULT)})")
    ap.add_argument("--form", choices=["local", "datasets", "both"], default="local",
                    help="the corpus form gen writes and fetch reads (both: fetch from each; bpe uses local's)")
    ap.add_argument("--vocab", type=int, default=37000, help="BPE vocabulary (default 37000, the paper's)")
    ap.add_argument("--sample-sentences", type=int, default=10_000_000, help="bpe.sample_sentences (default 10M)")
    ap.add_argument("--workers", type=int, default=8, help="ranks of one node in the loader's PSS figure (default 8)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--types", type=int, default=12_000_000, help="word types each side's tail draws from (default "
                    "12M; fewer: a quicker smoke test)")
    ap.add_argument("--results", type=Path, help="the results file (default bench/results/wmt_data-<time>.json); "
                    "one of the same --pairs is continued: its stages stay unless measured again")
    ap.add_argument("--gen-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    names = a.stages.split(",")
    if set(names) - set(STAGES):
        ap.error(f"--stages: {','.join(sorted(set(names) - set(STAGES)))}: expected names from {','.join(STAGES)}")
    a.stages = [s for s in STAGES if s in names]
    a.fetch_form = "local" if a.form in ("local", "both") else "datasets"
    return a


def main(argv: list[str] | None = None) -> None:
    import datetime

    a = parse(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.gen_child:
        return generate(a)
    if "gen" not in a.stages:
        have = json.loads((a.out / "data" / "corpus.json").read_text()) if (a.out / "data" / "corpus.json").exists() \
            else {}
        if have.get("pairs") != a.pairs:
            raise SystemExit(f"{a.out}/data: holds {have.get('pairs')} pairs, not {a.pairs}; add gen to --stages")
    now = datetime.datetime.now(datetime.timezone.utc)
    path = a.results or REPO / "bench" / "results" / f"wmt_data-{now:%Y%m%dT%H%M%SZ}.json"
    # The probe imports torch: in a child, so that this process stays small (see stage_gen).
    probe = json.loads(subprocess.run([sys.executable, str(REPO / "bench" / "machine.py")], capture_output=True,
                                      text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout)
    figures: dict[str, Any] = {"pairs": a.pairs, "form": a.form, "vocab": a.vocab, "types": a.types,
                               "sample_sentences": a.sample_sentences, "workers": a.workers, "stages": {}}
    if a.results and a.results.exists():  # a run continued in steps: the stages measured so far stay
        before = json.loads(a.results.read_text())["figures"]
        if before.get("pairs") == a.pairs:
            figures["stages"] = before.get("stages", {})
    funcs = {"gen": stage_gen, "fetch": stage_fetch, "spm": stage_spm, "bpe": stage_bpe, "tokens": stage_tokens,
             "bucket": stage_bucket,
             "loader": stage_loader, "restart": stage_restart}
    for name in a.stages:
        print(f"[wmt_data] {name} ({a.pairs:,} pairs) ...", file=sys.stderr, flush=True)
        result = funcs[name](a)
        # fetch's rows are per form: one run's form joins the others' of a continued run
        figures["stages"][name] = {**figures["stages"].get(name, {}), **result} if name == "fetch" else result
        print(f"[wmt_data] {name}: {json.dumps(figures['stages'][name])}", file=sys.stderr, flush=True)
        figures["disk_mb"] = {d.name: round(du(d) / MB, 1) for d in sorted(a.out.iterdir()) if d.is_dir()}
        machine.write_results("wmt_data", figures, path, probe)


if __name__ == "__main__":
    main()
