#!/usr/bin/env python3
"""The quickstart as a new user runs it: `make pipeline` in a fresh clone, per seed, on this CPU or restricted to AVX2.

Per seed (``--seeds``): a fresh ``git clone`` of HEAD (uncommitted changes are not measured), ``fetch.source`` set
to a local Multi30k copy (``$MTPIPE_MULTI30K``) and ``train.seed``, nothing else; ``make install`` and ``make
pipeline`` timed; the updates made and what stopped them, the precision chosen, sacreBLEU on test_2016_flickr (also
lowercased), chrF2, and valid BLEU of the pipeline's own model. ``--isa avx2`` runs it all under
``machine.AVX2_ONLY`` (an AVX2-only CPU emulated: fewer instructions, the same clock); the probe, taken under the
run's environment, shows it took. ``--cpus N`` pins every process to the first N CPUs (``taskset``,
``OMP_NUM_THREADS=N``): one fast CPU standing in for a slower pair. Targets: >= 41 BLEU with AVX-512 bf16, >= 38 on
AVX2 only, the pipeline under 45 minutes.

    python bench/quickstart.py --seeds 1,2 [--isa avx2] [--keep]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import machine  # noqa: E402
from mtpipe import env as mtenv  # noqa: E402

DATA = Path(mtenv.get("MTPIPE_MULTI30K") or REPO / "data" / "multi30k")  # {train,val,test_2016_flickr}.{en,de}.gz


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
        if subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{' '.join(cmd)} failed in {cwd}; see {log}")
    return time.monotonic() - t


def bleu(hyp: Path, refs: list[str], lowercase: bool = False) -> tuple[float, float]:
    import sacrebleu

    b = sacrebleu.corpus_bleu(hyp.read_text(encoding="utf-8").split("\n")[: len(refs)], [refs], lowercase=lowercase)
    return round(b.score, 2), round(b.sys_len / b.ref_len, 4)


def one_run(seed: int, args: argparse.Namespace, env: dict, pin: list[str], work: Path) -> dict:
    import pyarrow.parquet as pq

    clone, logs = work / f"seed{seed}", work / f"seed{seed}-logs"
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    set_params(clone / "params.yaml", args.data.resolve(), seed)
    logs.mkdir(exist_ok=True)
    print(f"seed {seed}: make install ...", flush=True)
    install = timed([*pin, "make", "install"], clone, env, logs / "install.log")
    print(f"seed {seed}: make pipeline (install {install / 60:.1f} min) ...", flush=True)
    pipeline = timed([*pin, "make", "pipeline"], clone, env, logs / "pipeline.log")
    score = json.loads((clone / "metrics" / "score.json").read_text(encoding="utf-8"))
    train = json.loads((clone / "artifacts" / "train" / "train.json").read_text(encoding="utf-8"))
    refs = {s: pq.read_table(clone / "artifacts" / "fetch" / f"{s}.parquet").column("tgt").to_pylist()
            for s in ("valid", "test")}
    valid_hyp, test_hyp = logs / "valid.hyp.txt", clone / "artifacts" / "decode" / "test.txt"
    with valid_hyp.open("w", encoding="utf-8") as f:  # the pipeline's own model and decode settings, on valid
        subprocess.run([*pin, str(clone / ".venv" / "bin" / "mtpipe"), "decode", "--split", "valid"], cwd=clone,
                       env=env, stdout=f, stderr=subprocess.DEVNULL, check=True)
    (logs / "train.json").write_text(json.dumps(train, indent=1), encoding="utf-8")
    if not args.keep:
        shutil.rmtree(clone)
    return {"seed": seed, "install_min": round(install / 60, 2), "pipeline_min": round(pipeline / 60, 2),
            "updates": train.get("steps"), "stopped_by": train.get("stopped_by"), "precision": train.get("precision"),
            "train_min": train.get("train_minutes"), "test_bleu": round(score["bleu"], 2),
            "test_bleu_lc": bleu(test_hyp, refs["test"], lowercase=True)[0],
            "test_ratio": bleu(test_hyp, refs["test"])[1], "test_chrf": round(score["chrf"], 2),
            "valid_bleu": bleu(valid_hyp, refs["valid"])[0], "signature": score.get("signatures", {}).get("bleu")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1,2", help="comma list of train.seed values, one fresh clone each")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native", help="avx2: emulate an AVX2-only CPU")
    ap.add_argument("--data", type=Path, default=DATA, help="local Multi30k ({split}.{en,de}.gz)")
    ap.add_argument("--out", type=Path, help="clones and logs (default bench/out/quickstart/<isa>-<UTC time>)")
    ap.add_argument("--results", type=Path, help="the results file (default bench/results/quickstart-<time>.json)")
    ap.add_argument("--keep", action="store_true", help="keep each clone")
    ap.add_argument("--cpus", type=int, default=0, help="pin the runs to the first N CPUs (taskset; OMP_NUM_THREADS=N)")
    args = ap.parse_args()
    if not (args.data / "train.en.gz").exists():
        raise SystemExit(f"{args.data}: no train.en.gz (set --data or $MTPIPE_MULTI30K to a Multi30k copy)")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    out = args.out or REPO / "bench" / "out" / "quickstart" / f"{args.isa}-{args.cpus or 'all'}cpu-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}  # each clone: its venv
    env.update(machine.AVX2_ONLY if args.isa == "avx2" else {})
    pin = []
    if args.cpus:
        if not shutil.which("taskset") or args.cpus > (os.cpu_count() or 1):
            raise SystemExit(f"--cpus {args.cpus}: needs taskset and at most {os.cpu_count()} CPUs")
        env["OMP_NUM_THREADS"] = str(args.cpus)
        pin = ["taskset", "-c", f"0-{args.cpus - 1}"]
    probe = machine.probe_under(env, prefix=pin)
    print(json.dumps(probe), flush=True)
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        runs.append(one_run(seed, args, env, pin, out))
        print(json.dumps(runs[-1]), flush=True)
    spread = {k: machine.stats([r[k] for r in runs]) for k in ("test_bleu", "valid_bleu", "pipeline_min", "updates")}
    print("min / median / max: " + "; ".join(f"{k} {v['min']} / {v['median']} / {v['max']}" for k, v in
                                             spread.items()))
    machine.write_results("quickstart", {"clone_of": machine.commit().split("+")[0], "isa": args.isa, "cpus":
                                         args.cpus or probe["cpu"]["cpus"], "runs": runs, "spread": spread},
                          args.results, machine=probe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
