#!/usr/bin/env python3
"""Sequence-level distillation on Multi30k (examples/distillation): `dvc repro` of the example, then the students
again per further seed, and each model's decoding speed.

Rows: the teacher (the quickstart's model, trained for ``--budget-minutes``), the student (the tiny preset, the same
budget) trained on the references, and the same student trained on the teacher's beam output on the training
sources. Per row and seed: test2016 cased sacreBLEU and chrF with beam search (4; alpha 1.5, the example's, and the
paper's 0.6) and greedy search, the updates made and the training minutes. The teacher is trained once (the first
seed); later seeds retrain the students only (DVC re-runs what their seed changes). Decoding speed: sentences/s that
`mtpipe decode` reports for test2016 (1,000 sentences), beam and greedy, each model in turn, ``--rounds`` rounds, in
the first seed's copy.

    python bench/distillation.py --data DIR [--seeds 1,2] [--budget-minutes 37]
    python bench/distillation.py --data DIR --seeds 1 --budget-minutes 1 --pairs 2000   # a check of the bench
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import example_runs, machine  # noqa: E402

MODELS = {"teacher": "teacher (quickstart model)", "reference": "student (tiny) on the references",
          "distilled": "student (tiny) on the teacher's output"}
SEARCHES = {"beam": "beam 4, alpha 1.5", "paperbeam": "beam 4, alpha 0.6 (the paper's)", "greedy": "greedy"}
TIMED = {"beam": [], "greedy": ["--beam", "1"]}  # decoding speed: the length penalty does not change the work much
STUDENTS = ("reference", "distilled")


def speed(repo: Path, rounds: int, threads: int) -> dict:
    """sentences/s of each model's test2016 decode, per search: every round, models in rotating order."""
    got: dict = {m: {s: [] for s in TIMED} for m in MODELS}
    order = list(MODELS)
    for r in range(rounds):
        for model in order[r % len(order):] + order[: r % len(order)]:
            for search, flags in TIMED.items():
                cmd = ["mtpipe", "decode", "--checkpoint", f"models/{model}_average", "--tokens",
                       f"data/{model}_bpe", "--split", "test", "--threads", str(threads), *flags]
                p = subprocess.run(cmd, cwd=repo, env={**example_runs.environment(), "COLUMNS": "200"},
                                   capture_output=True, text=True, check=True)
                rate = re.search(r"sentences/s\s*│\s*([\d.,]+)", p.stderr)
                if rate is None:
                    raise SystemExit(f"{' '.join(cmd)}: no sentences/s in its summary:\n{p.stderr[-2000:]}")
                got[model][search].append(float(rate.group(1).replace(",", "")))
    return {m: {s: {"rounds": v, "median": statistics.median(v)} for s, v in per.items()} for m, per in got.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    example_runs.add_flags(ap, budget=37)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the decoding-speed measurement")
    args = ap.parse_args()
    probe = machine.probe()
    measured: dict = {}

    def collect(repo: Path, seed: int) -> dict:
        first = not measured
        if first:  # the first copy: the teacher's and both students' decoding speed
            measured.update(speed(repo, args.rounds, args.threads or 2))
        return {"models": {f"{m}_{s}": example_runs.model_row(repo, f"{m}_{s}", m) for m in MODELS
                           for s in SEARCHES if first or m in STUDENTS}}

    def again(repo: Path, seed: int) -> None:  # the students only: a new seed, trained from scratch
        student = repo / "student.yaml"
        params = yaml.safe_load(student.read_text(encoding="utf-8"))
        params["train"]["seed"] = seed
        student.write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
        for name in STUDENTS:
            shutil.rmtree(repo / "models" / name, ignore_errors=True)

    runs = example_runs.run_seeds("distillation", "distillation", args, collect, again)
    rows = [f"{m}_{s}" for m in MODELS for s in SEARCHES]
    machine.write_results("distillation", {
        "budget_minutes": 0 if args.budget_updates else args.budget_minutes,
        "budget_updates": args.budget_updates, "pairs": args.pairs or "all", "models": MODELS, "searches": SEARCHES,
        "teacher_seed": runs[0]["seed"], "results": example_runs.rows(runs, rows),
        "speed_sentences_per_s": measured, "speed_threads": args.threads or 2, "runs": runs},
        args.results, machine=probe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
