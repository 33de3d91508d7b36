#!/usr/bin/env python3
"""The quickstart as a new user runs it: `make pipeline` in a fresh clone, per seed, on this CPU or restricted to AVX2.

For every seed (``--seeds``): a fresh ``git clone`` of this repository's HEAD (commit first: what is not committed is
not measured), ``fetch.source`` pointed at a local Multi30k copy (``$MTPIPE_MULTI30K``, as the README's offline
set-up does) and ``train.seed`` set, nothing else changed; then ``make install`` and ``make pipeline``, each timed.
Reported per run: the wall time of the install and of the pipeline (``dvc repro``, all seven stages), the updates
training made and what stopped it, the precision it chose, sacreBLEU on test_2016_flickr (``metrics/score.json``: 13a,
cased, detokenised) and the same lowercased, chrF2, and valid BLEU of the pipeline's own averaged model with the
committed decode settings (the split every setting was chosen on).

``--isa avx2`` runs everything with ``isa_probe.AVX2_ONLY`` in the environment (torch's, oneDNN's and fbgemm's
switches): how an AVX2-only CPU
(no AVX-512, no native bf16) is emulated on a newer one. That the restriction takes effect is shown, not assumed:
torch's dispatch level under the variables, and a bf16 against fp32 matmul probe (bf16 drops far below fp32 once the
bf16 instructions are out of reach), both in the results. The emulation removes instructions, not clock speed or
cache: a real AVX2-only CPU may also be slower per core.

    python bench/quickstart.py --seeds 1,2                     # this CPU as it is
    python bench/quickstart.py --seeds 1,2 --isa avx2          # restricted to AVX2
    python bench/quickstart.py --seeds 1 --keep                # keep the clone (its artifacts, logs, dvc.lock)
    python bench/quickstart.py --seeds 1 --isa avx2 --cpus 1   # AVX2 on one CPU: a proxy for a slower AVX2 machine

``--cpus N`` pins every process of the run (install, pipeline, the probe) to the first N CPUs (``taskset``) with
``OMP_NUM_THREADS=N``: a newer CPU restricted to AVX2 is still faster per core than the AVX2-only CPUs users have
(e.g. Zen 2/3), so one of its CPUs stands in for a slower 2-core machine's throughput.

Writes ``results.json`` and ``results.md`` to ``--out`` (default ``bench/out/quickstart/<isa>-<UTC time>``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from isa_probe import AVX2_ONLY  # bench/ is on the path: run as python bench/quickstart.py

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("MTPIPE_MULTI30K", REPO / "data" / "multi30k"))  # {train,val,test_2016_flickr}.{en,de}.gz

PROBE = REPO / "bench" / "isa_probe.py"  # one line of JSON: what torch uses under the run's environment


def cpu_facts() -> dict:
    """CPU model and the instruction-set flags that decide the speed class."""
    text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace") if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    family = re.search(r"^cpu family\s*:\s*(\d+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    wanted = sorted({f for f in (flags.group(1).split() if flags else [])
                     if f.startswith(("avx512", "amx")) or f in ("avx2", "avx_vnni", "fma")})
    return {"model": model.group(1).strip() if model else platform.processor(),
            "family": int(family.group(1)) if family else None, "flags": wanted, "cpus": os.cpu_count()}


def set_params(params: Path, source: Path, seed: int) -> None:
    """``fetch.source`` and ``train.seed`` set in place; every other line (and comment) stays as committed."""
    lines, section, done = params.read_text(encoding="utf-8").splitlines(keepends=True), "", set()
    for i, line in enumerate(lines):
        if re.match(r"^[A-Za-z_]+:", line):
            section = line.split(":")[0]
        for sec, key, value in (("fetch", "source", str(source)), ("train", "seed", str(seed))):
            m = re.match(rf"^(  {key}: *)(\S+)(.*)$", line.rstrip("\n"))
            if section == sec and m:
                lines[i] = m.group(1) + value + m.group(3) + "\n"
                done.add(key)
    if done != {"source", "seed"}:
        raise SystemExit(f"{params}: could not find fetch.source and train.seed to set")
    params.write_text("".join(lines), encoding="utf-8")


def timed(cmd: list[str], cwd: Path, env: dict, log: Path) -> float:
    t = time.monotonic()
    with log.open("w", encoding="utf-8") as f:
        p = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd} (exit {p.returncode}); see {log}")
    return time.monotonic() - t


def bleu(hyp: Path, refs: list[str], lowercase: bool = False) -> tuple[float, float]:
    import sacrebleu

    hyps = hyp.read_text(encoding="utf-8").split("\n")[: len(refs)]
    b = sacrebleu.corpus_bleu(hyps, [refs], lowercase=lowercase)
    return round(b.score, 2), round(b.sys_len / b.ref_len, 4)


def one_run(seed: int, args: argparse.Namespace, env: dict, work: Path) -> dict:
    clone = work / f"seed{seed}"
    if clone.exists():
        shutil.rmtree(clone)
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    set_params(clone / "params.yaml", args.data.resolve(), seed)
    logs = work / f"seed{seed}-logs"
    logs.mkdir(exist_ok=True)
    print(f"seed {seed}: make install ...", flush=True)
    install = timed([*args.pin, "make", "install"], clone, env, logs / "install.log")
    print(f"seed {seed}: make pipeline (install {install / 60:.1f} min) ...", flush=True)
    pipeline = timed([*args.pin, "make", "pipeline"], clone, env, logs / "pipeline.log")
    venv = clone / ".venv" / "bin"
    score = json.loads((clone / "metrics" / "score.json").read_text(encoding="utf-8"))
    train = json.loads((clone / "artifacts" / "train" / "train.json").read_text(encoding="utf-8"))
    import pyarrow.parquet as pq

    refs = {s: pq.read_table(clone / "artifacts" / "fetch" / f"{s}.parquet").column("tgt").to_pylist()
            for s in ("valid", "test")}
    # Valid BLEU of the pipeline's own model and decode settings (a hand-run decode prints to stdout only).
    valid_hyp = logs / "valid.hyp.txt"
    with valid_hyp.open("w", encoding="utf-8") as f:
        subprocess.run([*args.pin, str(venv / "mtpipe"), "decode", "--split", "valid"], cwd=clone, env=env, stdout=f,
                       stderr=subprocess.DEVNULL, check=True)
    test_hyp = clone / "artifacts" / "decode" / "test.txt"
    row = {
        "seed": seed, "install_min": round(install / 60, 2), "pipeline_min": round(pipeline / 60, 2),
        "updates": train.get("steps"), "stopped_by": train.get("stopped_by"), "precision": train.get("precision"),
        "train_min": train.get("train_minutes"), "test_bleu": round(score["bleu"], 2),
        "test_bleu_lc": bleu(test_hyp, refs["test"], lowercase=True)[0], "test_ratio": bleu(test_hyp, refs["test"])[1],
        "test_chrf": round(score["chrf"], 2), "valid_bleu": bleu(valid_hyp, refs["valid"])[0],
        "signature": score.get("signatures", {}).get("bleu", ""),
    }
    (logs / "train.json").write_text(json.dumps(train, indent=1), encoding="utf-8")
    if not args.keep:
        shutil.rmtree(clone)
    return row


def table(rows: list[dict], keys: list[str]) -> str:
    out = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1,2", help="comma list of train.seed values, one fresh clone each")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native", help="avx2: emulate an AVX2-only CPU")
    ap.add_argument("--data", type=Path, default=DATA, help="local Multi30k ({split}.{en,de}.gz)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep each clone")
    ap.add_argument("--cpus", type=int, default=0, help="pin the runs to the first N CPUs (taskset; OMP_NUM_THREADS=N)")
    args = ap.parse_args()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                      text=True).stdout.strip():
        print("note: uncommitted changes are not measured (the runs clone HEAD)", file=sys.stderr)
    if not (args.data / "train.en.gz").exists():
        raise SystemExit(f"{args.data}: no train.en.gz (set --data or $MTPIPE_MULTI30K to a Multi30k copy)")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    name = f"{args.isa}-{args.cpus}cpu" if args.cpus else args.isa
    out = args.out or REPO / "bench" / "out" / "quickstart" / f"{name}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **(AVX2_ONLY if args.isa == "avx2" else {})}
    if args.cpus:
        if not shutil.which("taskset") or args.cpus > (os.cpu_count() or 1):
            raise SystemExit(f"--cpus {args.cpus}: needs taskset and at most {os.cpu_count()} CPUs")
        env["OMP_NUM_THREADS"] = str(args.cpus)
        pin = ["taskset", "-c", f"0-{args.cpus - 1}"]
    else:
        pin = []
    args.pin = pin
    for k in ("VIRTUAL_ENV", "PYTHONPATH"):  # each clone uses its own venv
        env.pop(k, None)
    probe = subprocess.run([*pin, sys.executable, str(PROBE)], env={**env, "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True, check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    facts = {"date": stamp, "isa": args.isa, "cpu": cpu_facts(), "probe": json.loads(probe.stdout),
             "cpus_used": args.cpus or os.cpu_count(), "commit": commit.stdout.strip(),
             "env": {**(AVX2_ONLY if args.isa == "avx2" else {}), **({"OMP_NUM_THREADS": str(args.cpus)} if args.cpus
                                                               else {})}}
    print(json.dumps(facts), flush=True)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        rows.append(one_run(seed, args, env, out))
        print(json.dumps(rows[-1]), flush=True)
        (out / "results.json").write_text(json.dumps({**facts, "runs": rows}, indent=1), encoding="utf-8")
    keys = ["seed", "precision", "updates", "stopped_by", "train_min", "pipeline_min", "install_min", "test_bleu",
            "test_bleu_lc", "test_ratio", "test_chrf", "valid_bleu"]
    spread = {k: (min(r[k] for r in rows), statistics.median(r[k] for r in rows), max(r[k] for r in rows))
              for k in ("test_bleu", "valid_bleu", "pipeline_min", "updates")}
    md = [f"# Quickstart, {len(rows)} seed(s), {args.isa}, {facts['cpus_used']} CPU(s) used ({stamp} UTC, commit "
          f"{facts['commit']})", "",
          f"CPU: {facts['cpu']['model']} (family {facts['cpu']['family']}), {facts['cpu']['cpus']} CPUs, flags: "
          f"{', '.join(facts['cpu']['flags'])}", "",
          f"Probe under this run's environment {facts['env'] or '(none)'}: torch dispatch "
          f"{facts['probe']['torch_capability']}, native bf16 {facts['probe']['native_bf16']}, 1024^3 matmul "
          f"fp32 {facts['probe']['fp32_gflops']} / bf16 {facts['probe']['bf16_gflops']} GFLOP/s, int8 decoding layer "
          f"{facts['probe'].get('int8_gops', '?')} GOP/s", "",
          table(rows, keys), "",
          "min / median / max: " + "; ".join(f"{k} {a} / {b} / {c}" for k, (a, b, c) in spread.items())]
    (out / "results.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
