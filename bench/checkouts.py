#!/usr/bin/env python3
"""Speed of two checkouts of mtpipe, through the CLI: a change that moves code must not slow training or decoding.

Both checkouts run the same commands on the same machine, interleaved (round r runs the earlier checkout first when
r is even, the later first when it is odd), ``--rounds`` rounds:

* training: ``mtpipe train`` of the tiny preset for ``--updates`` updates (fp32, dropout on), from scratch; the figure
  is the run's own target tokens/s (``train.json``), which leaves out start-up and data loading;
* decoding: ``mtpipe decode`` of ``--sentences`` sentences of raw text at beam 4, in fp32, bf16 and int8; the figure
  is the command's wall time, start-up included (the same imports either side).

The corpus and the model decoded are :mod:`bench.equivalence`'s synthetic "language", prepared once with the later
checkout (data stages are not timed). Figures per checkout, and per measure the later / earlier ratio of each round
(speed: > 1 is faster), min / median / max, go to the results file (:mod:`bench.machine`).

    git worktree add /tmp/before <commit>
    python bench/checkouts.py --before /tmp/before                  # the later checkout is this one
    python bench/checkouts.py --before /tmp/before --isa avx2       # as on an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.equivalence import TRAIN_FLAGS, corpus  # noqa: E402 (after the path it needs)
from bench.machine import add_flags, isa_from_argv, write_results  # noqa: E402

DECODES = {"decode fp32 beam4": ["--precision", "fp32"], "decode bf16 beam4": ["--precision", "bf16"],
           "decode int8 beam4": ["--precision", "int8"]}


def run(checkout: Path, work: Path, *args: str) -> float:
    """``python -m mtpipe ARGS`` of ``checkout`` in ``work``; its wall seconds (a failure stops the benchmark)."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "COLUMNS": "150"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mtpipe", *args], cwd=work, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SystemExit(f"{checkout}: mtpipe {' '.join(args)}: exit {done.returncode}: {' | '.join(tail)}")
    return seconds


def train_flags(updates: int) -> list[str]:
    flags = list(TRAIN_FLAGS)
    flags[flags.index("--max-steps") + 1] = str(updates)
    flags[flags.index("--save-every-steps") + 1] = str(updates)
    flags[flags.index("--valid-every-steps") + 1] = str(updates)
    return flags


def prepare(work: Path, sentences: int, before: Path) -> tuple[Path, Path]:
    """The corpus, its bpe and buckets, a model trained on it, and ``sentences`` lines of raw text to decode.
    params.yaml is the earlier checkout's: a key added since is unknown to it (an error), while the later one reads
    a key it lacks as its default."""
    shutil.copy(before / "params.yaml", work / "params.yaml")
    corpus(work / "data")
    run(REPO, work, "fetch", "--source", str(work / "data"), "--out", "fetch")
    run(REPO, work, "bpe", "--corpus", "fetch", "--vocab-size", "600", "--out", "bpe")
    run(REPO, work, "bucket", "--tokens", "bpe", "--max-tokens", "512", "--out", "bucket")
    run(REPO, work, "train", "--tokens", "bpe", "--batches", "bucket", "--out", "model", *train_flags(200))
    [model] = sorted((work / "model" / "checkpoints").glob("step_*"))[-1:]
    with gzip.open(work / "data" / "train.en.gz", "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()[:sentences]
    text = work / "input.en"
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return model, text


def spread(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3), "max": round(max(values), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the earlier checkout (a git worktree)")
    ap.add_argument("--after", type=Path, default=REPO, help="the later checkout (default: this one)")
    ap.add_argument("--updates", type=int, default=100, help="training updates a run (default 100)")
    ap.add_argument("--sentences", type=int, default=1000, help="sentences a decode (default 1000)")
    add_flags(ap)
    args = ap.parse_args()
    isa_from_argv()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    raw: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    with tempfile.TemporaryDirectory(prefix="mtpipe-checkouts-") as tmp:
        work = Path(tmp)
        model, text = prepare(work, args.sentences, args.before)
        for r in range(args.rounds):
            for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                out = work / f"train-{side}-{r}"
                run(sides[side], work, "train", "--tokens", "bpe", "--batches", "bucket", "--out", str(out),
                    *train_flags(args.updates))
                rate = json.loads((out / "train.json").read_text())["tgt_tokens_per_s"]
                raw[side].setdefault("train tgt tokens/s", []).append(rate)
                for key, flags in DECODES.items():
                    seconds = run(sides[side], work, "decode", "--checkpoint", str(model), "--tokens", "bpe",
                                  "--input", str(text), "--threads", "2", "--beam", "4", *flags, "--out",
                                  str(work / f"decode-{side}-{r}-{key.split()[1]}"))
                    raw[side].setdefault(f"{key} seconds", []).append(seconds)
                print(f"round {r + 1} {side}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in raw[side].items()),
                      file=sys.stderr)
    # speed ratio later / earlier per round: tokens/s after / before, seconds before / after
    ratios = {key: spread([(a / b) if "tokens/s" in key else (b / a)
                           for a, b in zip(raw["after"][key], raw["before"][key])]) for key in raw["after"]}
    commits = {side: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True,
                                    text=True).stdout.strip() for side, path in sides.items()}
    figures = {"checkouts": {side: f"{path} ({commits[side]})" for side, path in sides.items()}, "rounds": args.rounds,
               "updates": args.updates, "sentences": args.sentences, "isa": args.isa,
               "values": raw, "speed after / before": ratios}
    path = write_results("checkouts", figures, args.results)
    for key, s in ratios.items():
        print(f"{key}: after / before speed {s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f} (min / median / max)")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
