#!/usr/bin/env python3
"""Back-translation on Multi30k (examples/backtranslation): `dvc repro` of the example per seed, in a fresh copy.

Rows, each an en->de model of the quickstart's settings trained for ``--budget-minutes``: A alone (half of the
training pairs); A + B back-translated by beam search; A + B back-translated by sampling; A + B back-translated by
beam search with a tag before each synthetic source; A + the real B (every pair: the upper bound). B's German is
translated by a de->en model trained on A for the same budget. Per row and seed: test2016 cased sacreBLEU, chrF,
the updates made and the training minutes; per seed the whole pipeline's minutes.

    python bench/backtranslation.py --data DIR [--seeds 1,2] [--budget-minutes 37]
    python bench/backtranslation.py --data DIR --seeds 2 --add-to bench/results/backtranslation-<time>.json
    python bench/backtranslation.py --data DIR --seeds 1 --budget-minutes 1 --pairs 2000   # a check of the bench
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import example_runs, machine  # noqa: E402

ROWS = {"a": "A alone", "bt_beam": "A + B back-translated (beam)", "bt_sample": "A + B back-translated (sampled)",
        "bt_tagged": "A + B back-translated (beam, tagged)", "full": "A + real B (upper bound)"}


def collect(repo: Path, seed: int) -> dict:
    return {"models": {row: example_runs.model_row(repo, row, row) for row in ROWS},
            "reverse": example_runs.training(repo, "rev")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    example_runs.add_flags(ap, budget=37)
    ap.add_argument("--add-to", type=Path, help="an earlier results file of this benchmark, measured with the same "
                    "budget and pairs: its seeds' runs are kept and this run's seeds added to them")
    args = ap.parse_args()
    probe = machine.probe()
    settings = {"budget_minutes": 0 if args.budget_updates else args.budget_minutes,
                "budget_updates": args.budget_updates, "pairs": args.pairs or "all"}
    earlier = example_runs.earlier_runs(args.add_to, "backtranslation", settings, args.seeds)
    runs = earlier + example_runs.run_seeds("backtranslation", "backtranslation", args, collect)
    machine.write_results("backtranslation", {
        **settings, "rows": ROWS, "results": example_runs.rows(runs, list(ROWS)), "runs": runs,
        **({"added_to": args.add_to.name} if args.add_to else {})}, args.results, machine=probe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
